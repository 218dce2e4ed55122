"""Moving weights between a (sharded) megatron GPTModel and HF-named full tensors.

Import: every rank reads only the HF tensors of its own layers and experts, and of those only the
rows/columns of its tensor-parallel shard. Export: a collective generator that gathers one parameter at
a time (TP or expert-TP all-gather inside the owning stage), sends it to the destination rank(s) and
yields HF-named tensors in buckets, so no rank ever holds more than about one bucket extra (with
`recycle`, at most one bucket of reusable CPU buffers stays allocated between syncs).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from moe.families import VALUE_HEAD_HF, get_family
from moe.lora import LoRAFactors, is_lora_param, merged_weight

from .digest import algorithm_for, tensor_digests
from .hf_checkpoint import CheckpointFormatError, HFCheckpoint, expected_hf_shapes
from .mapping import (Dims, ParamMap, full_to_hf, hf_row_ranges, hf_slices_to_shard, new_tensor,
                      param_maps, shards_to_full)

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.*)")
# The Transformer Engine spec (megatron's choice wherever TE is installed, i.e. on GPUs) names three kinds
# of parameters differently from the local spec the mapping is written in: a norm fused into the linear
# after it, and experts as one GroupedLinear holding weight{j}. Rewritten to local names first (the same
# rewrites as megatron-core's post_training/modelopt/gpt/state_dict_hooks.py and moe/upcycling_utils.py).
_TE_TO_LOCAL = (
    (re.compile(r"^self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"^mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
    (re.compile(r"^self_attention\.linear_q_up_proj\.layer_norm_weight$"), "self_attention.q_layernorm.weight"),
    (re.compile(r"^self_attention\.linear_kv_up_proj\.layer_norm_weight$"), "self_attention.kv_layernorm.weight"),
    (re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$"), r"mlp.experts.local_experts.\2.\1.weight"),
)


def _local_layer_name(rest: str) -> str:
    for pattern, local in _TE_TO_LOCAL:
        renamed, n = pattern.subn(local, rest)
        if n:
            return renamed
    return rest


def _inner(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


@dataclass
class LocalParam:
    local_name: str
    param: torch.nn.Parameter
    map: ParamMap
    tp_rank: int
    tp_size: int
    tp_group: object
    adapted: object = None  # the linear whose LoRA adapter this weight carries (moe/lora.py), else None

    def tensor(self, merged: bool = True) -> torch.Tensor:
        """What the model computes with, as HF weights carry it: the weight with its adapter merged, in its dtype
        (merged=False: the frozen base weight itself)."""
        return merged_weight(self.adapted) if merged and self.adapted is not None else self.param.detach()


def weight_tensors(module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight: the parameters, and the routers' expert_bias buffers -- no gradient,
    updated outside the optimizer, but model state all the same (imported, exported, synced, copied). Not LoRA's
    factors (moe/lora.py): no HF weight of the base is theirs; an export merges them into their linears'."""
    buffers = [(n, b) for n, b in module.named_buffers() if n.endswith("router.expert_bias")]
    return [(n, p) for n, p in module.named_parameters() if not is_lora_param(n)] + buffers


