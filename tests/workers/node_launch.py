"""Launched SGLang servers, one launcher per node (tests/test_node_launch.py): 2 torchrun agents on this machine
(nodes 0 and 1, one learner rank each) build the trainer's EngineSlot with rollout.sglang.launch=true, the
stand-in server of tests/sglang_support/standin. argv: out_dir base_port. Scenarios, in one launch:
  ok: each node's local rank 0 starts its node's server; rank 0's engine attaches to both; close stops both.
  node1_fails: node 1's server cannot start: every rank raises the same one-line error, node 0 stops its own.
  loopback: servers bound to 127.0.0.1 on 2 nodes: refused on every rank before anything starts.
Rank 0 reports."""
import json
import os
import sys
import time
import urllib.request

import torch.distributed as dist

from moe.model import load_hf_config
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.rollout import EngineError
from rlpo_mega.rollout.engines import EngineSlot
from tests.dist import ROOT, write_report

STANDIN = os.path.join(ROOT, "tests", "sglang_support", "standin")


def alive(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def scenario(out, port, host, fail_ports=()):
    os.makedirs(out, exist_ok=True)
    cfg = load_config("configs/demo_cpu.yaml", (
        "rollout.engine=sglang", "rollout.sglang.launch=true", f"rollout.sglang.host={host}",
        "rollout.sglang.num_servers=1", f"rollout.sglang.base_port={port}", f"rollout.sglang.python={sys.executable}",
        "rollout.sglang.startup_timeout=60", f"rollout.sglang.log_dir={out}", f"model.init_from_hf={out}",
        "rollout.sync_transport=disk", f"rollout.sync_dir={out}/sync", "routing.mode=off"))
    cfg.rollout.sglang.env = {"PYTHONPATH": STANDIN, "STANDIN_OUT": out,
                              "STANDIN_FAIL_PORTS": ",".join(str(p) for p in fail_ports)}
    group = distributed.control_group(120)
    result = {"rank": dist.get_rank(), "pid": os.getpid(), "node": int(os.environ["GROUP_RANK"])}
    try:
        slot = EngineSlot(cfg, load_hf_config(cfg.model.hf_config), group=group)
    except EngineError as e:
        result["error"] = str(e)
        slot = None
    if slot is not None:
        result["node_servers"] = [s.url for s in slot.node_servers]
        if slot.engine is not None:
            result["engine"] = [{"url": s.url, "own": s.launched is not None, "node": s.node}
                                for s in slot.engine.servers]
        dist.barrier(group=group)
        urls = [u for e in result.get("engine", []) for u in [e["url"]]]
        result["alive_before_close"] = [alive(u) for u in urls]
        dist.barrier(group=group)  # no node closes before rank 0 has looked
        slot.close()
        dist.barrier(group=group)
        time.sleep(0.5)
        result["alive_after_close"] = [alive(u) for u in urls]
    else:
        dist.barrier(group=group)
    result["records"] = {f: json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))
                         if f.startswith("server_") and f.endswith(".json")}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    return every


if __name__ == "__main__":
    out, port = sys.argv[1], int(sys.argv[2])
    distributed.init_process_group()
    report = {"ok": scenario(os.path.join(out, "ok"), port, "0.0.0.0"),
              "node1_fails": scenario(os.path.join(out, "fail"), port + 10, "0.0.0.0", fail_ports=(port + 11,)),
              "loopback": scenario(os.path.join(out, "loop"), port + 20, "127.0.0.1")}
    if dist.get_rank() == 0:
        write_report(report)
    distributed.destroy()
