"""The refit plan: for every HF tensor the bridge exports, which learner rank sends which slice of it to which TP
rank of which SGLang server, so that each server rank receives exactly its own shard and no rank gathers the model.

Both sides are written in one coordinate system, the HF tensor's; a *box* is a (start, stop) range per dim.
  learner  a rank holds one box of a tensor: the rows or columns of its TP (expert-TP) shard, by the rules the bridge
           imports checkpoints with (mapping.hf_row_ranges), for the layers of its pipeline stage and the experts of
           its EP rank; every data-parallel replica holds the same box.
  server   a TP rank of an SGLang 0.5.23 server holds the box its weight loaders narrow the HF tensor to
           (`server_region`): attention heads, MLP rows / columns and the 64-padded vocabulary over TP, experts
           partitioned over EP with each expert's FFN split over TP/EP, norms / router / small tensors whole.
A transfer is the intersection of one server rank's box with one learner box, sent by one rank holding the latter:
experts go shard to shard, and what every server rank needs whole reaches each of them once.

Source selection: pieces are assigned largest first, each to the least-loaded learner rank holding it (ties to the
lowest rank), i.e. greedy longest-processing-time scheduling. It spreads the work of a replicated shard over the
data-parallel ranks holding it -- a tensor every server rank needs whole comes from several holders, one per
receiving rank -- and keeps the busiest learner rank near total bytes / learner ranks wherever the layouts allow (a
pipeline stage holding more than its share, or a shard only one rank holds, can force more).

Block FP8 (rollout.weights=fp8, moe/bridge/fp8.py): a quantised weight is planned as its e4m3 codes (one byte an
element, the weight's own boxes), followed in the model by its fp32 `weight_scale_inv` -- the same boxes in 128-blocks
(TensorSpec.block_of). Each piece of codes is followed by its scales' piece, from the same sender to the same server
rank: the sender quantises the piece it cuts (bit-equal to quantising the whole tensor and slicing, where the piece's
edges are whole blocks: tests/test_fp8.py), so a piece whose edges are not whole 128-blocks is not planned.

Pure arithmetic over names and shapes: no tensors, no process groups; a sender and a receiver read their parts of
one plan. A server layout this plan does not express raises CannotPlan, one line naming what is not planned and a
transport that syncs it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Sequence

import torch

from moe.families import get_family
from moe.model import padded_vocab_size

from .fp8 import BLOCK, FP8_DTYPE, SCALE_SUFFIX, Fp8Selection, scale_name
from .hf_checkpoint import expected_hf_shapes
from .mapping import Dims, hf_row_ranges, param_maps

Box = tuple[tuple[int, int], ...]

# The path that syncs any server layout: SGLang's update_weights_from_distributed hands every TP rank whole tensors
# and its own weight loaders narrow them (rollout.sync_transport=sglang_distributed).
BROADCAST_TRANSPORT = "sglang_distributed"
SGLANG_VOCAB_PADDING = 64  # sglang/srt/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE


class CannotPlan(ValueError):
    """A layout the plan does not cover. `what`: what is not planned; `fallback`: a weight-sync transport that
    syncs it (None: none does, `what` says how to start the servers instead)."""

    def __init__(self, what: str, fallback: Optional[str] = BROADCAST_TRANSPORT):
        self.what, self.fallback = what, fallback
        tail = f"; rollout.sync_transport={fallback} syncs it (each TP rank narrows whole tensors itself)" if fallback else ""
        super().__init__(f"no shard-to-shard refit plan: {what}{tail}")


@dataclass(frozen=True)
class TensorSpec:
    """One HF tensor as the bridge exports it, and the megatron parameter holding it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    megatron: str  # the parameter it is (a part of): mapping.ParamMap.megatron
    kind: str  # how megatron fuses and splits that parameter: mapping.ParamMap.kind
    part: int  # its place among the parameter's HF tensors (q, k, v; gate, up)
    layer: Optional[int]  # global decoder layer; None: embedding, final norm, output layer
    expert: Optional[int]  # global routed expert; None: not a routed expert's
    sglang_whole: bool = False  # SGLang holds it whole on every TP rank although megatron splits it
    # a block-FP8 weight's scales (rollout.weights=fp8): the weight's shape; every box of this tensor is the weight's
    # box in 128-blocks (the rest of the fields are the weight's)
    block_of: Optional[tuple[int, ...]] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ModelSpec:
    """Every tensor of a model's export, in export order, and the sizes both sides split by."""

    tensors: tuple[TensorSpec, ...]
    layers: int
    experts: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, hf, dtype: torch.dtype, fp8: bool = False) -> "ModelSpec":
        """The policy's export (megatron_io.ExportStream, `dtype` its dtype) of the model `hf` configures; fp32
        where every side keeps a tensor in fp32 (ParamMap.fp32). fp8: the family's FP8 weights (moe/bridge/fp8.
        Fp8Selection) as e4m3 codes, each followed by its fp32 scales (module docstring)."""
        family = get_family(hf.model_type)
        shapes = expected_hf_shapes(hf)
        names = family.hf_names(hf)
        whole = {names[k].format(i=i) for k in family.sglang_whole(hf) for i in range(hf.num_hidden_layers)}
        selected = Fp8Selection(hf) if fp8 else (lambda name: False)
        tensors = []
        for pm in param_maps(hf):
            for j, n in enumerate(pm.hf):
                shape, rest = tuple(shapes[n]), (pm.megatron, pm.kind, j, pm.layer, pm.expert, n in whole)
                if selected(n):  # (positional: a model has ten thousand of them)
                    tensors += [TensorSpec(n, shape, FP8_DTYPE, *rest),
                                TensorSpec(scale_name(n), tuple(-(-d // BLOCK) for d in shape), torch.float32, *rest,
                                           shape)]
                else:
                    tensors.append(TensorSpec(n, shape, torch.float32 if pm.fp32 else dtype, *rest))
        tensors = tuple(tensors)
        return cls(tensors, hf.num_hidden_layers, family.num_experts(hf), hf.num_attention_heads,
                   hf.num_key_value_heads, family.head_dim(hf), hf.vocab_size)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class LearnerLayout:
    """The learner's megatron layout. Global ranks follow megatron's order tp-cp-ep-dp-pp (parallel_state.
    RankGenerator): a dense shard sits on tp_rank + TP * replica + stage * world/PP, where `replica` counts its
    context- and data-parallel copies (context parallelism copies weights as DP does, so it needs no field here);
    an expert shard on etp_rank + ETP * ep_rank + ETP * EP * expert_dp_rank + stage * world/PP."""

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    expert_tensor: int = 1
    vocab_divisible_by: int = 128  # model.vocab_divisible_by: the padded vocabulary megatron splits over TP
    # megatron names of column-parallel parameters kept whole on every TP rank (Transformer Engine's duplicated MLA
    # down-projections; megatron_io.local_params reads it from each parameter)
    whole_on_tp: frozenset[str] = frozenset()

    def __post_init__(self):
        sizes = (self.tensor, self.pipeline, self.expert, self.expert_tensor)
        if min(sizes) < 1 or self.world_size % (self.tensor * self.pipeline) \
                or self.world_size % (self.expert * self.expert_tensor * self.pipeline):
            raise ValueError(f"learner layout: world {self.world_size} with tensor={self.tensor} pipeline="
                             f"{self.pipeline} expert={self.expert} expert_tensor={self.expert_tensor} is not a layout")

    @property
    def stage_size(self) -> int:
        return self.world_size // self.pipeline

    def dense_holders(self, stage: int, tp_rank: int) -> tuple[int, ...]:
        first = stage * self.stage_size
        return tuple(range(first + tp_rank, first + self.stage_size, self.tensor))

    def expert_holders(self, stage: int, ep_rank: int, etp_rank: int) -> tuple[int, ...]:
        first = stage * self.stage_size
        return tuple(range(first + etp_rank + self.expert_tensor * ep_rank, first + self.stage_size,
                           self.expert_tensor * self.expert))


@dataclass(frozen=True)
class ServerLayout:
    """One SGLang server's parallel layout, as GET /server_info reports it. EP partitions the experts inside the TP
    group, moe-TP innermost (sglang/srt/distributed/parallel_state.py: rank = ep_rank * tp/ep + moe_tp_rank)."""

    tensor: int = 1
    expert: int = 1
    attention_dp: int = 1  # attention data parallelism: attention over tensor / attention_dp ranks (not planned)

    def __post_init__(self):
        if min(self.tensor, self.expert, self.attention_dp) < 1 or self.tensor % self.expert \
                or self.tensor % self.attention_dp:
            raise ValueError(f"SGLang layout: tp_size={self.tensor} with ep_size={self.expert} attn_dp_size="
                             f"{self.attention_dp} is not a layout (both must divide tp_size)")

    @property
    def moe_tensor(self) -> int:
        return self.tensor // self.expert

    @classmethod
    def from_server_info(cls, info: dict) -> "ServerLayout":
        """The layout of a server from its /server_info (SGLang 0.5.23's resolved server args). Knobs that move
        weights where this plan does not look are refused here, one line each."""

        def knob(name, default):
            value = info.get(name)
            return default if value is None else value

        tp = int(knob("tp_size", 1))
        attention_dp, replicas = int(knob("attn_dp_size", 1)), int(knob("dp_size", 1))
        if info.get("enable_dp_attention") and attention_dp == 1:  # the older spelling: --dp-size N --enable-dp-attention
            attention_dp, replicas = replicas, 1
        for name, value in (("pp_size", int(knob("pp_size", 1))), ("dp_size", replicas)):
            if value != 1:  # the engine refuses these too (SGLangEngine._check_layout)
                raise CannotPlan(f"a server with {name}={value} (weight sync knows TP ranks only): start one server "
                                 f"per replica (--{name.replace('_', '-')} 1)", fallback=None)
        unplanned = [
            (int(knob("attn_cp_size", 1)) != 1, f"attention context parallelism (attn_cp_size={info.get('attn_cp_size')})"),
            (int(knob("moe_dp_size", 1)) != 1, f"MoE data parallelism (moe_dp_size={info.get('moe_dp_size')})"),
            (knob("moe_a2a_backend", "none") != "none",
             f"moe_a2a_backend={info.get('moe_a2a_backend')} (shared experts replicated, not split over TP)"),
            (int(knob("ep_num_redundant_experts", 0)) != 0 or bool(info.get("enable_eplb"))
             or knob("init_expert_location", "trivial") != "trivial",
             "experts placed by EPLB or with redundant copies (not partitioned in order)"),
            (knob("moe_dense_tp_size", tp) != tp, f"moe_dense_tp_size={info.get('moe_dense_tp_size')} (dense MLPs "
                                                  "replicated on some models)"),
            (bool(info.get("enforce_shared_experts_fusion")) and int(knob("ep_size", 1)) > 1,
             "a shared expert fused into the routed experts under expert parallelism (split over TP/EP on every EP rank)"),
        ]
        for refused, what in unplanned:
            if refused:
                raise CannotPlan(what)
        return cls(tp, int(knob("ep_size", 1)), attention_dp)


# ---- boxes -------------------------------------------------------------------------------------------------------
def _whole(shape) -> Box:
    return tuple((0, n) for n in shape)


def _along(shape, dim: int, start: int, stop: int) -> Optional[Box]:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor of `shape`; None when empty."""
    if start >= stop:
        return None
    return tuple((start, stop) if d == dim else (0, n) for d, n in enumerate(shape))


def _intersect(a: Box, b: Box) -> Optional[Box]:
    box = tuple((max(s0, s1), min(e0, e1)) for (s0, e0), (s1, e1) in zip(a, b))
    return box if all(s < e for s, e in box) else None


def _within(box: Box, origin: Box) -> Box:
    """`box` in the coordinates of the shard `origin` (which contains it)."""
    return tuple((s - o, e - o) for (s, e), (o, _) in zip(box, origin))


def block_box(box: Box, shape, name: str) -> Box:
    """A box of a block-FP8 weight of `shape` in 128-blocks (its scales' box): refused where an edge inside the
    tensor is not a whole block (SGLang's loaders and the quantiser both cut blocks at multiples of 128)."""
    for (a, b), n in zip(box, shape):
        if a % BLOCK or (b % BLOCK and b != n):
            raise CannotPlan(f"{name}: rows/columns [{a}, {b}) of {n} are not whole {BLOCK}-blocks, which a block-FP8 "
                             "piece must be (rollout.weights=fp8)")
    return tuple((a // BLOCK, -(-b // BLOCK)) for a, b in box)


def _weight(spec: "TensorSpec") -> "TensorSpec":
    """The block-FP8 weight whose scales `spec` is (its fields but the shape, dtype and name)."""
    return replace(spec, name=spec.name.removesuffix(SCALE_SUFFIX), shape=spec.block_of, dtype=FP8_DTYPE,
                   block_of=None)


def box_numel(box: Box) -> int:
    return math.prod(e - s for s, e in box)


# ---- the learner's side ------------------------------------------------------------------------------------------
def _stage(spec: TensorSpec, model: ModelSpec, learner: LearnerLayout) -> int:
    """The pipeline stage holding `spec` (megatron splits the layers evenly; the embedding lives on the first stage,
    the final norm and output layer on the last -- a tied output layer's copy there is not used as a source: the
    export takes the embedding from the first stage too)."""
    if spec.layer is not None:
        return spec.layer // (model.layers // learner.pipeline)
    return 0 if spec.megatron.startswith("embedding.") else learner.pipeline - 1


def _learner_key(spec: TensorSpec, model: ModelSpec, learner: LearnerLayout) -> tuple:
    """What learner_shards reads of a tensor: tensors alike in it (a layer's experts of one EP rank) share shards."""
    return (spec.kind, spec.shape, spec.block_of, spec.megatron in learner.whole_on_tp, _stage(spec, model, learner),
            None if spec.expert is None else spec.expert // (model.experts // learner.expert))


def learner_shards(spec: TensorSpec, model: ModelSpec, learner: LearnerLayout,
                   memo: Optional[dict] = None) -> list[tuple[Box, tuple[int, ...]]]:
    """The boxes of `spec` the learner holds, a partition of the tensor, each with the global ranks holding it.
    memo: a dict kept across calls for one model and layout (a model has ten thousand expert tensors, a few hundred
    kinds of them)."""
    if memo is not None:
        key = _learner_key(spec, model, learner)
        if key not in memo:
            memo[key] = learner_shards(spec, model, learner)
        return memo[key]
    if spec.block_of is not None:  # a block-FP8 weight's scales: its shards in blocks
        return [(block_box(box, spec.block_of, spec.name), ranks)
                for box, ranks in learner_shards(_weight(spec), model, learner)]
    stage = _stage(spec, model, learner)
    if spec.expert is None:
        split = learner.tensor
        size = 1 if spec.megatron in learner.whole_on_tp else split
        holders = lambda t: learner.dense_holders(stage, t)  # noqa: E731
    else:
        ep_rank = spec.expert // (model.experts // learner.expert)
        split = size = learner.expert_tensor
        holders = lambda t: learner.expert_holders(stage, ep_rank, t)  # noqa: E731
    dims = Dims(model.heads, model.kv_heads, model.head_dim, model.vocab,
                padded_vocab_size(model.vocab, learner.vocab_divisible_by, learner.tensor))
    shards: dict[Box, list[int]] = {}
    for t in range(split):
        # hf_row_ranges reads each HF tensor of a map on its own, so one part's shape is enough
        (dim, start, stop), = hf_row_ranges(spec.kind, dims, [spec.shape], t if size > 1 else 0, size)
        box = _along(spec.shape, dim, start, stop)
        if box is not None:  # the last TP ranks of a padded vocabulary may hold padding only
            shards.setdefault(box, []).extend(holders(t))
    return [(box, tuple(sorted(ranks))) for box, ranks in shards.items()]


# ---- the server's side (SGLang 0.5.23) ---------------------------------------------------------------------------
def _even(spec: TensorSpec, dim: int, parts: int, index: int) -> Box:
    n = spec.shape[dim]
    if n % parts:  # SGLang asserts the split on GPUs (and zero-pads it on CPUs): a layout to refuse either way
        raise CannotPlan(f"{spec.name}: dim {dim} of size {n} does not split over {parts} SGLang ranks")
    step = n // parts
    return _along(spec.shape, dim, index * step, (index + 1) * step)


def _sglang_vocab_rows(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """The HF rows of a VocabParallelEmbedding / ParallelLMHead shard: the vocabulary padded to 64 (64 x tp where
    that does not split over tp), cut in equal parts; rows past the vocabulary are SGLang's zero padding."""
    pad = SGLANG_VOCAB_PADDING
    if -(-vocab // pad) * pad % tp:
        pad *= tp
    per = -(-vocab // pad) * pad // tp
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


def _qkv_box(spec: TensorSpec, model: ModelSpec, server: ServerLayout, rank: int) -> Box:
    """QKVParallelLinear: q heads over TP; KV heads over TP, each replicated on tp / kv_heads ranks where TP exceeds
    them (sglang/srt/layers/linear.py: shard_id = tp_rank // num_kv_head_replicas)."""
    tp, kv = server.tensor, model.kv_heads
    if spec.part == 0:
        if model.heads % tp:
            raise CannotPlan(f"{spec.name}: {model.heads} attention heads do not split over {tp} SGLang ranks")
        return _even(spec, 0, tp, rank)
    if tp <= kv:
        if kv % tp:
            raise CannotPlan(f"{spec.name}: {kv} KV heads do not split over {tp} SGLang ranks")
        return _even(spec, 0, tp, rank)
    if tp % kv:
        raise CannotPlan(f"{spec.name}: {tp} SGLang ranks do not replicate {kv} KV heads evenly")
    return _even(spec, 0, kv, rank // (tp // kv))


def server_region(spec: TensorSpec, model: ModelSpec, server: ServerLayout, rank: int) -> Optional[Box]:
    """The box of `spec` that TP rank `rank` of an SGLang server holds, as SGLang's weight loaders narrow the HF
    tensor (None: it holds none of it). A CUDA server's layout: on a CPU server SGLang pads an intermediate size that
    is not a multiple of tp x 32 and splits the padded rows (configs/update_config.py,
    adjust_config_with_unaligned_cpu_tp), which this does not model (shared/notes/refit-receiver.md); a transport
    using the plan checks it against the slices the server reports before the first sync. A block-FP8 weight's
    scales: its region in blocks (BlockQuantScaleParameter's loaders narrow by the weight's offsets / 128)."""
    if spec.block_of is not None:
        box = server_region(_weight(spec), model, server, rank)
        return None if box is None else block_box(box, spec.block_of, spec.name)
    if spec.kind == "replicated" or spec.sglang_whole:  # RMSNorm, ReplicatedLinear (router, MLA down-projections)
        return _whole(spec.shape)
    if spec.expert is not None:
        # FusedMoE: this EP rank's experts (global ids in order, _map_global_expert_id_to_local_expert_id), each
        # one's gate/up rows (_load_w13) and down columns (_load_w2) split over moe-TP
        ep_rank, moe_tp_rank = divmod(rank, server.moe_tensor)
        if spec.expert // (model.experts // server.expert) != ep_rank:
            return None
        return _even(spec, 0 if spec.kind == "glu" else 1, server.moe_tensor, moe_tp_rank)
    if spec.kind == "vocab":
        return _along(spec.shape, 0, *_sglang_vocab_rows(model.vocab, server.tensor, rank))
    if spec.kind == "qkv":
        return _qkv_box(spec, model, server, rank)
    # MergedColumnParallelLinear (a dense MLP's or shared expert's gate_up_proj: gate and up each split),
    # ColumnParallelLinear (MLA's up-projections); a shared expert SGLang fuses into FusedMoE (CUDA, no EP) is
    # split over moe-TP = TP: the same rows
    if spec.kind in ("glu", "column"):
        return _even(spec, 0, server.tensor, rank)
    if spec.kind == "row":  # RowParallelLinear: o_proj, down_proj
        return _even(spec, 1, server.tensor, rank)
    raise ValueError(f"unknown parameter kind {spec.kind!r}")


def _server_key(spec: TensorSpec, model: ModelSpec, server: ServerLayout) -> tuple:
    """What server_region reads of a tensor beyond the layouts: tensors alike in it share regions."""
    return (spec.kind, spec.shape, spec.block_of, spec.part, spec.sglang_whole, spec.dtype,
            None if spec.expert is None else spec.expert // (model.experts // server.expert))


def server_shard_bytes(model: ModelSpec, server: ServerLayout) -> list[int]:
    """Bytes each TP rank of a server of this layout holds of the model (SGLang's padding aside)."""
    out = []
    for rank in range(server.tensor):
        memo, total = {}, 0
        for spec in model.tensors:
            key = _server_key(spec, model, server)
            if key not in memo:
                box = server_region(spec, model, server, rank)
                memo[key] = 0 if box is None else box_numel(box) * spec.dtype.itemsize
            total += memo[key]
        out.append(total)
    return out


# ---- the plan ----------------------------------------------------------------------------------------------------
class Transfer(NamedTuple):
    """One slice of one HF tensor from one learner rank to one server rank (a named tuple: a refit of a large model
    plans a few hundred thousand of them)."""

    src: int  # learner global rank
    server: int  # index into Plan.servers
    rank: int  # that server's TP rank
    name: str  # HF name
    region: Box  # the slice, in the HF tensor's coordinates
    # the same slice within the sender's shard of the tensor (its box, learner_shards); a block-FP8 weight's scales:
    # the whole of the scales its sender makes by quantising the codes' piece
    src_box: Box
    dst_box: Box  # and within the receiver's shard (server_region)
    nbytes: int


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    learner: LearnerLayout
    servers: tuple[ServerLayout, ...]
    transfers: tuple[Transfer, ...]

    def sent_bytes(self) -> list[int]:
        """Bytes each learner rank sends, by global rank."""
        out = [0] * self.learner.world_size
        for t in self.transfers:
            out[t.src] += t.nbytes
        return out

    def received_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes each server rank receives, by (server index, TP rank)."""
        out = {(s, r): 0 for s, server in enumerate(self.servers) for r in range(server.tensor)}
        for t in self.transfers:
            out[t.server, t.rank] += t.nbytes
        return out

    def shard_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes each server rank holds of the model (its own shard, SGLang's padding aside), by (server, TP rank)."""
        return {(s, r): n for s, server in enumerate(self.servers)
                for r, n in enumerate(server_shard_bytes(self.model, server))}


def _check(model: ModelSpec, learner: LearnerLayout, servers: tuple[ServerLayout, ...]):
    if model.layers % learner.pipeline or model.experts % learner.expert:
        raise ValueError(f"learner layout: {model.layers} layers over pipeline={learner.pipeline}, {model.experts} "
                         f"experts over expert={learner.expert}")
    for server in servers:
        if server.attention_dp > 1:
            raise CannotPlan(f"DP attention (attn_dp_size={server.attention_dp}): which tensors SGLang splits over the "
                             "attention-TP group differs by model (attention in qwen3_moe/glm4_moe/deepseek_v3, not in "
                             "mixtral; the embedding, lm_head and dense MLPs by flags of their own)")
        if model.experts % server.expert:
            raise CannotPlan(f"{model.experts} experts do not split over SGLang ep_size={server.expert}")


def _balance(pieces: list[tuple], world: int, lead: Sequence[Optional[int]] = ()) -> list[int]:
    """A sending rank per piece (..., nbytes, holders): largest first, each to the least-loaded rank holding it (ties:
    the lowest). lead[i]: the piece that piece i goes with (a block-FP8 piece's scales: the same sender, which
    quantised both), weighed with it; None where it goes alone."""
    lead = list(lead) or [None] * len(pieces)
    size = [p[-2] for p in pieces]
    for i, j in enumerate(lead):
        if j is not None:
            size[j] += size[i]
    load = [0] * world
    src = [0] * len(pieces)
    for i in sorted((i for i in range(len(pieces)) if lead[i] is None), key=size.__getitem__, reverse=True):
        best = min(pieces[i][-1], key=load.__getitem__)
        src[i] = best
        load[best] += size[i]
    for i, j in enumerate(lead):
        if j is not None:
            src[i] = src[j]
    return src


def _server_pieces(spec: TensorSpec, model: ModelSpec, server: ServerLayout, shards: list) -> list[tuple]:
    """(rank, region, src_box, dst_box, nbytes, holders) of every piece of `spec` a server of this layout receives."""
    out = []
    for rank in range(server.tensor):
        held = server_region(spec, model, server, rank)
        if held is None:
            continue
        for box, holders in shards:
            region = _intersect(held, box)
            if region is not None:
                out.append((rank, region, _within(region, box), _within(region, held),
                            box_numel(region) * spec.dtype.itemsize, holders))
    return out


def _scale_pieces(spec: TensorSpec, model: ModelSpec, server: ServerLayout, codes: list) -> list[tuple]:
    """_server_pieces of a block-FP8 weight's scales, one per piece of its codes (`codes`): the piece's box in
    blocks, which its sender makes whole (src_box: the whole of them)."""
    out, held = [], {}
    for rank, region, _, _, _, holders in codes:
        if rank not in held:
            held[rank] = server_region(spec, model, server, rank)
        box = block_box(region, spec.block_of, spec.name)
        out.append((rank, box, _whole([b - a for a, b in box]), _within(box, held[rank]),
                    box_numel(box) * spec.dtype.itemsize, holders))
    return out


def reshard_plan(model: ModelSpec, learner: LearnerLayout, servers: Sequence[ServerLayout]) -> Plan:
    """Every transfer of one refit from `learner` into `servers` (in the model's export order, then server, TP rank):
    each byte each server rank holds arrives exactly once, from a learner rank holding it, and nothing else does."""
    servers = tuple(servers)
    _check(model, learner, servers)
    pieces, lead = [], []  # (name, server, rank, region, src_box, dst_box, nbytes, holders); the piece each goes with
    shard_memo, piece_memo, weight = {}, {}, []
    for spec in model.tensors:
        if spec.block_of is not None:  # a block-FP8 weight's scales: a piece per piece of its codes, from its sender
            for s, key, first in weight:
                scale_key = (key, "scales", spec.shape)
                if scale_key not in piece_memo:
                    piece_memo[scale_key] = _scale_pieces(spec, model, servers[s], piece_memo[key])
                pieces += [(spec.name, s, *piece) for piece in piece_memo[scale_key]]
                lead += range(first, first + len(piece_memo[key]))
            continue
        shards = learner_shards(spec, model, learner, shard_memo)
        # what server_region reads: tensors alike in it and in their shards get the same pieces (servers of one
        # layout too, from sources chosen apart)
        learner_key, weight = _learner_key(spec, model, learner), []
        for s, server in enumerate(servers):
            key = (learner_key, _server_key(spec, model, server), server)
            if key not in piece_memo:
                piece_memo[key] = _server_pieces(spec, model, server, shards)
            weight.append((s, key, len(pieces)))
            pieces += [(spec.name, s, *piece) for piece in piece_memo[key]]
        lead += [None] * sum(len(piece_memo[key]) for _, key, _ in weight)
    sources = _balance(pieces, learner.world_size, lead)
    transfers = tuple(Transfer(src, s, rank, name, region, src_box, dst_box, n)
                      for (name, s, rank, region, src_box, dst_box, n, _), src in zip(pieces, sources))
    return Plan(model, learner, servers, transfers)


def plan_buckets(plan: Plan, bucket_bytes: int, joined: frozenset = frozenset()) -> list[tuple[int, int]]:
    """The plan's transfers cut into buckets [start, stop) of about `bucket_bytes` in all (a larger tensor alone),
    in plan order, cut only between tensors and never before a name in `joined` (one an engine loads together with
    the tensor before it: mapping.ParamMap.with_previous) nor before a block-FP8 weight's scales (their sender
    quantises them with the codes). Sender and receiver cut one plan alike: each bucket is sent, received and loaded
    before the next, so a server rank holds at most one bucket's pieces at once."""
    out, start, size = [], 0, 0
    transfers = plan.transfers
    joined = joined | {t.name for t in plan.model.tensors if t.block_of is not None}
    for i, t in enumerate(transfers):
        if i > start and t.name != transfers[i - 1].name and t.name not in joined and size + t.nbytes > bucket_bytes:
            out.append((start, i))
            start, size = i, 0
        size += t.nbytes
    if start < len(transfers):
        out.append((start, len(transfers)))
    return out


PACK_ALIGN = 16  # a piece's byte offset in a packed bucket: a view as its dtype needs an aligned offset


def packed_offsets(transfers) -> tuple[list[int], int]:
    """Where each transfer's bytes sit when one server rank's pieces of a bucket are packed into one byte tensor, in
    the given (plan) order, each at a PACK_ALIGN-aligned offset; and the packed size. The colocated refit packs on
    the learner rank on the server rank's GPU and unpacks in the server: both call this."""
    offsets, at = [], 0
    for t in transfers:
        offsets.append(at)
        at += -(-t.nbytes // PACK_ALIGN) * PACK_ALIGN
    return offsets, at


def pack(transfers, pieces, device) -> "torch.Tensor":
    """One server rank's pieces of a bucket (`pieces[i]` is `transfers[i]`'s slice) as one byte tensor on `device`, at
    packed_offsets: what the colocated refit hands a server rank by one CUDA IPC handle."""
    offsets, size = packed_offsets(transfers)
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    for t, piece, at in zip(transfers, pieces, offsets):
        flat[at:at + t.nbytes].view(piece.dtype).view(piece.shape).copy_(piece)
    return flat


def unpack(flat: "torch.Tensor", transfers, dtypes) -> list:
    """pack's inverse, as views of `flat` (no copy): each transfer's slice, shaped as its region, in `dtypes[i]`."""
    offsets, size = packed_offsets(transfers)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != size:
        raise ValueError(f"a packed bucket of {flat.numel()} {flat.dtype} elements where the plan packs {size} bytes")
    return [flat[at:at + t.nbytes].view(dtype).view([b - a for a, b in t.region])
            for t, dtype, at in zip(transfers, dtypes, offsets)]


def piece_key(t: Transfer) -> str:
    """The name a transfer's digest goes by on both sides: the tensor, the server rank and the slice."""
    return f"{t.name}@{t.server}.{t.rank}:" + ",".join(f"{a}-{b}" for a, b in t.region)


__all__ = ["BROADCAST_TRANSPORT", "Box", "CannotPlan", "LearnerLayout", "ModelSpec", "Plan", "ServerLayout",
           "TensorSpec", "Transfer", "block_box", "box_numel", "learner_shards", "pack", "packed_offsets", "piece_key",
           "plan_buckets", "reshard_plan", "unpack",
           "server_region",
           "server_shard_bytes"]