def local_params(model) -> list[LocalParam]:
    """This rank's parameters with their global mapping and the group that shards them."""
    from megatron.core import parallel_state as ps

    inner = _inner(model)
    hf = inner.hf_config
    value_head = getattr(inner, "value_head", False)
    maps = {m.megatron: m for m in param_maps(hf, value_head)}
    layers = inner.decoder.layers if hasattr(inner, "decoder") else []
    ep_rank = ps.get_expert_model_parallel_rank()
    out = []
    for name, p in weight_tensors(inner):
        g = name
        m = _LAYER.match(name)
        if m:
            rest = _local_layer_name(m.group(2))
            me = _EXPERT.match(rest)
            if me:
                local_experts = layers[int(m.group(1))].mlp.experts.num_local_experts  # Sequential- and TEGroupedMLP
                rest = f"mlp.experts.local_experts.{ep_rank * local_experts + int(me.group(1))}.{me.group(2)}"
            g = f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}.{rest}"
        if g == "output_layer.weight" and hf.tie_word_embeddings and not value_head:
            g = "embedding.word_embeddings.weight"  # last stage's copy of the tied embedding
        if g not in maps:
            raise KeyError(f"megatron parameter {name!r} (global {g!r}) has no HF mapping for {hf.model_type}")
        pm = maps[g]
        if pm.expert is not None:
            rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
            group = ps.get_expert_tensor_parallel_group(check_initialized=False)
        else:
            rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
            group = ps.get_tensor_model_parallel_group()
        if pm.kind == "column" and not getattr(p, "tensor_model_parallel", False):
            rank, size = 0, 1  # kept whole on every TP rank (TE's duplicated MLA down-projections)
        owner = inner.get_submodule(name.rsplit(".", 1)[0]) if name.endswith(".weight") else None
        adapted = owner if isinstance(getattr(owner, "lora", None), LoRAFactors) else None
        out.append(LocalParam(name, p, pm, rank, size, group, adapted))
    return out


# ---- import ---------------------------------------------------------------------------------------
@torch.no_grad()
def load_hf_weights(model_chunks, hf_dir: str, vocab_divisible_by: int = 128) -> bool:
    """Fill already-built megatron model chunks from an HF checkpoint directory (any layout). A critic
    (value_head) loads a token-classification checkpoint whole, or a policy's (causal-LM) checkpoint without
    its LM head: the value head then keeps its initial weights. Returns whether every parameter was read."""
    from megatron.core import parallel_state as ps

    whole = True
    for chunk in model_chunks:
        inner = _inner(chunk)
        hf = inner.hf_config
        ckpt = HFCheckpoint(hf_dir)
        value_head = getattr(inner, "value_head", False)
        skip = ()
        if value_head and VALUE_HEAD_HF[0] not in ckpt.file_of:  # the policy's weights: the trunk only
            skip = VALUE_HEAD_HF + (get_family(hf.model_type).hf_names(hf)["output"],)
            whole = False
        ckpt.validate(hf, value_head, ignore=skip)  # every rank checks names and shapes before touching a parameter
        dims = Dims.of(hf, vocab_divisible_by, ps.get_tensor_model_parallel_world_size())
        for lp in local_params(chunk):
            if set(lp.map.hf) & set(skip):
                continue
            kind, names = lp.map.kind, lp.map.hf
            ranges = hf_row_ranges(kind, dims, [ckpt.shape(n) for n in names], lp.tp_rank, lp.tp_size)
            slices = [ckpt.read(n, *r) for n, r in zip(names, ranges)]
            shard = hf_slices_to_shard(kind, slices, dims, lp.tp_rank, lp.tp_size)
            if tuple(shard.shape) != tuple(lp.param.shape):
                raise CheckpointFormatError(
                    f"{hf_dir}: {', '.join(names)} give a shard of shape {list(shard.shape)} for megatron "
                    f"{lp.local_name} of shape {list(lp.param.shape)}")
            lp.param.data.copy_(shard.to(lp.param.dtype))
    return whole


# ---- export ---------------------------------------------------------------------------------------
def _export_plan(model):
    """What every export of this model needs, computed once (one all_gather_object) and cached on it:
    this rank's LocalParams by global megatron name, for every global name the sorted global ranks
    holding (a shard of) it and its full shape and dtype (so receivers allocate without asking), and the
    export order: every ParamMap with the element count of its HF tensors (for bucketing)."""
    inner = _inner(model)
    cached = getattr(inner, "_rlpo_export_plan", None)
    if cached is not None:
        return cached
    tied = inner.hf_config.tie_word_embeddings and not getattr(inner, "value_head", False)
    mine = {lp.map.megatron: lp for lp in local_params(model)
            if not (lp.local_name == "output_layer.weight" and tied)}
    owners, full_meta, everywhere, _ = _holders(mine)
    inner._rlpo_everywhere = everywhere
    value_head = getattr(inner, "value_head", False)
    shapes = expected_hf_shapes(inner.hf_config, value_head)
    order = [(pm, sum(math.prod(shapes[n]) for n in pm.hf)) for pm in param_maps(inner.hf_config, value_head)]
    inner._rlpo_export_plan = (mine, owners, full_meta, order)
    return inner._rlpo_export_plan


