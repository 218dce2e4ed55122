"""SGLang 0.5.23's parameter layout of a tiny model, built from transformers' own model (test helper)."""
from __future__ import annotations

import os
import re

import torch

from tests.dist import ROOT


def sglang_layout(config: str, fuse_shared_experts: bool = False):
    """(hf config, {HF name: tensor} of transformers' model, the same tensors in SGLang's TP-1 layout as its model
    code builds it: deepseek_v2.py fused_qkv_a_proj_with_mqa = [q_a_proj; kv_a_proj_with_mqa]; qkv_proj; gate_up_proj =
    [gate; up]; experts.w13_weight [E, 2I, H], w2_weight [E, H, I]). fuse_shared_experts: the shared expert folded
    in as expert slot n_routed_experts, as SGLang does on CUDA (glm4_moe.py iter_weights_with_fused_shared_experts)."""
    from transformers import AutoModelForCausalLM

    from moe.model import load_hf_config

    hf = load_hf_config(os.path.join(ROOT, config))
    torch.manual_seed(0)
    ref = {k: v.clone() for k, v in AutoModelForCausalLM.from_config(hf).state_dict().items()}
    for name in list(ref):  # transformers holds experts stacked ([E, 2I, H], [E, H, I]); checkpoints name each one
        if name.endswith(".mlp.experts.gate_up_proj"):
            for e, t in enumerate(ref.pop(name)):
                ref[f"{name[:-12]}{e}.gate_proj.weight"], ref[f"{name[:-12]}{e}.up_proj.weight"] = t.chunk(2, dim=0)
        elif name.endswith(".mlp.experts.down_proj"):
            for e, t in enumerate(ref.pop(name)):
                ref[f"{name[:-9]}{e}.down_proj.weight"] = t
    routed = getattr(hf, "n_routed_experts", None)
    sgl, experts = {}, {}
    for name, t in ref.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        shared = re.match(r"(.*\.mlp)\.shared_experts\.(gate|up|down)_proj\.weight$", name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        elif shared and fuse_shared_experts:
            experts.setdefault(shared.group(1) + ".experts", {})[(routed, shared.group(2))] = t
        elif name.endswith("kv_a_proj_with_mqa.weight") and hf.q_lora_rank is not None:
            sgl[name.replace("kv_a_proj_with_mqa", "fused_qkv_a_proj_with_mqa")] = torch.cat(
                [ref[name.replace("kv_a_proj_with_mqa", "q_a_proj")], t])
        elif re.search(r"\.(q|k|v)_proj\.(weight|bias)$", name) and "self_attn" in name:
            if ".q_proj." in name and name.replace("q_proj", "k_proj") in ref:
                sgl[name.replace("q_proj", "qkv_proj")] = torch.cat(
                    [ref[name], ref[name.replace("q_proj", "k_proj")], ref[name.replace("q_proj", "v_proj")]])
            elif ".q_proj." in name:
                sgl[name] = t  # MLA without q_lora: q_proj alone
        elif name.endswith("gate_proj.weight"):
            sgl[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, ref[name.replace("gate_proj", "up_proj")]])
        elif not name.endswith(("up_proj.weight", "q_a_proj.weight")):
            sgl[name] = t
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        sgl[prefix + ".w13_weight"] = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(n)])
        sgl[prefix + ".w2_weight"] = torch.stack([parts[(e, "down")] for e in range(n)])
    return hf, ref, sgl
