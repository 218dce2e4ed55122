"""A LoRA run's adapters (moe/lora.py) as a PEFT adapter: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained` puts on the transformers model of the same base.

Input: every factor whole, keyed as the dist checkpoint keys it (the global layer; a layer's experts stacked on a
leading axis, [E, ...]); a global tensor is the single process's (the checkpoint entries are reshardable).

- attention: the fused qkv's B is cut into q/k/v rows (the bridge's `qkv` mapping); q, k and v each take the one A
  (B_q A x is q's part of B A x). The output projection's A and B are PEFT's as they are.
- a dense or shared-expert MLP: fc1's B cut into gate and up rows (`glu`), both with fc1's A; fc2 is down_proj.
- routed experts: transformers 5 holds them fused, `gate_up_proj` [E, 2I, H] (gate rows, then up rows: megatron's
  fc1 at TP1) and `down_proj` [E, H, I], as [E, out, in]. PEFT targets them as parameters (peft 0.21's ParamWrapper,
  tuners/lora/layer.py): lora_A Linear(in, r*E) whose rows are expert-major (e*r + k), lora_B Linear(r*E, out) whose
  columns are rank-major (k*E + e), delta[e] = einsum("o r e, e r i -> e o i") * alpha / r: so A_e [r, in] and
  B_e [out, r] of each expert go in as they are, and a factor the layer's experts share (shared_outer, shared) is
  repeated for each. Two parameters of one module nest two wrappers: the first of `target_parameters` is the inner
  one, its keys under `base_layer.`.
Pure tensor code: the tests load what it writes with peft and compare logits with the learner's.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Mapping, Optional

import torch

from moe.bridge import outputs
from moe.bridge.mapping import Dims, full_to_hf
from moe.families import get_family

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's prefix of the base model's module paths in a saved adapter


def _layer(template: str, i: int) -> str:
    return template.format(i=i)


def _walk(hf, targets, factors: Mapping[str, torch.Tensor]):
    """The adapted places of the model in layer order, each factor whole, as
    ("linear", module path, A [r, in], B [out, r]) for an attention or MLP projection, and
    ("experts", layer, (fc1 A, fc1 B), (fc2 A, fc2 B)) for a MoE layer's routed experts, each factor [E, ...] or, where
    the layer's experts share it (shared_outer, shared), [1, ...]. Every factor in `factors` is used, or refused."""
    family = get_family(hf.model_type)
    mods = family.peft_modules(hf)
    dims = Dims.of(hf)
    pattern = family.moe_layer_pattern(hf)
    used: set[str] = set()

    def get(key):
        if key not in factors:
            raise KeyError(f"LoRA factor {key} is not in the checkpoint")
        used.add(key)
        return factors[key]

    def mlp(prefix, role, i):
        a1 = get(prefix + "linear_fc1.lora.a")
        gate_b, up_b = full_to_hf("glu", get(prefix + "linear_fc1.lora.b"), dims)
        yield "linear", _layer(mods[f"{role}_gate"], i), a1, gate_b
        yield "linear", _layer(mods[f"{role}_up"], i), a1, up_b
        yield "linear", _layer(mods[f"{role}_down"], i), get(prefix + "linear_fc2.lora.a"), get(prefix + "linear_fc2.lora.b")

    def expert_factor(d, fc, ab):
        own = d + f"mlp.experts.experts.linear_{fc}.lora.{ab}"
        return get(own) if own in factors else get(d + f"mlp.experts.lora_{fc}_{ab}").unsqueeze(0)

    for i in range(hf.num_hidden_layers):
        d = f"decoder.layers.{i}."
        if "attention" in targets:
            a = get(d + "self_attention.linear_qkv.lora.a")
            for key, b in zip("qkv", full_to_hf("qkv", get(d + "self_attention.linear_qkv.lora.b"), dims)):
                yield "linear", _layer(mods[key], i), a, b
            yield ("linear", _layer(mods["o"], i), get(d + "self_attention.linear_proj.lora.a"),
                   get(d + "self_attention.linear_proj.lora.b"))
        if not pattern[i]:
            if "dense_mlp" in targets:
                yield from mlp(d + "mlp.", "dense", i)
            continue
        if family.shared_expert_size(hf) and "shared_experts" in targets:
            yield from mlp(d + "mlp.shared_experts.", "shared", i)
        if "experts" in targets:
            yield ("experts", i, (expert_factor(d, "fc1", "a"), expert_factor(d, "fc1", "b")),
                   (expert_factor(d, "fc2", "a"), expert_factor(d, "fc2", "b")))
    unused = sorted(set(factors) - used)
    if unused:
        raise ValueError(f"LoRA factors with no PEFT place: {unused[:4]} ({len(unused)}); model.lora.targets "
                         f"{list(targets)} do not name them")


