"""Process-group and megatron parallel_state set-up from torchrun's environment.

Every size is validated against the world size and the model before anything starts, so a bad layout
fails with one message instead of a hang or a shape error deep inside megatron.
"""
from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.families import get_family
from moe.model import ParallelSizes
from . import platform


class ParallelLayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    """Resolved parallel sizes for a world of `world_size` processes."""

    world_size: int
    tensor: int
    pipeline: int
    expert: int
    expert_tensor: int
    sequence_parallel: bool
    context: int = 1

    @property
    def data(self) -> int:
        return self.world_size // (self.tensor * self.pipeline * self.context)

    @property
    def expert_data(self) -> int:
        return self.world_size // (self.expert * self.expert_tensor * self.pipeline)

    def sizes(self) -> ParallelSizes:
        return ParallelSizes(self.tensor, self.pipeline, self.expert, self.expert_tensor,
                             self.sequence_parallel, self.context)


def resolve_layout(parallel, world_size: int, hf=None) -> Layout:
    """Check `parallel` (a ParallelConfig) against the world and, if given, the HF model config."""
    tp, pp, ep, cp = parallel.tensor, parallel.pipeline, parallel.expert, parallel.context
    etp = parallel.expert_tensor if parallel.expert_tensor is not None else tp
    errors = []
    for name, v in (("tensor", tp), ("pipeline", pp), ("expert", ep), ("expert_tensor", etp), ("context", cp)):
        if v < 1:
            errors.append(f"parallel.{name}={v} must be >= 1")
    if errors:
        raise ParallelLayoutError("; ".join(errors))
    if world_size % (tp * pp * cp):
        names, sizes = ("tensor*pipeline", f"{tp}*{pp}") if cp == 1 else ("tensor*pipeline*context", f"{tp}*{pp}*{cp}")
        errors.append(f"world size {world_size} is not divisible by {names} = {sizes} = {tp * pp * cp}")
    if world_size % (ep * etp * pp):
        errors.append(
            f"world size {world_size} is not divisible by expert*expert_tensor*pipeline = "
            f"{ep}*{etp}*{pp} = {ep * etp * pp}"
        )
    sp = parallel.sequence_parallel
    if sp is None:
        sp = tp > 1
    if hf is not None:
        family = get_family(hf.model_type)
        heads, kv = hf.num_attention_heads, hf.num_key_value_heads
        experts, layers = family.num_experts(hf), hf.num_hidden_layers
        if heads % tp:
            errors.append(f"num_attention_heads={heads} is not divisible by tensor={tp}")
        if kv % tp:
            errors.append(f"num_key_value_heads={kv} is not divisible by tensor={tp}")
        if experts % ep:
            errors.append(f"num_experts={experts} is not divisible by expert={ep}")
        if layers % pp:
            errors.append(f"num_hidden_layers={layers} is not divisible by pipeline={pp}")
        ffn = hf.moe_intermediate_size if hasattr(hf, "moe_intermediate_size") else hf.intermediate_size
        if ffn % etp:
            errors.append(f"expert ffn size {ffn} is not divisible by expert_tensor={etp}")
        if tp > 1 and not sp:
            errors.append(
                f"tensor={tp} with a MoE model requires sequence parallel (megatron moe_layer.py); "
                "set parallel.sequence_parallel=true or leave it unset"
            )
    if tp == 1 and sp:
        errors.append("sequence_parallel=true needs tensor > 1")
    if errors:
        raise ParallelLayoutError("bad parallel layout: " + "; ".join(errors))
    return Layout(world_size, tp, pp, ep, etp, bool(sp), cp)


def init_process_group(timeout_minutes: int = 30):
    """torch.distributed from torchrun's env (or a single process without torchrun)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    bind_device()
    dist.init_process_group(backend=platform.backend(),
                            timeout=datetime.timedelta(minutes=timeout_minutes))


def bind_device():
    """Make this rank's GPU (torchrun's LOCAL_RANK; 0 without torchrun) the current device, on a CUDA machine.
    First thing in a rank, before anything can create a CUDA context: what creates one before it (a tensor put
    on "cuda"; possibly Transformer Engine's import, which megatron-core's import and `platform.apply()` do)
    creates it on GPU 0, where every rank would then hold one for the rest of its life. Idempotent; called by
    `rlpo-mega train` before it imports TE and megatron-core (rlpo_mega/cli.py) and again by `init`."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(parallel, hf=None, seed: int = 1234) -> Layout:
    """This rank's GPU, platform patches, process group, megatron parallel_state and seeds; returns the layout."""
    bind_device()  # before platform.apply(), which imports Transformer Engine (moe.model.have_transformer_engine)
    platform.apply()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = resolve_layout(parallel, world, hf)  # validate before any collective starts
    init_process_group()
    init_model_parallel(layout)
    set_seed(seed)
    return layout


def init_model_parallel(layout: Layout):
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor,
        context_parallel_size=layout.context,
        create_gloo_process_groups=True,
    )


def set_seed(seed: int):
    """Same seed for data everywhere; megatron's tracker gives TP/EP ranks their own streams."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


_CONTROL: dict = {}


def control_group(timeout_s: float):
    """A gloo group over the whole world with its own timeout (collective: every rank calls it once): for
    host-side flags that ranks exchange while one of them runs long work, e.g. the ranks that wait for rank
    0's SGLang rollout (NCCL's 30-minute collective timeout would kill a long-CoT rollout)."""
    key = float(timeout_s)
    if key not in _CONTROL:
        _CONTROL[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return _CONTROL[key]


def destroy(keep_world: bool = False, barrier: bool = True):
    """Tear down megatron's groups and (unless keep_world: several runs in one launch) the world group;
    torch cannot re-create a world group under the same torchrun rendezvous. barrier=False after an error:
    a peer may be stuck in a collective this rank left, and waiting for it would hide this rank's error."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for group in _CONTROL.values():
        dist.destroy_process_group(group)
    _CONTROL.clear()
    if dist.is_initialized() and not keep_world:
        if barrier:
            dist.barrier()  # no rank may close its connections while a peer is still communicating
        dist.destroy_process_group()


def all_ok(ok, device) -> bool:
    """`ok` (a bool, or a bool device tensor: read on the host only after the all-reduce) on every rank."""
    if torch.is_tensor(ok):
        flag = (~ok.to(device=device, dtype=torch.bool)).float().reshape(1)
    else:
        flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0
