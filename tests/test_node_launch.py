"""rollout.sglang.launch=true launches per node (issue 27 item 5): two torchrun agents on this machine stand for
two nodes (static rendezvous: GROUP_RANK 0 and 1, one learner rank each), and SGLang is the test-only stand-in
server of tests/sglang_support/standin (it answers /health and records its command line; the real SGLang launch
is tests/test_sglang_trainer.py's). tests/workers/node_launch.py builds the trainer's EngineSlot."""
import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

from tests.dist import ROOT, WORKERS, free_port

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("nodes"))
    master, base = free_port(), free_port(20000, 25000)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        env = {**os.environ, "RLPO_REPORT": path, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        agents = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={k}", "--nproc-per-node=1",
             "--master-addr=127.0.0.1", f"--master-port={master}", os.path.join(WORKERS, "node_launch.py"), out,
             str(base)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for k in (0, 1)]
        logs = [a.communicate(timeout=500)[0] for a in agents]
        assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
        with open(path) as f:
            return json.load(f), base


def test_each_node_launches_its_own_servers(report):
    """Node k's local rank 0 starts node k's server (its parent process is that rank; port base + k, so URLs stay
    distinct on one host; bound to 0.0.0.0 and named by the hostname); rank 0's engine attaches to both, restarts
    its own node's itself and leaves node 1's to node 1's launcher; closing the slot stops both. Each launcher froze
    its server's collector once it answered (POST /freeze_gc: SGLang's own after-warm-up freeze misses a server
    started with skip_server_warmup)."""
    runs, base = report
    ranks = runs["ok"]
    host = socket.gethostname()
    assert [r["node_servers"] for r in ranks] == [[f"http://{host}:{base}"], [f"http://{host}:{base + 1}"]]
    assert ranks[0]["engine"] == [{"url": f"http://{host}:{base}", "own": True, "node": None},
                                  {"url": f"http://{host}:{base + 1}", "own": False, "node": 1}]
    records = ranks[0]["records"]
    for k, r in enumerate(ranks):
        rec = records[f"server_{base + k}.json"]
        assert rec["ppid"] == r["pid"], (k, rec, r)  # started by that node's own rank
        argv = rec["argv"]
        assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[argv.index("--port") + 1] == str(base + k)
        assert rec.get("freeze_gc") is True, rec
    assert ranks[0]["alive_before_close"] == [True, True] and ranks[0]["alive_after_close"] == [False, False]


def test_a_node_whose_server_fails_stops_every_rank_with_one_line(report):
    runs, base = report
    ranks = runs["node1_fails"]
    errors = {r["error"] for r in ranks}
    assert len(errors) == 1, errors
    (error,) = errors
    assert error.startswith("SGLang engine: could not start a server on node 1: SGLang server ") and "\n" not in error
    assert f":{base + 11} exited with code 1 during start-up" in error
    assert "server_%d.json" % (base + 10) in ranks[0]["records"]  # node 0's had started (and was stopped)


def test_loopback_servers_on_several_nodes_are_refused(report):
    runs, _ = report
    ranks = runs["loopback"]
    assert {r["error"] for r in ranks} == {
        "rollout.sglang.launch=true on 2 nodes: servers bound to 127.0.0.1 cannot be reached from drivers on "
        "other nodes; set rollout.sglang.host=0.0.0.0 (each node's servers are then addressed by its hostname)"}
    assert ranks[0]["records"] == {}