def _config(rank: int, alpha: float, base: Optional[str], **targets) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None, **targets}


def _copy(t: torch.Tensor) -> torch.Tensor:  # q, k and v share one A, which safetensors stores once per name
    return t.clone(memory_format=torch.contiguous_format)


def adapter(hf, rank: int, alpha: float, targets, factors: Mapping[str, torch.Tensor],
            base: Optional[str] = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json's dict, {PEFT key: tensor}) of the factors of a model.lora run (rank, alpha, targets as
    the checkpoint records them), for peft 0.21 on transformers 5."""
    fused = get_family(hf.model_type).hf_inmemory_names(hf)
    num_experts = get_family(hf.model_type).num_experts(hf)
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []  # the attention's projections
    linears: list[str] = []  # a dense or shared-expert MLP's
    experts_module = None
    for kind, where, *ab in _walk(hf, targets, factors):
        if kind == "linear":
            (modules if ".self_attn." in where else linears).append(where)
            tensors[f"{PREFIX}{where}.lora_A.weight"], tensors[f"{PREFIX}{where}.lora_B.weight"] = map(_copy, ab)
            continue
        gate_up, down = _layer(fused["experts_gate_up"], where), _layer(fused["experts_down"], where)
        experts_module = gate_up.rsplit(".", 1)[0]
        if down.rsplit(".", 1)[0] != experts_module:
            raise ValueError(f"{hf.model_type}: the fused experts' parameters {gate_up} and {down} are not "
                             "on one module")
        for inner, (a, b) in zip(("base_layer.", ""), ab):  # gate_up_proj wrapped first: the inner one
            a = a.expand(num_experts, *a.shape[1:])  # [E, r, in]
            b = b.expand(num_experts, *b.shape[1:])  # [E, out, r]
            tensors[f"{PREFIX}{experts_module}.{inner}lora_A.weight"] = a.reshape(num_experts * rank, a.shape[-1])
            tensors[f"{PREFIX}{experts_module}.{inner}lora_B.weight"] = \
                b.permute(1, 2, 0).reshape(b.shape[1], rank * num_experts).contiguous()
    # The MLPs' projections are named as parameters (`<module>.weight`: a 2-D ParamWrapper is a plain LoRA linear,
    # its keys the same), not modules: on transformers 5, peft rewrites the target_modules of the families whose
    # experts transformers fuses (qwen2_moe's pattern: qwen3_moe, glm4_moe; mixtral) that end in gate_proj, up_proj or
    # down_proj (w1/w2/w3) as the v4 experts', into the fused experts' parameters at twice the rank, and drops them as
    # modules (peft 0.21.2 utils/transformers_weight_conversion.py, _convert_peft_config_moe). Full paths throughout:
    # a leaf name would also take a shared expert's projection where only the dense MLP is adapted.
    params = [f"{m}.weight" for m in linears]
    if experts_module:
        params += [f.split("{i}.", 1)[1] for f in (fused["experts_gate_up"], fused["experts_down"])]
    return _config(rank, alpha, base, target_modules=modules or None, target_parameters=params or None), tensors


def sglang_target_modules(hf, targets) -> list[str]:
    """The leaf names SGLang targets for model.lora's `targets` (its --lora-target-modules and the adapter config's
    target_modules: SGLang matches a leaf in every layer, lora/utils.py get_normalized_target_modules)."""
    family = get_family(hf.model_type)
    mods, names = family.peft_modules(hf), family.hf_names(hf)
    roles = {"attention": [mods[k] for k in "qkvo"],
             "dense_mlp": [mods[f"dense_{k}"] for k in ("gate", "up", "down")],
             "shared_experts": [mods[f"shared_{k}"] for k in ("gate", "up", "down")],
             "experts": [names[f"expert_{k}"].removesuffix(".weight") for k in ("gate", "up", "down")]}
    leaves: list[str] = []
    for t in targets:
        for module in roles[t]:
            leaf = module.rsplit(".", 1)[1]
            if leaf not in leaves:
                leaves.append(leaf)
    return leaves


def sglang_adapter_numel(hf, rank: int, targets, expert_layout: str) -> int:
    """Elements of the adapter `sglang_adapter` makes, from the HF weights' shapes (no model): per adapted weight
    [out, in] an A [r, in] and a B [out, r]; a MoE layer's experts' factors once per expert, but once per layer
    where the layer's experts share them (shared_outer: gate/up's A and down's B; "shared" sends only those shared,
    its other two repeated per expert)."""
    from moe.bridge.hf_checkpoint import expected_hf_shapes

    family = get_family(hf.model_type)
    shapes, mods, names = expected_hf_shapes(hf, False), family.peft_modules(hf), family.hf_names(hf)
    experts = family.num_experts(hf)
    outer = expert_layout != "per_expert"  # gate/up's A and down's B: [1, ...] for the layer
    total = 0
    for i in range(hf.num_hidden_layers):
        linears = []
        if "attention" in targets:
            linears += [mods[k] for k in "qkvo"]
        for role, target in (("dense", "dense_mlp"), ("shared", "shared_experts")):
            if target in targets:
                linears += [mods[f"{role}_{k}"] for k in ("gate", "up", "down")]
        for module in linears:
            shape = shapes.get(_layer(module, i) + ".weight")
            if shape is not None:
                total += rank * (shape[0] + shape[1])
        if "experts" in targets:
            for k in ("gate", "up", "down"):
                shape = shapes.get(_layer(names[f"expert_{k}"].replace("{e}", "0"), i))
                if shape is None:
                    continue  # a dense layer
                a_once, b_once = (outer, False) if k != "down" else (False, outer)
                total += rank * shape[1] * (1 if a_once else experts) + rank * shape[0] * (1 if b_once else experts)
    return total


def sglang_adapter(hf, rank: int, alpha: float, targets, factors: Mapping[str, torch.Tensor]
                   ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config_dict, {name: tensor}) of the factors as SGLang 0.5.23 loads an adapter (/load_lora_adapter_from_tensors,
    or a directory for /load_lora_adapter): PEFT's per-module keys for the attention's and the MLPs' projections
    (lora/lora.py normalises q/k/v into qkv_proj and gate/up into gate_up_proj), and a MoE layer's experts as 3-D
    tensors `<experts>.{gate,up,down}_proj.lora_{A,B}.weight` [E, ...], or [1, ...] where the layer's experts share
    the factor (mem_pool.py's "shared outer MoE weight": fc1's A and fc2's B, which the servers take with
    experts_shared_outer_loras; "shared" sends fc1's B and fc2's A repeated per expert). The leaf names stand as the
    target modules: SGLang matches them in every layer (lora/utils.py get_normalized_target_modules)."""
    names = get_family(hf.model_type).hf_names(hf)
    num_experts = get_family(hf.model_type).num_experts(hf)
    tensors: dict[str, torch.Tensor] = {}

    def put(module, a, b):
        tensors[f"{PREFIX}{module}.lora_A.weight"], tensors[f"{PREFIX}{module}.lora_B.weight"] = _copy(a), _copy(b)

    for kind, where, *ab in _walk(hf, targets, factors):
        if kind == "linear":
            put(where, *ab)
            continue
        (a1, b1), (a2, b2) = ab
        b1, a2 = b1.expand(num_experts, *b1.shape[1:]), a2.expand(num_experts, *a2.shape[1:])
        gate_b, up_b = (t.contiguous() for t in b1.chunk(2, dim=1))  # each expert's fc1 rows: gate, then up
        for key, a, b in (("expert_gate", a1, gate_b), ("expert_up", a1, up_b), ("expert_down", a2, b2)):
            put(_layer(names[key].replace(".{e}.", "."), where).removesuffix(".weight"), a, b)
    return _config(rank, alpha, None, target_modules=sglang_target_modules(hf, targets)), tensors


def write(out_dir: str, config: dict, tensors: Mapping[str, torch.Tensor]):
    """The adapter's two files into `out_dir` (made by the caller, empty)."""
    from safetensors.torch import save_file

    save_file(dict(tensors), os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump(config, f, indent=2)



KIND = "peft_adapter"  # the marker kind of an adapter directory rlpo-mega wrote (moe/bridge/outputs.py)


def write_dir(path: str, config: dict, tensors: Mapping[str, torch.Tensor], overwrite: bool = False):
    """The adapter as the directory `path`, written into a fresh sibling and swapped in whole (a server loading it
    never reads a half-written one). `path` must be absent, empty or (overwrite) an adapter rlpo-mega wrote: nothing
    else is ever replaced (moe/bridge/outputs.py)."""
    outputs.check_target(path, KIND, overwrite)
    tmp = outputs.temp_sibling(path)
    try:
        write(tmp, config, tensors)
        outputs.mark(tmp, KIND)
        outputs.swap_in(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
