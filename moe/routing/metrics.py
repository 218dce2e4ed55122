"""Routing metrics per step and per MoE layer.

- agreement: fraction of tokens whose live-router top-k SET equals the reference top-k (the rollout
  trace in R3, the old-policy record in R2): how much replay is changing, i.e. how much the ratios would
  be noise without it.
- expert load: histogram of the experts actually used, its entropy (nats; log E is uniform) and
  max/mean (1 is perfectly balanced).
- log-prob mismatch between the trainer and the rollout engine, with and without replay
  (rlpo_mega.algorithms.mismatch's k3 KL and |w - 1|).
Counts are summed over micro-batches and all ranks (tokens are disjoint across DP and SP ranks, layers
across PP stages), so the numbers are global whatever the layout. They are kept on the routers' device
(RoutingStats' `device`): counting never waits for the accelerator, and the all-reduce gets the device
tensor NCCL requires; the host sees one copy of each phase's table, after the reduction.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N, k] x [N, k] -> bool [N]: the two top-k id sets are equal (order ignored)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def agreement(live: torch.Tensor, ref: torch.Tensor, valid: Optional[torch.Tensor] = None) -> float:
    eq = same_sets(live, ref)
    if valid is not None:
        eq = eq[valid]
    return float(eq.double().mean()) if eq.numel() else float("nan")


def load_histogram(ids: torch.Tensor, num_experts: int, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ids [N, k] (in [0, E)) -> tokens per expert [E] (float64, on ids' device). Invalid rows weigh 0
    instead of being dropped: no boolean indexing or bincount, which would wait for the accelerator."""
    weight = torch.ones(ids.shape, dtype=torch.float64, device=ids.device)
    if valid is not None:
        weight = weight * valid.reshape(-1, 1).to(torch.float64)
    hist = torch.zeros(num_experts, dtype=torch.float64, device=ids.device)
    return hist.index_add_(0, ids.reshape(-1).long(), weight.reshape(-1))


def load_entropy(hist: torch.Tensor) -> float:
    total = hist.sum()
    if total <= 0:
        return float("nan")
    p = hist / total
    return float(-(p[p > 0] * p[p > 0].log()).sum())


def max_over_mean(hist: torch.Tensor) -> float:
    mean = hist.mean()
    return float(hist.max() / mean) if mean > 0 else float("nan")


def min_over_mean(hist: torch.Tensor) -> float:
    mean = hist.mean()
    return float(hist.min() / mean) if mean > 0 else float("nan")


class RoutingStats:
    """Per-phase, per-MoE-layer counters: [agree, compared, live fallback entries, tokens, load x E], on
    `device` (the routes' device: the model's; the caller passes it, this package knows no platform)."""

    def __init__(self, num_layers: int, num_experts: int, moe_layers, device=None):
        self.L, self.E, self.moe_layers = num_layers, num_experts, tuple(moe_layers)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._acc: dict[str, torch.Tensor] = {}

    def _table(self, phase):
        if phase not in self._acc:
            self._acc[phase] = torch.zeros(self.L, 4 + self.E, dtype=torch.float64, device=self.device)
        return self._acc[phase]

    def update(self, phase: str, col: int, used: torch.Tensor, live: Optional[torch.Tensor] = None,
               target: Optional[torch.Tensor] = None):
        """used/live [N, k] for one layer and micro-batch; target [N, k] the reference routes with the
        transport's markers (-2 padding: not counted, -1 live fallback: counted as fallback, not compared)."""
        t = self._table(phase)
        real = None if target is None else target[:, 0] >= -1
        if target is not None and live is not None:  # masks, not boolean indexing: no wait for the device
            ref = target[:, 0] >= 0
            t[col, 0] += (same_sets(live, target.to(live.dtype)) & ref).sum()
            t[col, 1] += ref.sum()
            t[col, 2] += (target[:, 0] == -1).sum()
        t[col, 3] += used.shape[0] if real is None else real.sum()
        t[col, 4:] += load_histogram(used, self.E, real)

    def reduce(self, group=None, phases=None) -> dict:
        """Sum over every rank (collective: all ranks call it), then the metrics; resets the counters of
        the phases reported (all, or the given ones)."""
        given = phases is not None
        phases = sorted(phases if given else self._acc)
        if not given and dist.is_initialized() and dist.get_world_size(group) > 1:
            every = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, phases, group=group)  # a stage may have seen no MoE layer
            phases = sorted({p for ps in every for p in ps})
        out = {}
        if not phases:
            return out
        tables = torch.stack([self._table(phase) for phase in phases])  # one reduction and one copy for all
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(tables, group=group)
        tables = tables.cpu()  # the metrics read it entry by entry: on the host
        for phase, t in zip(phases, tables):
            out.update(self._metrics(phase, t))
            self._acc.pop(phase, None)
        return out

    def _metrics(self, phase, t) -> dict:
        p = f"routing/{phase}"
        out = {}
        agree = []
        for col in range(self.L):
            name = f"layer{self.moe_layers[col]}"
            hist = t[col, 4:]
            if t[col, 1] > 0:
                out[f"{p}/agreement/{name}"] = float(t[col, 0] / t[col, 1])
                agree.append(out[f"{p}/agreement/{name}"])
            out[f"{p}/load_entropy/{name}"] = load_entropy(hist)
            out[f"{p}/load_max_over_mean/{name}"] = max_over_mean(hist)
            out[f"{p}/load_min_over_mean/{name}"] = min_over_mean(hist)
        if t[:, 1].sum() > 0:
            out[f"{p}/agreement"] = float(t[:, 0].sum() / t[:, 1].sum())
            out[f"{p}/agreement_min_layer"] = min(agree)
        ent = [out[f"{p}/load_entropy/layer{m}"] for m in self.moe_layers]
        out[f"{p}/load_entropy"] = sum(ent) / len(ent) if ent else float("nan")
        out[f"{p}/load_entropy_max"] = math.log(self.E)
        mm = [out[f"{p}/load_max_over_mean/layer{m}"] for m in self.moe_layers]
        out[f"{p}/load_max_over_mean"] = max(mm) if mm else float("nan")
        out[f"{p}/fallback_entries"] = float(t[:, 2].sum())
        out[f"{p}/tokens"] = float(t[:, 3].max()) if self.L else 0.0
        return out
