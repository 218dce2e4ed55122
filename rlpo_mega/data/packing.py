"""Which sample trains where: mini-batches, the data-parallel split and micro-batches, from lengths alone.

Every rank computes the same plan from the global scalars (each sample's length), so nothing but the
samples themselves has to travel (rlpo_mega.training.exchange), and every rank knows which samples its
peers hold.

- mini-batches: contiguous slices of the step's samples (one optimizer step each), as before packing.
- data-parallel split ("packed"): sequence-length-aware. Karmarkar-Karp's largest differencing method
  balances the tokens of the DP ranks (long-CoT lengths are long-tailed: an equal number of rows per rank
  leaves most ranks waiting for the one with the longest samples); verl balances the same way.
- micro-batches ("packed"): by a token budget (max_tokens_per_micro_batch) or, without one, a fixed
  count; also Karmarkar-Karp within the rank. Every DP rank runs the same number of micro-batches (the
  expert-parallel all-to-all of a micro-batch spans DP ranks), the largest any rank needs.
- "padded" (the reference layout): equal contiguous rows per DP rank and per micro-batch, as slime's and
  the first version of this trainer's padded batches.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Optional, Sequence

from moe.context_parallel import padded_length, position_in_sequence

LAYOUTS = ("packed", "padded")


def karmarkar_karp(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of `weights` in `parts` sets with sums as equal as the largest differencing method makes
    them (deterministic; each set sorted). Sets may be empty when there are fewer items than parts."""
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1")
    if parts == 1:  # one set: everything (the differencing below would copy lists n times to find it)
        return [list(range(len(weights)))]
    # a partial solution: `parts` (sum, items) sets sorted by sum descending; keyed by its spread
    # (items are tuples, never mutated: every partial solution's empty sets can be one shared list, made at C
    # speed; the plan runs each step and the planner over many drawn steps of thousands of samples)
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    if not order:
        return [[] for _ in range(parts)]
    empty = [(0, ())] * (parts - 1)
    heap = [(-weights[i], tie, [(weights[i], (i,))] + empty) for tie, i in enumerate(order)]  # already a heap
    tie = len(heap)
    pop, push, first = heapq.heappop, heapq.heappush, itemgetter(0)
    while len(heap) > 1:
        a, b = pop(heap)[2], pop(heap)[2]
        # the heaviest set of one with the lightest of the other: the difference shrinks
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=first, reverse=True)  # stable, as key=-sum: equal sums keep their order
        push(heap, (merged[-1][0] - merged[0][0], tie, merged))
        tie += 1
    return [sorted(items) for _, items in heap[0][2]]


