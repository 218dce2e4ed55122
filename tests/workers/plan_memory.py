"""What megatron-core allocated on each rank, for tests/test_plan.py's exact memory-model check.

Run inside the parity launch of a layout (tests/layout_runs.py, RLPO_PLAN_MEMORY_DIR) or alone: builds the tiny
policy in bf16 with and without the distributed optimizer (and with optimizer CPU offload), takes one optimizer step (Adam creates its state
lazily) and writes each rank's bytes, counted from the distinct storages of the tensors megatron-core made:
parameters (and module buffers), main_grad buffers, and the optimizer's state and fp32 main copies.
"""
import json
import os
import sys

import torch

from moe.model import load_hf_config
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy, unwrap

MODEL = "configs/models/tiny_glm4_moe.json"  # dense first layer, shared expert, fp32 router bias, q/k/v biases


def _storages(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _adam_tensors(inner) -> list:
    """An Adam's params (fp32 main copies, or views of fp32 params) and moments."""
    return [p for g in inner.param_groups for p in g["params"]] + [
        v for s in inner.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]


def allocated(chunks, opt) -> dict:
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    model = unwrap(chunks[0])
    seen: set = set()
    params = _storages(list(model.parameters()) + list(model.buffers()), seen)
    grads = _storages([p.main_grad for p in model.parameters()], seen)
    state, host = [], []
    for sub in getattr(opt, "chained_optimizers", [opt]):
        inner = sub.optimizer
        if not isinstance(inner, HybridDeviceOptimizer):
            state += _adam_tensors(inner)
            continue
        # optimizer CPU offload: the distributed optimizer's fp32 main shards (none under precision_aware) and the
        # device AdamW stay on the accelerator; the host AdamWs' params and moments, the host copies of the
        # offloaded params and of their gradients are host memory
        state += [p for g in sub.shard_fp32_from_float16_groups for p in g if p is not None]
        if inner.gpu_optimizer is not None:
            state += _adam_tensors(inner.gpu_optimizer)
        for cpu in inner.cpu_optimizers:
            host += _adam_tensors(cpu)
        host += list(inner.gpu_params_map_cpu_copy.values()) + list(inner.cpu_copy_map_grad.values())
    optimizer = _storages(state, seen)
    return {"params": sum(p.numel() for p in model.parameters()), "param_bytes": params, "grad_bytes": grads,
            "optimizer_bytes": optimizer, "host_optimizer_bytes": _storages(host, seen)}


# kind -> overrides (bf16): the plain and the distributed optimizer; optimizer CPU offload with slime's flags
# (precision_aware: the host holds the fp32 master) and without precision_aware (the accelerator keeps the
# distributed optimizer's fp32 main shard)
KINDS = {"plain": (), "distopt": ("optim.use_distributed_optimizer=true",),
         "offload": ("optim.use_distributed_optimizer=true", "optim.cpu_offload=true", "optim.precision_aware=true",
                     "optim.overlap_cpu_optimizer_d2h_h2d=true"),
         "offload_main": ("optim.use_distributed_optimizer=true", "optim.cpu_offload=true")}


def run(out_dir: str, overrides: tuple, model: str = MODEL) -> None:
    from megatron.core import parallel_state

    hf = load_hf_config(model)
    for kind, extra in KINDS.items():
        cfg = load_config(None, overrides + ("model.params_dtype=bfloat16",) + extra)
        layout = distributed.init(cfg.parallel, hf, cfg.seed)
        chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim)
        for p in unwrap(chunks[0]).parameters():
            p.main_grad.zero_()
        ok, _, _ = opt.step()
        assert ok
        rank = torch.distributed.get_rank()
        report = {**allocated(chunks, opt), "rank": rank, "world_size": layout.world_size,
                  "dp_rank": parallel_state.get_data_parallel_rank(),
                  "expert_dp_rank": parallel_state.get_expert_data_parallel_rank()}
        with open(os.path.join(out_dir, f"memory_{kind}_{rank}.json"), "w") as f:
            json.dump(report, f)
        del chunks, opt
        torch.distributed.barrier()


if __name__ == "__main__":
    run(sys.argv[1], tuple(sys.argv[2:]))
    distributed.destroy()
