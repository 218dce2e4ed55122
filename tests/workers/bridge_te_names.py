"""Bridge worker for the Transformer Engine spec's parameter names, without Transformer Engine.

The TE spec (megatron's choice where TE is installed) holds the same tensors as the local spec under other
names: the input norm as `self_attention.linear_qkv.layer_norm_weight`, a dense MLP's pre-norm as
`mlp.linear_fc1.layer_norm_weight`, experts as `mlp.experts.linear_fc{1,2}.weight{j}` of one GroupedLinear
(names from megatron-core's own rewrite tables). This worker moves a local-spec model's parameters into
that module layout (same tensor objects; TE's kernels are not what is tested) and checks the bridge:
export equals the local-spec export and the HF checkpoint exactly, and import fills every tensor.
argv: out_dir model_configs [overrides...].
"""
import os
import re

import torch
import torch.distributed as dist

from moe.bridge.megatron_io import _inner, export_hf_state, load_hf_weights, local_params
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy
from tests.workers.bridge import make_hf_checkpoint, per_family_main


def move_param(src_module, src_name, dst_module, dst_name):
    p = src_module._parameters.pop(src_name)
    dst_module.register_parameter(dst_name, p)


def to_te_layout(model):
    """Re-home the local spec's parameters where the TE spec has them (in place; same Parameters)."""
    for layer in _inner(model).decoder.layers:
        move_param(layer.input_layernorm, "weight", layer.self_attention.linear_qkv, "layer_norm_weight")
        if hasattr(layer.mlp, "linear_fc1"):  # dense MLP: its pre-norm fuses into linear_fc1
            move_param(layer.pre_mlp_layernorm, "weight", layer.mlp.linear_fc1, "layer_norm_weight")
            continue
        sequential = layer.mlp.experts
        grouped = torch.nn.Module()
        grouped.num_local_experts = sequential.num_local_experts
        grouped.linear_fc1, grouped.linear_fc2 = torch.nn.Module(), torch.nn.Module()
        for j, expert in enumerate(sequential.local_experts):
            move_param(expert.linear_fc1, "weight", grouped.linear_fc1, f"weight{j}")
            move_param(expert.linear_fc2, "weight", grouped.linear_fc2, f"weight{j}")
        layer.mlp.experts = grouped
    _inner(model).__dict__.pop("_rlpo_export_plan", None)  # names changed: plan again


def run_family(out_dir, hf, overrides):
    src = os.path.join(out_dir, f"hf_src_{hf.model_type}")
    cfg = load_config(None, tuple(overrides) + (f"model.init_from_hf={src}",))
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    if dist.get_rank() == 0 and not os.path.isdir(src):
        make_hf_checkpoint(hf, src)
    dist.barrier()
    chunks, _ = build_policy(hf, layout, cfg.model, None, with_ddp=False)
    local_names = sorted(lp.map.megatron for lp in local_params(chunks[0]))
    local_export = export_hf_state(chunks, dst=0)

    to_te_layout(chunks[0])
    te_names = sorted(name for name, _ in _inner(chunks[0]).named_parameters())
    report = {"te_style_names": sum(bool(re.search(r"layer_norm_weight$|linear_fc[12]\.weight\d+$", n))
                                    for n in te_names),
              "local_style_left": sum(bool(re.search(r"input_layernorm|local_experts", n)) for n in te_names),
              "global_names_equal": sorted(lp.map.megatron for lp in local_params(chunks[0])) == local_names}
    te_export = export_hf_state(chunks, dst=0)
    with torch.no_grad():  # import into the TE layout: every tensor must be written again
        for p in _inner(chunks[0]).parameters():
            p.zero_()
    load_hf_weights(chunks, src, cfg.model.vocab_divisible_by)
    reimported = export_hf_state(chunks, dst=0)
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        original = {}
        for f in os.listdir(src):
            if f.endswith(".safetensors"):
                original.update(load_file(os.path.join(src, f)))
        report["export_equals_local"] = sorted(te_export) == sorted(local_export) and all(
            torch.equal(te_export[k], local_export[k]) for k in local_export)
        report["reimport_equals_checkpoint"] = sorted(reimported) == sorted(original) and all(
            torch.equal(reimported[k], original[k]) for k in original)
        report["tensors"] = len(original)
    return report


if __name__ == "__main__":
    per_family_main(run_family)
