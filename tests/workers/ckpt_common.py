"""Shared pieces of the checkpoint workers: fixed data, layouts and switching layouts in one launch."""
from __future__ import annotations

import os

import torch

from moe.model import load_hf_config
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy
from rlpo_mega.training.warmup import data_parallel_shard, eval_loss, split_micro_batches, train_step

FAMILIES = {
    "qwen3_moe": "configs/models/tiny_qwen3_moe.json",
    "mixtral": "configs/models/tiny_mixtral.json",
}
# lr large enough that Adam's state visibly changes step 2 (the no-optimizer-state control must differ).
COMMON = ("optim.lr=0.01",)
LAYOUT_BIG = ("parallel.tensor=2", "parallel.expert=2", "parallel.pipeline=2", "parallel.num_micro_batches=2")
LAYOUT_TP1 = ("parallel.num_micro_batches=1",)
SEED = 1234
GLOBAL_BATCH = 8  # divisible by DP8 (TP1 on 8 processes) and DP2 x 2 micro-batches
SEQ = 17


def fork_checkpoint_queue():
    """Call before the process group exists. dist_checkpointing.save collects write results through
    a multiprocessing Manager it starts with the *spawn* method on first use; that server must import
    torch to unpickle them (~3 s CPU per rank, ~15 s for 8 ranks on 2 cores). A forked server
    inherits the imports: first save 4.6 s -> 0.3 s (2 ranks). Forking before any gloo thread exists.
    Returns the manager: call .shutdown() before leaving with os._exit, or its server outlives the
    worker and holds torchrun's output pipes open.
    """
    import multiprocessing as mp

    import torch.distributed.checkpoint  # noqa: F401  (inherited by the forked server)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert not torch.distributed.is_initialized() and filesystem_async._results_queue is None
    manager = mp.get_context("fork").Manager()
    filesystem_async._results_queue = manager.Queue()
    return manager


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def fixed_batches(hf) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randint(0, hf.vocab_size, (GLOBAL_BATCH, SEQ), generator=g)
            for name in ("train1", "train2", "eval", "train3")}  # train3 last: the others stay as they were


class Run:
    """One model + optimizer at one layout; `build` (re)initialises megatron's parallel state first."""

    def __init__(self, family: str, layout_overrides, seed: int, hf=None):
        self.hf = hf or load_hf_config(FAMILIES[family])
        self.cfg = load_config(None, COMMON + tuple(layout_overrides))
        if not torch.distributed.is_initialized():
            self.layout = distributed.init(self.cfg.parallel, self.hf, seed)
        else:
            self.layout = distributed.resolve_layout(self.cfg.parallel, world(), self.hf)
            distributed.init_model_parallel(self.layout)
            distributed.set_seed(seed)
        self.chunks, self.opt = build_policy(self.hf, self.layout, self.cfg.model, self.cfg.optim)
        self.data = fixed_batches(self.hf)

    def mbs(self, name):
        return split_micro_batches(data_parallel_shard(self.data[name]), self.cfg.parallel.num_micro_batches)

    def step(self, name) -> float:
        return train_step(self.chunks, self.opt, self.mbs(name))["loss"]

    def eval(self) -> float:
        return eval_loss(self.chunks, self.mbs("eval"))

    def describe(self) -> str:
        lay = self.layout
        return f"TP{lay.tensor}/EP{lay.expert}/PP{lay.pipeline}/DP{lay.data} on {lay.world_size}"


def finish(report, manager):
    """Write rank 0's report, then leave without the slow interpreter teardown.

    Teardown takes ~10 s on 8 ranks x 2 cores; the report is written, every rank passed the barrier
    and the queue manager's server is shut down (it would hold torchrun's pipes open)."""
    import os
    import sys

    from rlpo_mega import distributed

    if rank() == 0:
        from tests.dist import write_report

        write_report(report)
    torch.distributed.barrier()
    distributed.destroy()
    manager.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
