"""Platform selection: the CUDA path is megatron-core as shipped; the CPU path adds run-time patches.

`apply()` is called once per process before any model is built (by `rlpo_mega.distributed.init`).
The switch is `torch.cuda.is_available()`, never a config flag, so a GPU run cannot pick up CPU code.
Transformer Engine is optional on either: without it the model uses megatron's local layer spec, and
`megatron_fixes.FIXES` (defects of that spec in megatron-core 0.16.1, none CPU-specific) apply on CPU
and GPU alike; with it, none do.
"""
from __future__ import annotations

import os

import torch

from moe.model import have_transformer_engine

from . import cpu_megatron, megatron_fixes

_APPLIED: list[str] | None = None

# Ablation tests name patches to leave out; never set in a real run.
_SKIP_ENV = "RLPO_MEGA_ABLATE_PATCH"


class PlatformError(RuntimeError):
    pass




def _check_version():
    import megatron.core

    found = getattr(megatron.core, "__version__", "unknown")
    if found != cpu_megatron.WRITTEN_FOR:
        raise PlatformError(
            f"rlpo_mega's CPU platform patches were written for megatron-core=={cpu_megatron.WRITTEN_FOR}"
            f" but {found} is installed; install megatron-core=={cpu_megatron.WRITTEN_FOR} "
            "(pip install -e .) or run on a CUDA machine, where no patch is applied."
        )


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def apply() -> list[str]:
    """Apply what this platform needs (idempotent). Returns the names of the patches applied."""
    global _APPLIED
    if _APPLIED is not None:
        return _APPLIED
    skip = {s for s in os.environ.get(_SKIP_ENV, "").split(",") if s}
    unknown = skip - {p.name for p in all_patches() + megatron_fixes.SPEEDUPS}
    if unknown:  # a misspelt ablation would otherwise run with every patch and prove nothing
        raise PlatformError(f"{_SKIP_ENV} names unknown patches {sorted(unknown)}")
    cuda = torch.cuda.is_available()
    te = have_transformer_engine()  # first: a broken TE would otherwise fail inside megatron's imports
    if not cuda:
        _check_version()
    applied = []
    for patch in select(have_transformer_engine=te, have_cuda=cuda):
        if patch.name in skip:
            continue
        patch.apply()
        applied.append(patch.name)
    _APPLIED = applied
    return applied


def select(have_transformer_engine: bool, have_cuda: bool):
    """The patches a platform needs: the local-spec fixes without TE (any device), the offload fixes and the speed-ups
    always (they answer or replace megatron code that both specs reach), the CPU patches without CUDA."""
    return ((() if have_transformer_engine else megatron_fixes.FIXES) + megatron_fixes.OFFLOAD_FIXES
            + megatron_fixes.SPEEDUPS + (() if have_cuda else cpu_megatron.PATCHES))


def all_patches():
    return cpu_megatron.PATCHES + megatron_fixes.FIXES + megatron_fixes.OFFLOAD_FIXES
