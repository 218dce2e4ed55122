"""reduce_metrics across 2 gloo ranks: mean / max / min / sum, NaN skipped, key-mismatch error; rank 0 reports."""
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.dist import write_report  # noqa: E402
from rlpo_mega.logging import reduce_metrics  # noqa: E402
from rlpo_mega.reductions import Stat  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
# rank r: mean of (1, 3) = 2; max/min of (10, 20); sum of (5, 7) = 12; NaN on rank 1 only -> rank 0's 4.0
metrics = {"reward/mean": torch.tensor(1.0 + 2 * rank), Stat("response/length_max", "max"): 10 + 10 * rank,
           Stat("ratio/seq_min", "min"): 10.0 + 10 * rank, Stat("dynamic_sampling/kept", "sum"): 5 + 2 * rank,
           "entropy/mean": math.nan if rank else 4.0, "kl/policy": math.nan}
out = reduce_metrics(metrics, group=dist.new_group(backend="gloo"))
try:
    reduce_metrics({"a": 1.0} if rank == 0 else {"b": 1.0})
    mismatch = None
except ValueError as e:
    mismatch = str(e)
gathered = [None, None]
dist.all_gather_object(gathered, out)
if rank == 0:
    write_report({"out": {k: (None if math.isnan(v) else v) for k, v in out.items()},
                  "same": repr(gathered[0]) == repr(gathered[1]), "mismatch": mismatch})
dist.destroy_process_group()
