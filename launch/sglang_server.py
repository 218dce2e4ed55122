"""Start and stop one SGLang server (`python -m sglang.launch_server`), wait for GET /health, log to a file.

Used by rlpo_mega.rollout.sglang_engine when `rollout.sglang.launch` is on; also a CLI:
    python launch/sglang_server.py --model-path HF_DIR --port 30000 [--python VENV/bin/python] [sglang flags...]
(launch/slurm/train_disaggregated.sbatch starts its servers this way).

The server process is started in its own session, so stop() ends the whole process group (scheduler and
detokenizer children included) and nothing else. This directory is put on the server's PYTHONPATH so
sglang can import `rlpo_sglang_hooks` (the weight-digest hook, --custom-weight-loader).

Keys: every server is started with the job's key (`api_key`; the CLI's is $RLPO_SGLANG_KEY, which
launch/slurm/*.sbatch make per job) for --api-key and --admin-api-key, through the shim rlpo_sglang_keys, which adds
both flags inside the server's process: the key is never on a command line. Its log file is mode 0600 (SGLang
prints its arguments, the key included, at start). Every request to it but /health, /ready and /metrics (open in
SGLang whatever the keys) needs `Authorization: Bearer <key>`.
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request

HOOKS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HOOKS_DIR)  # the hook imports moe.families.sglang_names and rlpo_mega's digest
REPORT_LOADER = "rlpo_sglang_hooks.report_digests"  # load_format: the server digests what it holds
KEY_SHIM = "rlpo_sglang_keys"  # launch/rlpo_sglang_keys.py: --api-key/--admin-api-key from the environment
KEY_ENV = "RLPO_SGLANG_KEY"  # the shim's variable (rlpo_sglang_keys.KEY_ENV)
KEY_ARGS = ("api_key", "admin_api_key")
# server calls never go through a proxy (http_proxy & co.), as the engine's
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def hook_pythonpath(existing: str | None = None) -> str:
    """PYTHONPATH that lets a server import the weight-digest hook (launch/) and what it uses (the root)."""
    return os.pathsep.join(p for p in (HOOKS_DIR, REPO_ROOT, existing) if p)


def server_args_to_cli(args: dict) -> list[str]:
    """{"attention_backend": "torch_native", "disable_overlap_schedule": True} -> CLI flags."""
    out = []
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False or v is None:
            continue
        elif isinstance(v, (list, tuple)):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


# torchrun's variables: a server launched from a learner rank must not inherit them, or its own
# torch.distributed set-up joins the learner's rendezvous (MASTER_PORT, WORLD_SIZE) and waits forever.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


# the learner's settings that would slow a server down: CUDA_DEVICE_MAX_CONNECTIONS=1 (launch/slurm/common.sh
# exports it to the learner steps for Megatron-Core's TP/SP communication overlap) gives each GPU one hardware
# queue, which serializes the streams SGLang overlaps. The sbatch server steps start without it
# (train_disaggregated.sbatch, rlpo_step_env); a server the trainer launches drops it here. A server that should
# have it sets it in its own env (rollout.sglang.env; SGLANG_ENV for the sbatch steps).
_LEARNER_ONLY_VARS = ("CUDA_DEVICE_MAX_CONNECTIONS",)


def server_environment(environ) -> dict:
    """The launching process's environment without torchrun's (and its OMP_NUM_THREADS=1 default) and without
    the learner's CUDA_DEVICE_MAX_CONNECTIONS; the server's own env (SGLangServer(env=...)) goes on top."""
    return {k: v for k, v in environ.items()
            if k not in _TORCHRUN_VARS and k not in _LEARNER_ONLY_VARS and not k.startswith("TORCHELASTIC_")}


def _pdeathsig():
    """In the server's child, before exec: SIGTERM when the parent thread dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


