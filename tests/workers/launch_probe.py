"""tests/test_warm_launch.py's worker: argv = MODE; reports what a rank sees of its launch."""
import os
import sys
import time

import torch.distributed as dist

from tests.dist import write_report

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "RLPO_PROBE")

if __name__ == "__main__":
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, {"env": {k: os.environ.get(k) for k in ENV}, "argv": sys.argv,
                                  "cwd": os.getcwd(), "main": __name__})
    if mode == "fail" and dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    if mode in ("fail", "hang"):
        time.sleep(600)  # rank 0 waits: the launcher must stop it
    if dist.get_rank() == 0:
        write_report(seen)
    dist.destroy_process_group()
