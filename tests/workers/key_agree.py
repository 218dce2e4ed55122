"""2 ranks, servers launched by the trainer (rollout.sglang.launch=true) with no key in the environment: EngineSlot
agrees on one key (rank 0 makes it, every rank learns it) before the node's launcher starts them, and puts it in
$RLPO_SGLANG_KEY on every rank (a rebuild's relaunch reads it there, and keeps it). With a key in rank 0's
environment, that key is every rank's. The launch and the engine are recorders: what is under test is the key
the ranks hold when the servers are launched."""
import os

import torch.distributed as dist

import rlpo_mega.rollout.engines as engines_module
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.rollout.engines import EngineSlot
from tests.dist import write_report

dist.init_process_group("gloo")
rank = dist.get_rank()
group = distributed.control_group(120.0)
seen = []


def launched(sg, model, node, nodes, colocate, extra_args=None):  # this node's launcher (local rank 0)
    seen.append(("launch", os.environ.get(sg.api_key_env)))
    return []


engines_module.launch_node_servers = launched
engines_module.build_engine = lambda cfg, hf: None
engines_module.make_transport = lambda cfg, engine, hf: None
cfg = load_config(None, ("rollout.engine=sglang", "rollout.sglang.launch=true"))
os.environ.pop("RLPO_SGLANG_KEY", None)
slot = EngineSlot(cfg, None, group=group)  # made on rank 0, learned by rank 1
seen.append(("built", os.environ.get("RLPO_SGLANG_KEY")))
slot.close()
slot.build()  # a rebuild: the same key
seen.append(("rebuilt", os.environ.get("RLPO_SGLANG_KEY")))
os.environ.pop("RLPO_SGLANG_KEY")
if rank == 0:
    os.environ["RLPO_SGLANG_KEY"] = "rank-zero-key-" + "z" * 20
slot.build()  # rank 0's own (e.g. exported by launch/slurm/common.sh), every rank's
seen.append(("given", os.environ.get("RLPO_SGLANG_KEY")))
every = [None] * dist.get_world_size()
dist.all_gather_object(every, seen, group=group)
if rank == 0:
    write_report(every)
dist.destroy_process_group()
