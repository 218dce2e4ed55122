"""Contiguous shares of a list: how prompts split over engine ranks (rollout/producers) and servers over SGLang
drivers (rollout, weight_sync's colocated placements). At the bottom of the package: the rollout side and the weight
sync both use it."""
from __future__ import annotations

from typing import Sequence


def share_of(items: Sequence, index: int, parts: int) -> list:
    """Part `index` of `parts` contiguous shares of `items`, the first len(items) % parts one longer: how prompts
    split over engine ranks (rollout/producers.share) and servers over SGLang drivers."""
    per, extra = divmod(len(items), parts)
    start = index * per + min(index, extra)
    return list(items[start:start + per + (1 if index < extra else 0)])


__all__ = ["share_of"]
