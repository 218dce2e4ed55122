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
from typing import Mapping, Optional

import torch

from moe.bridge.mapping import Dims, full_to_hf
from moe.families import get_family

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's prefix of the base model's module paths in a saved adapter


def _layer(template: str, i: int) -> str:
    return template.format(i=i)


def adapter(hf, rank: int, alpha: float, targets, factors: Mapping[str, torch.Tensor],
            base: Optional[str] = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json's dict, {PEFT key: tensor}) of the factors of a model.lora run (rank, alpha, targets as
    the checkpoint records them)."""
    family = get_family(hf.model_type)
    mods, fused = family.peft_modules(hf), family.hf_inmemory_names(hf)
    dims = Dims.of(hf)
    pattern = family.moe_layer_pattern(hf)
    num_experts = family.num_experts(hf)
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []  # the attention's projections
    linears: list[str] = []  # a dense or shared-expert MLP's
    used: set[str] = set()

    def get(key):
        if key not in factors:
            raise KeyError(f"LoRA factor {key} is not in the checkpoint")
        used.add(key)
        return factors[key]

    def put(module, a, b, inner=""):  # copies: q, k and v share one A, which safetensors stores once per name
        tensors[f"{PREFIX}{module}.{inner}lora_A.weight"] = a.clone(memory_format=torch.contiguous_format)
        tensors[f"{PREFIX}{module}.{inner}lora_B.weight"] = b.clone(memory_format=torch.contiguous_format)

    def mlp(prefix, role, i):
        a1 = get(prefix + "linear_fc1.lora.a")
        gate_b, up_b = full_to_hf("glu", get(prefix + "linear_fc1.lora.b"), dims)
        for key, a, b in ((f"{role}_gate", a1, gate_b), (f"{role}_up", a1, up_b),
                          (f"{role}_down", get(prefix + "linear_fc2.lora.a"), get(prefix + "linear_fc2.lora.b"))):
            linears.append(_layer(mods[key], i))
            put(linears[-1], a, b)

    def expert_factor(d, fc, ab):
        own = d + f"mlp.experts.experts.linear_{fc}.lora.{ab}"
        if own in factors:
            return get(own)
        shared = get(d + f"mlp.experts.lora_{fc}_{ab}")
        return shared.unsqueeze(0).expand(num_experts, *shared.shape)

    experts_module = None
    for i in range(hf.num_hidden_layers):
        d = f"decoder.layers.{i}."
        if "attention" in targets:
            a = get(d + "self_attention.linear_qkv.lora.a")
            for key, b in zip("qkv", full_to_hf("qkv", get(d + "self_attention.linear_qkv.lora.b"), dims)):
                modules.append(_layer(mods[key], i))
                put(modules[-1], a, b)
            modules.append(_layer(mods["o"], i))
            put(modules[-1], get(d + "self_attention.linear_proj.lora.a"), get(d + "self_attention.linear_proj.lora.b"))
        if not pattern[i]:
            if "dense_mlp" in targets:
                mlp(d + "mlp.", "dense", i)
            continue
        if family.shared_expert_size(hf) and "shared_experts" in targets:
            mlp(d + "mlp.shared_experts.", "shared", i)
        if "experts" in targets:
            gate_up, down = _layer(fused["experts_gate_up"], i), _layer(fused["experts_down"], i)
            experts_module = gate_up.rsplit(".", 1)[0]
            if down.rsplit(".", 1)[0] != experts_module:
                raise ValueError(f"{hf.model_type}: the fused experts' parameters {gate_up} and {down} are not "
                                 "on one module")
            for inner, fc in (("base_layer.", "fc1"), ("", "fc2")):  # gate_up_proj wrapped first: the inner one
                a, b = expert_factor(d, fc, "a"), expert_factor(d, fc, "b")  # [E, r, in], [E, out, r]
                put(experts_module, a.reshape(num_experts * rank, a.shape[-1]),
                    b.permute(1, 2, 0).reshape(b.shape[1], rank * num_experts), inner)
    unused = sorted(set(factors) - used)
    if unused:
        raise ValueError(f"LoRA factors with no PEFT place: {unused[:4]} ({len(unused)}); model.lora.targets "
                         f"{list(targets)} do not name them")
    # The MLPs' projections are named as parameters (`<module>.weight`: a 2-D ParamWrapper is a plain LoRA linear,
    # its keys the same), not modules: on transformers 5, peft rewrites the target_modules of the families whose
    # experts transformers fuses (qwen2_moe's pattern: qwen3_moe, glm4_moe; mixtral) that end in gate_proj, up_proj or
    # down_proj (w1/w2/w3) as the v4 experts', into the fused experts' parameters at twice the rank, and drops them as
    # modules (peft 0.21.2 utils/transformers_weight_conversion.py, _convert_peft_config_moe). Full paths throughout:
    # a leaf name would also take a shared expert's projection where only the dense MLP is adapted.
    params = [f"{m}.weight" for m in linears]
    if experts_module:
        params += [f.split("{i}.", 1)[1] for f in (fused["experts_gate_up"], fused["experts_down"])]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "target_modules": modules or None, "target_parameters": params or None,
    }
    return config, tensors


def write(out_dir: str, config: dict, tensors: Mapping[str, torch.Tensor]):
    """The adapter's two files into `out_dir` (made by the caller, empty)."""
    from safetensors.torch import save_file

    save_file(dict(tensors), os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
