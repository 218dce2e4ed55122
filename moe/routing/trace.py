"""The routing trace of one sample: top-k expert ids per token per MoE layer, compact and validated.

Contract (architecture.md): `ids[t, l, j]` is the j-th expert chosen for input token t of the sample at
MoE layer l (the l-th entry of the family's MoE layer list, not the decoder layer index). The rows are
the sample's tokens 0 .. prompt+completion-2: the last sampled token never ran a forward in the engine,
which is exactly the trainer's input `tokens[:-1]`, so row t routes input position t.

Ids are stored as uint8 when the experts fit (<= 256), else int16: a trace costs layers * topk bytes per
token. A bad trace (shape, id range, duplicate ids within a token's top-k, missing rows, all-zero layers:
the silent failure slime hit when route data was absent) raises `RoutingTraceError` naming the sample,
layer and token; with `on_error="fallback"` the bad entries are instead marked `replaced` (the trainer
routes them with its live router), counted and logged. Never silent.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from moe.families import get_family

log = logging.getLogger(__name__)

ON_ERROR = ("error", "fallback")
# Below this many tokens a top-1 layer routing every token to expert 0 may be genuine.
ALL_ZERO_MIN_TOKENS_TOP1 = 16


class RoutingTraceError(ValueError):
    pass


def compact_dtype(num_experts: int) -> torch.dtype:
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


@dataclass
class RoutingTrace:
    ids: torch.Tensor  # [T, L, k] compact dtype
    num_experts: int
    replaced: Optional[torch.Tensor] = None  # bool [T, L]: entries the live router decides (fallback)
    problems: list = field(default_factory=list)  # messages of what was replaced

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.ids.shape[1]

    @property
    def topk(self) -> int:
        return self.ids.shape[2]

    @property
    def num_replaced(self) -> int:
        return 0 if self.replaced is None else int(self.replaced.sum())

    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size()


@dataclass(frozen=True)
class TraceSpec:
    """What a sample's trace must look like for this model."""

    num_experts: int
    topk: int
    moe_layers: tuple  # decoder layer index of each MoE layer (trace axis 1)

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)

    @classmethod
    def from_hf(cls, hf) -> "TraceSpec":
        family = get_family(hf.model_type)
        pattern = family.moe_layer_pattern(hf)
        return cls(family.num_experts(hf), int(hf.num_experts_per_tok),
                   tuple(i for i, m in enumerate(pattern) if m))

    def layer_name(self, col: int) -> str:
        return f"MoE layer {col} (decoder layer {self.moe_layers[col]})"