def _holders(mine: dict) -> tuple[dict, dict, set, dict]:
    """Over every rank (one all_gather_object) from this rank's {name: LocalParam}: each name's sorted global ranks
    holding (a shard of) it, its full shape and dtype (so receivers allocate without asking), the names every rank
    holds whole (data-parallel replicas of an unsplit tensor: an export to every rank (dst=None) takes the local copy,
    identical on all replicas, instead of a broadcast per tensor), and each name's kind of split."""
    info = []
    for name, lp in mine.items():
        shape = lp.param.shape
        if lp.tp_size > 1 and lp.map.kind != "replicated":
            shape = shards_to_full(lp.map.kind, [torch.empty(shape, device="meta")] * lp.tp_size).shape
        info.append((name, tuple(shape), lp.param.dtype, lp.tp_size == 1 or lp.map.kind == "replicated", lp.map.kind))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, info)
    owners: dict[str, list[int]] = {}
    full_meta: dict[str, tuple] = {}
    whole: dict[str, int] = {}
    kinds: dict[str, str] = {}
    for rank, items in enumerate(every):
        for name, shape, dtype, is_whole, kind in items:
            owners.setdefault(name, []).append(rank)
            full_meta[name] = (shape, dtype)
            whole[name] = whole.get(name, 0) + int(is_whole)
            kinds[name] = kind
    return owners, full_meta, {n for n, k in whole.items() if k == len(every)}, kinds


def adapter_key(name: str, inner, ep_rank: int) -> tuple[str, Optional[int]]:
    """(the key a LoRA factor has in the dist checkpoint, its global expert or None) of the factor `name` of a pipeline
    stage: the global layer; an expert's own factors under the layer's `mlp.experts.experts.` (the checkpoint stacks
    them on a leading expert axis)."""
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"LoRA factor {name!r} is not in a decoder layer")
    layers = inner.decoder.layers
    layer, rest = layers[int(m.group(1))], m.group(2)
    me = _EXPERT.match(rest)
    expert = None
    if me:
        expert = ep_rank * layer.mlp.experts.num_local_experts + int(me.group(1))
        rest = f"mlp.experts.experts.{me.group(2)}"
    return f"decoder.layers.{layer.layer_number - 1}.{rest}", expert


def _factor_kind(lora: LoRAFactors, ab: str, glu: bool) -> str:
    """How a factor is split over its linear's tensor-parallel group (moe/lora.py): a column-parallel linear's B by
    rows (a gated fc1's as its weight: [gate part; up part] per rank), a row-parallel one's A by columns; the other
    factor whole on every rank."""
    if lora.kind == "column":
        return "replicated" if ab == "a" else ("glu" if glu else "column")
    return "row" if ab == "a" else "replicated"


def _adapter_plan(model):
    """_export_plan's tuple for the model's LoRA factors (moe/lora.py), cached beside it: each factor as a
    LocalParam whose map names it by its checkpoint key (an expert's own: `<key>#<global expert>`), whole where
    every rank holds it."""
    from megatron.core import parallel_state as ps

    inner = _inner(model)
    cached = getattr(inner, "_rlpo_adapter_plan", None)
    if cached is not None:
        return cached
    ep_rank = ps.get_expert_model_parallel_rank()
    mine = {}
    for name, p in inner.named_parameters():
        if not is_lora_param(name):
            continue
        key, expert = adapter_key(name, inner, ep_rank)
        key = key if expert is None else f"{key}#{expert}"
        owner, ab = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
        linear = inner.get_submodule(owner) if name.rsplit(".", 2)[1] == "lora" else None
        if linear is None:  # a layer's shared expert factor (lora_fc1_a ...): whole on every rank
            kind, size, rank_, group = "replicated", 1, 0, None
        else:
            lora = linear.lora
            glu = owner.endswith("linear_fc1") and bool(getattr(linear.config, "gated_linear_unit", False))
            kind = _factor_kind(lora, ab, glu)
            size, group = lora.tp, lora.group
            rank_ = group.rank() if group is not None and size > 1 else 0
        mine[key] = LocalParam(name, p, ParamMap(key, (key,), kind), rank_, size, group)
    owners, full_meta, inner._rlpo_adapter_everywhere, kinds = _holders(mine)
    order = [(ParamMap(k, (k,), kinds[k]), math.prod(full_meta[k][0])) for k in sorted(owners)]
    inner._rlpo_adapter_plan = (mine, owners, full_meta, order)
    return inner._rlpo_adapter_plan


