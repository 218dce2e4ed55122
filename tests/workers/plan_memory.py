"""What megatron-core allocated on each rank, for tests/test_plan.py's exact memory-model check.

Run inside the parity launch of a layout (tests/layout_runs.py, RLPO_PLAN_MEMORY_DIR) or alone: builds the tiny
policy in bf16 with and without the distributed optimizer, takes one optimizer step (Adam creates its state
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


def allocated(chunks, opt) -> dict:
    model = unwrap(chunks[0])
    seen: set = set()
    params = _storages(list(model.parameters()) + list(model.buffers()), seen)
    grads = _storages([p.main_grad for p in model.parameters()], seen)
    state = []
    for sub in getattr(opt, "chained_optimizers", [opt]):
        inner = sub.optimizer
        state += [p for g in inner.param_groups for p in g["params"]]  # fp32 main copies (views of fp32 params)
        state += [v for s in inner.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    optimizer = _storages(state, seen)
    return {"params": sum(p.numel() for p in model.parameters()), "param_bytes": params, "grad_bytes": grads,
            "optimizer_bytes": optimizer}


def run(out_dir: str, overrides: tuple, model: str = MODEL) -> None:
    from megatron.core import parallel_state

    hf = load_hf_config(model)
    for dist_opt in (False, True):
        cfg = load_config(None, overrides + ("model.params_dtype=bfloat16",
                                             f"optim.use_distributed_optimizer={str(dist_opt).lower()}"))
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
        with open(os.path.join(out_dir, f"memory_{'distopt' if dist_opt else 'plain'}_{rank}.json"), "w") as f:
            json.dump(report, f)
        del chunks, opt
        torch.distributed.barrier()


if __name__ == "__main__":
    run(sys.argv[1], tuple(sys.argv[2:]))
    distributed.destroy()
