"""A test launcher that forks the ranks of a worker script from a process that has already imported torch,
transformers, megatron-core and the trainer: the suite's launches otherwise spend most of their CPU time
importing (measured: a parity layout rank used 9.2 s of CPU of which ~8.5 s import, plus 2-2.5 s for the
torchrun agent), and CI runs them on 2 cores.

What a rank runs is unchanged: the worker script as `__main__` in a process with torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, ...), its own process group over
gloo, the same PYTHONPATH/OMP/warnings settings. Nothing here is initialised before the fork: no process group,
no platform patch (`platform.apply()` runs in the rank, as in a fresh process), no CUDA, one thread (checked).
What differs from torchrun is the agent only: no rendezvous store of the agent's (rank 0 hosts the store, as
`init_process_group`'s env:// does without an agent), no elastic restarts (the suite never asks for them),
and stdout/stderr are the ranks' outputs one after another rather than interleaved.

`tests.dist.torchrun(..., fresh=True)` keeps the real `python -m torch.distributed.run` for the launches that
need a fresh interpreter (a module replaced before megatron's import) or test the launcher itself; the CLI
tests (`rlpo-mega train`, which re-executes under torchrun) never come here.

Protocol: the client (tests.dist) writes one JSON request per line to the server's stdin, the server answers
one JSON line on its stdout. One launch at a time per server; tests.dist keeps a pool for concurrent callers.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time
import traceback

_GRACE_S = 10.0  # SIGTERM -> SIGKILL for the ranks still running after one failed (torchrun: 30 s)


def _preimport():
    import threading

    import moe  # noqa: F401  (first, as in a rank: megatron-core's fusions eager on a CPU, moe/__init__.py)
    import megatron.core  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401

    import rlpo_mega.training.trainer  # noqa: F401
    from rlpo_mega import platform

    # transformers' model code, which the parity and bridge workers compare against (~1 s)
    for family in ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3"):
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")

    # forking is only sound from a quiet process: one thread, nothing patched or initialised
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, "warm launcher has threads"
    assert platform._APPLIED is None, "warm launcher applied platform patches before forking"
    assert not torch.distributed.is_initialized()
    assert not torch.cuda.is_initialized()
    from megatron.core.fusions import fused_bias_swiglu
    assert torch.cuda.is_available() or not hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable"), \
        "megatron-core imported before moe: its fusions were torch.compile'd on a CPU"


def _rank_env(env: dict, rank: int, nproc: int, port: int) -> dict:
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "warm", "TORCHELASTIC_USE_AGENT_STORE": "False"}


def _run_rank(worker: str, args: list[str], env: dict, cwd: str, out: str, err: str, private: list[int]) -> None:
    """In the forked child: become the rank, run the worker as __main__, exit with its code. Never returns."""
    code = 1
    try:
        os.setsid()  # its own group, so that a timeout kills what it started too
        for fd in private:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [worker, *args]
        sys.path[0] = os.path.dirname(worker)  # as `python worker.py` has it
        code = 0
        try:
            runpy.run_path(worker, run_name="__main__")
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        import threading

        threading._shutdown()  # join non-daemon threads, then atexit: what an interpreter's exit does
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF if code >= 0 else 1)


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _launch(req: dict, private: list[int]) -> dict:
    from tests.dist import free_port

    nproc, worker, timeout = int(req["nproc"]), req["worker"], float(req["timeout"])
    port = free_port()
    # mkdtemp, not TemporaryDirectory: its weakref finalizer is an atexit function, which a rank's exit would run
    tmp = tempfile.mkdtemp(prefix="warm_launch_")
    try:
        outs = [(os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(nproc)]
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                _run_rank(worker, req["args"], _rank_env(req["env"], rank, nproc, port), req["cwd"],
                          *outs[rank], private)
            pids.append(pid)
        codes: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        timed_out, stop_at = False, None
        while len(codes) < nproc:
            for pid in pids:
                if pid in codes:
                    continue
                # WNOWAIT: the exited rank stays a zombie, so its pid (its group's id) cannot be reused before
                # the final SIGKILL to its group below
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is not None and info.si_pid == pid:
                    codes[pid] = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                    if codes[pid] != 0 and stop_at is None:  # as torchrun: one rank failed, stop the others
                        _kill([p for p in pids if p not in codes], signal.SIGTERM)
                        stop_at = time.monotonic() + _GRACE_S
            now = time.monotonic()
            if now > deadline and not timed_out:
                timed_out = True
                _kill([p for p in pids if p not in codes], signal.SIGKILL)
            if stop_at is not None and now > stop_at:
                _kill([p for p in pids if p not in codes], signal.SIGKILL)
            time.sleep(0.02)
        _kill(pids, signal.SIGKILL)  # whatever a rank left running in its group (a server it started)
        for pid in pids:
            os.waitpid(pid, 0)
        stdout, stderr = [], []
        for out, err in outs:
            for path, acc in ((out, stdout), (err, stderr)):
                if os.path.exists(path):  # a rank killed before it opened it
                    with open(path, errors="replace") as f:
                        acc.append(f.read())
        failed = [codes[p] for p in pids if codes[p] != 0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"rc": (1 if failed else 0), "rank_codes": [codes[p] for p in pids], "timed_out": timed_out,
            "stdout": "".join(stdout), "stderr": "".join(stderr)}


def main():
    # the request/reply pipes move off fds 0/1, which the ranks take over
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    _preimport()
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    private = [requests.fileno(), replies.fileno()]
    for line in requests:
        replies.write(json.dumps(_launch(json.loads(line), private)) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
