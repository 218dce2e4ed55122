"""launch/slurm on a real single-node SLURM (tests/slurm_support.py, 4 fake GPUs), plus the scripts' commands.

- train_colocated.sbatch runs the real `rlpo-mega train` (1 node, 2 ranks) with `sbatch --wait`;
- SIGTERM reaches every rank, both directly (`scancel --signal=TERM`) and through the batch shell's trap
  (`scancel --batch --signal=TERM`, what `#SBATCH --signal=B:TERM@600` delivers before the time limit);
- train_disaggregated.sbatch: its server steps run concurrently, each with its own CPUs and fake GPUs
  (stand-in servers); and the real thing: one learner step (2 ranks) and two CPU SGLang server steps on
  the one node, 2 RL steps with sglang_distributed weight syncs (skipped without the SGLang venv);
- both scripts under DRY_RUN=1 for made-up node lists, and launch/sglang_server.py's flag pass-through;
- without SLURM (tests/fake_slurm.py as srun, squeue, scancel; what it models is in its docstring): both
  scripts' dry-run commands replayed in order under each way of submitting GPUs (`--gpus-per-node=8`,
  `--gres=gpu:8`, `--gpus=16`): every step gets exactly its own GPUs; CUDA_DEVICE_MAX_CONNECTIONS reaches the
  learners only; and a stop signal to the batch shell reaches the learners first, the servers once the learner
  step has ended, with the learners' exit code as the job's.
The SLURM tests skip (with the reason) only when slurm-wlm/munge are absent and cannot be apt-installed.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch.sglang_server import SGLangServer, server_args_to_cli
from tests.slurm_support import (SUBMIT_STYLES, FakeSlurm, clean_env, install_time, slurm_cluster,
                                 slurm_unavailable)
from tests.test_sglang import FAMILIES, SERVER_ARGS, SUPPORT, sglang_python  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent
COLOCATED = ROOT / "launch" / "slurm" / "train_colocated.sbatch"
DISAGG = ROOT / "launch" / "slurm" / "train_disaggregated.sbatch"

# The short real run at a 2-process layout (the trainer is being rewritten: change these two if its keys move).
TRAIN_CONFIG = "configs/demo_cpu.yaml"
TRAIN_OVERRIDES = ["parallel.expert=2", "train_iters=1", "trainer.warmup.steps=2", "trainer.eval_every=0",
                   "checkpoint.save_dir=null", "logging.mode=disabled", "logging.plot=false"]
FAKE_GPUS = 4  # the test cluster's gres/gpu (device files on /dev/null): allocation only


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
    with slurm_cluster(root, gpus=FAKE_GPUS) as c:
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
        assert "batch shell got TERM: TERM to the learner step only" in _read(batch_out), diag()


def _free_ports(n: int) -> int:
    """A first port p with p .. p+n-1 free (server k of a node listens on SGLANG_PORT+k)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            p = s.getsockname()[1]
        if p + n > 65535:
            continue
        socks = []
        try:
            for q in range(p, p + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("", q))
            return p
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no {n} consecutive free ports")


FAKE_SERVER = """\
import argparse, http.server, json, os, signal, sys, time
p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
a, _ = p.parse_known_args()
out = os.environ["FAKE_SGLANG_OUT"]
healthy = 200 if os.environ.get("FAKE_SGLANG_HEALTH", "200") == "200" else 503
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(healthy if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
srv = http.server.HTTPServer(("0.0.0.0", a.port), Health)
def on_term(sig, frame):
    with open(os.path.join(out, f"stopped-{a.port}"), "w") as f:
        f.write(repr(time.time()))
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
rec = {"argv": sys.argv[1:], "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "step": os.environ.get("SLURM_STEP_ID"),
       "cpus_per_task": os.environ.get("SLURM_CPUS_PER_TASK"), "start": time.time(),
       "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
       "cmdline": open("/proc/self/cmdline").read().split("\\0")}
with open(os.path.join(out, f"server-{a.port}.json"), "w") as f:
    json.dump(rec, f)
srv.serve_forever()
"""

FAKE_LEARNER = """\
import json, os, sys, urllib.request
out, overrides = sys.argv[1], sys.argv[2:]
urls = [o.split("=", 1)[1].strip("[]").split(",") for o in overrides if o.startswith("rollout.sglang.urls=")][0]
health = []
for u in urls:
    with urllib.request.urlopen(u + "/health", timeout=10) as r:
        health.append(r.status)
with open(os.path.join(out, "learner.json"), "w") as f:
    json.dump({"overrides": overrides, "health": health, "seen": sorted(os.listdir(out))}, f)
"""