def stacked_factors(named) -> dict[str, torch.Tensor]:
    """{checkpoint key: whole factor} of an adapter stream's tensors: an expert's own factors (`<key>#<expert>`)
    stacked on a leading expert axis, as the dist checkpoint holds them (moe/bridge/peft.py takes either)."""
    out, experts = {}, {}
    for key, t in named:
        if "#" in key:
            key, e = key.split("#")
            experts.setdefault(key, {})[int(e)] = t
        else:
            out[key] = t
    for key, by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"LoRA factor {key}: experts {sorted(by_expert)[:8]} are not 0..{len(by_expert) - 1}")
        out[key] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


class _BufferPool:
    """CPU buffers for the tensors an export materialises (TP gathers, received tensors, q/k/v splits,
    dtype casts), reused across buckets and syncs. Fresh pages are what a CPU export pays most for: glibc hands freed
    buckets back to the kernel and every new buffer faults its pages in again (measured here: 1.6 us a
    page, 60 ms of a 450 MB EP2 sync). Accelerators need none of this (torch's caching allocator). Holds
    at most `keep_bytes` (the bucket size) between buckets and syncs (`held_bytes`)."""

    def __init__(self):
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.lent: list[torch.Tensor] = []
        self.busy = False  # one recycling stream at a time

    def empty(self, shape, dtype, device) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return new_tensor(shape, dtype, device)
        stack = self.free.get((tuple(shape), dtype))
        t = stack.pop() if stack else new_tensor(shape, dtype, "cpu")
        self.lent.append(t)
        return t

    def release(self, keep_bytes: int):
        """Everything lent is free again (the consumer is done with the bucket that used it); beyond
        `keep_bytes`, buffers of shapes that bucket did not use are dropped first, then any."""
        if not self.lent:  # a sending rank releases after every parameter, mostly with nothing lent
            return
        used = {(tuple(t.shape), t.dtype) for t in self.lent}
        for t in self.lent:
            self.free.setdefault((tuple(t.shape), t.dtype), []).append(t)
        self.lent.clear()
        excess = self.held_bytes - keep_bytes
        for key in sorted(self.free, key=lambda k: k in used):  # unused shapes first
            stack = self.free[key]
            while stack and excess > 0:
                t = stack.pop()
                excess -= t.numel() * t.element_size()
            if not stack:
                del self.free[key]
            if excess <= 0:
                break

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.free.values() for t in ts) + \
            sum(t.numel() * t.element_size() for t in self.lent)


