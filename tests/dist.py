"""Run a worker script under torchrun (gloo, CPU) and collect what rank 0 reports as JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


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
             expect_fail: bool = False, json_report: bool = True):
    """Returns rank 0's JSON report (None if json_report=False), or for expect_fail the process."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--standalone",
               os.path.join(WORKERS, worker), *args]
        full_env = {**os.environ, "RLPO_REPORT": report, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
                    "PYTHONWARNINGS": "ignore", **(env or {})}
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
        if expect_fail:
            return proc
        if proc.returncode != 0:
            raise AssertionError(f"{worker} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        if not json_report:
            return None
        with open(report) as f:
            return json.load(f)


def write_report(obj):
    """Called by workers on rank 0."""
    path = os.environ["RLPO_REPORT"]
    with open(path, "w") as f:
        json.dump(obj, f)
