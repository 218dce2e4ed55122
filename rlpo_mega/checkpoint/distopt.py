"""The distributed optimizer's state in a checkpoint: megatron-core's fully_reshardable tensors, without its gathers.

fully_reshardable (the format rlpo_mega.checkpoint stores, for it reshards across every parallel dimension) keeps
each parameter's fp32 main copy, exp_avg and exp_avg_sq model-shaped, under the keys
`optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<param key>`. megatron-core 0.16.1 writes it by gathering each DP
group's whole buffers on the group's rank 0 (get_parameter_state_dp_zero: 12 B per element of the rank's
model-parallel shard, on the host) and reads it by allocating the whole shard's state on every rank: at the recipes'
size that is most of a terabyte on one host (rlpo-mega plan, Qwen3-30B on 2 nodes: 772 GB on node 0 at a save).
Here the same tensors are written and read with each rank holding only its own share:

- save: each parameter is written by one *owner*, the DP rank whose contiguous range of the bucket holds the
  parameter's first element. The owner holds that part of the state already; only a parameter that runs past the
  end of the owner's range needs the other parts, sent point-to-point by the DP ranks that hold them (over the
  optimizer's gloo group, on the host, as megatron's own gather). A rank holds on the host the state of the
  parameters it owns: the host memory of a save is the rank's share of the optimizer state, spread over all ranks.
- load: each rank reads only the parameters its range touches, and keeps its range of them.

The tensors, keys and shapes are megatron's: checkpoints written either way load either way.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from rlpo_mega import platform

STATES = ("param", "exp_avg", "exp_avg_sq")  # the param_state entry names megatron's loader reads
_KEY_NAMES = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def dp_shares(params: list, buckets: list, dp: int) -> tuple[list[int], list[int]]:
    """Elements of one DDP buffer per DP rank: (owned: the parameters whose first element lies in the rank's range,
    which it writes at a save; touched: the parameters its range holds any of, which it reads at a load).
    params: [start, end) of every parameter in the buffer; buckets: [start, end) of every bucket (padded to a
    multiple of dp, each cut into dp equal contiguous ranges, as the distributed optimizer cuts them)."""
    owned, touched = [0] * dp, [0] * dp
    for start, end in params:
        first, last = _ranks_holding(start, end, buckets, dp)
        owned[first] += end - start
        for k in range(first, last + 1):
            touched[k] += end - start
    return owned, touched


def _ranks_holding(start: int, end: int, buckets: list, dp: int) -> tuple[int, int]:
    b0, b1 = next((b0, b1) for b0, b1 in buckets if b0 <= start < b1)
    shard = (b1 - b0) // dp
    return (start - b0) // shard, (end - 1 - b0) // shard


def _model_metadata(model_sd) -> dict:
    """model parameter -> its ShardedTensor (or ShardedTensorFactory) in the model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return {v.data: v for v in nested_values(model_sd) if isinstance(v, (ShardedTensor, ShardedTensorFactory))}


def _names(param) -> tuple[str, ...]:
    # an fp32 model parameter is its own main parameter (distrib_optimizer.py:420): written with the weights
    return STATES[1:] if param.dtype == torch.float32 else STATES


def _sharded(meta, name: str, data: torch.Tensor, replica_id):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if meta.flattened_range is not None:
        raise ValueError(f"{meta.key}: a flattened model tensor cannot carry optimizer state")
    kwargs = {"key": f"optimizer.state.{_KEY_NAMES[name]}.{meta.key}", "data": data, "replica_id": replica_id}
    if not isinstance(meta, ShardedTensorFactory):
        kwargs["dtype"] = data.dtype
    t = replace(meta, **kwargs)
    t.validate_metadata_integrity()
    return t


def _replica(meta, k: int) -> tuple:
    """replica_id of the state of the parameter `meta` on the DP rank k places after its owner: the owner's is the
    main replica of its DP group (at a save the only copy; at a load every rank reading it is counted once, as
    dist_checkpointing checks); the model's (PP, TP) part says whether this model-parallel copy is the one."""
    if len(meta.replica_id) != 3:
        raise ValueError(f"{meta.key}: replica_id {meta.replica_id} is not megatron's (PP, TP, DP)")
    return (*meta.replica_id[:2], k)


def _local_states(sub, param, names, mine) -> dict:
    """This rank's range `mine` of the parameter's main copy and Adam moments (flat). A never-stepped Apex/TE
    FusedAdam has no moments yet: they are Adam's initial zeros."""
    states = sub._get_main_param_and_optimizer_states(param)
    main = states["param"]
    if main.numel() != mine.size:  # what megatron's own gather would copy into the wrong place (or fail on)
        raise RuntimeError(
            f"the distributed optimizer's state for a range of {mine.size} elements has {main.numel()}: its "
            "param-group index map points at another parameter (distrib_optimizer.py:894-908)")
    return {n: (states[n] if n in states else torch.zeros_like(main)).detach().reshape(-1) for n in names}


