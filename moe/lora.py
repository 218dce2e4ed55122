"""LoRA adapters on megatron-core's parallel linears: beside a frozen linear W, a side path adds
(alpha / rank) * B(A(x)) to its output; B starts at zero, so an adapted model starts as its base exactly.

Where (`TARGETS`): the attention's qkv and output projections, a dense MLP's and the shared experts' fc1/fc2, the
routed experts' fc1/fc2. Never the router: R3 replays the routes the learner's own router scores, and an adapted
router would score differently from the base the servers route with. Never the embedding or the output layer.

The side path is exact under tensor and sequence parallelism: each rank holds its part of the single process's A and
B, and the step's numbers are the single process's.
- column-parallel base (its output rows split over TP): A [r, in] whole on every rank, B [out/tp, r] the base's rows.
  Without SP the input is whole: h = A x, then megatron's copy_to_tensor_model_parallel_region (its backward
  all-reduces dh, r wide), so A's gradient and the input's are whole on every rank. With SP the input is this rank's
  sequence chunk: h = A x_chunk gathered along the sequence (gather_from_sequence_parallel_region; backward:
  reduce-scatter), and A's gradient, of this chunk only, is summed over TP by megatron's finalize_model_grads as
  the norms' are (`param.sequence_parallel`, finalize_model_grads.py:354).
- row-parallel base (its input columns split over TP): A [r, in/tp] the base's columns, B [out, r] whole.
  h = A x_part summed over TP: without SP by an all-reduce (reduce_from_tensor_model_parallel_region), with SP by a
  reduce-scatter along the sequence (reduce_scatter_to_sequence_parallel_region), whose chunk B turns into this
  rank's chunk of the output; B's gradient from it is summed over TP as A's above.
- routed experts (megatron's SequentialMLP): at expert-TP 1 each expert's linears are whole and so are its factors.
  At expert-TP > 1 the token dispatcher hands every expert-TP rank the same tokens and sums the experts' row-parallel
  outputs (and the inputs' gradients) over expert-TP itself, so a factor split like its base's weight (fc1's B,
  fc2's A) needs nothing, and one whole on every expert-TP rank (fc1's A, fc2's B) has its gradient summed over
  expert-TP on the way back (`_SumGrad`: the partial sums that made expert LoRA wrong there, Megatron-Bridge #5634).
  The layout
  (`ExpertLayout`) says which factors each expert has of its own and which the layer's experts share:
  "per_expert" (A and B for each), "shared" (one A and B for all), "shared_outer" (fc1's A and fc2's B shared, fc1's
  B and fc2's A each expert's own: the layout SGLang serves natively). An expert's own factors are expert
  parameters (`allreduce=False`: reduced over the expert-data-parallel group, as the expert weights are); shared
  ones are reduced over the whole data-parallel group, EP ranks included, whose tokens they all saw. "shared" at
  expert-TP > 1 is refused (its fc1 B and fc2 A would be split over expert-TP and shared over experts: not built).

A is drawn like PEFT's (kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) from a generator seeded by the
run's seed and the parameter's place in the whole model (global layer, role, global expert), on the host, whole, then
cut: every layout starts from the single process's adapters.

`merged_weight` gives W + (alpha / rank) B A for a linear's own shard (per expert), in W's dtype: what the servers
load where they take merged weights. `adapters_off` runs the base model (the KL reference) without a second copy.

Imports megatron lazily (this module also serves the tests' pure checks); moe/ imports nothing from rlpo_mega.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import typing
from dataclasses import dataclass
from typing import Iterator, Literal, Optional

import torch

ExpertLayout = Literal["per_expert", "shared", "shared_outer"]
TARGETS: tuple[str, ...] = ("attention", "experts", "shared_experts", "dense_mlp")
EXPERT_LAYOUTS: tuple[str, ...] = typing.get_args(ExpertLayout)


class LoRAError(ValueError):
    """A LoRA request this model or layout cannot take; one line naming the cause and the fix."""


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    targets: tuple[str, ...] = ("attention", "experts", "shared_experts", "dense_mlp")
    expert_layout: ExpertLayout = "shared_outer"
    seed: int = 0  # the run's: A's draws

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def __post_init__(self):
        if self.rank < 1:
            raise LoRAError(f"LoRA rank {self.rank} must be >= 1")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise LoRAError(f"LoRA targets {list(self.targets)}: choose from {list(TARGETS)}")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise LoRAError(f"LoRA expert layout {self.expert_layout!r}: choose from {list(EXPERT_LAYOUTS)}")


def _draw_a(spec: LoRASpec, key: str, rank: int, fan_in: int) -> torch.Tensor:
    """The whole A [rank, fan_in] of the parameter at `key`, the same at every layout (fp32, host)."""
    digest = hashlib.sha256(f"{spec.seed}/{key}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(rank, fan_in).uniform_(-bound, bound, generator=gen)


def _param(data: torch.Tensor, **attrs) -> torch.nn.Parameter:
    p = torch.nn.Parameter(data)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _tp(linear) -> tuple[int, int, object]:
    """(size, rank, group) of the linear's own tensor-parallel group (the expert-TP group for an expert's)."""
    group = linear.tp_group
    if group is None:
        return 1, 0, None
    return group.size(), group.rank(), group


class _SumGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over `group` backward: a factor whole on every expert-TP rank, each of
    which saw only its part of the product."""

    @staticmethod
    def forward(ctx, param, group):
        ctx.group = group
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class LoRAFactors(torch.nn.Module):
    """The A and B of one adapted linear: this rank's parts (the module's docstring says which part is whose). A
    factor named in `shared` belongs to the experts module (one per layer, used by each of its experts) and is only
    referenced here, so it is one parameter to DDP, the optimizer and the checkpoint."""

    def __init__(self, a: torch.nn.Parameter, b: torch.nn.Parameter, scale: float, kind: str, tp: int, group,
                 sequence_parallel: bool, shared: tuple[str, ...] = ()):
        super().__init__()
        self.kind, self.scale, self.tp, self.group, self.sp = kind, scale, tp, group, sequence_parallel
        self.shared = shared
        self.expert_tp = False  # an expert's linear at expert-TP > 1: the dispatcher does the communication
        # a shared factor is registered on the module that owns it (the experts'); here it is only referenced
        if "a" in shared:
            object.__setattr__(self, "a", a)
        else:
            self.a = a
        if "b" in shared:
            object.__setattr__(self, "b", b)
        else:
            self.b = b
        self.enabled = True

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.expert_tp:
            a, b = self.a, self.b
            if self.kind == "column":
                a = _SumGrad.apply(a, self.group)
            else:
                b = _SumGrad.apply(b, self.group)
            return torch.nn.functional.linear(torch.nn.functional.linear(x, a.to(x.dtype)), b.to(x.dtype)) * self.scale
        h = torch.nn.functional.linear(x, self.a.to(x.dtype))
        if self.tp > 1:
            if self.kind == "column":
                h = (mappings.gather_from_sequence_parallel_region(h, group=self.group) if self.sp
                     else mappings.copy_to_tensor_model_parallel_region(h, group=self.group))
            else:
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.group) if self.sp
                     else mappings.reduce_from_tensor_model_parallel_region(h, group=self.group))
        return torch.nn.functional.linear(h, self.b.to(x.dtype)) * self.scale

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """W + scale * B A for this rank's shard of W, computed in fp32, in W's dtype."""
        return (weight.float() + self.scale * (self.b.float() @ self.a.float())).to(weight.dtype)


