"""Model-family registry: one entry per HF `model_type`; adding a family touches no other entry."""
from __future__ import annotations

from .base import VALUE_HEAD_HF, MoEFamily, UnsupportedModelError

FAMILIES: dict[str, MoEFamily] = {}


def register_family(family_cls: type[MoEFamily]) -> type[MoEFamily]:
    family = family_cls()
    if family.model_type in FAMILIES:
        raise ValueError(f"model family {family.model_type!r} is registered twice")
    FAMILIES[family.model_type] = family
    return family_cls


def get_family(model_type: str) -> MoEFamily:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(sorted(FAMILIES))}. Add a family in moe/families/ to support it."
        ) from None


# Importing the modules registers them.
from . import deepseek_v3, glm4_moe, mixtral, qwen3_moe  # noqa: E402,F401

__all__ = ["FAMILIES", "VALUE_HEAD_HF", "MoEFamily", "UnsupportedModelError", "get_family", "register_family"]