class ExportStream:
    """Iterate to get buckets `[(hf_name, tensor), ...]`; all ranks of the learner must iterate.

    `dst`: the global rank that receives full tensors, a sequence of such ranks (several rollout drivers: each
    parameter's leader sends it point-to-point to every one of them, in rank order), or None (every rank
    does, by broadcast). Other ranks take part in the collectives and yield one empty bucket at the end.
    `digests` holds the sender-side digest of every tensor yielded (unless a transport set
    `compute_digests = False` and fills it itself as it loads), computed with
    `digest_algorithm` (default: the cheap one on the parameters' device); receivers digest with the same.
    A bucket holds at most `bucket_bytes` (one larger tensor goes alone; a map `with_previous` always joins
    the bucket of the map before it, whose tensor an engine fuses with it on load) and is valid until the next
    one is requested: the stream then empties the list so its tensors can be freed. A consumer that
    keeps no reference to a bucket's tensors after that (it copies or sends them) may set
    `recycle = True`: the stream then reuses its CPU buffers across buckets and syncs (_BufferPool).
    """

    def __init__(self, model_chunks, bucket_bytes: int = 64 << 20, dst: int | Sequence[int] | None = 0,
                 vocab_divisible_by: int = 128, dtype: torch.dtype | None = None,
                 digest_algorithm: str | None = None, merged: bool = True):
        self.merged = merged  # a LoRA run's weights with their adapters merged; False: the frozen base alone
        self._digests = tensor_digests
        if digest_algorithm is None:
            first = next(_inner(model_chunks[0]).parameters(), None)
            digest_algorithm = algorithm_for(first.device if first is not None else "cpu")
        self.digest_algorithm = digest_algorithm
        self.chunks = model_chunks
        self.bucket_bytes = bucket_bytes
        self.dst = dst
        # the receiving ranks in the one order every rank sends and receives in (None: all of them)
        self._dsts = None if dst is None else [dst] if isinstance(dst, int) else sorted(set(dst))
        self.dtype = dtype
        self.vocab_divisible_by = vocab_divisible_by
        self.digests: dict[str, str] = {}
        self.compute_digests = True  # a transport that digests while loading turns this off
        self.recycle = False  # a transport that is done with a bucket's tensors when it asks for the next
        self.bytes_sent = 0

    @property
    def receives(self) -> bool:
        return self._dsts is None or dist.get_rank() in self._dsts

    def __iter__(self):
        pool = None
        if self.recycle:
            pool = _inner(self.chunks[0]).__dict__.setdefault("_rlpo_export_pool", _BufferPool())
            if pool.busy:
                raise RuntimeError("two recycling export streams of one model at once would share its buffers: "
                                   "drain or close one before iterating the other")
            pool.busy = True
        try:
            yield from self._buckets(pool)
        finally:
            if pool is not None:
                pool.busy = False
                pool.release(self.bucket_bytes)

    def _buckets(self, pool):
        from megatron.core import parallel_state as ps

        chunk = self.chunks[0]
        hf = _inner(chunk).hf_config
        dims = Dims.of(hf, self.vocab_divisible_by, ps.get_tensor_model_parallel_world_size())
        mine, owners, full_meta, order = self._plan(chunk)
        self._device = next(iter(mine.values())).param.device if mine else torch.device("cpu")
        rank = dist.get_rank()
        receives = self.receives
        self._empty = pool.empty if pool is not None else new_tensor
        bucket, size = [], 0
        for pm, numel in order:
            if receives and bucket and not pm.with_previous:
                nbytes = numel * ((None if pm.fp32 else self.dtype) or full_meta[pm.megatron][1]).itemsize
                if size + nbytes > self.bucket_bytes:  # yield before gathering: a bucket stays <= bucket_bytes
                    self._digest_bucket(bucket)
                    yield bucket
                    bucket.clear()  # the consumer is done with it: free its tensors before the next gathers
                    bucket, size = [], 0
                    if pool is not None:
                        pool.release(self.bucket_bytes)
            full = self._gather(pm, mine.get(pm.megatron), owners[pm.megatron], full_meta[pm.megatron], rank)
            if not receives and pool is not None:
                pool.release(self.bucket_bytes)  # a sending rank's buffers are done once sent (blocking CPU send)
            if full is None:
                continue
            for name, t in zip(pm.hf, self._to_hf(pm.kind, full, dims, self._empty)):
                if self.dtype is not None and t.dtype != self.dtype and not pm.fp32:
                    t = self._empty(t.shape, self.dtype, t.device).copy_(t)
                bucket.append((name, t))
                size += t.numel() * t.element_size()
                self.bytes_sent += t.numel() * t.element_size()
            full = t = None
        if bucket or not self.receives:
            self._digest_bucket(bucket)
            yield bucket

    @staticmethod
    def _plan(chunk):
        return _export_plan(chunk)

    @staticmethod
    def _everywhere(inner) -> set:
        return inner._rlpo_everywhere

    @staticmethod
    def _to_hf(kind, full, dims, empty):
        return full_to_hf(kind, full, dims, empty)

    def _digest_bucket(self, bucket):
        """The sender-side digests of a bucket about to be yielded, all at once (one host sync per bucket on
        an accelerator: moe.bridge.digest.tensor_digests)."""
        if self.compute_digests and bucket:
            names, tensors = zip(*bucket)
            self.digests.update(zip(names, self._digests(list(tensors), self.digest_algorithm)))

    def _gather(self, pm, lp, holders, meta, rank):
        """Full megatron tensor on the receiving rank(s) (None elsewhere)."""
        if pm.megatron in self._everywhere(_inner(self.chunks[0])):
            if not self.receives:
                return None
            full = lp.tensor(self.merged)  # every rank holds it whole: a receiver takes its own replica, no communication
            if (tuple(full.shape), full.dtype) != meta:
                raise RuntimeError(f"export of {pm.megatron}: local tensor {tuple(full.shape)} {full.dtype} differs "
                                   f"from the export plan's {meta}")
            return full
        leader = holders[0]
        full = None
        if lp is not None:
            group_ranks = dist.get_process_group_ranks(lp.tp_group) if lp.tp_size > 1 else [rank]
            if min(group_ranks) == leader:  # only the leader's TP group gathers; replicas stay idle
                data = lp.tensor(self.merged)
                if lp.tp_size > 1 and pm.kind != "replicated":
                    if pm.kind in ("qkv", "vocab"):  # shards concatenate along dim 0: gather in place
                        gathered = self._empty((data.shape[0] * lp.tp_size, *data.shape[1:]), data.dtype, data.device)
                        dist.all_gather(list(gathered.chunk(lp.tp_size)), data.contiguous(), group=lp.tp_group)
                        data = gathered
                    else:
                        shards = [self._empty(data.shape, data.dtype, data.device) for _ in range(lp.tp_size)]
                        dist.all_gather(shards, data.contiguous(), group=lp.tp_group)
                        data = shards_to_full(pm.kind, shards)
                full = data if rank == leader else None
        if full is not None and (tuple(full.shape), full.dtype) != meta:
            raise RuntimeError(f"export of {pm.megatron}: full tensor {tuple(full.shape)} {full.dtype} differs "
                               f"from the export plan's {meta}")
        if self._dsts is None:
            if rank != leader:
                full = self._empty(meta[0], meta[1], self._device)
            dist.broadcast(full, src=leader)
            return full
        if rank == leader:
            # blocking sends in ascending rank order, every parameter in the plan's order: each pair of ranks
            # meets its transfers in the same order on both sides (gloo and NCCL cannot deadlock)
            data = full.contiguous()
            for d in self._dsts:
                if d != leader:
                    dist.send(data, dst=d)
            return full if leader in self._dsts else None
        if rank in self._dsts:
            full = self._empty(meta[0], meta[1], self._device)
            dist.recv(full, src=leader)
            return full
        return None


class AdapterStream(ExportStream):
    """ExportStream of a LoRA run's factors alone (moe/lora.py), each gathered whole from its layout: buckets of
    (`checkpoint key`, tensor), an expert's own factor as `<key>#<global expert>` (`stacked_factors` stacks them as
    the checkpoint does); what rollout.lora_sync=adapter sends where the servers hold the base."""

    @staticmethod
    def _plan(chunk):
        return _adapter_plan(chunk)

    @staticmethod
    def _everywhere(inner) -> set:
        return inner._rlpo_adapter_everywhere

    @staticmethod
    def _to_hf(kind, full, dims, empty):
        return [full]  # a factor whole, as the checkpoint holds it (a gated fc1's B: [gate; up])


def export_hf_state(model_chunks, **kwargs) -> dict[str, torch.Tensor]:
    """The whole model as an HF state dict on the receiving rank(s) (for tests and small models)."""
    out = {}
    for bucket in ExportStream(model_chunks, **kwargs):
        out.update(bucket)
    return out
