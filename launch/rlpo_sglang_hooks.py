"""Runs inside an SGLang server (registered with --custom-weight-loader; launch/ is on its PYTHONPATH).

SGLang offers no way to read Qwen3-MoE/Mixtral weights back over HTTP (get_weights_by_name is implemented
for a few dense models only), yet the weight-sync digest check must see what the server actually holds.
`dump_params` is called through update_weights_from_tensor(load_format="rlpo_sglang_hooks.dump_params");
the first tensor's *name* is a directory, where every TP rank writes its parameters (SGLang names, its
fused layout) as `params_tp{rank}.safetensors`; the client maps them back to HF names and digests them.
Imports torch and safetensors only (the SGLang environment has no rlpo_mega dependencies).
"""
import os

import torch


def dump_params(model, named_tensors):
    from safetensors.torch import save_file

    directory = named_tensors[0][0]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous()
        if any(t.data_ptr() == u.data_ptr() and t.shape == u.shape for u in tensors.values()):
            t = t.clone()  # tied weights: safetensors refuses shared storage
        tensors[name] = t
    tmp = os.path.join(directory, f".params_tp{rank}.tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(directory, f"params_tp{rank}.safetensors"))