class SGLangServer:
    """One server. api_key: the job's key (default: $RLPO_SGLANG_KEY; neither: a server without a key, which answers
    anyone -- only the tests' stand-ins start one)."""

    def __init__(self, model_path: str, host: str = "127.0.0.1", port: int = 30000, tp_size: int = 1,
                 server_args: dict | None = None, python: str | None = None, log_dir: str | None = None,
                 env: dict | None = None, advertise: str | None = None, api_key: str | None = None):
        self.model_path, self.host, self.port, self.tp_size = model_path, host, port, tp_size
        self.api_key = api_key or os.environ.get(KEY_ENV) or None
        self.advertise = advertise  # the host its URL names (bound to 0.0.0.0: this node's hostname)
        self.server_args = dict(server_args or {})
        keyed = [k for k in KEY_ARGS if k in self.server_args]
        if keyed:
            raise ValueError(f"SGLangServer: server_args {', '.join(keyed)}: the server's key is its api_key (the job's, "
                             "given to the server through its environment, never on a command line or in a config)")
        self.python = python or sys.executable
        self.log_dir = log_dir or os.path.join(os.getcwd(), "logs", "sglang")
        self.env = {str(k): str(v) for k, v in (env or {}).items()}  # YAML may give numbers (FLAG: 1)
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.log_dir, f"server_{host}_{port}.log")

    @property
    def url(self) -> str:
        return f"http://{self.advertise or self.host}:{self.port}"

    def command(self) -> list[str]:
        args = {"model_path": self.model_path, "host": self.host, "port": self.port, "tp_size": self.tp_size,
                **self.server_args}
        loaders = list(args.pop("custom_weight_loader", None) or [])
        if REPORT_LOADER not in loaders:
            loaders.append(REPORT_LOADER)
        args["custom_weight_loader"] = loaders
        return [self.python, "-m", KEY_SHIM, "sglang.launch_server", *server_args_to_cli(args)]

    @property
    def auth(self) -> dict:
        """The header every request to this server carries."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, timeout: float = 300.0) -> "SGLangServer":
        os.makedirs(self.log_dir, exist_ok=True)
        env = {**server_environment(os.environ), **self.env}
        env["PYTHONPATH"] = hook_pythonpath(env.get("PYTHONPATH"))
        env.pop(KEY_ENV, None)  # this server's key only (none: none, whatever the launching process holds)
        if self.api_key:
            env[KEY_ENV] = self.api_key
        # owner-only: SGLang prints its server_args, the keys included, at start
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        log = os.fdopen(fd, "ab")
        log.write(f"\n=== {time.strftime('%F %T')} {' '.join(self.command())}\n".encode())
        log.flush()
        # The server dies with this process however it ends: SIGTERM from the kernel when the starting thread
        # dies (PR_SET_PDEATHSIG, also on SIGKILL; only from the main thread, which lives as long as the
        # process), and stop() at interpreter exit (an exception included)
        main = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_pdeathsig if main else None)
        log.close()
        atexit.register(self.stop, 2.0)
        self.wait_healthy(timeout)
        self.freeze_gc()
        return self

    def freeze_gc(self):
        """POST /freeze_gc once the server answers: what it holds now (its modules, torch, the model) leaves Python's
        collector. SGLang does this itself after its warm-up, but with skip_server_warmup it posts before its HTTP
        server listens ("post-warmup freeze_gc failed ... connection refused" in the log) and runs unfrozen. That
        matters on its CPU platform, where every /flush_cache (each weight sync's) runs gc.collect() in the
        scheduler (platforms/cpu.py empty_cache): 0.35 s a sync over the unfrozen heap in tools/bench_async.py,
        2 ms frozen. A server without the endpoint still serves: the failure goes to its log."""
        try:
            req = urllib.request.Request(self.url + "/freeze_gc", data=b"", method="POST", headers=self.auth)
            with _OPENER.open(req, timeout=30) as r:
                r.read()
        except Exception as e:
            with open(self.log_path, "ab") as log:
                log.write(f"=== rlpo_mega: POST /freeze_gc failed ({e}); the server runs with its collector unfrozen\n"
                          .encode())

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with _OPENER.open(urllib.request.Request(self.url + "/health", headers=self.auth), timeout=timeout) as r:
                return r.status == 200
        except Exception:
            return False

    def wait_healthy(self, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server {self.url} exited with code {self.proc.returncode} during "
                                   f"start-up{self._startup_cause()}; see its log {self.log_path}")
            if self.healthy(timeout=2.0):
                return
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"SGLang server {self.url} not healthy after {timeout:.0f} s; see its log "
                           f"{self.log_path} (raise rollout.sglang.startup_timeout if it is just slow)")

    def _startup_cause(self) -> str:
        """The cause a user can act on, from the log's tail: a taken port is the common one (uvicorn exits 3)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 20000))
                tail = f.read().decode(errors="replace")
        except OSError:
            return ""
        if "address already in use" in tail.lower():
            return (f": port {self.port} on {self.host} is already in use (another server or process holds it; "
                    f"choose a free one with rollout.sglang.base_port)")
        return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig=signal.SIGKILL):
        """Signal the server's whole process group (its own session: ours only)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 10.0):
        atexit.unregister(self.stop)
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        self.kill(signal.SIGCONT)  # a stopped (frozen) server acts on its TERM only once continued
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.proc.wait(10)
        try:  # children that outlived the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc = None


def _log_tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"<{path}: {e}>"


def main(argv=None) -> int:
    """CLI: one server in the foreground. Flags it does not know go to sglang.launch_server unchanged (in
    their order; `--` may separate them), so SLURM scripts and users can pass any server flag
    (`--base-gpu-id`, `--mem-fraction-static 0.8`, ...). The weight-digest hook is always added to
    --custom-weight-loader (merged with any given), and its directory to the server's PYTHONPATH. The server's key
    is $RLPO_SGLANG_KEY (required: the trainer sends it with every request); --api-key and --admin-api-key are
    refused here (a command line is readable by every user of the node).
    Exits with the server's exit code; SIGTERM/SIGINT stop the server (whole process group) first."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:  # the old spelling: our flags, --, sglang flags; the sglang flags are passed through anyway
        argv.remove("--")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False,  # a server flag that is a prefix of ours must pass through
                                epilog="Any other flag is passed to sglang.launch_server unchanged.")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--custom-weight-loader", nargs="*", default=[],
                   help="more custom weight loaders (the digest hook is always added)")
    p.add_argument("--python", default=None, help="the interpreter of the environment that has sglang "
                   "(default: this one)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /health")
    p.add_argument("--log-file", default=None, help="the server's output (default: logs/sglang/server_HOST_PORT.log)")
    p.add_argument("--dry-run", action="store_true", help="print the server command and exit")
    a, extra = p.parse_known_args(argv)
    keyed = sorted({t.split("=", 1)[0] for t in extra} & {"--api-key", "--admin-api-key"})  # (names: no key echoed)
    if keyed:
        print(f"launch/sglang_server.py: {', '.join(keyed)}: the server's key comes from ${KEY_ENV}, never from a "
              "command line (readable by every user of the node); remove the flag", file=sys.stderr)
        return 2
    key = os.environ.get(KEY_ENV)
    if not key and not a.dry_run:
        print(f"launch/sglang_server.py: ${KEY_ENV} is not set: export the job's key (the trainer sends it with every "
              "request; launch/slurm/*.sbatch make one per job) -- a server without one answers anyone who reaches "
              "it", file=sys.stderr)
        return 2
    server_args = {"custom_weight_loader": a.custom_weight_loader} if a.custom_weight_loader else None
    # this process runs in the server's own step, whose environment is the server's already (the sbatch starts
    # it without the learner's settings; SGLANG_ENV may set one of them for the servers): kept as it is
    own = {k: os.environ[k] for k in _LEARNER_ONLY_VARS if k in os.environ}
    server = SGLangServer(a.model_path, a.host, a.port, a.tp_size, server_args=server_args, python=a.python,
                          env=own, api_key=key)
    if a.log_file:
        server.log_dir, server.log_path = os.path.dirname(os.path.abspath(a.log_file)), a.log_file
    base_command = server.command
    server.command = lambda: base_command() + extra  # type: ignore[method-assign]
    if a.dry_run:
        print("+ " + " ".join(shlex.quote(t) for t in server.command()), flush=True)
        return 0

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)  # unwinds to the finally below, which stops the server

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        print(f"starting SGLang server {server.url}: {' '.join(server.command())} (log {server.log_path})",
              flush=True)
        try:
            server.start(a.timeout)
        except (RuntimeError, TimeoutError) as e:
            print(f"{e}\n--- last lines of {server.log_path}:\n{_log_tail(server.log_path)}", file=sys.stderr,
                  flush=True)
            return 1
        print(f"SGLang server ready at {server.url} (log {server.log_path}); SIGTERM or Ctrl-C stops it", flush=True)
        rc = server.proc.wait()
        print(f"SGLang server {server.url} exited with code {rc}; last lines of {server.log_path}:\n"
              f"{_log_tail(server.log_path)}", file=sys.stderr, flush=True)
        return rc if rc >= 0 else 128 - rc
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second TERM (SLURM sends several) must not cut the
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # stop short and leave the server's children behind
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
