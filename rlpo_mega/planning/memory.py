"""Bytes per learner GPU: what megatron-core allocates for a rank (exact, from meta_build's buffers) and what a
micro-batch adds (an estimate, stated as one).

Exact (tests/test_plan.py compares them byte for byte with the tensors megatron-core allocated at TP2+SP, EP2,
PP2 and TP2/EP2/PP2, with and without the distributed optimizer):
- params: the DDP param buffers under the distributed optimizer (each parameter a view into one), else the
  parameters themselves; plus the modules' buffers (a sigmoid router's fp32 score-correction bias).
- grads: the DDP grad buffers (fp32: grad_reduce_in_fp32), padding included.
- optimizer: Adam's exp_avg and exp_avg_sq (fp32) and the fp32 main copies of 16-bit parameters. The
  distributed optimizer cuts every bucket into DP-size equal ranges (distrib_optimizer.py
  `_build_model_gbuf_range`) and keeps state only for the parameter elements inside this rank's range; fp32
  parameters are their own main copies (views). Without it: every element, full size. With optimizer CPU offload
  (optim.cpu_offload, all of the state: offload_fraction 1.0) split into what stays on the accelerator and what
  the host holds (`_offloaded_state`).

Estimated (one number each, the formula in its function): activations of the largest micro-batch under the
recipe's recompute setting, the logits and the log-prob kernel's chunk, the exchange's buffers and routes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from moe.families import get_family
from moe.model import padded_vocab_size
from rlpo_mega.algorithms.logprobs import _rows_per_chunk

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9


def _range_elements(params: list, lo: int, hi: int) -> int:
    """Parameter elements of [lo, hi) (buffer indices), padding excluded."""
    return sum(max(0, min(e, hi) - max(s, lo)) for s, e in params)


def optimizer_elements(buffer: dict, dp_rank: int) -> int:
    """Elements of `buffer` whose optimizer state DP rank `dp_rank` keeps (the distributed optimizer)."""
    total = 0
    for start, end in buffer["buckets"]:
        size = (end - start) // buffer["dp"]
        lo = start + dp_rank * size
        total += _range_elements(buffer["params"], lo, lo + size)
    return total


@dataclass(frozen=True)
class Offload:
    """Optimizer CPU offload (megatron-core's HybridDeviceOptimizer under the distributed optimizer)."""
    fraction: float
    precision_aware: bool

    @classmethod
    def of(cls, optim) -> "Offload | None":
        return cls(optim.offload_fraction, optim.precision_aware) if optim.cpu_offload else None


@dataclass
class ModelBytes:
    """One model (policy or critic) on one rank: parameter count and bytes by kind (optimizer_bytes on the
    accelerator, host_optimizer_bytes in host memory: optimizer CPU offload)."""
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    host_optimizer_bytes: int = 0

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def _offloaded_state(elements: int, param_dtype: str, offload: Offload) -> tuple[int, int]:
    """(accelerator, host) bytes of the optimizer state of `elements` elements of one buffer in this rank's range,
    under the HybridDeviceOptimizer (hybrid_optimizer.py:251-300 and the distributed optimizer's main shards,
    distrib_optimizer.py:379-449). It takes the params it is given in order and moves them to the host until
    `fraction` of their elements are there: all at 1.0 (exact); below, this takes `fraction` of each buffer's
    elements (an estimate: megatron's cut falls at a parameter boundary in its param-group order).
    - a 16-bit param: without precision_aware the distributed optimizer keeps an fp32 main shard on the accelerator
      (4 B) and hands it to the HDO; on the host: its fp32 copy (4), AdamW's two moments (8), the gradient's host
      copy (4). With precision_aware the HDO gets the bf16 shard itself: on the host the fp32 master made from its
      bf16 host copy (4; that copy is dropped once the master exists), the moments (8), the gradient's copy (4);
      nothing stays on the accelerator.
    - an fp32 param (its own main copy): on the host its copy, the moments and the gradient's copy (16).
    What stays on the accelerator ((1 - fraction) of the elements) keeps the moments there (8), and a 16-bit one
    under precision_aware also the fp32 master the HDO makes for it (4)."""
    host_elements = elements if offload.fraction >= 1 else int(offload.fraction * elements)
    kept = elements - host_elements
    if param_dtype == "float32":
        return 8 * kept, 16 * host_elements
    if offload.precision_aware:
        return 12 * kept, 16 * host_elements
    return 4 * elements + 8 * kept, 16 * host_elements


def model_bytes(rank: dict, distributed_optimizer: bool, dp_rank: int | None = None,
                expert_dp_rank: int | None = None, offload: Offload | None = None) -> ModelBytes:
    """`rank`: one entry of meta_build.build. dp_rank/expert_dp_rank: the rank's place in its data-parallel
    groups (None: the largest over them, what a table of the layout needs). offload: optimizer CPU offload
    (with the distributed optimizer)."""
    buffers = rank["buffers"]
    if distributed_optimizer:
        # the trainable parameters live in DDP's buffers; a frozen base (LoRA) in its own tensors
        params = sum(b["numel"] * ITEMSIZE[b["param_dtype"]] for b in buffers) + rank.get("frozen_param_bytes", 0)
    else:
        params = rank["param_bytes"]
    params += rank["module_buffer_bytes"]
    grads = sum(b["numel"] * ITEMSIZE[b["grad_dtype"]] for b in buffers)
    opt = host = 0
    for b in buffers:
        main = 0 if b["param_dtype"] == "float32" else 4  # fp32 params are their own main copy
        if distributed_optimizer:
            which = expert_dp_rank if b["expert"] else dp_rank
            ranks = range(b["dp"]) if which is None else (which,)
            elements = max(optimizer_elements(b, r) for r in ranks)
        else:
            elements = b["numel_unpadded"]
        if offload is not None:
            on_device, on_host = _offloaded_state(elements, b["param_dtype"], offload)
            opt += on_device
            host += on_host
        else:
            opt += elements * (main + 8)
    return ModelBytes(rank["params"], params, grads, opt, host)


@dataclass(frozen=True)
class Shape:
    """The sizes the activation estimate needs (megatron's TransformerConfig fields of the family)."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense layers' MLP
    moe_ffn: int
    shared_ffn: int
    topk: int
    experts: int
    moe_layers: tuple  # 1 per layer that is MoE
    padded_vocab: int

    @classmethod
    def of(cls, hf, vocab_divisible_by: int, tp: int):
        family = get_family(hf.model_type)
        f = family.transformer_fields(hf)
        return cls(f["hidden_size"], f["num_attention_heads"], f.get("num_query_groups") or f["num_attention_heads"],
                   f.get("kv_channels") or f["hidden_size"] // f["num_attention_heads"], f["ffn_hidden_size"],
                   f.get("moe_ffn_hidden_size") or f["ffn_hidden_size"],
                   f.get("moe_shared_expert_intermediate_size") or 0, f.get("moe_router_topk") or 1,
                   family.num_experts(hf), tuple(family.moe_layer_pattern(hf)),
                   padded_vocab_size(hf.vocab_size, vocab_divisible_by, tp))


def layer_activation_bytes(s: Shape, tokens: int, tp: int, moe: bool, imbalance: float) -> int:
    """What one decoder layer keeps for its backward, bf16 (2 B), sequence parallel over `tp`, flash-style
    attention (no [L, L] scores: Transformer Engine's fused attention), no dropout masks (dropout 0).
    Attention: the input norm's and the QKV linear's inputs (sequence shards), q/k/v, the attention output and
    its log-sum-exp (fp32), the projection's input. MoE: the norm's and router's inputs, fp32 router logits
    and probabilities, then per routed token copy (tokens x topk / tp on average, times `imbalance` for the
    busiest rank: nothing caps an expert's load) the permuted input, fc1's gate+up output, the activation
    and the un-permuted output. A dense MLP and a shared expert: their norm input, fc1's output and the
    activation, split over TP."""
    t = tokens / tp
    attn = 2 * t * (2 * s.hidden + (s.heads + 2 * s.kv_heads) * s.head_dim + 2 * s.heads * s.head_dim) \
        + 4 * t * s.heads
    if not moe:
        return int(attn + 2 * t * (s.hidden + 3 * s.ffn))
    copies = t * s.topk * imbalance
    mlp = 2 * t * 2 * s.hidden + 4 * 2 * t * s.experts + copies * (2 * (2 * s.hidden + 3 * s.moe_ffn) + 4)
    if s.shared_ffn:
        mlp += 2 * t * 3 * s.shared_ffn
    return int(attn + mlp)


def activation_bytes(s: Shape, tokens: int, tp: int, layers: range, recompute: bool, in_flight: int,
                     imbalance: float) -> int:
    """A pipeline stage's activations with `in_flight` micro-batches of `tokens` started and not yet finished
    (1F1B: pipeline - stage). Full recompute (uniform, one layer per checkpoint) keeps each layer's input and
    rebuilds one layer at a time in the backward; without it every layer keeps everything."""
    per_layer = [layer_activation_bytes(s, tokens, tp, bool(s.moe_layers[i]), imbalance) for i in layers]
    if recompute:
        kept = len(per_layer) * 2 * tokens / tp * s.hidden
        return int(in_flight * kept + max(per_layer, default=0))
    return int(in_flight * sum(per_layer))


def logits_bytes(s: Shape, tokens: int, tp: int) -> int:
    """The output layer's logits of one micro-batch [tokens, vocab / tp] (bf16) and their gradient."""
    return 2 * 2 * tokens * s.padded_vocab // tp


def logprob_chunk_bytes(s: Shape, tokens: int, tp: int) -> int:
    """The log-prob kernel's fp32 temporaries: a few chunk-sized tensors (algorithms/logprobs.py)."""
    rows = _rows_per_chunk(tokens, s.padded_vocab // tp, None)
    return 3 * 4 * rows * (s.padded_vocab // tp)


def route_bytes(moe_layers_here: int, topk: int, tokens: int, tp: int) -> int:
    """R3 routes of one micro-batch on the device: [tokens / tp, this stage's MoE layers, topk] int16."""
    return 2 * math.ceil(tokens / tp) * moe_layers_here * topk


@dataclass
class GPUBytes:
    """One learner GPU (a pipeline stage's rank), by kind."""
    stage: int
    params: int  # parameter count (policy + critic)
    by_kind: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


def hf_model_bytes(hf, dtype: str) -> int:
    """The embedded engine's weights: transformers' model of `hf` with parameters in `dtype`, built on the meta
    device; every parameter once (tied embeddings share one) and the modules' buffers (RoPE's inv_freq)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, dtype=getattr(torch, dtype))
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))

