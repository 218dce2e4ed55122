"""A fake `srun`, `squeue` and `scancel` for running launch/slurm/*.sbatch without SLURM (standard library only:
every call is a fresh interpreter). What it models, from Slurm's documentation and source (srun(1) and
src/srun/opt.c, src/common/slurm_opt.c at Slurm 26.05), and nothing else:

- srun reads options from its environment ("INPUT ENVIRONMENT VARIABLES": SLURM_GPUS -> --gpus,
  SLURM_GPUS_PER_NODE -> --gpus-per-node, SLURM_GPUS_PER_TASK, SLURM_GPUS_PER_SOCKET, SLURM_GRES and
  SLURM_STEP_GRES -> --gres, SLURM_TRES_PER_TASK -> --tres-per-task, SLURM_CPUS_PER_TASK, SLURM_MEM_PER_NODE,
  SLURM_EXACT, SLURM_OVERLAP, SLURM_JOB_NAME -> --job-name); an option on the command line wins over its own
  variable only. sbatch exports the job's GPU request in those variables, so a step inherits it.
- --gpus given on the command line drops an inherited SLURM_GPUS_PER_NODE (srun's _opt_verify);
  --gres=gpu with --gpus-per-node (either from the environment) is refused:
  "srun: fatal: --gpus-per-node and --gres=gpu are mutually exclusive." and exit 1 (Slurm 26.05+; older
  releases accepted the pair).
- GPUs: each node of the job has FAKE_SLURM_GPUS_PER_NODE, numbered 0..n-1. A step that asks for none gets all
  of the job's GPUs on its nodes (srun(1) --gres: "By default, a job step is allocated all of the generic
  resources that have been requested by the job"), --gres=none none. GPU counts from several options must agree
  per node, and fit the node's GPUs, else "Requested node configuration is not available" (what slurmctld
  answers). GPUs held by a running step are not given to another unless one of them runs with --overlap; where
  real srun would wait for them ("Requested nodes are busy") this one fails at once, so a test never hangs.
- Each task runs on this machine with SLURMD_NODENAME, SLURM_STEP_ID, SLURM_PROCID, ..., CUDA_VISIBLE_DEVICES
  (the step's global GPU numbers, so that steps can be compared), in its own process group; --output with %N %j
  %s %t %x; srun's exit code is the highest of its tasks'; --kill-on-bad-exit; TERM or INT to srun kills the
  step's tasks at once (SIGKILL), as real srun does.
- `squeue -h -s -j JOB -o "%i %j"` lists running steps; `scancel --signal=SIG ID...` signals every task of a
  step (JOB.STEP) or of every step (JOB), never the batch shell.

FAKE_SRUN_NOEXEC=1: allocate and record the step, start nothing, exit 0; the step keeps its GPUs (a dry run's
commands replayed in order: the servers hold theirs when the learners' step is placed).

State (steps, their GPUs, every signal sent) lives in FAKE_SLURM_DIR: steps/<id>.json, signals.jsonl.
Options not listed in _VALUE_OPTS / _FLAG_OPTS are refused, so nothing passes unmodelled.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time

_VALUE_OPTS = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks",
               "--ntasks-per-node": "ntasks-per-node", "-w": "nodelist", "--nodelist": "nodelist",
               "-c": "cpus-per-task", "--cpus-per-task": "cpus-per-task", "--mem": "mem", "--gres": "gres",
               "-o": "output", "--output": "output", "-e": "error", "--error": "error", "-J": "job-name",
               "--job-name": "job-name", "-G": "gpus", "--gpus": "gpus", "--gpus-per-node": "gpus-per-node",
               "--gpus-per-task": "gpus-per-task", "--gpus-per-socket": "gpus-per-socket",
               "--tres-per-task": "tres-per-task", "-p": "partition", "--partition": "partition",
               "-t": "time", "--time": "time"}
_FLAG_OPTS = {"--exact": "exact", "--overlap": "overlap", "-K": "kill-on-bad-exit",
              "--kill-on-bad-exit": "kill-on-bad-exit", "-l": "label", "--label": "label",
              "-u": "unbuffered", "--unbuffered": "unbuffered"}
# srun's environment -> option table (srun(1) INPUT ENVIRONMENT VARIABLES), the part modelled here; later
# entries win over earlier ones for the same option (SLURM_STEP_GRES over SLURM_GRES)
ENV_OPTS = [("SLURM_GPUS", "gpus"), ("SLURM_GPUS_PER_NODE", "gpus-per-node"), ("SLURM_GPUS_PER_TASK", "gpus-per-task"),
            ("SLURM_GPUS_PER_SOCKET", "gpus-per-socket"), ("SLURM_GRES", "gres"), ("SLURM_STEP_GRES", "gres"),
            ("SLURM_TRES_PER_TASK", "tres-per-task"), ("SLURM_CPUS_PER_TASK", "cpus-per-task"),
            ("SLURM_MEM_PER_NODE", "mem"), ("SLURM_EXACT", "exact"), ("SLURM_OVERLAP", "overlap"),
            ("SLURM_JOB_NAME", "job-name")]
_FLAGS_FROM_ENV = {"exact", "overlap"}

NOT_AVAILABLE = "Requested node configuration is not available"


class Refused(Exception):
    """srun's own refusal: the message (one line, as srun prints it) and the exit code."""

    def __init__(self, line: str, code: int = 1):
        super().__init__(line)
        self.line, self.code = line, code


