"""Asynchronous RL without partial rollout, where a weight sync waits for a driver's running round: the world
group (the export's collectives; NCCL on GPUs) has a 3 s timeout here, and rank 0's engine calls take 6 s. The
other rank must wait for the pause on the control group (rollout.wait_timeout), not in the export.

argv: out_dir. Rank 0 writes {"rc", "steps"}.
"""
import datetime
import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))  # the trainer keeps this world group

import tests.workers.train_hooks  # noqa: E402,F401  (registers test_slow)
from tests.dist import write_report  # noqa: E402
from tests.workers.train_scenarios import cfg, history, train  # noqa: E402

out = sys.argv[1]
os.environ["RLPO_SLOW_RANK"], os.environ["RLPO_SLOW_S"] = "0", "6"
rc = train(cfg(out, "slow", "rollout.engine=test_slow", "rollout.producer=async", "trainer.max_staleness=1",
               "rollout.partial_rollout=false", "train_iters=3"))
if dist.get_rank() == 0:
    write_report({"rc": rc, "steps": [h["step"] for h in history(out, "slow")]})
