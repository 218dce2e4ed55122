"""A real single-node SLURM (slurmctld + slurmd + munged) under a temporary directory, for tests.

Recipe: ../shared/notes/slurm.md. Debian's slurm-wlm 22.05 and munge are installed with apt when missing
(`apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge`, about 5-12 s). Everything
else lives under the given directory: config, munge key and socket, state, spool, logs. No /etc changes,
no systemd, no cgroups. Only the three daemons this module starts are ever signalled, by their PIDs.

    with slurm_cluster(tmp_path, gpus=4) as cluster:
        cluster.run(["srun", "-n2", "hostname"])

`gpus=N` declares N fake GPUs (gres/gpu, device files that are symlinks to /dev/null): jobs and steps can
request them (`--gpus-per-node`, `--gres=gpu:k`) and get CUDA_VISIBLE_DEVICES, nothing more.

`slurm_unavailable()` returns None when SLURM can be used (installing it first if needed), otherwise the
exact reason (for pytest.skip). Set RLPO_SLURM_NO_INSTALL=1 to never run apt-get.

`FakeSlurm` runs the batch scripts without SLURM, with tests/fake_slurm.py as srun, squeue and scancel (what it
models is in its docstring: srun's options from the environment, the GPU options Slurm refuses together, each
step's GPUs, signals to steps), and gives them the environment sbatch exports for a way of asking for GPUs
(SUBMIT_STYLES):

    fake = FakeSlurm(tmp_path, ["node-a", "node-b"], gpus_per_node=8)
    env = fake.batch_env("--gpus=16", CONFIG=...)      # then `bash launch/slurm/...sbatch` with it
    fake.steps()                                       # every step: its name, GPUs per node, exit code, ...
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from tests.dist import free_port
from tests.fake_slurm import load_steps

APT_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "srun", "scancel", "sinfo", "squeue", "scontrol", "munged", "mungekey"]
SBIN_DIRS = ["/usr/sbin", "/sbin", "/usr/local/sbin"]

_install_result: Optional[tuple[Optional[str], float]] = None  # (reason or None, apt seconds), once per process


def _which(name: str) -> Optional[str]:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN_DIRS)
    return shutil.which(name, path=path)


def _missing() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def _apt(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # wait for a dpkg/apt lock held by another apt run instead of failing at once
    lock = ["-o", "DPkg::Lock::Timeout=120"]
    return subprocess.run(["apt-get", *lock, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _tail(text: str, n: int = 5) -> str:
    return " | ".join(line for line in text.strip().splitlines()[-n:])


def install_time() -> float:
    """Seconds spent in apt-get by this process (0 when nothing was installed)."""
    return _install_result[1] if _install_result else 0.0


def slurm_unavailable() -> Optional[str]:
    """None if the SLURM and munge binaries are present (installed with apt here if needed), else why not."""
    global _install_result
    if _install_result is not None:
        return _install_result[0]
    missing = _missing()
    if not missing:
        _install_result = (None, 0.0)
        return None
    t0 = time.monotonic()
    reason = _ensure_installed(missing)
    _install_result = (reason, time.monotonic() - t0)
    return reason


def _ensure_installed(missing: list[str]) -> Optional[str]:
    what = f"SLURM binaries missing ({', '.join(missing)})"
    if os.environ.get("RLPO_SLURM_NO_INSTALL"):
        return f"{what} and RLPO_SLURM_NO_INSTALL is set"
    if os.geteuid() != 0:
        return f"{what} and not root, so cannot apt-get install {' '.join(APT_PACKAGES)}"
    if shutil.which("apt-get") is None:
        return f"{what} and no apt-get on this machine"
    cmd = ["install", "-y", "--no-install-recommends", *APT_PACKAGES]
    try:
        r = _apt(cmd, timeout=300)
        if r.returncode != 0:  # stale or empty package lists on a fresh machine: refresh once
            u = _apt(["update"], timeout=300)
            if u.returncode != 0:
                return (f"{what}; apt-get install failed ({_tail(r.stderr)}) "
                        f"and apt-get update failed ({_tail(u.stderr)})")
            r = _apt(cmd, timeout=300)
            if r.returncode != 0:
                return f"{what}; apt-get install {' '.join(APT_PACKAGES)} failed: {_tail(r.stderr)}"
    except subprocess.TimeoutExpired as e:
        return f"{what}; apt-get timed out after {e.timeout:.0f} s"
    missing = _missing()
    if missing:
        return f"apt-get install succeeded but binaries are still missing: {', '.join(missing)}"
    return None


def _free_ports(n: int) -> list[int]:
    """n distinct free ports below the ephemeral range (tests.dist.free_port says why)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def clean_env(extra: Optional[dict] = None) -> dict:
    """os.environ without stray SLURM_* variables (a test run inside a SLURM job must not leak them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env["PATH"] = env.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN_DIRS)
    env.update(extra or {})
    return env


class SlurmCluster:
    """One node (this host, 127.0.0.1), partition `debug`, daemons started and stopped by this object;
    `gpus` fake GPUs (gres/gpu on /dev/null symlinks: allocation and CUDA_VISIBLE_DEVICES only)."""

    def __init__(self, root: Path, gpus: int = 0):
        self.root = Path(root)
        self.gpus = gpus
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.log_dir = self.root / "log"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = clean_env({"SLURM_CONF": str(self.conf)})

    # -- helpers ---------------------------------------------------------------------------------------
    def run(self, cmd: list[str], timeout: float = 120, check: bool = True, env: Optional[dict] = None,
            **kw) -> subprocess.CompletedProcess:
        e = dict(self.env, **(env or {}))
        r = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{cmd} exited {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}\n"
                               + self.daemon_logs())
        return r

    def daemon_logs(self, n: int = 15) -> str:
        out = []
        for f in sorted(self.log_dir.glob("*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-n:]))
        return "\n".join(out)

    def _node_line(self) -> str:
        r = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30, env=self.env)
        fields = dict(tok.split("=", 1) for tok in r.stdout.split() if "=" in tok)
        cpus = fields.get("CPUs", str(os.cpu_count() or 1))
        keep = ["Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore"]
        topo = " ".join(f"{k}={fields[k]}" for k in keep if k in fields)
        mem = max(int(fields.get("RealMemory", "1024")) - 256, 256)
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        return f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} {topo} RealMemory={mem}{gres} State=UNKNOWN"

    def _write_gres(self) -> str:
        """gres.conf (read from SLURM_CONF's directory) for the fake GPUs; the slurm.conf line it needs."""
        if not self.gpus:
            return ""
        dev = self.root / "dev"
        dev.mkdir(exist_ok=True)
        for i in range(self.gpus):
            f = dev / f"nvidia{i}"
            if not f.is_symlink():
                f.symlink_to("/dev/null")
        (self.root / "gres.conf").write_text(f"Name=gpu File={dev}/nvidia[0-{self.gpus - 1}]\n")
        return "GresTypes=gpu\n"

    def write_config(self) -> None:
        r = self.root
        for d in ["munge", "state", "spool", "log"]:
            (r / d).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket directory (or parent) that is not world-readable; mktemp makes 0700
        for d in [r, r / "munge"]:
            os.chmod(d, 0o755)
        ctld_port, slurmd_port = _free_ports(2)
        gres_types = self._write_gres()
        self.conf.write_text(f"""\
ClusterName=ci
{gres_types}SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.sock
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=4
{self._node_line()}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.log_dir / f"{name}.stdout", "wb")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    # -- life cycle ------------------------------------------------------------------------------------
    def start(self, timeout: float = 30) -> "SlurmCluster":
        self.write_config()
        m = self.root / "munge"
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={m}/munge.key"], check=True,
                       capture_output=True, timeout=30)
        os.chmod(m / "munge.key", 0o600)
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--key-file={m}/munge.key",
                               f"--socket={m}/munge.sock", f"--pid-file={m}/munged.pid",
                               f"--seed-file={m}/munged.seed", f"--log-file={self.log_dir}/munged.log"])
        self._wait(lambda: (m / "munge.sock").exists(), timeout, "munged socket")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i"])
        self._spawn("slurmd", [_which("slurmd"), "-D"])
        self._wait(self._idle, timeout, "node idle in sinfo")
        return self

    def _idle(self) -> bool:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited {p.returncode} during start-up\n" + self.daemon_logs())
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True, timeout=10)
        return r.returncode == 0 and r.stdout.strip() == "idle"

    def _wait(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.1)
        raise RuntimeError(f"SLURM test cluster: timed out waiting for {what}\n" + self.daemon_logs())

    def stop(self, timeout: float = 10) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            # leftover jobs' slurmstepd outlive slurmd: cancel them while the controller is still up
            subprocess.run(["scancel", "--full", "--partition=debug"], env=self.env, capture_output=True,
                           timeout=10)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                r = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True,
                                   timeout=10)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.2)
        for name in ["slurmd", "slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()

    # -- jobs ------------------------------------------------------------------------------------------
    def job_state(self, job_id: str) -> str:
        r = self.run(["scontrol", "show", "job", job_id], check=False)
        for tok in r.stdout.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "GONE"


@contextlib.contextmanager
def slurm_cluster(root, gpus: int = 0) -> Iterator[SlurmCluster]:
    """Start a one-node cluster under `root` (a fresh directory), with `gpus` fake GPUs, and stop it on exit."""
    cluster = SlurmCluster(Path(root), gpus)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


# -- without SLURM: tests/fake_slurm.py as srun, squeue, scancel -------------------------------------------
FAKE_SLURM = Path(__file__).resolve().with_name("fake_slurm.py")

# What sbatch exports for each way of asking for GPUs, beside SLURM_GPUS_ON_NODE and SLURM_JOB_GPUS (src/common/
# env.c set_env_from_opts): --gpus-per-node and --gpus as the variables srun reads back as those options;
# --gres exports no such variable (a step without a GPU option gets the job's GRES anyway).
SUBMIT_STYLES = ("--gpus-per-node", "--gres", "--gpus")


class FakeSlurm:
    """A job on made-up `nodes` with `gpus_per_node` GPUs each, its state under `root` (see the module doc)."""

    def __init__(self, root: Path, nodes: list[str], gpus_per_node: int = 8, job_id: str = "4242"):
        self.root = Path(root)
        self.nodes, self.gpus_per_node, self.job_id = list(nodes), gpus_per_node, job_id
        self.state = self.root / "fake-slurm"
        self.bin = self.root / "fake-slurm-bin"
        self.state.mkdir(parents=True, exist_ok=True)
        self.bin.mkdir(parents=True, exist_ok=True)
        for tool in ("srun", "squeue", "scancel"):
            f = self.bin / tool
            # -S: no site packages to import, a fresh interpreter per call stays cheap
            f.write_text(f'#!/bin/sh\nexec {sys.executable} -S {FAKE_SLURM} {tool} "$@"\n')
            f.chmod(0o755)

    def submit_env(self, style: str) -> dict:
        """The GPU variables sbatch exports for `style` (SUBMIT_STYLES) over the whole job."""
        g, n = self.gpus_per_node, len(self.nodes)
        env = {"SLURM_GPUS_ON_NODE": str(g), "SLURM_JOB_GPUS": ",".join(map(str, range(g)))}
        if style == "--gpus-per-node":
            env["SLURM_GPUS_PER_NODE"] = str(g)
        elif style == "--gpus":
            env["SLURM_GPUS"] = str(g * n)
        elif style != "--gres":
            raise ValueError(f"unknown submission style {style!r}; one of {SUBMIT_STYLES}")
        return env

    def batch_env(self, style: Optional[str] = None, **extra) -> dict:
        """The environment of a batch script sbatch started (`style`: its GPU request, None: none), plus the
        fake's own variables and `extra`."""
        env = clean_env({"SLURM_JOB_ID": self.job_id, "SLURM_JOB_NAME": "rlpo-test",
                         "SLURM_JOB_NUM_NODES": str(len(self.nodes)), "SLURM_NNODES": str(len(self.nodes)),
                         "SLURM_NTASKS_PER_NODE": "1",  # the scripts' #SBATCH --ntasks-per-node=1
                         "RLPO_HOSTNAMES": " ".join(self.nodes), "FAKE_SLURM_DIR": str(self.state),
                         "FAKE_SLURM_NODES": " ".join(self.nodes), "FAKE_SLURM_GPUS_PER_NODE": str(self.gpus_per_node)})
        env["PATH"] = f"{self.bin}{os.pathsep}{env['PATH']}"
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        if style is not None:
            env.update(self.submit_env(style))
        env.update(extra)
        return env

    def steps(self) -> list[dict]:
        return load_steps(str(self.state))

    def signals(self) -> list[dict]:
        f = self.state / "signals.jsonl"
        return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []

    def cleanup(self) -> None:
        """SIGKILL to the process groups of every task the fake srun started (each task leads its own)."""
        for step in self.steps():
            for task in step["tasks"]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(task["pid"], signal.SIGKILL)
