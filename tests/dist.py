"""Run a worker script under torchrun (gloo, CPU) and collect what rank 0 reports as JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


def _pythonpath() -> str:
    """The repository first, then what the caller's PYTHONPATH already holds (a GPU machine's carried wheels are
    installed into a folder named there)."""
    return os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)


def free_port(low: int = 20000, high: int = 29999) -> int:
    """A free TCP port below the kernel's ephemeral range, for a server that binds it only later.

    bind(0) hands out ephemeral ports, the same range gloo's pairs and torchrun's stores draw from while the
    server starts: a CI run lost an SGLang server's HTTP port that way (uvicorn exit 3, address in use).
    SGLang picks its own internal ports the same way (get_free_port_below_ephemeral)."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = min(high, int(f.read().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    if high - low + 1 < 64:  # an unusual ephemeral range leaves no room below it: any free port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for port in random.sample(range(low, high + 1), 64):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in [{low}, {high}]")


def torchrun(worker: str, nproc: int, *args: str, env: dict | None = None, timeout: int = 600,
             expect_fail: bool = False, json_report: bool = True, fresh: bool = False):
    """Returns rank 0's JSON report (None if json_report=False), or for expect_fail the process.

    The ranks are forked from a warm launcher (tests/warm_launch.py: torch, megatron-core and the trainer
    already imported; the suite's launches otherwise spend most of their CPU importing them). fresh=True runs
    `python -m torch.distributed.run` instead, for a launch that needs a fresh interpreter or tests torchrun's
    own behaviour; so does RLPO_TEST_FRESH_LAUNCH=1 for every launch."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        path = os.path.join(WORKERS, worker)
        full_env = {**os.environ, "RLPO_REPORT": report, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1",
                    "PYTHONWARNINGS": "ignore", **(env or {})}
        if fresh or os.environ.get("RLPO_TEST_FRESH_LAUNCH") == "1":
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
                   path, *args]
            proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
        else:
            proc = _warm_launch(path, nproc, list(args), full_env, timeout)
        if expect_fail:
            return proc
        if proc.returncode != 0:
            raise AssertionError(f"{worker} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        if not json_report:
            return None
        with open(report) as f:
            return json.load(f)


_IDLE: list[subprocess.Popen] = []  # warm launchers not running a launch
_IDLE_LOCK = threading.Lock()


def _warm_server() -> subprocess.Popen:
    with _IDLE_LOCK:
        while _IDLE:
            server = _IDLE.pop()
            if server.poll() is None:
                return server
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    server = subprocess.Popen([sys.executable, "-m", "tests.warm_launch"], cwd=ROOT, env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    ready = server.stdout.readline()
    if not ready.strip():
        raise RuntimeError(f"tests/warm_launch.py did not start (rc {server.wait()}); "
                           "run a worker with RLPO_TEST_FRESH_LAUNCH=1 to see why")
    return server


def _warm_launch(path: str, nproc: int, args: list[str], env: dict, timeout: float):
    server = _warm_server()
    server.stdin.write(json.dumps({"worker": path, "nproc": nproc, "args": args, "env": env, "cwd": ROOT,
                                   "timeout": timeout}) + "\n")
    server.stdin.flush()
    line = server.stdout.readline()  # the server enforces the timeout itself
    if not line:
        raise RuntimeError(f"tests/warm_launch.py died running {path} (rc {server.wait()})")
    with _IDLE_LOCK:
        _IDLE.append(server)
    reply = json.loads(line)
    cmd = [path, *args]
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(cmd, timeout, output=reply["stdout"], stderr=reply["stderr"])
    return subprocess.CompletedProcess(cmd, reply["rc"], reply["stdout"], reply["stderr"])


def write_report(obj):
    """Called by workers on rank 0."""
    path = os.environ["RLPO_REPORT"]
    with open(path, "w") as f:
        json.dump(obj, f)