def test_disaggregated_server_steps_own_resources(cluster, tmp_path):
    """Two server steps on one node run at the same time, each holding its own CPU and SGLANG_TP fake GPUs
    (disjoint CUDA_VISIBLE_DEVICES, no --base-gpu-id), with the learner step beside them (--overlap); the
    learner gets their URLs, and the servers get TERM when it is done. Stand-in servers and learner."""
    (tmp_path / "fake_sglang.py").write_text(FAKE_SERVER)
    learner = tmp_path / "fake_learner.py"
    learner.write_text(FAKE_LEARNER)
    out = tmp_path / "out"
    out.mkdir()
    port = _free_ports(2)
    env = _job_env(tmp_path, LEARNER_NODES="1", ROLLOUT_ON_LEARNER_NODES="1", SERVERS_PER_NODE="2", SGLANG_TP="2",
                   SGLANG_MODEL="/no/model", SGLANG_LAUNCHER="fake_sglang", SGLANG_PORT=str(port),
                   SGLANG_ENV=f"PYTHONPATH={tmp_path} FAKE_SGLANG_OUT={out}", SGLANG_STARTUP_TIMEOUT="60",
                   NPROC_PER_NODE="1", TRAIN_ENTRY=f"{learner} {out}", MASTER_PORT=str(_free_ports(1)))
    batch_out = tmp_path / "batch.out"
    r = cluster.run(["sbatch", "--wait", "--parsable", "--nodes=1", "--exclusive", f"--gpus-per-node={FAKE_GPUS}",
                     f"--output={batch_out}", str(DISAGG)], cwd=ROOT, env=env, timeout=120, check=False)
    logs = tmp_path / "logs"
    diag = (f"sbatch rc {r.returncode}\n{r.stdout}\n{r.stderr}\n--- batch output\n{_read(batch_out)}\n"
            + "\n".join(f"--- {p.name}\n{_read(p)[-3000:]}" for p in sorted(logs.glob("*.log")))
            + f"\nout: {sorted(os.listdir(out))}\n{cluster.daemon_logs()}")
    assert r.returncode == 0, diag
    servers = [json.loads((out / f"server-{port + k}.json").read_text()) for k in range(2)]
    gpus = [set(s["cuda"].split(",")) for s in servers]
    assert all(len(g) == 2 for g in gpus) and not gpus[0] & gpus[1], (gpus, diag)
    assert gpus[0] | gpus[1] <= {str(i) for i in range(FAKE_GPUS)}, gpus
    assert [s["cpus_per_task"] for s in servers] == ["1", "1"], servers  # 2 CPUs / 2 servers
    assert servers[0]["step"] != servers[1]["step"], servers
    assert not any("--base-gpu-id" in s["argv"] for s in servers), servers
    seen = json.loads((out / "learner.json").read_text())
    assert seen["health"] == [200, 200], seen  # both servers up together, while the learner ran
    assert seen["overrides"] == ["rollout.engine=sglang",
                                 f"rollout.sglang.urls=[http://{cluster.host}:{port},http://{cluster.host}:{port + 1}]",
                                 "rollout.sglang.tp_size=2"]  # SGLANG_TP: the client checks it against the servers
    _wait_for(lambda: {f"stopped-{port}", f"stopped-{port + 1}"} <= set(os.listdir(out)), 10,
              "the servers' TERM handlers", lambda: diag)
    assert "learners exited with code 0; stopping the rollout servers" in _read(batch_out), diag