# -- state ------------------------------------------------------------------------------------------------
def _state_dir() -> str:
    d = os.environ.get("FAKE_SLURM_DIR")
    if not d:
        sys.exit("fake slurm: FAKE_SLURM_DIR is not set")
    os.makedirs(os.path.join(d, "steps"), exist_ok=True)
    return d


class _Lock:
    def __enter__(self):
        self.f = open(os.path.join(_state_dir(), "lock"), "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def _write(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _alive(pid) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_steps(state_dir: str) -> list[dict]:
    """Every step recorded so far, in the order they were created."""
    out = []
    steps = os.path.join(state_dir, "steps")
    for name in os.listdir(steps) if os.path.isdir(steps) else []:
        if name.endswith(".json"):
            with open(os.path.join(steps, name)) as f:
                out.append(json.load(f))
    return sorted(out, key=lambda s: s["step"])


def _running(step: dict) -> bool:
    """Holding its resources: a NOEXEC step always, a launched one while its srun lives."""
    return step["state"] == "held" or (step["state"] == "running" and _alive(step["srun_pid"]))


def _log_signal(entry: dict) -> None:
    with open(os.path.join(_state_dir(), "signals.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")


# -- srun -------------------------------------------------------------------------------------------------
def parse_srun(argv: list[str]) -> tuple[dict, list[str]]:
    """(options given on the command line, the command)."""
    opts: dict = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        tok = argv[i]
        name, eq, val = tok.partition("=")
        if name in _FLAG_OPTS:
            opts[_FLAG_OPTS[name]] = val if eq else "1"
        elif name in _VALUE_OPTS:
            if not eq:
                if len(name) == 2 and len(tok) > 2:  # -N1
                    name, val = tok[:2], tok[2:]
                else:
                    i += 1
                    if i >= len(argv):
                        raise Refused(f"srun: option {name} requires an argument", 2)
                    val = argv[i]
            opts[_VALUE_OPTS[name]] = val
        elif len(tok) > 2 and tok[:2] in _VALUE_OPTS:  # -N1, -n2
            opts[_VALUE_OPTS[tok[:2]]] = tok[2:]
        else:
            raise Refused(f"fake srun: option {tok} is not modelled (tests/fake_slurm.py)", 2)
        i += 1
    if i >= len(argv):
        raise Refused("srun: fatal: No command given to execute.", 1)
    return opts, argv[i:]


def effective_options(cli: dict, env: dict) -> tuple[dict, dict]:
    """srun's options after reading its environment: ({option: value}, {option: 'cli' | 'env'}), with srun's
    rules between GPU options applied (see the module docstring)."""
    opts, source = dict(cli), {k: "cli" for k in cli}
    for var, opt in ENV_OPTS:
        if var in env and source.get(opt) != "cli":
            val = env[var]
            if opt in _FLAGS_FROM_ENV:
                if val not in ("", "yes") and not (val.isdigit() and int(val) != 0):
                    continue
                val = "1"
            opts[opt], source[opt] = val, "env"
    if source.get("gpus-per-node") == "env" and source.get("gpus") == "cli":
        del opts["gpus-per-node"], source["gpus-per-node"]  # srun/opt.c _opt_verify: --gpus overrides it
    if _gres_gpus(opts.get("gres")) is not None and opts.get("gres", "").lower() != "none" and "gpus-per-node" in opts:
        raise Refused("srun: fatal: --gpus-per-node and --gres=gpu are mutually exclusive.", 1)
    return opts, source


def _count(spec: str) -> int:
    """'4', 'h100:4' -> 4."""
    last = spec.split(":")[-1]
    if not last.isdigit():
        raise Refused(f"srun: error: Invalid GPU specification {spec!r}", 1)
    return int(last)


def _gres_gpus(gres):
    """GPUs per node asked by a --gres list ('gpu', 'gpu:4', 'gres/gpu:h100:4', 'none'), or None (no gpu entry)."""
    if not gres:
        return None
    if gres.lower() == "none":
        return 0
    for entry in gres.split(","):
        parts = entry.split(":")
        if parts[0] in ("gpu", "gres/gpu"):
            return int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return None


def _tres_gpus(tres):
    """GPUs per task in a --tres-per-task list ('cpu=8,gres/gpu:2', 'gres/gpu=2'), or None."""
    for entry in (tres or "").split(","):
        m = re.fullmatch(r"(?:gres/)?gpu(?:[:=](?:[^:=,]+[:=])?(\d+))?", entry)
        if m:
            return int(m.group(1) or 1)
    return None


def gpu_demand(opts: dict, nodes: list[str], tasks_per_node: int) -> dict:
    """{node: GPUs} the step asks for, or None per node for 'all of the job's GPUs there' (no GPU option)."""
    if "gpus-per-socket" in opts:
        raise Refused("fake srun: --gpus-per-socket is not modelled (tests/fake_slurm.py)", 2)
    asks = {}
    g = _gres_gpus(opts.get("gres"))
    if g is not None:
        asks["--gres"] = {n: g for n in nodes}
    if "gpus-per-node" in opts:
        asks["--gpus-per-node"] = {n: _count(opts["gpus-per-node"]) for n in nodes}
    if "gpus-per-task" in opts:
        asks["--gpus-per-task"] = {n: _count(opts["gpus-per-task"]) * tasks_per_node for n in nodes}
    t = _tres_gpus(opts.get("tres-per-task"))
    if t is not None:
        asks["--tres-per-task"] = {n: t * tasks_per_node for n in nodes}
    if "gpus" in opts:  # a step total: spread as evenly as the nodes allow
        total = _count(opts["gpus"])
        base, extra = divmod(total, len(nodes))
        asks["--gpus"] = {n: base + (1 if i < extra else 0) for i, n in enumerate(nodes)}
    if not asks:
        return {n: None for n in nodes}
    first = next(iter(asks.values()))
    if any(a != first for a in asks.values()):
        raise Refused(f"srun: error: Unable to create step for job {_job_id()}: {NOT_AVAILABLE} "
                      f"(GPU counts disagree: {asks})", 1)
    return first


def _job_id() -> str:
    return os.environ.get("SLURM_JOB_ID", "0")


def allocate(opts: dict, nodes: list[str], tasks_per_node: int, steps: list[dict]) -> dict:
    """{node: [GPU numbers]} for a new step, given the running ones."""
    have = int(os.environ.get("FAKE_SLURM_GPUS_PER_NODE", "0"))
    overlap = "overlap" in opts
    demand = gpu_demand(opts, nodes, tasks_per_node)
    out = {}
    for node in nodes:
        want = have if demand[node] is None else demand[node]
        if want > have:
            raise Refused(f"srun: error: Unable to create step for job {_job_id()}: {NOT_AVAILABLE} "
                          f"({want} GPUs asked on {node}, the job has {have} there)", 1)
        held = set()
        if not overlap:
            for s in steps:
                if _running(s) and not s["overlap"]:
                    held.update(s["gpus"].get(node, []))
        free = [g for g in range(have) if g not in held]
        if want > len(free):
            raise Refused(f"srun: Job {_job_id()} step creation temporarily disabled, retrying (Requested nodes "
                          f"are busy) [fake srun: {want} GPUs asked on {node}, {len(free)} free; real srun would "
                          "wait here, this one refuses]", 1)
        out[node] = free[:want]
    return out


def apply_env_prefix(command: list[str], env: dict) -> dict:
    """The environment a command starting with `env [-u NAME] [NAME=VALUE]... prog` gives `prog`."""
    env = dict(env)
    if not command or os.path.basename(command[0]) != "env":
        return env
    i = 1
    while i < len(command):
        tok = command[i]
        if tok == "-u":
            env.pop(command[i + 1], None)
            i += 2
        elif tok.startswith("--unset="):
            env.pop(tok.split("=", 1)[1], None)
            i += 1
        elif tok in ("-i", "--ignore-environment", "-"):
            env = {}
            i += 1
        elif "=" in tok and not tok.startswith("-"):
            k, v = tok.split("=", 1)
            env[k] = v
            i += 1
        else:
            break
    return env


def _output_path(pattern: str, node: str, task: int, step: int, name: str) -> str:
    subs = {"N": node, "t": str(task), "s": str(step), "j": _job_id(), "J": f"{_job_id()}.{step}", "x": name, "%": "%"}
    return re.sub(r"%([NtsjJx%])", lambda m: subs[m.group(1)], pattern)


def srun_main(argv: list[str]) -> int:
    env = dict(os.environ)
    try:
        cli, command = parse_srun(argv)
        opts, source = effective_options(cli, env)
        job_nodes = os.environ.get("FAKE_SLURM_NODES", "").split()
        if "nodelist" in opts:
            nodes = opts["nodelist"].split(",")
        else:
            nodes = job_nodes[:int(opts.get("nodes", 1))]
        unknown = [n for n in nodes if n not in job_nodes]
        if unknown:
            raise Refused(f"srun: error: Unable to create step for job {_job_id()}: Requested node(s) {unknown} "
                          f"not in the job's allocation {job_nodes}", 1)
        if "nodes" in opts and int(opts["nodes"]) != len(nodes):
            raise Refused(f"srun: error: --nodes={opts['nodes']} but --nodelist names {len(nodes)} node(s)", 1)
        ntasks = int(opts.get("ntasks", len(nodes) * int(opts.get("ntasks-per-node", 1))))
        if ntasks % len(nodes):
            raise Refused(f"fake srun: {ntasks} tasks over {len(nodes)} nodes is not modelled", 2)
        per_node = ntasks // len(nodes)
        noexec = os.environ.get("FAKE_SRUN_NOEXEC") == "1"
        stop: list = []
        if not noexec:  # from here on, as real srun: TERM or INT kills the step's tasks
            signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
            signal.signal(signal.SIGINT, lambda s, f: stop.append(s))
        with _Lock():  # allocation, start and record at once: squeue/scancel see a step with its tasks
            d = _state_dir()
            steps = load_steps(d)
            gpus = allocate(opts, nodes, per_node, steps)
            step_no = len(steps)
            name = opts.get("job-name", "")
            rec = {"step": step_no, "id": f"{_job_id()}.{step_no}", "name": name, "nodes": nodes,
                   "gpus": gpus, "overlap": "overlap" in opts, "options": opts, "sources": source,
                   "srun_argv": argv, "command": command, "state": "held" if noexec else "running",
                   "srun_pid": os.getpid(), "tasks": [], "start": time.time(), "end": None, "rc": None,
                   "task_env": apply_env_prefix(command, _task_env(env, nodes[0], 0, 0, step_no, gpus[nodes[0]],
                                                                    nodes, ntasks))}
            procs = [] if noexec else _start_tasks(rec, env, opts, per_node)
            rec["tasks"] = [{"pid": p.pid} for p in procs]
            path = os.path.join(d, "steps", f"{step_no}.json")
            _write(path, rec)
    except Refused as e:
        print(e.line, file=sys.stderr, flush=True)
        return e.code
    if noexec:
        return 0
    return _wait_tasks(rec, path, procs, opts, stop)


def _task_env(env: dict, node: str, task: int, local: int, step: int, gpus: list, nodes: list, ntasks: int) -> dict:
    e = dict(env)
    e.update(SLURMD_NODENAME=node, SLURM_STEP_ID=str(step), SLURM_STEPID=str(step), SLURM_PROCID=str(task),
             SLURM_LOCALID=str(local), SLURM_NODEID=str(nodes.index(node)), SLURM_STEP_NODELIST=",".join(nodes),
             SLURM_STEP_NUM_NODES=str(len(nodes)), SLURM_STEP_NUM_TASKS=str(ntasks))
    if gpus:
        e["CUDA_VISIBLE_DEVICES"] = e["SLURM_STEP_GPUS"] = ",".join(map(str, gpus))
    else:
        e.pop("CUDA_VISIBLE_DEVICES", None)
        e.pop("SLURM_STEP_GPUS", None)
    return e


def _start_tasks(rec: dict, env: dict, opts: dict, per_node: int) -> list:
    files, procs = {}, []
    ntasks = per_node * len(rec["nodes"])
    for ni, node in enumerate(rec["nodes"]):
        for local in range(per_node):
            task = ni * per_node + local
            out = None
            if "output" in opts:
                p = _output_path(opts["output"], node, task, rec["step"], rec["name"])
                if p not in files:
                    files[p] = open(p, "w")
                out = files[p]
            e = _task_env(env, node, task, local, rec["step"], rec["gpus"][node], rec["nodes"], ntasks)
            procs.append(subprocess.Popen(rec["command"], env=e, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT if out else None, start_new_session=True))
    for f in files.values():
        f.close()
    return procs


def _wait_tasks(rec: dict, path: str, procs: list, opts: dict, stop: list) -> int:
    killed = None
    while any(p.poll() is None for p in procs):
        bad = "kill-on-bad-exit" in opts and any(p.returncode not in (None, 0) for p in procs)
        if (stop or bad) and killed is None:
            killed = signal.Signals(stop[0]).name if stop else "a task's bad exit"
            for p in procs:
                if p.poll() is None:
                    _killpg(p.pid, signal.SIGKILL)
        time.sleep(0.02)
    codes = [p.returncode if p.returncode >= 0 else 128 - p.returncode for p in procs]
    rec.update(state="done", end=time.time(), rc=max(codes), task_rcs=codes, killed_by_srun=killed)
    with _Lock():
        _write(path, rec)
    return max(codes)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- squeue, scancel --------------------------------------------------------------------------------------
def squeue_main(argv: list[str]) -> int:
    job, fmt, steps_view = None, None, False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--noheader"):
            pass
        elif a in ("-s", "--steps"):
            steps_view = True
        elif a in ("-j", "-o"):
            i += 1
            if a == "-j":
                job = argv[i]
            else:
                fmt = argv[i]
        else:
            print(f"fake squeue: option {a} is not modelled (tests/fake_slurm.py)", file=sys.stderr)
            return 2
        i += 1
    if not steps_view or fmt is None or set(re.findall(r"%(\w)", fmt)) - {"i", "j"}:
        print(f"fake squeue: only `squeue -h -s -j JOB -o '%i %j'` is modelled (got {argv})", file=sys.stderr)
        return 2
    for s in load_steps(_state_dir()):
        if _running(s) and (job is None or s["id"].split(".")[0] == job):
            print(fmt.replace("%i", s["id"]).replace("%j", s["name"]))
    return 0


def scancel_main(argv: list[str]) -> int:
    sig, ids = None, []
    for a in argv:
        if a.startswith("--signal="):
            sig = a.split("=", 1)[1]
        elif a.startswith("-"):
            print(f"fake scancel: option {a} is not modelled (tests/fake_slurm.py)", file=sys.stderr)
            return 2
        else:
            ids.append(a)
    if sig is None or not ids:
        print("fake scancel: only `scancel --signal=SIG JOB[.STEP]...` is modelled", file=sys.stderr)
        return 2
    signum = getattr(signal, "SIG" + sig.upper().removeprefix("SIG"))
    with _Lock():
        steps = [s for s in load_steps(_state_dir()) if _running(s)]
    hit = [s for s in steps if s["id"] in ids or s["id"].split(".")[0] in ids]
    _log_signal({"time": time.time(), "signal": sig, "targets": ids, "steps": [s["id"] for s in hit],
                 "names": [s["name"] for s in hit]})
    for s in hit:
        for t in s["tasks"]:
            _killpg(t["pid"], signum)
    return 0


def main() -> int:
    tool, argv = sys.argv[1], sys.argv[2:]
    return {"srun": srun_main, "squeue": squeue_main, "scancel": scancel_main}[tool](argv)


if __name__ == "__main__":
    sys.exit(main())
