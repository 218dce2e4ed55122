"""The scalars' gather that ends every rollout: each engine rank holds its own samples (tokens, rollout log-probs,
routes); every rank gets every sample's scalars (lengths, reward, flags, owner: a few dozen bytes each, over the
host-side control group), which is all that advantages, dynamic sampling and the micro-batch plan
(rlpo_mega.data.packing) need. The owner validates its samples' routing traces first
(moe.routing.trace.validate_trace), so a bad trace is one error on every rank, before any exchange. The payloads
(tokens, log-probs, routes) move later, only to the ranks that train them (training/exchange.py)."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from moe.routing.trace import RoutingTraceError, TraceSpec, validate_batch
from rlpo_mega.rollout.base import Sample


def gather_scalars(local: list[Sample], spec: Optional[TraceSpec], on_bad_trace: str, group) -> list[Sample]:
    """Every rank: all samples in rank order (= the prompt order of collect.share), this rank's own (their
    routes validated into compact traces) and the others' scalars (Sample.from_scalars). Raises
    RoutingTraceError on every rank when an owner's trace is bad (on_bad_trace=error)."""
    me = dist.get_rank()
    rows, error = [], None
    try:
        # traces the engine already checked as they arrived (trace_checked) are compact and clean
        traced = [i for i, s in enumerate(local) if s.routes is not None and spec is not None and not s.trace_checked]
        # each trace in its own memory (moe.routing.trace.validate_batch): no copy of the whole share
        traces, _ = validate_batch([local[i].routes for i in traced], spec,
                                   [len(local[i].prompt_ids) + len(local[i].response_ids) - 1 for i in traced],
                                   on_bad_trace, [f"{me}:{i}" for i in traced]) if traced else ([], {})
        for i, tr in zip(traced, traces):
            local[i].routes, local[i].replaced = tr.ids, tr.replaced
        replaced = {i: (tr.num_replaced, 0 if tr.replaced is None else int(tr.replaced.any(dim=1).sum()))
                    for i, tr in zip(traced, traces) if tr.replaced is not None}
        for i, s in enumerate(local):
            s.owner = me
            s.replaced_entries, s.replaced_tokens = replaced.get(i, (0, 0))
            rows.append(s.scalars())
    except RoutingTraceError as e:
        error = f"rank {me}: {e}"
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (rows, error), group=group)
    errors = [e for _, e in every if e]
    if errors:
        raise RoutingTraceError("; ".join(errors))
    return [local[i] if rank == me else Sample.from_scalars(row, rank)
            for rank, (rank_rows, _) in enumerate(every) for i, row in enumerate(rank_rows)]
