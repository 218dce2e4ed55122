"""launch/slurm on a real single-node SLURM (tests/slurm_support.py), plus the disaggregated script's commands.

- train_colocated.sbatch runs the real `rlpo-mega train` (1 node, 2 ranks) with `sbatch --wait`;
- SIGTERM reaches every rank, both directly (`scancel --signal=TERM`) and through the batch shell's trap
  (`scancel --batch --signal=TERM`, what `#SBATCH --signal=B:TERM@120` delivers before the time limit);
- train_disaggregated.sbatch under DRY_RUN=1 for a made-up 2 learner + 1 rollout node list (no GPUs or SGLang
  here), and train_colocated.sbatch's per-node torchrun commands for 2 made-up nodes.
The SLURM tests skip (with the reason) only when slurm-wlm/munge are absent and cannot be apt-installed.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_support import clean_env, install_time, slurm_cluster, slurm_unavailable

ROOT = Path(__file__).resolve().parent.parent
COLOCATED = ROOT / "launch" / "slurm" / "train_colocated.sbatch"
DISAGG = ROOT / "launch" / "slurm" / "train_disaggregated.sbatch"

# The short real run at a 2-process layout (the trainer is being rewritten: change these two if its keys move).
TRAIN_CONFIG = "configs/demo_cpu.yaml"
TRAIN_OVERRIDES = ["parallel.expert=2", "train_iters=1", "trainer.warmup.steps=2", "trainer.eval_every=0",
                   "checkpoint.save_dir=null", "logging.mode=disabled", "logging.plot=false"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError as e:
        pytest.skip(f"this host's name {host!r} does not resolve ({e}); torch.distributed needs it as MASTER_ADDR")
    if install_time():
        print(f"\n[slurm] apt-get install took {install_time():.1f} s")
    root = tmp_path_factory.mktemp("slurm")
    t0 = time.monotonic()
    with slurm_cluster(root) as c:
        print(f"\n[slurm] cluster up in {time.monotonic() - t0:.1f} s")
        yield c


def _job_env(tmp_path: Path, **extra) -> dict:
    return {"LOG_DIR": str(tmp_path / "logs"), "PYTHON": sys.executable, "RLPO_ROOT": str(ROOT),
            "PYTHONWARNINGS": "ignore", **extra}


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"<{path} missing>"


def _wait_for(pred, timeout: float, what: str, diag=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{diag()}")


def test_colocated_training_two_ranks(cluster, tmp_path):
    env = _job_env(tmp_path, CONFIG=TRAIN_CONFIG, NPROC_PER_NODE="2",
                   OVERRIDES=" ".join(TRAIN_OVERRIDES + [f"logging.dir={tmp_path / 'run'}"]))
    batch_out = tmp_path / "batch.out"
    t0 = time.monotonic()
    r = cluster.run(["sbatch", "--wait", "--parsable", "--nodes=1", f"--output={batch_out}", str(COLOCATED)],
                    cwd=ROOT, env=env, timeout=150, check=False)
    elapsed = time.monotonic() - t0
    logs = tmp_path / "logs"
    node_log = logs / f"learner-{cluster.host}.log"
    diag = (f"sbatch rc {r.returncode}\n{r.stdout}\n{r.stderr}\n--- batch output\n{_read(batch_out)}\n"
            f"--- {node_log.name}\n{_read(node_log)[-6000:]}\n{cluster.daemon_logs()}")
    assert r.returncode == 0, diag
    print(f"\n[slurm] colocated job (sbatch --wait) {elapsed:.1f} s")
    text = _read(node_log)
    assert f"node {cluster.host} rank 0 of 1, 2 processes" in text, diag
    assert "[default0]:" in text, diag  # torchrun --tee prefixes every rank's console lines
    # torchrun's per-rank files: one directory per local rank under LOG_DIR/torchrun/<node>/<run>/attempt_0/
    rank_dirs = sorted(p.name for p in (logs / "torchrun" / cluster.host).glob("*/attempt_0/*") if p.is_dir())
    assert rank_dirs == ["0", "1"], (rank_dirs, diag)
    assert "learners exited with code 0" in _read(batch_out), diag
    assert "step 1/1 | reward" in text, diag  # the RL trainer's console line


TERM_WORKER = """\
import os, signal, sys, time
out = sys.argv[1]
rank = os.environ["RANK"]
def on_term(sig, frame):
    with open(os.path.join(out, f"term-{rank}"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(out, f"ready-{rank}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.parametrize("via", ["steps", "batch_trap"])
def test_sigterm_reaches_ranks(cluster, tmp_path, via):
    """`scancel --signal=TERM` (all steps) and `scancel --batch --signal=TERM` (the batch shell, whose trap
    forwards it) both run every rank's TERM handler."""
    worker = tmp_path / "term_worker.py"
    worker.write_text(TERM_WORKER)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = _job_env(tmp_path, CONFIG=TRAIN_CONFIG, NPROC_PER_NODE="2", TRAIN_ENTRY=f"{worker} {marks}",
                   SHUTDOWN_TIMEOUT="20")
    batch_out = tmp_path / "batch.out"
    r = cluster.run(["sbatch", "--parsable", "--nodes=1", f"--output={batch_out}", str(COLOCATED)],
                    cwd=ROOT, env=env, timeout=30)
    job = r.stdout.strip().split(";")[0]
    node_log = tmp_path / "logs" / f"learner-{cluster.host}.log"

    def diag():
        return (f"marks {sorted(os.listdir(marks))}\n--- batch output\n{_read(batch_out)}\n--- node log\n"
                f"{_read(node_log)[-4000:]}\n{cluster.daemon_logs()}")

    try:
        _wait_for(lambda: {"ready-0", "ready-1"} <= set(os.listdir(marks)), 60, "both ranks to start", diag)
        cmd = ["scancel", "--signal=TERM", job] if via == "steps" else ["scancel", "--batch", "--signal=TERM", job]
        cluster.run(cmd)
        _wait_for(lambda: {"term-0", "term-1"} <= set(os.listdir(marks)), 20, "both ranks' TERM handlers", diag)
        _wait_for(lambda: cluster.job_state(job) not in ("PENDING", "RUNNING", "COMPLETING"), 40,
                  "the job to end", diag)
    finally:
        cluster.run(["scancel", "--full", job], check=False)
    if via == "batch_trap":
        assert "forwarding TERM to all job steps" in _read(batch_out), diag()


def _dry_run(script: Path, hosts: str, **env) -> list[list[str]]:
    e = clean_env({"DRY_RUN": "1", "RLPO_HOSTNAMES": hosts, "SLURM_JOB_ID": "4242", "RLPO_ROOT": str(ROOT),
                   "PYTHON": "python3", "LOG_DIR": "/logs", **env})
    r = subprocess.run(["bash", str(script)], env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr + r.stdout
    return [shlex.split(line[2:]) for line in r.stdout.splitlines() if line.startswith("+ ")]


def _flag(cmd: list[str], name: str) -> str:
    for tok in cmd:
        if tok.startswith(name + "="):
            return tok.split("=", 1)[1]
    i = cmd.index(name)
    return cmd[i + 1]


def test_disaggregated_dry_run_commands():
    cmds = _dry_run(DISAGG, "node-a node-b node-c", LEARNER_NODES="2", ROLLOUT_NODES="1", NPROC_PER_NODE="8",
                    CONFIG="configs/demo_cpu.yaml", OVERRIDES="parallel.expert=8 train_iters=5",
                    SGLANG_MODEL="/models/qwen3-moe", SGLANG_TP="4", SERVERS_PER_NODE="2",
                    SGLANG_ARGS="--enable-return-routed-experts")
    kinds = [c[0] if c[0] != "python3" else "torchrun" for c in cmds]
    assert kinds == ["srun", "srun", "rlpo_wait_health", "rlpo_wait_health", "srun", "torchrun", "torchrun",
                     "rlpo_stop"], cmds
    servers, health, learners, trs = cmds[0:2], cmds[2:4], cmds[4], cmds[5:7]
    for k, s in enumerate(servers):
        assert _flag(s, "--nodelist") == "node-c" and _flag(s, "--nodes") == "1", s
        assert _flag(s, "--output") == f"/logs/rollout-%N-{k}.log"
        assert s[-1] == "&"
        i = s.index("-m")
        assert s[i - 1:i + 2] == ["python3", "-m", "sglang.launch_server"], s
        assert _flag(s, "--model-path") == "/models/qwen3-moe" and _flag(s, "--tp-size") == "4"
        assert _flag(s, "--port") == str(30000 + k) and _flag(s, "--base-gpu-id") == str(4 * k)
        assert "--enable-return-routed-experts" in s
    assert [h[1:] for h in health] == [["http://node-c:30000/health", "900"], ["http://node-c:30001/health", "900"]]
    assert _flag(learners, "--nodelist") == "node-a,node-b" and _flag(learners, "--nodes") == "2"
    assert _flag(learners, "--ntasks-per-node") == "1" and _flag(learners, "--output") == "/logs/learner-%N.log"
    assert "MASTER_ADDR=node-a" in learners and "NNODES=2" in learners and "NPROC_PER_NODE=8" in learners
    tail = learners[learners.index("-m"):-1]
    assert tail == ["-m", "rlpo_mega.cli", "train", "configs/demo_cpu.yaml", "parallel.expert=8", "train_iters=5",
                    "rollout.engine=sglang", "rollout.sglang.urls=[http://node-c:30000,http://node-c:30001]"]
    for rank, (node, t) in enumerate(zip(["node-a", "node-b"], trs)):
        assert t[1:3] == ["-m", "torch.distributed.run"], t
        assert _flag(t, "--nnodes") == "2" and _flag(t, "--nproc-per-node") == "8"
        assert _flag(t, "--node-rank") == str(rank) and _flag(t, "--master-addr") == "node-a"
        assert _flag(t, "--master-port") == str(20000 + 4242) and _flag(t, "--log-dir") == f"/logs/torchrun/{node}"
        assert t[t.index("-m", 3):] == tail


def test_disaggregated_rejects_bad_split():
    e = clean_env({"DRY_RUN": "1", "RLPO_HOSTNAMES": "node-a node-b", "LEARNER_NODES": "2", "ROLLOUT_NODES": "1",
                   "CONFIG": "c.yaml", "SGLANG_MODEL": "m", "RLPO_ROOT": str(ROOT)})
    r = subprocess.run(["bash", str(DISAGG)], env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "LEARNER_NODES" in r.stderr, r.stderr


def test_colocated_dry_run_two_nodes():
    cmds = _dry_run(COLOCATED, "gpu-01 gpu-02", NPROC_PER_NODE="8", CONFIG="configs/demo_cpu.yaml",
                    OVERRIDES="parallel.expert=16")
    assert len(cmds) == 3, cmds
    srun, t0, t1 = cmds
    assert srun[0] == "srun" and _flag(srun, "--nodelist") == "gpu-01,gpu-02" and _flag(srun, "--ntasks") == "2"
    assert [_flag(t, "--node-rank") for t in (t0, t1)] == ["0", "1"]
    assert {_flag(t, "--master-addr") for t in (t0, t1)} == {"gpu-01"}
    assert t0[-5:] == ["-m", "rlpo_mega.cli", "train", "configs/demo_cpu.yaml", "parallel.expert=16"]
    assert re.fullmatch(r"\d+", _flag(t0, "--shutdown-timeout"))
