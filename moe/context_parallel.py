"""Context parallelism (CP) for packed sequences: megatron-core's THD layout, and an attention that runs it
without Transformer Engine.

Layout (megatron-core's get_thd_batch_on_this_cp_rank, TE's thd_get_partitioned_indices): each sequence of a
packed row is padded to a multiple of 2 x cp (2 x cp x tp under sequence parallelism: the CP-local row is then
scattered over TP), cut into 2 x cp equal chunks, and CP rank r keeps chunks r and 2cp-1-r, in that order,
sequence after sequence: every rank holds the same share of each sequence's causal work. cu_seqlens stay global
(the padded ones describe this layout); a rank's local row is cu_padded / cp long per sequence.

Attention without TE (all-gather KV, Llama 3 section 3.3.2; TE's cp_comm_type="all_gather"): the CP ranks
all-gather K and V (differentiable: the backward sums each rank's dK/dV contributions back to their owners),
put the rows back in sequence order, and each local query attends, causally by its global position, to the keys
of its own sequence. The softmax runs in one pass over the whole prefix, so the result is the single-rank
attention's (tested equal, outputs and gradients: tests/test_context_parallel.py). Memory: every rank holds the
whole row's K and V (what all-gather trades for a single, unoverlapped collective per layer).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def padded_length(length: int, cp: int, tp: int = 1) -> int:
    """A sequence's length padded to megatron's CP divisibility: a multiple of 2 x cp (x tp with SP)."""
    unit = 2 * cp * tp
    return -(-length // unit) * unit


def position_in_sequence(j, c, cp: int, rank):
    """The layout, written once: where the j-th of CP rank `rank`'s 2c local rows of a sequence sits in that
    sequence (c: its chunk length, its padded length / 2cp): rows [0, c) are chunk `rank`, rows [c, 2c) chunk
    2cp-1-rank. Python ints or broadcastable tensors alike (the attention and the index builders call it on the
    device, the packing plan on the host)."""
    return rank * c + j + (j >= c) * (2 * (cp - 1 - rank) * c)


def shard_index(cu_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """The positions (in the packed, padded row) that CP rank `rank` holds, in its local order: per sequence,
    chunk `rank` then chunk 2cp-1-rank. cu_padded: int [n + 1] on the host (built with the batch), every
    length a multiple of 2 x cp."""
    cu = cu_padded.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    if bool((lengths % (2 * cp)).any()):
        raise ValueError(f"context parallel size {cp}: padded sequence lengths {lengths.tolist()} must be "
                         f"multiples of {2 * cp} (2 x cp)")
    return _positions(cu, cp, int(cu[-1]) // cp, torch.tensor([rank]))[0]


def _positions(cu: torch.Tensor, cp: int, local: int, ranks: torch.Tensor) -> torch.Tensor:
    """For each of `ranks`, the row positions of its `local` rows -> [len(ranks), local] (on cu's device)."""
    t = torch.arange(local, device=cu.device)
    seq = torch.searchsorted(cu[1:] // cp, t, right=True)  # each local row's sequence
    j = t - cu[seq] // cp  # its place in the sequence's local share
    c = ((cu[seq + 1] - cu[seq]) // (2 * cp))[None, :]  # its sequence's chunk length
    return cu[seq][None, :] + position_in_sequence(j[None, :], c, cp, ranks[:, None])


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """x [t, ...] of every rank of `group`, concatenated rank-major along the first dimension; the backward
    reduce-scatters (sums) each row's gradient into its owner. megatron-core's sequence-parallel gather over
    the CP group: one collective each way on NCCL and gloo alike (torch.distributed.nn's all_gather emulates its
    backward on gloo with scatters addressed by group rank, wrong on a subgroup such as CP's under TP)."""
    # lazy: the config checks and the planner read padded_length before anything may import megatron, which a
    # broken Transformer Engine makes fail before moe.model.have_transformer_engine() can report it
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x.contiguous(), tensor_parallel_output_grad=True, group=group)


def _sequence_order(cu: torch.Tensor, cp: int, local: int) -> torch.Tensor:
    """For each position of the whole padded row, its row in the rank-major concatenation of every CP rank's
    local rows (what an all-gather returns): the inverse of the layout."""
    held = _positions(cu, cp, local, torch.arange(cp, device=cu.device)).reshape(-1)  # gathered row -> position
    order = torch.empty_like(held)
    order[held] = torch.arange(held.shape[0], device=cu.device)
    return order


def local_rows(cu_padded: torch.Tensor, cp: int, rank: int, local: int) -> torch.Tensor:
    """This rank's `local` rows' places in the whole padded row (on cu's device, no host read): shard_index
    from the tensors' sizes."""
    cu = cu_padded.to(torch.long)
    return _positions(cu, cp, local, torch.full((1,), rank, device=cu.device))[0]


def gather(values: torch.Tensor, cu_padded: torch.Tensor, group) -> torch.Tensor:
    """Per-token values of this CP rank's local row [1, t / cp, ...] -> the whole padded row [1, t, ...] in
    sequence order, on every CP rank. Differentiable: the all-gather's backward sums every rank's gradient of
    each row into its owner. Every CP rank then computes the same loss over the whole row, so each rank's
    gradient is cp times its own tokens' share; the per-token normalisation megatron applies (the token count
    all-reduced over data x context parallel ranks, cp times the row's) cancels that factor exactly -- as
    Megatron-LM's RL does (rl_utils.py)."""
    cp = dist.get_world_size(group)
    rows = all_gather(values[0], group)
    cu = cu_padded.to(device=values.device, dtype=torch.long)
    return rows.index_select(0, _sequence_order(cu, cp, values.shape[1])).unsqueeze(0)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_padded: torch.Tensor,
              longest: int, group, scale: float) -> torch.Tensor:
    """Causal attention of this CP rank's queries over their sequences' whole prefixes.

    query [t, heads, dim], key/value [t, kv heads, dim]: this rank's local row (shard_index's order, RoPE
    applied at global positions); cu_padded: int [n + 1] global padded boundaries (on the tensors' device);
    longest: the longest padded sequence (a Python int: no host sync per layer). Query head h reads k/v head
    h // (heads / kv heads). Returns [t, heads * v dim], this rank's rows."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = query.device
    cu = cu_padded.to(device=dev, dtype=torch.long)
    n, t = cu.shape[0] - 1, query.shape[0]
    lengths = cu[1:] - cu[:-1]
    c = lengths // (2 * cp)  # chunk length per sequence
    lcu = cu // cp
    # the whole row's K and V in sequence order: gathered rank-major (K and V in one collective), then every
    # position reads its row of the gathered block
    kv = all_gather(torch.cat([key, value], dim=-1), group)
    kv = kv.index_select(0, _sequence_order(cu, cp, t))
    k, v = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
    # per sequence: its 2c local queries against its `longest`-padded keys, as one batch
    half = longest // (2 * cp)
    qj = torch.arange(2 * half, device=dev)
    q_valid = qj[None, :] < 2 * c[:, None]
    q_rows = torch.where(q_valid, lcu[:-1, None] + qj[None, :], 0)  # [n, 2 half]
    q_pos = position_in_sequence(qj[None, :], c[:, None], cp, rank)
    kp = torch.arange(longest, device=dev)
    k_rows = torch.where(kp[None, :] < lengths[:, None], cu[:-1, None] + kp[None, :], 0)  # [n, longest]
    visible = (kp[None, None, :] <= q_pos[:, :, None]) & (kp[None, None, :] < lengths[:, None, None])
    visible = visible | ~q_valid[:, :, None] & (kp == 0)[None, None, :]  # a filler query row sees one key
    q = query[q_rows].transpose(1, 2)  # [n, heads, 2 half, dim]
    kk, vv = (x[k_rows].transpose(1, 2) for x in (k, v))  # [n, kv heads, longest, dim]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        kk, vv = kk.repeat_interleave(groups, dim=1), vv.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=visible[:, None], scale=scale)
    out = out.transpose(1, 2).reshape(n * 2 * half, -1)  # [n * 2 half, heads * v dim]
    tok = torch.arange(t, device=dev)
    seq = torch.searchsorted(lcu[1:], tok, right=True)
    return out.index_select(0, seq * 2 * half + tok - lcu[seq])