def _geometry(sub):
    """(index, param, (start, end), first and last DP rank holding it, the bucket, this rank's range of it or None,
    exchange group, its ranks, its device) of every parameter, in the order of megatron's param_state numbering
    (sharded_param_state_fully_reshardable: buffers in order, each in its param_index_map order)."""
    index = 0
    for b, buffer in enumerate(sub.buffers):
        group, ranks, device = _group(sub, buffer)
        bounds = [(bk.offset, bk.offset + bk.grad_data.numel()) for bk in buffer.buckets]
        local = {}
        for per_bucket in sub.gbuf_ranges[b].values():
            for m in per_bucket:
                local.update(m["param_map"])
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            first, last = _ranks_holding(start, end, bounds, len(ranks))
            mine = local[param]["param"] if param in local else None
            yield (index, param, (start, end), (first, last), buffer.buckets[bucket_id], mine, group, ranks, device)
            index += 1


def _group(sub, buffer):
    """(process group, its global ranks, device) of the exchange: the optimizer's gloo group on the host where
    megatron made one, else its DP group on the accelerator. Its ranks are the buffer's DP ranks, in order."""
    gloo = sub.data_parallel_group_gloo
    group = gloo if gloo is not None else sub.data_parallel_group
    ranks = dist.get_process_group_ranks(group)
    if ranks != dist.get_process_group_ranks(buffer.data_parallel_group):
        raise RuntimeError(f"the distributed optimizer's DP group {ranks} is not its buffer's "
                           f"{dist.get_process_group_ranks(buffer.data_parallel_group)}")
    return group, ranks, (torch.device("cpu") if gloo is not None else platform.device())


def save_state(sub, model_sd) -> dict:
    """param_state of one DistributedOptimizer for a save: {param index: {state: ShardedTensor}} for the parameters
    this rank owns (model-shaped, on the host, the main replica of its DP group); nothing for the others.
    Collective over the optimizer's DP group."""
    meta = _model_metadata(model_sd)
    out, sends, recvs = {}, [], []
    for index, param, (start, end), (first, last), bucket, mine, group, ranks, device in _geometry(sub):
        if mine is None:
            continue
        names = _names(param)
        local = _local_states(sub, param, names, mine)
        if ranks[first] != dist.get_rank():  # a later part of a parameter another rank owns: send it there
            for n in names:
                piece = local[n].to(device)
                sends.append((dist.isend(piece, ranks[first], group=group), piece))
            continue
        full = {n: torch.empty(param.numel(), dtype=torch.float32) for n in names}
        for n in names:
            full[n][mine.start:mine.end].copy_(local[n])
        shard = bucket.grad_data.numel() // len(ranks)
        for k in range(first + 1, last + 1):
            lo = max(start, bucket.offset + k * shard) - start
            hi = min(end, bucket.offset + (k + 1) * shard) - start
            for n in names:  # on the host straight into place; from the accelerator through a part-sized buffer
                if device.type == "cpu":
                    recvs.append((dist.irecv(full[n][lo:hi], ranks[k], group=group), None, None))
                else:
                    into = torch.empty(hi - lo, dtype=torch.float32, device=device)
                    recvs.append((dist.irecv(into, ranks[k], group=group), full[n][lo:hi], into))
        m = meta[param]
        out[index] = {n: _sharded(m, n, full[n].view(param.shape), _replica(m, 0)) for n in names}
    for op, _ in sends:
        op.wait()
    for op, dst, src in recvs:
        op.wait()
        if dst is not None:
            dst.copy_(src)
    return out


def load_state(sub, model_sd) -> dict:
    """param_state of one DistributedOptimizer to fill at a load: {param index: {state: tensor to load}} for the
    parameters this rank's range touches (model-shaped, on the host); load_parameter_state_from_fully_reshardable
    keeps the range. An fp32 parameter's 'param' entry is the parameter itself (its own main copy, loaded with
    the weights)."""
    meta = _model_metadata(model_sd)
    out = {}
    for index, param, _, (first, _), _, mine, _, ranks, _ in _geometry(sub):
        if mine is None:
            continue
        m = meta[param]
        replica = _replica(m, ranks.index(dist.get_rank()) - first)
        out[index] = {n: _sharded(m, n, torch.empty(param.shape, dtype=torch.float32), replica) for n in _names(param)}
        if param.dtype == torch.float32:
            out[index]["param"] = param
    return out
