"""2 ranks: rank 0 is busy for 6 s (a long rollout) while rank 1 waits for its verdict. The world group has a
3 s timeout: rollout_phase.agree on distributed.control_group (60 s) waits it out; the default group does not."""
import datetime
import os
import time

import torch
import torch.distributed as dist

from rlpo_mega import distributed
from rlpo_mega.rollout.engines import agree
from tests.dist import write_report

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
rank = dist.get_rank()
group = distributed.control_group(60.0)
report = {}
t0 = time.monotonic()
if rank == 0:
    time.sleep(6)
code, _ = agree(1 if rank == 0 else 0, group)
report["control_group"] = {"code": code, "waited_s": round(time.monotonic() - t0, 1)}
if rank == 0:
    time.sleep(6)
try:
    dist.all_reduce(torch.zeros(1))
    report["default_group"] = "finished"
except Exception as e:  # gloo's timeout on the waiting rank
    report["default_group"] = f"timed out: {str(e)[:80]}"
flag = [None, None]  # rank 1 (the waiting rank) reports, over the control group
dist.all_gather_object(flag, report, group=group)
if rank == 0:
    write_report(flag[1])
os._exit(0)  # the default group is broken on rank 1 by design; no orderly teardown
