"""A plan's rows (a GPU or a host: bytes by kind against a budget) and its refusal: what the planner and the
engines' own plan hooks (RolloutEngine.plan, rollout/sglang_plan.py) write."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

GB = 1e9


class PlanError(ValueError):
    """The recipe does not fit, or cannot be planned: one line naming the first budget exceeded."""


@dataclass
class Row:
    """One GPU or host: bytes by kind against a budget."""
    role: str
    name: str
    budget: int
    parts: dict = field(default_factory=dict)  # kind -> bytes
    info: dict = field(default_factory=dict)  # counts, not bytes
    notes: list = field(default_factory=list)
    problem: Optional[str] = None  # a failure that is not a sum over budget

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def headroom(self) -> int:
        return self.budget - self.total


@dataclass
class EnginePlan:
    """What a rollout engine adds to a plan (RolloutEngine.plan), at the recipe's real size."""
    servers: list = field(default_factory=list)  # Rows of its own GPUs (none: it generates on the learner's)
    # rollout.colocate: part -> bytes on a learner GPU while it generates ("weights", "KV cache" or "KV pool",
    # "digest", "runtime"), what it keeps there while released, and what the hand-over copies to the host for it
    colocated: dict = field(default_factory=dict)
    released: int = 0
    host_copy: int = 0
    # rollout.colocate: what a sync holds on every learner GPU for the engine (SGLang: the bucket the export
    # broadcasts to each rank and its flattened copy, the payload of the server rank on that GPU), in place of the
    # drivers' one bucket
    gpu_sync: int = 0
    # the exchange's send on a driver: its share of the step with every MoE layer's routes (SGLang: the driver
    # holds what its servers returned), not only the rows it trains
    driver_sends_all_layers: bool = False
    answers_decoding: int = 0  # answers whose routes a driver decodes at once (their bodies on the host)
