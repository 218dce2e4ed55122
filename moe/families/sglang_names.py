"""SGLang's parameter layout (TP 1) -> HF names, for every registered family.

SGLang fuses q/k/v into `qkv_proj`, MLA's two down-projections (q_a_proj, kv_a_proj_with_mqa: deepseek_v3 with a
q_lora_rank) into `fused_qkv_a_proj_with_mqa`, a dense MLP's gate/up into `gate_up_proj`, and a MoE layer's experts into
`experts.w13_weight` [E, 2I, H] (per expert: gate rows, then up rows) and `experts.w2_weight` [E, H, I]; its
embedding and lm_head may carry padded vocabulary rows. The per-expert HF names come from the family's own
`hf_names` templates, so a new family needs nothing here.

Imports torch and transformers only: this module also runs inside SGLang servers (launch/rlpo_sglang_hooks.py),
whose environment has neither megatron-core nor rlpo_mega's dependencies.
"""
from __future__ import annotations

import re

import torch

from moe.bridge.fp8 import BLOCK, SCALE_SUFFIX

from . import get_family

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_SCALE, _FP8_BLOCK = SCALE_SUFFIX, BLOCK


def sglang_to_hf(params: dict[str, torch.Tensor], hf, first_expert: int = 0, tie: bool = True) -> dict[str, torch.Tensor]:
    """SGLang's fused TP-1 parameters -> HF-named tensors (views where possible). first_expert: a fused expert
    tensor holds experts [first_expert, first_expert + its length) (the digest hook's slices). tie: a tied
    lm_head is named from the embedding (off for one parameter at a time: the caller names it)."""
    names = get_family(hf.model_type).hf_names(hf)
    family = get_family(hf.model_type)
    heads, kv = int(hf.num_attention_heads), int(hf.num_key_value_heads)
    head_dim = family.head_dim(hf)
    vocab = int(hf.vocab_size)
    out = {}
    for name, t in params.items():
        # a block-FP8 layer's weight_scale_inv (rollout.weights=fp8): one row per 128 rows of its weight, so its
        # fused parts split at the same places in 128ths (SGLang refuses parts that are not whole blocks)
        rows = (lambda n: n // _FP8_BLOCK) if name.endswith(_SCALE) else (lambda n: n)
        if ".qkv_proj." in name:
            q, k, v = t.split([rows(heads * head_dim), rows(kv * head_dim), rows(kv * head_dim)], dim=0)
            for part, x in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv_proj", part)] = x
        elif ".fused_qkv_a_proj_with_mqa." in name:  # rows [q_a (q_lora_rank); kv_a (kv_lora_rank + rope)]
            q_a, kv_a = t.split([int(hf.q_lora_rank), t.shape[0] - int(hf.q_lora_rank)], dim=0)
            out[name.replace("fused_qkv_a_proj_with_mqa", "q_a_proj")] = q_a
            out[name.replace("fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa")] = kv_a
        elif ".gate_up_proj." in name:
            g, u = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = g, u
        elif name.endswith(("experts.w13_weight", "experts.w2_weight", "experts.w13_weight" + _SCALE,
                            "experts.w2_weight" + _SCALE)):
            i = int(_LAYER.search(name).group(1))
            suffix = _SCALE if name.endswith(_SCALE) else ""
            for k in range(t.shape[0]):
                gate, up, down = (n + suffix for n in _expert_names(names, family, hf, name, first_expert + k))
                if "w13_weight" in name:
                    out[gate.format(i=i)], out[up.format(i=i)] = t[k].chunk(2, dim=0)
                else:
                    out[down.format(i=i)] = t[k]
        elif name in (names["embedding"], names["output"]):
            out[name] = t[:vocab]
        else:
            out[name] = t
    if tie and names["output"] not in out and getattr(hf, "tie_word_embeddings", False):
        out[names["output"]] = out[names["embedding"]]
    return out


def _expert_names(names: dict, family, hf, param: str, e: int) -> tuple[str, str, str]:
    """HF name templates ({i}: the layer) of slot e of a fused expert parameter. Past the routed experts is the
    shared expert: on CUDA (compute capability >= 8.0, no expert parallelism) SGLang folds a DeepSeek-V3-block
    model's one shared expert into the routed ones as slot n_routed_experts (sglang/srt/models/glm4_moe.py
    iter_weights_with_fused_shared_experts: `shared_experts.*` loaded as `experts.<n_routed_experts>.*`)."""
    routed = family.num_experts(hf)
    if e < routed:
        return tuple(names[k].replace("{e}", str(e)) for k in ("expert_gate", "expert_up", "expert_down"))
    if e == routed and "shared_gate" in names and int(getattr(hf, "n_shared_experts", 0) or 0) == 1:
        return names["shared_gate"], names["shared_up"], names["shared_down"]
    raise ValueError(f"{param}: expert slot {e} is past the model's {routed} routed experts and not one fused shared "
                     f"expert (n_shared_experts={getattr(hf, 'n_shared_experts', None)}): a layout this code does not "
                     "know; start SGLang with --disable-shared-experts-fusion")


__all__ = ["sglang_to_hf"]