def _hook(module, args, output):
    lora = module.lora
    if not lora.enabled:
        return output
    out, bias = output
    return out + lora.delta(args[0]), bias


def _adapt(linear, spec: LoRASpec, key: str, kind: str, a: Optional[torch.nn.Parameter] = None,
           b: Optional[torch.nn.Parameter] = None, expert: bool = False, glu: bool = False) -> LoRAFactors:
    """Give `linear` (megatron's ColumnParallelLinear or RowParallelLinear, local spec) its adapter. a/b: shared
    factors to use instead of its own; glu: a gated MLP's fc1 (its rows [gate; up] per TP rank)."""
    tp, tp_rank, group = _tp(linear)
    shared = tuple(n for n, given in (("a", a), ("b", b)) if given is not None)
    out_part, in_part = linear.weight.shape
    device, dtype = linear.weight.device, linear.weight.dtype
    explicit = getattr(linear, "explicit_expert_comm", False)
    sp = bool(getattr(linear, "sequence_parallel", False)) and not explicit
    own = {"allreduce": False} if expert else {}
    if a is None:
        if kind == "column":
            whole = _draw_a(spec, key, spec.rank, in_part)
            a = _param(whole.to(device, dtype), **own, **({"sequence_parallel": True} if sp and tp > 1 else {}))
        else:
            whole = _draw_a(spec, key, spec.rank, in_part * tp)
            part = whole[:, tp_rank * in_part:(tp_rank + 1) * in_part].contiguous()
            a = _param(part.to(device, dtype), **own, tensor_model_parallel=tp > 1, partition_dim=1,
                       partition_stride=1)
    if b is None:
        if kind == "column":
            b = _param(torch.zeros(out_part, spec.rank, device=device, dtype=dtype), **own,
                       tensor_model_parallel=tp > 1, partition_dim=0, partition_stride=1)
        else:
            b = _param(torch.zeros(out_part, spec.rank, device=device, dtype=dtype), **own,
                       **({"sequence_parallel": True} if sp and tp > 1 else {}))
    factors = LoRAFactors(a, b, spec.scale, kind, tp, group, sp and tp > 1, shared=shared)
    factors.expert_tp = explicit and tp > 1
    linear.lora = factors
    linear.register_forward_hook(_hook)
    _checkpoint_shards(linear, kind, glu)
    return factors


