"""Cost of one python-tool call: before issue 64 (a user and a network namespace only) and with the sandbox
(each mechanism this machine can make), side by side in one run.

    python tools/bench_sandbox.py [--calls 30] [--rounds 3]

Each row: the median and p10/p90 of `calls` calls of `print(1)` per round (the rows take turns, so a busy
machine slows them alike), and the median added to the old call. The old call is the code of
rlpo_mega/environments/python_tool.py before the sandbox (copied below): the venv's interpreter, `-I`,
RLIMIT_AS, unshare(CLONE_NEWUSER | CLONE_NEWNET), the code as __main__.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlpo_mega.environments.sandbox import Limits, SandboxError, sandbox_for  # noqa: E402

# python_tool.py before issue 64 (its _BOOT and run_python), for the baseline
_OLD_BOOT = r"""
import ctypes, resource, sys
mem = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000 | 0x40000000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET
    sys.stderr.write("NO_SANDBOX errno %d\n" % ctypes.get_errno())
    sys.exit(97)
code = sys.stdin.read()
sys.argv = ["tool"]
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


def old_run_python(code: str, time_limit: float, memory_mb: int):
    proc = subprocess.Popen([sys.executable, "-I", "-c", _OLD_BOOT, str(memory_mb << 20)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8"}, cwd="/")
    try:
        out, err = proc.communicate(code, timeout=time_limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err
    return proc.returncode, out, err


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    limits = Limits()
    rows = {"before: user+net namespaces (old python_tool)": lambda: old_run_python("print(1)", 5.0, 512)}
    for mech in ("bwrap", "direct"):
        try:
            box = sandbox_for(mech)
        except SandboxError as e:
            print(f"{mech}: not available here ({e})")
            continue
        rows[f"after: sandbox, {mech} ({'root' if box.root else 'userns'} mode)"] = \
            lambda box=box: box.run("print(1)", limits)
    for f in rows.values():  # warm: page cache, the probe's first start
        f()
    times = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, f in rows.items():
            for _ in range(args.calls):
                t = time.perf_counter()
                f()
                times[name].append((time.perf_counter() - t) * 1e3)
    base = statistics.median(next(iter(times.values())))
    print(f"{'one call of print(1)':55s} {'median':>8s} {'p10':>7s} {'p90':>7s} {'added':>8s}   (ms, "
          f"{args.rounds}x{args.calls} calls, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    for name, ts in times.items():
        ts.sort()
        med = statistics.median(ts)
        print(f"{name:55s} {med:8.1f} {ts[len(ts) // 10]:7.1f} {ts[len(ts) * 9 // 10]:7.1f} {med - base:+8.1f}")


if __name__ == "__main__":
    main()