def validate_trace(ids, spec: TraceSpec, num_tokens: int, sample, on_error: str = "error") -> RoutingTrace:
    """Check one sample's ids [T, L, k] (any int dtype; -1 = no data) against `spec` and its token count
    (prompt + completion - 1). Returns a compact RoutingTrace; see the module doc for `on_error`."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error={on_error!r}; choose one of {ON_ERROR}")
    ids = torch.as_tensor(ids)
    where = f"routing trace of sample {sample}"
    L, k, E = spec.num_layers, spec.topk, spec.num_experts
    problems: list[str] = []
    replaced = torch.zeros(num_tokens, L, dtype=torch.bool)

    def whole(msg):  # misaligned or mis-shaped: no row can be trusted
        if on_error == "error":
            raise RoutingTraceError(f"{where}: {msg}")
        replaced.fill_(True)
        problems.append(msg)
        return _finish(torch.zeros(num_tokens, L, k, dtype=torch.long), spec, replaced, problems, sample)

    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        return whole(f"ids must be integers, got {ids.dtype}")
    if ids.dim() != 3 or ids.shape[1] != L or ids.shape[2] != k:
        return whole(f"shape {tuple(ids.shape)}, expected [tokens, {L} MoE layers, top-{k}] "
                     f"(tokens = prompt + completion - 1 = {num_tokens})")
    if ids.shape[0] > num_tokens:
        return whole(f"{ids.shape[0]} rows for {num_tokens} tokens (prompt + completion - 1): the trace is "
                     "not aligned with the trainer's tokens (last-token shift or prefix mismatch?)")
    ids = ids.long()
    if ids.shape[0] < num_tokens:
        t0 = ids.shape[0]
        msg = f"missing rows for tokens {t0}..{num_tokens - 1} ({num_tokens - t0} of {num_tokens})"
        if on_error == "error":
            raise RoutingTraceError(f"{where}: {msg}")
        problems.append(msg)
        replaced[t0:] = True
        ids = torch.cat([ids, ids.new_zeros(num_tokens - t0, L, k)])
    present = ~replaced[:, :, None].expand(-1, -1, k)

    # All-zero layer before duplicates: zeros everywhere means the data never arrived.
    if num_tokens and (k >= 2 or num_tokens >= ALL_ZERO_MIN_TOKENS_TOP1):
        zero_layer = ((ids == 0) | ~present).all(dim=2).all(dim=0) & present.any(dim=2).any(dim=0)
        for col in zero_layer.nonzero().flatten().tolist():
            _bad(f"{spec.layer_name(col)}: every expert id is 0 (route data missing?)", replaced,
                 (slice(None), col), on_error, where, problems)
    checks = (
        (ids < 0, "missing route (id -1, no data)"),
        (ids >= E, f"expert id out of range [0, {E})"),
    )
    for bad_ids, what in checks:
        bad = (bad_ids & present).any(dim=2) & ~replaced
        if bad.any():
            t, col = bad.nonzero()[0].tolist()
            _bad(f"token {t}, {spec.layer_name(col)}: {what}: {ids[t, col].tolist()} "
                 f"({int(bad.sum())} entries)", replaced, bad, on_error, where, problems)
    if k > 1:
        s = ids.sort(dim=2).values
        dup = (s[:, :, 1:] == s[:, :, :-1]).any(dim=2) & ~replaced
        if dup.any():
            t, col = dup.nonzero()[0].tolist()
            _bad(f"token {t}, {spec.layer_name(col)}: duplicate expert ids in the top-{k} "
                 f"{ids[t, col].tolist()} ({int(dup.sum())} entries)", replaced, dup, on_error, where, problems)
    ids = torch.where(replaced[:, :, None], torch.zeros_like(ids), ids)
    return _finish(ids, spec, replaced, problems, sample)


def _bad(msg, replaced, index, on_error, where, problems):
    if on_error == "error":
        raise RoutingTraceError(f"{where}: {msg}")
    replaced[index] = True
    problems.append(msg)


def _finish(ids, spec, replaced, problems, sample) -> RoutingTrace:
    trace = RoutingTrace(ids.to(compact_dtype(spec.num_experts)), spec.num_experts,
                         replaced if replaced.any() else None, problems)
    if problems:
        log.warning("routing trace of sample %s: %d (token, layer) entries fall back to the live router: %s",
                    sample, trace.num_replaced, "; ".join(problems))
    return trace


DUPLICATE_BLOCK = 1 << 16


def clean_trace(ids, spec: TraceSpec, num_tokens: int) -> Optional[RoutingTrace]:
    """The checks of validate_trace for one sample, in its own memory: the compact trace when it is clean, else
    None (then validate_trace names the problem or falls back). No widening beyond the ids' own dtype and no
    sort: the range is one unsigned max (negatives wrap above any expert count), duplicates within a top-k are
    k*(k-1)/2 compares of contiguous columns (k - 1 calls), and an all-zero layer is a column max. A stream of answers can be
    checked one by one as they arrive, each costing about what its own ids' bytes do."""
    L, k, E = spec.num_layers, spec.topk, spec.num_experts
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_cuda:
            return None
        ids = ids.numpy()
    if ids.dtype.kind not in "iu" or ids.shape != (num_tokens, L, k):
        return None
    if ids.size:
        unsigned = ids.view(ids.dtype.str.replace("i", "u")) if ids.dtype.kind == "i" else ids
        if int(unsigned.max()) >= E:  # also every negative id (-1 = no data)
            return None
    compact = torch.from_numpy(ids.astype(torch.empty(0, dtype=compact_dtype(E)).numpy().dtype, copy=False))
    flat = compact.numpy().reshape(-1, k)
    if k > 1:
        # in blocks of DUPLICATE_BLOCK (token, layer) rows, so that the transposed copy and the compares' outputs
        # stay in cache and below malloc's mmap threshold: whole-sample temporaries cost twice as much, half of it
        # page faults on memory fresh from the kernel for every answer
        for start in range(0, flat.shape[0], DUPLICATE_BLOCK):
            cols = np.ascontiguousarray(flat[start:start + DUPLICATE_BLOCK].T)  # [k, rows]: contiguous compares
            for a in range(k - 1):  # column a against every later column in one compare
                if (cols[a + 1:] == cols[a]).any():
                    return None
    # top-2 and more: k distinct ids hold a non-zero one, so no layer is all zero once duplicates are excluded
    if num_tokens and k == 1 and num_tokens >= ALL_ZERO_MIN_TOKENS_TOP1:
        if not compact.numpy().reshape(num_tokens, L * k).max(axis=0).reshape(L, k).any(axis=1).all():
            return None  # a layer whose ids are all 0
    return RoutingTrace(compact, E)


def validate_batch(traces: Sequence, spec: TraceSpec, num_tokens: Sequence[int], on_error: str = "error",
                   sample_ids: Optional[Sequence] = None) -> tuple[list[RoutingTrace], dict]:
    """Validate every sample; returns the traces and counts (fallback entries and tokens, bytes)."""
    if len(traces) != len(num_tokens):
        raise ValueError(f"{len(traces)} routing traces for {len(num_tokens)} samples")
    names = sample_ids if sample_ids is not None else range(len(traces))
    # each trace in its own memory (clean_trace); one with a problem again through validate_trace, for its
    # message or its fallback entries
    out = [clean_trace(t, spec, n) or validate_trace(t, spec, n, s, on_error)
           for t, n, s in zip(traces, num_tokens, names)]
    stats = {
        "routing/fallback_entries": sum(t.num_replaced for t in out),
        "routing/fallback_tokens": sum(int(t.replaced.any(dim=1).sum()) for t in out if t.replaced is not None),
        "routing/fallback_samples": sum(t.replaced is not None for t in out),
        "routing/trace_tokens": sum(num_tokens),
        "routing/trace_bytes": sum(t.nbytes() for t in out),
    }
    return out, stats