def aligned(tokens: int, multiple: int) -> int:
    return -(-tokens // multiple) * multiple


@dataclass(frozen=True)
class StepPlan:
    """micro[m][d][j]: the sample indices of micro-batch j of DP rank d in mini-batch m (ascending)."""
    layout: str
    micro: list

    def dp_of(self) -> dict[int, int]:
        return {i: d for mini in self.micro for d, rank in enumerate(mini) for mb in rank for i in mb}

    def computed_tokens(self, spans: Sequence[int], align: int = 1) -> int:
        """Positions the model runs over all DP replicas (pads included): packed rows are aligned (an empty
        micro-batch still runs one aligned pad segment), padded rows all take the step's longest sample."""
        if self.layout == "padded":
            width = aligned(max(spans), align)
            return sum(max(len(mb), 1) * width for mini in self.micro for rank in mini for mb in rank)
        return sum(aligned(max(sum(spans[i] for i in mb), 1), align)
                   for mini in self.micro for rank in mini for mb in rank)

    def shards(self, spans: Sequence[int], align: int, sp_size: int, cp_size: int = 1
               ) -> dict[int, list[tuple[tuple[int, int], ...]]]:
        """Each sample's trace rows held by each rank of its sequence-parallel (and context-parallel) group, as
        ranges ((lo, hi), ...), listed by cp_rank x sp_size + sp_rank. Without CP: SP rank k holds positions
        [k t / sp, (k + 1) t / sp) of its micro-batch's row of t positions (packed: aligned to `align`, the
        samples back to back; padded: the step's longest sample, aligned), one range per sample, empty ranges
        (span, span) or (0, 0). Under CP (packed): each sample padded to 2 x cp x align, CP rank r holding its
        chunks r and 2cp-1-r (moe.context_parallel's layout), SP rank k the k-th contiguous part of that local
        row: at most two ranges per sample, empty ones left out. What the exchange sends each rank
        (training/exchange.py)."""
        if cp_size > 1:
            return self._context_parallel_shards(spans, align, sp_size, cp_size)
        width = aligned(max(spans), align) if self.layout == "padded" else None
        out = {}
        for mini in self.micro:
            for rank in mini:
                for mb in rank:
                    t = width or aligned(max(sum(spans[i] for i in mb), 1), align)
                    n, off = t // sp_size, 0
                    for i in mb:
                        out[i] = [((min(max(k * n - off, 0), spans[i]), min(max((k + 1) * n - off, 0), spans[i])),)
                                  for k in range(sp_size)]
                        off += spans[i] if width is None else 0
        return out

    def _context_parallel_shards(self, spans, align, sp_size, cp):
        out = {}
        for mini in self.micro:
            for rank in mini:
                for mb in rank:
                    chunk = [padded_length(spans[i], cp, align) // (2 * cp) for i in mb]
                    n = 2 * sum(chunk) // sp_size  # each SP rank's part of a CP rank's local row
                    out.update({i: [] for i in mb})
                    for r in range(cp):
                        for k in range(sp_size):
                            off = 0  # the sample's first row in CP rank r's local row
                            for i, c in zip(mb, chunk):
                                a, b = max(k * n - off, 0), min((k + 1) * n - off, 2 * c)  # in its 2c local rows
                                ranges = []
                                for lo, hi in ((a, min(b, c)), (max(a, c), b)):  # each within one chunk
                                    if lo < hi:
                                        at = position_in_sequence(lo, c, cp, r)
                                        lo, hi = min(at, spans[i]), min(at + hi - lo, spans[i])
                                    if lo < hi:
                                        ranges.append((lo, hi))
                                out[i].append(tuple(ranges))
                                off += 2 * c
        return out

    def mine(self, dp_rank: int) -> list[list[list[int]]]:
        """[mini][micro] -> sample indices for one DP rank."""
        return [mini[dp_rank] for mini in self.micro]


def plan_step(spans: Sequence[int], mini_batches: int, dp: int, num_micro_batches: int = 1,
              max_tokens: Optional[int] = None, layout: str = "packed", align: int = 1) -> StepPlan:
    """spans: each sample's input positions (prompt + response - 1). align: a packed micro-batch is padded
    to a multiple of this (the TP size under sequence parallelism)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; choose one of {LAYOUTS}")
    n = len(spans)
    if n % mini_batches:
        raise ValueError(f"{n} samples do not split into {mini_batches} mini-batches")
    per = n // mini_batches
    minis = [list(range(m * per, (m + 1) * per)) for m in range(mini_batches)]
    if layout == "padded":
        if per % (dp * num_micro_batches):
            raise ValueError(f"a mini-batch of {per} rows does not split into {dp} DP ranks x "
                             f"{num_micro_batches} micro-batches")
        rows = per // dp
        k = rows // num_micro_batches
        return StepPlan(layout, [[[idx[d * rows + j * k: d * rows + (j + 1) * k] for j in range(num_micro_batches)]
                                  for d in range(dp)] for idx in minis])
    out = []
    for idx in minis:
        if len(idx) < dp:
            raise ValueError(f"a mini-batch of {len(idx)} samples cannot give each of {dp} DP ranks one")
        ranks = [[idx[i] for i in part] for part in karmarkar_karp([spans[i] for i in idx], dp)]
        count = max(_micro_count(r, spans, num_micro_batches, max_tokens, align) for r in ranks)
        out.append([_cut(r, spans, count, max_tokens, align) for r in ranks])
    return StepPlan(layout, out)


def _cut(samples, spans, count, max_tokens, align):
    parts = karmarkar_karp([spans[i] for i in samples], count)
    return [[samples[i] for i in p] for p in parts]


def _fits(parts, samples, spans, max_tokens, align):
    return all(aligned(sum(spans[samples[i]] for i in p), align) <= max_tokens for p in parts)


def _micro_count(samples, spans, minimum, max_tokens, align) -> int:
    """The fewest micro-batches (>= minimum) whose token counts fit the budget. A rank may hold fewer samples
    than `minimum` (the DP split balances tokens, not counts): its extra micro-batches are empty, and an empty
    micro-batch runs one masked pad segment (training/batches.build_micro_batch), so every rank still joins
    each micro-batch's collectives."""
    if max_tokens is None or not samples:
        return minimum
    longest = max(spans[i] for i in samples)
    if aligned(longest, align) > max_tokens:
        raise ValueError(f"a sample spans {longest} tokens, more than trainer.max_tokens_per_micro_batch="
                         f"{max_tokens}: raise the budget to at least the longest prompt + response")
    k = max(minimum, math.ceil(aligned(sum(spans[i] for i in samples), align) / max_tokens))
    while k < len(samples) and not _fits(karmarkar_karp([spans[i] for i in samples], k), samples, spans,
                                         max_tokens, align):
        k += 1  # balanced sets can still overflow by a sample; one more set always helps in the end
    return max(minimum, min(k, len(samples)))
