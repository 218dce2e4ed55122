"""The recipe's real model, built by megatron-core for one rank of its layout on the `meta` device.

`rlpo-mega plan` sizes a recipe without GPUs, weights or a process group of the recipe's size: this module runs
in a child process (`python -m rlpo_mega.planning.meta_build`, JSON in on stdin, JSON out on stdout) that
joins torch's fake process group (every collective a no-op) as the rank to size, lets megatron-core's own
parallel_state, GPTModel and DistributedDataParallel build that rank's model and its param/grad buffers --
with megatron's own sharding, vocabulary padding and bucket padding -- and reports what they hold. Nothing is
allocated: `torch.cuda.current_device()` is the meta device while the model and its buffers are built.

One child per plan: it is the CPU platform (megatron's run-time patches, no CUDA even on a GPU host), and a
fake world group must not share a process with a real one.
"""
from __future__ import annotations

import functools
import gc
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch

from moe.lora import LoRASpec, is_lora_param
from moe.lora import attach as attach_lora
from moe.model import build_gpt_model, load_hf_config, transformer_config
from rlpo_mega import platform
from rlpo_mega.distributed import Layout
from rlpo_mega.model_setup import PARAMS_DTYPES, ddp_config


@dataclass(frozen=True)
class Request:
    hf_config: str  # config.json path (or directory)
    layout: Layout  # the world and its parallel sizes (rlpo_mega.distributed.resolve_layout)
    params_dtype: str  # float32 | bfloat16
    vocab_divisible_by: int
    use_distributed_optimizer: bool
    value_head: bool = False  # the critic: a scalar head in place of the output layer
    recompute: bool = False
    ranks: tuple = ()  # global ranks to build; () = the first rank of every pipeline stage
    lora: tuple = ()  # model.lora (a critic: critic.lora): (rank, alpha, targets, expert_layout) of LoRASpec; () = none


def _interval_lists(buffer) -> list:
    """[start, end) of every parameter in the buffer (megatron's param_index_map), in buffer order."""
    return sorted([s, e] for s, e, _ in buffer.param_index_map.values())


def _describe(ddp, model) -> dict:
    buffers = []
    for expert, group in ((False, ddp.buffers), (True, ddp.expert_parallel_buffers)):
        for b in group:
            buffers.append({
                "expert": expert, "param_dtype": str(b.param_dtype).removeprefix("torch."),
                "grad_dtype": str(b.grad_dtype).removeprefix("torch."), "numel": int(b.numel),
                "numel_unpadded": int(b.numel_unpadded), "dp": int(b.data_parallel_world_size),
                "params": _interval_lists(b), "buckets": [list(map(int, x)) for x in b.bucket_indices]})
    params = list(model.parameters())
    return {
        "params": int(sum(p.numel() for p in params)),
        "param_bytes": int(sum(p.numel() * p.element_size() for p in params)),
        # LoRA's frozen base: outside DDP's buffers (no gradient, no optimizer state), in its own tensors
        "frozen_param_bytes": int(sum(p.numel() * p.element_size() for p in params if not p.requires_grad)),
        "trainable_params": int(sum(p.numel() for p in params if p.requires_grad)),
        "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
        "expert_params": int(sum(p.numel() for p in params if not getattr(p, "allreduce", True))),
        # the model the engines serve and the sync sends (LoRA's factors are merged into it, not sent)
        "base_params": int(sum(p.numel() for n, p in model.named_parameters() if not is_lora_param(n))),
        "base_expert_params": int(sum(p.numel() for n, p in model.named_parameters()
                                      if not is_lora_param(n) and not getattr(p, "allreduce", True))),
        # buffers of the modules (the routers' fp32 score-correction bias) beside the parameters; one built on the
        # host (not the device) holds no GPU memory
        "module_buffer_bytes": int(sum(b.numel() * b.element_size() for b in model.buffers()
                                       if b.device.type == "meta")),
        "buffers": buffers,
    }


def _build_rank(req: Request, rank: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    lay = req.layout
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world_size)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=lay.tensor, pipeline_model_parallel_size=lay.pipeline,
            expert_model_parallel_size=lay.expert, expert_tensor_parallel_size=lay.expert_tensor,
            context_parallel_size=lay.context, create_gloo_process_groups=False)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
        hf = load_hf_config(req.hf_config)
        config = transformer_config(hf, lay.sizes(), params_dtype=PARAMS_DTYPES[req.params_dtype],
                                    recompute=req.recompute, calculate_per_token_loss=True)
        # meta tensors hold no values: megatron's CPU initialisation (full weights, then split) would draw them
        config.use_cpu_initialization = False
        config.perform_initialization = False
        with torch.device("meta"):
            model = build_gpt_model(hf, config, vocab_divisible_by=req.vocab_divisible_by, value_head=req.value_head)
            if req.lora:  # as model_setup.build_policy: the adapters (a critic's: critic.lora), then DDP
                rank_, alpha, targets, expert_layout = req.lora
                attach_lora(model, LoRASpec(rank_, alpha, tuple(targets), expert_layout))
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config(req.use_distributed_optimizer),
                                      module=model)
        out = _describe(ddp, model)
        out.update(rank=rank, stage=parallel_state.get_pipeline_model_parallel_rank(),
                   tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                   ep_rank=parallel_state.get_expert_model_parallel_rank(),
                   # the DDP buffers' (and the distributed optimizer's) group: data x context parallel
                   dp_rank=parallel_state.get_data_parallel_rank(with_context_parallel=True),
                   expert_dp_rank=parallel_state.get_expert_data_parallel_rank())
        return out
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def build(req: Request) -> list[dict]:
    """In this process: the ranks of `req` (see Request.ranks). Use `run` from anywhere else."""
    platform.apply()
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("meta")  # DDP's buffers: torch.zeros(device=current_device())
    try:
        lay = req.layout
        ranks = req.ranks or tuple(s * (lay.world_size // lay.pipeline) for s in range(lay.pipeline))
        return [_build_rank(req, r) for r in ranks]
    finally:
        torch.cuda.current_device = real


class MetaBuildError(RuntimeError):
    pass


def run(req: Request, timeout: float = 600.0) -> list[dict]:
    """`build(req)` in a child process on the CPU platform (see the module docstring)."""
    import subprocess

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "rlpo_mega.planning.meta_build"], input=json.dumps(asdict(req)),
                          capture_output=True, text=True, timeout=timeout, env=env)
    return child_result(req, proc)


def child_result(req: Request, proc) -> list[dict]:
    """What a finished child (`main`) reported: its last stdout line, or a MetaBuildError naming its last error."""
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        raise MetaBuildError(f"building {req.hf_config} on the meta device at TP{req.layout.tensor}/PP"
                             f"{req.layout.pipeline}/EP{req.layout.expert} failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=16)
def run_cached(req: Request) -> list[dict]:
    """`run`, once per request in this process (a plan at two length distributions builds once)."""
    return run(req)


def main() -> int:
    import logging

    logging.disable(logging.WARNING)  # megatron's per-buffer logs would reach stdout
    raw = json.loads(sys.stdin.read())
    raw["ranks"] = tuple(raw.get("ranks", ()))
    raw["layout"] = Layout(**raw["layout"])
    raw["lora"] = tuple(raw.get("lora") or ())
    result = build(Request(**raw))
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    gc.freeze()  # the teardown skips what torch and megatron-core built at import (rlpo_mega/cli.py `entry`)
    sys.exit(code)