@pytest.mark.timeout(900)
def test_disaggregated_sglang_training(cluster, tmp_path, sglang_python):  # noqa: F811  (the fixture)
    """train_disaggregated.sbatch for real on the one node: two CPU SGLang server steps (launch.sglang_server
    from the SGLang venv, tests/test_sglang.py's recipe) started concurrently, then the learner step (2 ranks,
    EP2, the demo config shrunk, GSPO + R3) rolling out on both for 2 RL steps with sglang_distributed weight
    syncs (each digest-verified inside the servers); the servers are stopped with TERM at the end. The servers are
    keyed as the job starts them (its key made by the batch shell, never on a command line): while the job runs,
    requests without the key, or with another, are refused (401) on generation and on every control endpoint the
    project calls, /health and /ready stay open (SGLang's rule), and the learners train with the key."""
    from moe.model import load_hf_config
    from tests.workers.bridge import make_hf_checkpoint

    hf = tmp_path / "hf"
    make_hf_checkpoint(load_hf_config(str(ROOT / FAMILIES["qwen3_moe"])), str(hf))
    run = tmp_path / "run"
    port = _free_ports(2)
    # TRAIN_OVERRIDES' 2 warm-up steps (at lr 1e-2) move the policy away from the servers' checkpoint before
    # RL: the first sync must change what both servers hold, or step 1's log-probs disagree with theirs
    overrides = TRAIN_OVERRIDES + [
        "train_iters=2", "trainer.warmup.lr=1e-2", f"model.init_from_hf={hf}",
        "rollout.sync_transport=sglang_distributed", "prompts.prompts_per_step=4", "prompts.n_samples=2",
        "rollout.sglang.request_timeout=300", f"logging.dir={run}"]
    env = _job_env(tmp_path, CONFIG=TRAIN_CONFIG, NPROC_PER_NODE="2", OVERRIDES=" ".join(overrides),
                   LEARNER_NODES="1", ROLLOUT_ON_LEARNER_NODES="1", SERVERS_PER_NODE="2", SGLANG_GPUS_PER_SERVER="0",
                   SGLANG_MODEL=str(hf), SGLANG_PYTHON=sglang_python, SGLANG_PORT=str(port),
                   SGLANG_ENV=f"SGLANG_USE_CPU_ENGINE=1 TORCHDYNAMO_DISABLE=1 PYTHONPATH={os.path.join(SUPPORT, 'path')}",
                   SGLANG_ARGS=" ".join(server_args_to_cli(SERVER_ARGS)), SGLANG_STARTUP_TIMEOUT="400",
                   MASTER_PORT=str(_free_ports(1)))
    batch_out = tmp_path / "batch.out"
    urls = [f"http://{cluster.host}:{port + k}" for k in range(2)]
    probed: dict = {}
    stop = threading.Event()
    prober = threading.Thread(target=_probe_keyed_servers, args=(urls, batch_out, probed, stop), daemon=True)
    prober.start()
    t0 = time.monotonic()
    try:
        r = cluster.run(["sbatch", "--wait", "--parsable", "--nodes=1", "--exclusive", f"--output={batch_out}",
                         str(DISAGG)], cwd=ROOT, env=env, timeout=840, check=False)
    finally:
        stop.set()
        prober.join(60)
    elapsed = time.monotonic() - t0
    logs = tmp_path / "logs"
    learner_log = logs / f"learner-{cluster.host}.log"
    diag = (f"sbatch rc {r.returncode} after {elapsed:.0f} s\n{r.stdout}\n{r.stderr}\n--- batch output\n"
            f"{_read(batch_out)}\n--- {learner_log.name}\n{_read(learner_log)[-8000:]}\n"
            + "\n".join(f"--- {p.name}\n{_read(p)[-3000:]}" for p in sorted(logs.glob("*-*-*.log")))
            + f"\n{cluster.daemon_logs()}")
    assert r.returncode == 0, diag
    print(f"\n[slurm] disaggregated job, 2 SGLang server steps + 2 learner ranks, 2 RL steps: {elapsed:.1f} s")
    out = _read(batch_out)
    assert all(f"healthy: {u}" in out for u in urls), diag
    # the servers as the job ran them: keyed, the key on none of their command lines
    assert set(probed) == set(urls) and "error" not in probed, (probed, diag)
    for url, got in probed.items():
        assert got["open"] == {"/health": 200, "/ready": 200}, (url, got)
        assert set(got["refused"].values()) == {(401, 401)}, (url, got)
        assert not got["key_on_command_line"], (url, got)
    assert (logs.stat().st_mode & 0o777) == 0o700 and all(
        (p.stat().st_mode & 0o077) == 0 for p in logs.glob("sglang-*.log")), [oct(p.stat().st_mode) for p in
                                                                                logs.glob("*.log")]
    assert "learners exited with code 0; stopping the rollout servers" in out, diag
    text = _read(learner_log)
    assert "step 2/2 | reward" in text, diag
    # each server step ran launch.sglang_server (started once): the digest hook's loader on its command line;
    # the weight group was set up once, and every sync's broadcast was followed by the in-server digest
    # report (update_weights_from_tensor with the hook's load format): at the start and after each step
    cmd = SGLangServer(str(hf)).command()
    hook_loaders = list(itertools.takewhile(lambda t: not t.startswith("--"),
                                            cmd[cmd.index("--custom-weight-loader") + 1:]))
    for k in range(2):
        server_log = _read(logs / f"sglang-{cluster.host}-{k}.log")
        started = [line for line in server_log.splitlines() if line.startswith("=== ")]
        assert len(started) == 1 and all(f" {t} " in started[0] + " " for t in hook_loaders), diag
        assert "SGLang server ready" in _read(logs / f"rollout-{cluster.host}-{k}.log"), diag
        calls = {path: server_log.count(f'"POST /{path} HTTP/1.1" 200') for path in
                 ("init_weights_update_group", "update_weights_from_distributed", "update_weights_from_tensor")}
        assert calls["init_weights_update_group"] == 1, (calls, diag)
        assert calls["update_weights_from_distributed"] == calls["update_weights_from_tensor"] >= 2, (calls, diag)
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2], history
    for h in history:  # step 2 rolls out on both servers from the weights synced after step 1
        assert h["routing/update/fallback_entries"] == 0, h  # every token replayed SGLang's routes
        # the learner's log-probs of the servers' samples equal theirs (fp32): at step 2 only if the weights
        # synced over sglang_distributed took effect on both servers
        assert h["mismatch/ratio_dev_max"] < 1e-4 and h["mismatch/k3_kl"] < 1e-8, h


def _probe_keyed_servers(urls, batch_out: Path, probed: dict, stop: threading.Event):
    """Once the batch shell has seen every server healthy (and before the learners are done), each URL: every
    endpoint the project calls without a key and with another key (their statuses), /health and /ready without
    one, and whether any process's command line holds an --api-key."""
    from tests.test_server_keys import CONTROL, NORMAL, OTHER, http_status as status

    try:
        while not all(f"healthy: {u}" in _read(batch_out) for u in urls):
            if stop.wait(1.0):
                return
        for url in urls:
            probed[url] = {"refused": {p: (status(url, p), status(url, p, "Bearer " + OTHER)) for p in NORMAL + CONTROL},
                           "open": {p: status(url, p) for p in ("/health", "/ready")}}
        on_cmdline = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"--api-key" in f.read():
                        on_cmdline.append(pid)
            except OSError:
                pass
        for url in urls:
            probed[url]["key_on_command_line"] = on_cmdline
    except Exception as e:  # reported by the test
        probed["error"] = repr(e)