def _checkpoint_shards(linear, kind: str, glu: bool):
    """The linear's checkpoint entries for its own factors, sharded as they are held: megatron's
    ColumnParallelLinear/RowParallelLinear.sharded_state_dict takes every tensor of the module but its weight and
    bias as whole on every TP rank, which would keep one TP rank's part of a split factor and drop the others (the
    loss of Megatron-Bridge #2240). A gated fc1's B is laid out as its weight is ([gate part; up part] on each TP
    rank): megatron's swiglu factory, as MLP.sharded_state_dict applies to the weight."""
    original = linear.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = original(prefix, sharded_offsets, metadata)
        own = linear.lora.state_dict(prefix="", keep_vars=True)  # the factors it holds, not the shared ones
        axis = {"b": 0} if kind == "column" else {"a": 1}
        made = make_sharded_tensors_for_checkpoint(
            own, f"{prefix}lora.", {k: v for k, v in axis.items() if k in own}, sharded_offsets,
            tp_group=linear.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if glu and f"{prefix}lora.b" in made:
            made[f"{prefix}lora.b"] = apply_swiglu_sharded_factory(
                made[f"{prefix}lora.b"], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
        out.update(made)
        return out

    linear.sharded_state_dict = sharded_state_dict


def _shared_checkpoint(experts, names: list[str]):
    """The experts' shared factors in their checkpoint: megatron's SequentialMLP.sharded_state_dict holds its
    experts' tensors only (a tensor of its own would be left out); each shared factor is whole on every rank."""
    original = experts.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = original(prefix, sharded_offsets, metadata)
        own = {n: getattr(experts, n) for n in names}
        out.update(make_sharded_tensors_for_checkpoint(own, prefix, {}, sharded_offsets))
        return out

    experts.sharded_state_dict = sharded_state_dict


def _is_te(linear) -> bool:
    return type(linear).__module__.startswith("megatron.core.extensions.transformer_engine")


def attach(model, spec: LoRASpec) -> dict[str, int]:
    """Freeze every base parameter of `model` (one pipeline stage's GPTModel, before DDP) and give the targeted linears
    adapters; a value model's scalar head (moe.value_head, on the last stage) stays trainable, as it is new. Returns
    counts: {"adapted": linears, "trainable": parameters (elements) of this rank}."""
    from megatron.core import parallel_state

    for p in model.parameters():
        p.requires_grad_(False)
    head = getattr(model, "output_layer", None)
    if getattr(model, "value_head", False) and head is not None:  # a critic: its scalar head trains whole
        for p in head.parameters():
            p.requires_grad_(True)
    adapted = 0
    for layer in model.decoder.layers:
        n = int(layer.layer_number)  # global, 1-based (pipeline stages continue the count)
        att = layer.self_attention
        if "attention" in spec.targets:
            if not hasattr(att, "linear_qkv"):
                raise LoRAError(f"LoRA on attention: layer {n}'s attention ({type(att).__name__}) has no fused qkv "
                                "projection (multi-latent attention is not built); drop 'attention' from the targets")
            for name, kind in (("linear_qkv", "column"), ("linear_proj", "row")):
                _check_local(getattr(att, name), "attention")
                _adapt(getattr(att, name), spec, f"{n}/{name}", kind)
                adapted += 1
        mlp = layer.mlp
        experts = getattr(mlp, "experts", None)
        if experts is None:  # a dense layer
            if "dense_mlp" in spec.targets:
                adapted += _adapt_mlp(mlp, spec, f"{n}/mlp")
            continue
        shared_mlp = getattr(mlp, "shared_experts", None)
        if shared_mlp is not None and "shared_experts" in spec.targets:
            adapted += _adapt_mlp(shared_mlp, spec, f"{n}/shared_experts")
        if "experts" in spec.targets:
            adapted += _adapt_experts(experts, spec, n, parallel_state.get_expert_model_parallel_rank())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"adapted": adapted, "trainable": trainable}


def _check_local(linear, what: str):
    if _is_te(linear):
        raise LoRAError(f"LoRA on {what}: {type(linear).__name__} (Transformer Engine's spec) is not built yet: "
                        "adapters sit on megatron-core's local linears; run without Transformer Engine")


def _adapt_mlp(mlp, spec: LoRASpec, key: str) -> int:
    for name, kind in (("linear_fc1", "column"), ("linear_fc2", "row")):
        _check_local(getattr(mlp, name), key)
        _adapt(getattr(mlp, name), spec, f"{key}/{name}", kind,
               glu=name == "linear_fc1" and mlp.config.gated_linear_unit)
    return 2


def _adapt_experts(experts, spec: LoRASpec, layer: int, ep_rank: int) -> int:
    local = getattr(experts, "local_experts", None)
    if local is None:
        raise LoRAError(f"LoRA on experts: layer {layer}'s {type(experts).__name__} is not built yet (adapters sit "
                        "on SequentialMLP's per-expert linears: model.moe_grouped_gemm off, no Transformer Engine)")
    first = local[0]
    etp, _, _ = _tp(first.linear_fc1)
    if etp > 1 and spec.expert_layout == "shared":
        raise LoRAError(f"LoRA expert layout 'shared' at expert-tensor-parallel size {etp} is not built (its fc1 B "
                        "and fc2 A would be split over expert-TP and shared by the experts); use shared_outer or "
                        "per_expert, or expert-TP 1")
    for e in local:
        _check_local(e.linear_fc1, "experts")
    hidden = first.linear_fc1.weight.shape[1]
    fc1_out = first.linear_fc1.weight.shape[0]
    inter = first.linear_fc2.weight.shape[1]
    device, dtype = first.linear_fc1.weight.device, first.linear_fc1.weight.dtype
    # the layer's shared factors: parameters of the experts module (one per layer, reduced over all of DP)
    shared: dict[str, torch.nn.Parameter] = {}
    if spec.expert_layout in ("shared", "shared_outer"):
        shared["fc1_a"] = _param(_draw_a(spec, f"{layer}/experts/fc1/a", spec.rank, hidden).to(device, dtype))
        shared["fc2_b"] = _param(torch.zeros(hidden, spec.rank, device=device, dtype=dtype))
    if spec.expert_layout == "shared":
        shared["fc1_b"] = _param(torch.zeros(fc1_out, spec.rank, device=device, dtype=dtype))
        shared["fc2_a"] = _param(_draw_a(spec, f"{layer}/experts/fc2/a", spec.rank, inter).to(device, dtype))
    for k, p in shared.items():
        experts.register_parameter(f"lora_{k}", p)
    if shared:
        _shared_checkpoint(experts, [f"lora_{k}" for k in shared])
    for i, e in enumerate(local):
        g = ep_rank * len(local) + i
        _adapt(e.linear_fc1, spec, f"{layer}/experts/{g}/linear_fc1", "column", a=shared.get("fc1_a"),
               b=shared.get("fc1_b"), expert=True, glu=e.config.gated_linear_unit)
        _adapt(e.linear_fc2, spec, f"{layer}/experts/{g}/linear_fc2", "row", a=shared.get("fc2_a"),
               b=shared.get("fc2_b"), expert=True)
    return 2 * len(local)


def adapters(model) -> Iterator[tuple[str, object]]:
    """(qualified name of the base linear, its LoRAFactors) over the model."""
    for name, module in model.named_modules():
        lora = getattr(module, "lora", None)
        if isinstance(lora, LoRAFactors):
            yield name, module


@contextlib.contextmanager
def adapters_off(models):
    """The base model: every adapter of `models` (pipeline chunks, DDP-wrapped or not) skipped inside."""
    found = [m.lora for model in models for _, m in adapters(model)]
    for lora in found:
        lora.enabled = False
    try:
        yield
    finally:
        for lora in found:
            lora.enabled = True


def merged_weight(linear) -> torch.Tensor:
    """The linear's weight shard with its adapter merged (W itself where it has none)."""
    lora = getattr(linear, "lora", None)
    return lora.merged(linear.weight) if isinstance(lora, LoRAFactors) else linear.weight


def is_lora_param(name: str) -> bool:
    """A factor's parameter name: `<linear>.lora.a/b` (its own) or `<experts>.lora_fc1_a` (a layer's shared)."""
    last = name.rsplit(".", 2)
    return (len(last) >= 2 and last[-2] == "lora") or last[-1].startswith("lora_")