def _dry_run(script: Path, hosts: str, base_env=None, **env) -> list[list[str]]:
    e = dict(base_env) if base_env is not None else clean_env()
    e.update({"DRY_RUN": "1", "RLPO_HOSTNAMES": hosts, "SLURM_JOB_ID": "4242", "RLPO_ROOT": str(ROOT),
              "PYTHON": "python3", "LOG_DIR": "/logs", **env})
    r = subprocess.run(["bash", str(script)], env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr + r.stdout
    return [shlex.split(line[2:]) for line in r.stdout.splitlines() if line.startswith("+ ")]


def _srun_at(cmd: list[str]) -> int:
    """Where `srun` starts in a printed command (after an `env -u NAME ... NAME=VALUE` prefix), else -1."""
    if cmd[:1] == ["srun"]:
        return 0
    if cmd[:1] == ["env"]:
        i = 1
        while i < len(cmd) and (cmd[i] == "-u" or cmd[i - 1] == "-u" or "=" in cmd[i]):
            i += 1
        return i if cmd[i:i + 1] == ["srun"] else -1
    return -1


def _kind(cmd: list[str]) -> str:
    return "srun" if _srun_at(cmd) >= 0 else ("torchrun" if cmd[0] == "python3" else cmd[0])


def _flag(cmd: list[str], name: str) -> str:
    for tok in cmd:
        if tok.startswith(name + "="):
            return tok.split("=", 1)[1]
    i = cmd.index(name)
    return cmd[i + 1]


KEY_SHIM = str(ROOT / "launch" / "rlpo_sglang_keys.py")


def _server_command(cmd: list[str]) -> list[str]:
    """What a server step runs (after srun's flags and the optional `env K=V ...`): `PYTHON -m launch.sglang_server
    ...`, or `PYTHON launch/rlpo_sglang_keys.py MODULE ...` (any other launcher, through the key shim)."""
    i = (cmd.index(KEY_SHIM) if KEY_SHIM in cmd else cmd.index("-m")) - 1
    return cmd[i:-1] if cmd[-1] == "&" else cmd[i:]


def test_disaggregated_dry_run_commands():
    cmds = _dry_run(DISAGG, "node-a node-b node-c", LEARNER_NODES="2", ROLLOUT_NODES="1", NPROC_PER_NODE="8",
                    CONFIG="configs/demo_cpu.yaml", OVERRIDES="parallel.expert=8 train_iters=5",
                    SGLANG_MODEL="/models/qwen3-moe", SGLANG_TP="4", SERVERS_PER_NODE="2",
                    SGLANG_PYTHON="/opt/sglang/bin/python", SGLANG_ENV="SGLANG_FLAG=1 OTHER=x y",
                    SGLANG_ARGS="--enable-return-routed-experts --mem-fraction-static 0.8",
                    SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="96")
    kinds = [_kind(c) for c in cmds]
    # per server: its srun step, then (dry run only) the sglang command launch.sglang_server would run there
    assert kinds == ["srun", "/opt/sglang/bin/python", "srun", "/opt/sglang/bin/python", "rlpo_wait_health",
                     "rlpo_wait_health", "srun", "torchrun", "torchrun", "rlpo_stop_steps"], cmds
    servers, inner, health = cmds[0:4:2], cmds[1:4:2], cmds[4:6]
    learners, trs = cmds[6], cmds[7:9]
    for k, (s, sg) in enumerate(zip(servers, inner)):
        assert s[-1] == "&"
        # its own resources: 96 CPUs / 2 servers, SGLANG_TP GPUs, the job's memory without taking it
        assert _flag(s, "--nodelist") == "node-c" and _flag(s, "--nodes") == "1" and _flag(s, "--ntasks") == "1"
        assert "--exact" in s and _flag(s, "--cpus-per-task") == "48" and _flag(s, "--gres") == "gpu:4"
        assert _flag(s, "--mem") == "0" and "--overlap" not in s
        assert _flag(s, "--job-name") == f"rlpo-sglang-node-c-{k}"  # the step's name: stopped with TERM by it
        assert _flag(s, "--output") == f"/logs/rollout-%N-{k}.log"
        i = s.index("env")
        assert s[i:i + 4] == ["env", "SGLANG_FLAG=1", "OTHER=x", "y"], s  # SGLANG_ENV: the server steps only
        launcher = _server_command(s)
        assert launcher[:3] == ["/opt/sglang/bin/python", "-m", "launch.sglang_server"], s
        assert _flag(launcher, "--model-path") == "/models/qwen3-moe" and _flag(launcher, "--tp-size") == "4"
        assert _flag(launcher, "--port") == str(30000 + k) and _flag(launcher, "--host") == "0.0.0.0"
        assert _flag(launcher, "--log-file") == f"/logs/sglang-node-c-{k}.log"
        assert _flag(launcher, "--timeout") == "900"
        assert "--base-gpu-id" not in s  # the step sees only its own GPUs: base 0
        assert launcher[-3:] == ["--enable-return-routed-experts", "--mem-fraction-static", "0.8"]
        # the server command is SGLangServer's own (weight-digest loader included) plus the passed flags
        want = SGLangServer("/models/qwen3-moe", "0.0.0.0", 30000 + k, 4, python="/opt/sglang/bin/python").command()
        assert sg == want + ["--enable-return-routed-experts", "--mem-fraction-static", "0.8"], (sg, want)
    assert [h[1:] for h in health] == [["http://node-c:30000/health", "900"], ["http://node-c:30001/health", "900"]]
    assert _flag(learners, "--nodelist") == "node-a,node-b" and _flag(learners, "--nodes") == "2"
    assert _flag(learners, "--ntasks-per-node") == "1" and _flag(learners, "--output") == "/logs/learner-%N.log"
    assert "--overlap" not in learners
    assert "MASTER_ADDR=node-a" in learners and "NNODES=2" in learners and "NPROC_PER_NODE=8" in learners
    tail = learners[learners.index("-m"):-1]
    assert tail == ["-m", "rlpo_mega.cli", "train", "configs/demo_cpu.yaml", "parallel.expert=8", "train_iters=5",
                    "rollout.engine=sglang", "rollout.sglang.urls=[http://node-c:30000,http://node-c:30001]",
                    "rollout.sglang.tp_size=4"]
    for rank, (node, t) in enumerate(zip(["node-a", "node-b"], trs)):
        assert t[1:4] == ["-m", "rlpo_mega.cli", "torchrun"], t  # torchrun under rlpo-mega's agent: a stop exits 75
        assert _flag(t, "--nnodes") == "2" and _flag(t, "--nproc-per-node") == "8"
        assert _flag(t, "--node-rank") == str(rank) and _flag(t, "--master-addr") == "node-a"
        assert _flag(t, "--master-port") == str(20000 + 4242) and _flag(t, "--log-dir") == f"/logs/torchrun/{node}"
        assert t[t.index("-m", 3):] == tail


def test_disaggregated_dry_run_shared_node_cpu():
    """ROLLOUT_ON_LEARNER_NODES=1 on a CPU job: servers on the learner node, no GPU request, the learner step
    overlaps them; a bare sglang.launch_server gets the flags unchanged, through the key shim (which adds the job's
    key inside the server's process)."""
    cmds = _dry_run(DISAGG, "node-a", LEARNER_NODES="1", ROLLOUT_ON_LEARNER_NODES="1", NPROC_PER_NODE="2",
                    CONFIG="c.yaml", SGLANG_MODEL="/m", SERVERS_PER_NODE="2", SLURM_CPUS_ON_NODE="2",
                    SGLANG_LAUNCHER="sglang.launch_server", SGLANG_ARGS="--device cpu")
    kinds = [_kind(c) for c in cmds]
    assert kinds == ["srun", "srun", "rlpo_wait_health", "rlpo_wait_health", "srun", "torchrun", "rlpo_stop_steps"], cmds
    for k, s in enumerate(cmds[:2]):
        assert _flag(s, "--nodelist") == "node-a" and _flag(s, "--cpus-per-task") == "1" and "--exact" in s
        assert not any(t.startswith("--gres") for t in s) and "env" not in s
        assert _server_command(s) == ["python3", KEY_SHIM, "sglang.launch_server", "--model-path", "/m", "--host",
                                      "0.0.0.0", "--port", str(30000 + k), "--tp-size", "1", "--device", "cpu"]
    learners = cmds[4]
    assert _flag(learners, "--nodelist") == "node-a" and "--overlap" in learners
    assert learners[-4:-1] == ["rollout.engine=sglang", "rollout.sglang.urls=[http://node-a:30000,http://node-a:30001]",
                               "rollout.sglang.tp_size=1"]


@pytest.mark.parametrize("script", [DISAGG, COLOCATED])
def test_dry_runs_never_print_the_key(script):
    """The job's key (RLPO_SGLANG_KEY, given or made by common.sh) reaches every step through the environment: no
    printed command holds it, nor any --api-key flag (launch.sglang_server and the shim add it inside the server)."""
    key = "dry-run-job-key-" + "x" * 32
    e = clean_env({"DRY_RUN": "1", "RLPO_HOSTNAMES": "node-a node-b", "LEARNER_NODES": "1", "CONFIG": "c.yaml",
                   "SGLANG_MODEL": "/m", "RLPO_ROOT": str(ROOT), "PYTHON": "python3", "LOG_DIR": "/logs",
                   "RLPO_SGLANG_KEY": key, "SLURM_JOB_ID": "4242"})
    for launcher in ("launch.sglang_server", "sglang.launch_server"):
        r = subprocess.run(["bash", str(script)], env={**e, "SGLANG_LAUNCHER": launcher}, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert key not in r.stdout + r.stderr and "--api-key" not in r.stdout + r.stderr, r.stdout


def test_disaggregated_rejects_bad_split():
    e = clean_env({"DRY_RUN": "1", "RLPO_HOSTNAMES": "node-a node-b", "LEARNER_NODES": "2", "ROLLOUT_NODES": "1",
                   "CONFIG": "c.yaml", "SGLANG_MODEL": "m", "RLPO_ROOT": str(ROOT)})
    r = subprocess.run(["bash", str(DISAGG)], env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "LEARNER_NODES" in r.stderr, r.stderr
    e.update(ROLLOUT_ON_LEARNER_NODES="1", LEARNER_NODES="1", ROLLOUT_NODES="2")  # more rollout than learner nodes
    r = subprocess.run(["bash", str(DISAGG)], env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "ROLLOUT_ON_LEARNER_NODES" in r.stderr, r.stderr


def test_sglang_server_cli_passes_flags_through():
    """launch/sglang_server.py: flags it does not know reach sglang.launch_server in their order (also after
    `--`); extra weight loaders are merged with the digest hook's, not replaced by it."""
    script = ROOT / "launch" / "sglang_server.py"
    r = subprocess.run([sys.executable, str(script), "--model-path", "/m", "--port", "31000", "--base-gpu-id", "2",
                        "--custom-weight-loader", "my.loader", "--enable-return-routed-experts",
                        "--random-seed", "-1", "--", "--mem-fraction-static", "0.8", "--python", "/venv/bin/python",
                        "--dry-run"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout.strip()[2:])
    want = SGLangServer("/m", port=31000, python="/venv/bin/python",
                        server_args={"custom_weight_loader": ["my.loader"]}).command()
    assert cmd == want + ["--base-gpu-id", "2", "--enable-return-routed-experts", "--random-seed", "-1",
                          "--mem-fraction-static", "0.8"], (cmd, want)
    loaders = cmd[cmd.index("--custom-weight-loader") + 1:cmd.index("--base-gpu-id")]
    assert "my.loader" in loaders and len(loaders) >= 2, loaders  # ours and the hook's


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


# -- without SLURM: tests/fake_slurm.py ---------------------------------------------------------------------
def _replay(fake: FakeSlurm, env: dict, cmds: list[list[str]]) -> list[dict]:
    """Run a dry run's srun steps, in its order, through the fake srun with FAKE_SRUN_NOEXEC=1 (each step takes
    its GPUs and keeps them, as a server does while the learners start); the steps as it recorded them."""
    steps = [c[:-1] if c[-1] == "&" else c for c in cmds if _srun_at(c) >= 0]
    for c in steps:
        r = subprocess.run(c, env=dict(env, FAKE_SRUN_NOEXEC="1"), capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, (c, r.stderr)
    recorded = fake.steps()
    assert len(recorded) == len(steps), recorded
    return recorded


def _no_shared_gpus(steps: list[dict]) -> None:
    held: dict = {}
    for s in steps:
        for node, gpus in s["gpus"].items():
            for g in gpus:
                assert (node, g) not in held, f"GPU {g} of {node}: steps {held[(node, g)]} and {s['name']}"
                held[(node, g)] = s["name"]


@pytest.mark.parametrize("style", SUBMIT_STYLES)
def test_disaggregated_steps_get_their_gpus(tmp_path, style):
    """Under sbatch --gpus-per-node=8, --gres=gpu:8 or --gpus=16 (2 nodes): each TP4 server step gets exactly
    its 4 GPUs (none shared), the learner step all 8 of its node; the steps' inherited GPU options are gone,
    so srun neither refuses the server steps' --gres nor asks the learner step for the job's 16."""
    fake = FakeSlurm(tmp_path, ["node-a", "node-b"], gpus_per_node=8)
    env = fake.batch_env(style, SLURM_CPUS_ON_NODE="96", SLURM_CPUS_PER_TASK="96", SLURM_TRES_PER_TASK="cpu=96")
    cmds = _dry_run(DISAGG, "node-a node-b", base_env=env, LEARNER_NODES="1", ROLLOUT_NODES="1", NPROC_PER_NODE="8",
                    CONFIG="c.yaml", SGLANG_MODEL="/m", SGLANG_TP="4", SERVERS_PER_NODE="2",
                    SGLANG_LAUNCHER="sglang.launch_server")
    steps = _replay(fake, env, cmds)
    servers, learners = steps[:2], steps[2]
    assert [s["name"] for s in servers] == ["rlpo-sglang-node-b-0", "rlpo-sglang-node-b-1"], servers
    assert [s["gpus"] for s in servers] == [{"node-b": [0, 1, 2, 3]}, {"node-b": [4, 5, 6, 7]}], servers
    assert learners["name"] == "rlpo-learner" and learners["gpus"] == {"node-a": list(range(8))}, learners
    _no_shared_gpus(steps)
    for s in servers:  # one GPU option, from the command line; nothing inherited
        assert s["options"]["gres"] == "gpu:4" and s["sources"]["gres"] == "cli", s["options"]
        assert not {"gpus", "gpus-per-node", "gpus-per-task"} & set(s["options"]), s["options"]
        assert s["task_env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, s["gpus"]["node-b"]))
    assert not {"gres", "gpus", "gpus-per-node", "gpus-per-task"} & set(learners["options"]), learners["options"]
    # the CPU request the job made stays with the steps (only GPU entries leave SLURM_TRES_PER_TASK)
    assert learners["options"]["tres-per-task"] == "cpu=96", learners["options"]


@pytest.mark.parametrize("style", SUBMIT_STYLES)
def test_colocated_steps_get_their_gpus(tmp_path, style):
    """The colocated learner step gets all 8 GPUs of both nodes whichever way the job asked for 16."""
    fake = FakeSlurm(tmp_path, ["gpu-01", "gpu-02"], gpus_per_node=8)
    env = fake.batch_env(style)
    cmds = _dry_run(COLOCATED, "gpu-01 gpu-02", base_env=env, NPROC_PER_NODE="8", CONFIG="c.yaml")
    (step,) = _replay(fake, env, cmds)
    assert step["name"] == "rlpo-learner", step
    assert step["gpus"] == {"gpu-01": list(range(8)), "gpu-02": list(range(8))}, step["gpus"]
    assert not {"gres", "gpus", "gpus-per-node"} & set(step["options"]), step["options"]
    assert step["task_env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_fake_srun_models_inherited_gpu_options(tmp_path):
    """What the server and learner steps met before they dropped the job's GPU options: srun reads
    SLURM_GPUS_PER_NODE as --gpus-per-node and refuses it beside --gres=gpu (Slurm 26.05+); an inherited
    --gpus=16 asks a one-node step for 16 GPUs. An explicit option wins over its own variable only, and
    --gpus on the command line drops an inherited SLURM_GPUS_PER_NODE."""
    fake = FakeSlurm(tmp_path, ["node-a", "node-b"], gpus_per_node=8)

    def srun(style, *args):
        env = dict(fake.batch_env(style), FAKE_SRUN_NOEXEC="1")
        return subprocess.run(["srun", *args, "true"], env=env, capture_output=True, text=True, timeout=30)

    r = srun("--gpus-per-node", "--nodes=1", "--nodelist=node-b", "--exact", "--gres=gpu:4")
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == "srun: fatal: --gpus-per-node and --gres=gpu are mutually exclusive."
    r = srun("--gpus", "--nodes=1", "--nodelist=node-b", "--exact", "--gres=gpu:4")
    assert r.returncode == 1 and "Requested node configuration is not available" in r.stderr, r.stderr
    r = srun("--gpus", "--nodes=1", "--nodelist=node-a")  # a learner step on one node of the two
    assert r.returncode == 1 and "16 GPUs asked on node-a, the job has 8" in r.stderr, r.stderr
    assert fake.steps() == []
    assert srun("--gpus-per-node", "--nodes=1", "--nodelist=node-b", "--gpus-per-node=2").returncode == 0
    assert srun("--gpus-per-node", "--nodes=1", "--nodelist=node-b", "--gpus=2").returncode == 0
    assert srun("--gres", "--nodes=1", "--nodelist=node-b", "--gres=gpu:2").returncode == 0
    assert [s["gpus"] for s in fake.steps()] == [{"node-b": [0, 1]}, {"node-b": [2, 3]}, {"node-b": [4, 5]}]
    r = srun("--gres", "--nodes=1", "--nodelist=node-b", "--gres=gpu:4")  # 2 left: real srun would wait
    assert r.returncode == 1 and "Requested nodes are busy" in r.stderr, r.stderr


@pytest.mark.parametrize("user_value", [None, "1"])
def test_cuda_device_max_connections_learners_only(tmp_path, user_value):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 reaches the learner step (Megatron-Core's overlap) and not the server
    steps, also when the user exported it before sbatch."""
    fake = FakeSlurm(tmp_path, ["node-a", "node-b"], gpus_per_node=8)
    extra = {} if user_value is None else {"CUDA_DEVICE_MAX_CONNECTIONS": user_value}
    env = fake.batch_env("--gpus-per-node", **extra)
    cmds = _dry_run(DISAGG, "node-a node-b", base_env=env, LEARNER_NODES="1", CONFIG="c.yaml", SGLANG_MODEL="/m",
                    SGLANG_TP="8", SGLANG_LAUNCHER="sglang.launch_server")
    server, learner = _replay(fake, env, cmds)
    assert learner["name"] == "rlpo-learner" and learner["task_env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert server["name"].startswith("rlpo-sglang-") and "CUDA_DEVICE_MAX_CONNECTIONS" not in server["task_env"]


STOP_LEARNER = """\
import json, os, signal, sys, time, urllib.request
out, overrides = sys.argv[1], sys.argv[2:]
urls = [o.split("=", 1)[1].strip("[]").split(",") for o in overrides if o.startswith("rollout.sglang.urls=")][0]
def on_term(sig, frame):
    rec = {"term": time.time(), "health": []}
    for u in urls:  # the last sync still reaches the servers
        try:
            with urllib.request.urlopen(u + "/health", timeout=5) as r:
                rec["health"].append(r.status)
        except OSError as e:
            rec["health"].append(str(e))
    time.sleep(0.3)  # the save
    rec["exit"] = time.time()
    with open(os.path.join(out, "learner-stop.json"), "w") as f:
        json.dump(rec, f)
    sys.exit(75)
signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(out, "learner-ready"), "w") as f:
    f.write(os.environ.get("RLPO_SGLANG_KEY", ""))
time.sleep(60)
sys.exit(3)
"""

# launch/torchrun.sh's `$PYTHON -m rlpo_mega.cli torchrun --flag=value... ENTRY...` without torchrun: the entry as
# the one rank, its exit code passed through (as rlpo-mega's agent does for a stop: tests/test_cli.py; this
# saves a torch import)
TORCHRUN_SHIM = """\
#!/bin/bash
if [[ "$1" == -m && "$2" == rlpo_mega.cli && "$3" == torchrun ]]; then
    shift 3
    while [[ "$1" == --* ]]; do shift; done
    RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 exec {python} "$@"
fi
exec {python} "$@"
"""


def _stop_job(tmp_path: Path, health: str = "200"):
    """train_disaggregated.sbatch run for real under the fake SLURM (2 stand-in servers on one node, the
    stand-in learner on the other; the node names are loopback addresses, so the URLs work here)."""
    (tmp_path / "fake_sglang.py").write_text(FAKE_SERVER)
    learner = tmp_path / "stop_learner.py"
    learner.write_text(STOP_LEARNER)
    shim = tmp_path / "python-torchrun"
    shim.write_text(TORCHRUN_SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    port = _free_ports(2)
    fake = FakeSlurm(tmp_path, ["127.0.0.2", "127.0.0.3"], gpus_per_node=2)
    env = fake.batch_env("--gpus-per-node", RLPO_ROOT=str(ROOT), LOG_DIR=str(tmp_path / "logs"), PYTHON=str(shim),
                         SGLANG_PYTHON=sys.executable, LEARNER_NODES="1", SERVERS_PER_NODE="2", SGLANG_TP="1",
                         SGLANG_MODEL="/no/model", SGLANG_LAUNCHER="fake_sglang", SGLANG_PORT=str(port),
                         SGLANG_ENV=f"PYTHONPATH={tmp_path} FAKE_SGLANG_OUT={out} FAKE_SGLANG_HEALTH={health}",
                         SGLANG_STARTUP_TIMEOUT="30", SGLANG_HEALTH_POLL="0.1", SGLANG_STOP_TIMEOUT="5",
                         TRAIN_ENTRY=f"{learner} {out}", PYTHONWARNINGS="ignore")
    (tmp_path / "logs").mkdir()
    batch_out = open(tmp_path / "batch.out", "w")
    batch = subprocess.Popen(["bash", str(DISAGG)], env=env, cwd=ROOT, stdout=batch_out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    batch_out.close()
    return fake, batch, out, port


def _diag(tmp_path: Path, fake: FakeSlurm, out: Path):
    logs = tmp_path / "logs"
    return lambda: (f"--- batch\n{_read(tmp_path / 'batch.out')}\n"
                    + "\n".join(f"--- {p.name}\n{_read(p)[-2000:]}" for p in sorted(logs.glob("*.log")))
                    + f"\nout: {sorted(os.listdir(out))}\nsignals: {fake.signals()}\n"
                    + "\n".join(f"step {s['id']} {s['name']} {s['state']} rc {s['rc']}" for s in fake.steps()))


def test_stop_reaches_learners_before_servers(tmp_path):
    """TERM to the batch shell (what `#SBATCH --signal=B:TERM@600` sends): TERM to the learner step only; the
    servers answer /health while the learners stop (their last sync), get TERM only after the learner step has
    ended, and the job exits with the learners' code (75: stopped and saved)."""
    fake, batch, out, port = _stop_job(tmp_path)
    diag = _diag(tmp_path, fake, out)
    try:
        _wait_for(lambda: (out / "learner-ready").exists(), 30, "the learner to start", diag)
        os.kill(batch.pid, signal.SIGTERM)
        rc = batch.wait(30)
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
        fake.cleanup()
    assert rc == 75, (rc, diag())
    steps = {s["name"]: s for s in fake.steps()}
    learner = steps["rlpo-learner"]
    assert learner["rc"] == 75 and not learner["killed_by_srun"], diag()
    sent = fake.signals()
    # the first TERM: the learner step alone; the next: the servers, after the learner step had ended
    assert sent[0]["signal"] == "TERM" and sent[0]["names"] == ["rlpo-learner"], sent
    assert sorted(sent[1]["names"]) == ["rlpo-sglang-127.0.0.3-0", "rlpo-sglang-127.0.0.3-1"], sent
    assert len(sent) == 2 and sent[1]["time"] >= learner["end"], (sent, learner["end"])
    stop = json.loads((out / "learner-stop.json").read_text())
    assert stop["health"] == [200, 200], stop  # both servers still up while the learner stopped
    for k in range(2):
        assert float((out / f"stopped-{port + k}").read_text()) > stop["exit"], diag()  # TERM handler ran
        assert json.loads((out / f"server-{port + k}.json").read_text())["max_connections"] is None
    text = _read(tmp_path / "batch.out")
    # the job's key: made by the batch shell, the same in the learner step and in both servers, where it reached
    # the server's own argv (the shim adds it in-process) and never a command line; nothing printed it
    key = (out / "learner-ready").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", key), key
    for k in range(2):
        server = json.loads((out / f"server-{port + k}.json").read_text())
        assert server["argv"][-2:] == [f"--api-key={key}", f"--admin-api-key={key}"], server["argv"]
        assert not any(key in t or t.startswith("--api-key") for t in server["cmdline"]), server["cmdline"]
    logs = tmp_path / "logs"
    assert (logs.stat().st_mode & 0o777) == 0o700, oct(logs.stat().st_mode)
    assert not any(key in _read(p) for p in [tmp_path / "batch.out", *logs.rglob("*.log")]), diag()
    assert "batch shell got TERM: TERM to the learner step only" in text, diag()
    assert "learners exited with code 75; stopping the rollout servers" in text, diag()


def test_stop_before_learners_start(tmp_path):
    """A stop while the servers start (never healthy here): the servers are stopped, no learner step is
    started, and the job exits 75."""
    fake, batch, out, port = _stop_job(tmp_path, health="503")
    diag = _diag(tmp_path, fake, out)
    try:
        _wait_for(lambda: all((out / f"server-{port + k}.json").exists() for k in range(2)), 30,
                  "both servers to start", diag)
        os.kill(batch.pid, signal.SIGTERM)
        rc = batch.wait(30)
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
        fake.cleanup()
    assert rc == 75, (rc, diag())
    assert sorted(s["name"] for s in fake.steps()) == ["rlpo-sglang-127.0.0.3-0", "rlpo-sglang-127.0.0.3-1"], diag()
    assert all((out / f"stopped-{port + k}").exists() for k in range(2)), diag()
    assert "stopped (TERM) before the learners started; stopping the rollout servers" in _read(tmp_path / "batch.out")
