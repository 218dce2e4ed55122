"""The python tool's sandbox under attack (rlpo_mega/environments/sandbox.py): each case is a tool call that tries
something a model's code must not do, and fails with nothing lost on the host.

Both mechanisms run every case, with no skip: the namespaces made directly (always possible here: CI runs as
root) and bubblewrap (`make venv` installs it where it can; where it is missing or older than 0.7 its half of
the suite fails, saying so). As root the sandbox runs in "root" mode (the code drops to a uid of its own per
call); test_unprivileged_trainer runs the attacks again as an unprivileged user ("userns" mode).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from rlpo_mega.config import EnvironmentConfig
from rlpo_mega.environments import sandbox as sb
from rlpo_mega.environments.sandbox import Limits, SandboxError, sandbox_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MECHANISMS = ("direct", "bwrap")


@pytest.fixture(scope="module", params=MECHANISMS)
def box(request):
    mechanism = request.param
    if mechanism == "bwrap":
        path = shutil.which("bwrap")
        version = sb._bwrap_version(path) if path else None
        if version is None or version < sb.BWRAP_MIN:
            found = f"{path} is {version}" if path else "not installed"
            pytest.fail(f"bubblewrap >= 0.7 is needed for the bwrap half of the sandbox suite ({found}): the "
                        "venv's set-up (or `make sandbox-deps`) installs it where it can (root with apt-get or "
                        "dnf); else `apt-get install bubblewrap` (Debian 12: 0.8, Ubuntu 24.04: 0.9)", pytrace=False)
    return sandbox_for(mechanism)


def run(box, code, **limits):
    return box.run(textwrap.dedent(code), Limits(**{"time_limit": 10.0, **limits}))


def failed(r):
    return r.exit_code != 0


# --------------------------------------------------------------------------------------------------------------
# Files the trainer owns

@pytest.fixture
def owned(tmp_path):
    """Files as a run leaves them: a checkpoint and a file beside it, a file of the run directory, a file in the
    trainer's home directory (the real one: the sandbox must not show it either)."""
    tag = uuid.uuid4().hex
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    files = {"checkpoint": ckpt / "model.safetensors", "beside a checkpoint": ckpt.parent / "latest",
             "run directory": tmp_path / "run" / "config.yaml",
             "home directory": pathlib.Path.home() / f".rlpo-sandbox-test-{tag}"}
    for name, f in files.items():
        f.write_text(f"secret {tag} {name}")
    yield files
    files["home directory"].unlink(missing_ok=True)


def state(files):
    """What must not change: each file's content, inode and mtime, and the listing of each file's directory."""
    return {name: (f.read_text(), f.stat().st_ino, f.stat().st_mtime_ns, sorted(os.listdir(f.parent)))
            for name, f in files.items()}


ATTACKS = {
    "read": "print(open({p!r}).read())",
    "delete": "import os; os.remove({p!r})",
    "overwrite": "open({p!r}, 'w').write('pwned')",
    "append": "open({p!r}, 'a').write('pwned')",
    "rename": "import os; os.rename({p!r}, {p!r} + '.bak')",
    "write beside": "import os; open(os.path.join(os.path.dirname({p!r}), 'evil'), 'w').write('x')",
    "list its directory": "import os; print(os.listdir(os.path.dirname({p!r})))",
}


def test_the_trainers_files_cannot_be_read_deleted_or_overwritten(box, owned):
    before = state(owned)
    for name, f in owned.items():
        for attack, code in ATTACKS.items():
            r = run(box, code.format(p=str(f)))
            assert "secret" not in r.stdout + r.stderr and f.name not in r.stdout, (box.mechanism, name, attack, r)
            if attack == "list its directory" and r.exit_code == 0:
                # root mode, the interpreter in the home directory (pyenv): that directory shows the
                # interpreter's tree and nothing else
                assert name == "home directory" and r.stdout.strip() == repr(
                    [sys.base_prefix[len(str(f.parent)) + 1:].split("/")[0]]), r
                continue
            assert failed(r) and ("FileNotFoundError" in r.stderr or "Read-only file system" in r.stderr), \
                (box.mechanism, name, attack, r)
    assert state(owned) == before


def test_nothing_outside_the_scratch_directory_is_writable(box, tmp_path):
    stdlib = os.path.dirname(os.__file__)
    base_stdlib = os.path.join(os.path.realpath(sys.base_prefix), "lib", os.path.basename(stdlib))
    targets = ["/evil", "/tmp/evil", "/usr/lib/evil", base_stdlib + "/evil", "/dev/evil", "/proc/evil",
               "/sandbox/../evil", str(tmp_path / "evil"), os.path.expanduser("~/evil")]
    for t in targets:
        r = run(box, f"open({t!r}, 'w').write('x')")
        assert failed(r) and ("Read-only file system" in r.stderr or "No such file" in r.stderr
                              or "Permission denied" in r.stderr), (t, r)
        r = run(box, f"import os; os.mkdir({t!r} + '.d')")
        assert failed(r), (t, r)
    os_py = os.path.join(base_stdlib, "os.py")
    before = open(os_py, "rb").read()
    r = run(box, f"open({os_py!r}, 'r+b').write(b'pwned')")
    assert failed(r) and ("Read-only file system" in r.stderr or "Permission denied" in r.stderr), r
    # through a link made in the scratch directory
    r = run(box, "import os; os.symlink('/usr/lib', 'l'); open('l/evil', 'w')")
    assert failed(r) and ("Read-only file system" in r.stderr or "Permission denied" in r.stderr), r
    assert open(os_py, "rb").read() == before and not os.path.exists(tmp_path / "evil")
    assert not os.path.exists("/usr/lib/evil") and not os.path.exists(base_stdlib + "/evil")


MOUNT = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
def remount_rw(path):  # MS_REMOUNT | MS_BIND, read-write
    return libc.mount(None, path.encode(), None, 32 | 4096, None), ctypes.get_errno()
"""


def test_the_read_only_binds_cannot_be_remounted(box):
    """Without capabilities (root mode: the uid drop; userns mode: capset/execve by a non-0 uid) no mount call
    succeeds; in a user namespace of the code's own, the binds it inherits are locked read-only by the kernel
    (MNT_LOCK_READONLY when mounts are copied into a less privileged mount namespace)."""
    r = run(box, MOUNT + """
print(remount_rw("/usr/lib"), remount_rw("/"), libc.umount2(b"/proc", 2))
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
print(status["CapEff"].strip(), status["CapPrm"].strip(), status["NoNewPrivs"].strip())
""")
    lines = r.stdout.splitlines()
    assert r.exit_code == 0 and lines[0] == "(-1, 1) (-1, 1) -1", r  # EPERM
    assert lines[1] == "0000000000000000 0000000000000000 1", r
    r = run(box, MOUNT + """
outer = os.getuid()
if libc.unshare(0x10000000 | 0x20000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS
    print("no user namespace", ctypes.get_errno())
else:
    try:  # root mode: the uid change made it non-dumpable, its /proc files root's: no map (still all caps there)
        open("/proc/self/setgroups", "w").write("deny")
        open("/proc/self/uid_map", "w").write("0 %d 1" % outer)
    except OSError as e:
        print("no id map:", e.strerror)
    print("in a user namespace as", os.getuid(), remount_rw("/usr/lib"))
try:
    open("/usr/lib/evil", "w")
except OSError as e:
    print("write:", e.strerror)
""")
    assert r.exit_code == 0 and r.stdout.splitlines()[-1] == "write: Read-only file system", r
    assert "(-1, 1)" in r.stdout or "no user namespace" in r.stdout, r


def test_the_scratch_directory_is_fresh_private_and_size_limited(box):
    r = run(box, """
import os
print(os.getcwd(), os.environ["HOME"], os.environ["TMPDIR"], os.listdir("."))
open("left", "w").write("x")
import tempfile; tempfile.mkstemp()
""")
    assert r.exit_code == 0 and r.stdout.split() == ["/sandbox", "/sandbox", "/sandbox", "[]"], r
    r = run(box, "import os; print(os.listdir('.'))")  # the next call: nothing left behind
    assert r.exit_code == 0 and r.stdout == "[]\n", r
    # RLIMIT_FSIZE: one file past the scratch size; tmpfs size=: files that fill it together
    r = run(box, "open('big', 'wb').write(b'0' * (5 << 20))", scratch_mb=4)
    assert failed(r) and "File too large" in r.stderr, r
    r = run(box, "for i in range(3): open(f'f{i}', 'wb').write(b'0' * (3 << 20))", scratch_mb=4)
    assert failed(r) and "No space left on device" in r.stderr, r


def test_nothing_it_writes_outlives_the_call(box, tmp_path):
    tag = uuid.uuid4().hex
    r = run(box, f"""
import os
for d in (".", os.environ["TMPDIR"], os.path.expanduser("~")):
    open(os.path.join(d, "left-{tag}"), "w").write("x")
print(sorted(os.listdir(".")))
""")
    assert r.exit_code == 0 and r.stdout.strip() == f"['left-{tag}']", r
    for d in ("/tmp", os.getcwd(), os.path.expanduser("~"), str(tmp_path), ROOT):
        assert not os.path.exists(os.path.join(d, f"left-{tag}")), d
    assert run(box, "import os; print(os.listdir())").stdout == "[]\n"


def test_no_open_file_leads_outside(box):
    """The code's only descriptors are its pipes (a descriptor of a host directory would let openat(fd, "..")
    walk the host's tree), and its root is its own: `..` of / is /, holding only what the layout binds."""
    r = run(box, """
import json, os
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
print(json.dumps([fds, sorted(os.listdir("/..")), os.path.realpath("/../../..")]))
""")
    assert r.exit_code == 0, r
    fds, top, up = json.loads(r.stdout)
    assert fds[:3] == [0, 1, 2] and len(fds) == 4, r  # and listdir's own
    assert top == sorted({a[-1].split("/")[1] for kind, *a in box.layout} | {"dev", "proc", "sandbox"}), r
    assert up == "/", r


def test_the_environment_is_cleared(box, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-key-of-the-run")
    r = run(box, """
import os, glob
print(sorted(os.environ))
for f in glob.glob("/proc/*/environ"):
    try:
        assert b"secret-key" not in open(f, "rb").read(), f
    except PermissionError:
        pass
""")
    assert r.exit_code == 0, r
    assert eval(r.stdout) == sorted(["HOME", "LANG", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                     "PATH", "TMPDIR"] + (["PWD"] if box.mechanism == "bwrap" else [])), r


def _pid_ns_members(ns):
    """Host pids whose PID namespace is `ns` (as /proc/PID/ns/pid reads)."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.readlink(f"/proc/{p}/ns/pid") == ns:
                    out.append(int(p))
            except OSError:
                pass
    return out


def assert_nothing_left(r, within=5.0):
    """The call's PID namespace (its code printed NS=...) has no process left."""
    ns = next(line[3:] for line in r.stdout.splitlines() if line.startswith("NS="))
    end = time.monotonic() + within
    while _pid_ns_members(ns) and time.monotonic() < end:
        time.sleep(0.05)
    assert _pid_ns_members(ns) == [], ns


NS = "import os; print('NS=' + os.readlink('/proc/self/ns/pid'), flush=True)\n"


def test_processes_outside_cannot_be_seen_or_signalled(box):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        r = run(box, f"""
import os, signal
print(sorted(p for p in os.listdir("/proc") if p.isdigit()), os.getpid())
for pid in ({sleeper.pid}, {os.getpid()}, {os.getppid()}):
    try:
        os.kill(pid, signal.SIGKILL)
        print("killed", pid)
    except ProcessLookupError:
        pass
try:
    os.kill(1, signal.SIGKILL)  # the namespace's init: the kernel drops it (userns mode), or EPERM (root mode)
except PermissionError:
    pass
print("alive")
""")
        assert r.exit_code == 0 and r.stdout.splitlines() == ["['1', '2'] 2", "alive"], r
        # kill(-1): every process this one may signal -- in its own PID namespace only (it ends the call)
        r = run(box, NS + "import os, signal; os.kill(-1, signal.SIGKILL); os.kill(0, signal.SIGKILL)")
        assert failed(r), r
        assert sleeper.poll() is None  # the host's process lives on, and so do we
    finally:
        sleeper.kill()
        sleeper.wait()


def test_no_network(box):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    abstract = socket.socket(socket.AF_UNIX)
    name = f"\0rlpo-sandbox-test-{uuid.uuid4().hex}"
    abstract.bind(name)
    abstract.listen()
    listener.settimeout(0.2)
    try:
        for target in ("('1.1.1.1', 80)", f"('127.0.0.1', {listener.getsockname()[1]})"):
            r = run(box, f"import socket; socket.create_connection({target}, timeout=3)")
            assert failed(r) and ("OSError" in r.stderr or "ConnectionRefusedError" in r.stderr), (target, r)
        r = run(box, f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({name!r})")
        assert failed(r) and "ConnectionRefusedError" in r.stderr, r  # another network namespace's name
        r = run(box, "import socket; print(socket.if_nameindex())")
        assert r.exit_code == 0 and r.stdout.strip() == "[(1, 'lo')]", r
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
        abstract.close()


def test_a_fork_bomb_ends_the_call_not_the_node(box):
    r = run(box, NS + """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print("forked", n, e.errno)
""", max_processes=16)
    assert r.exit_code == 0, r
    forked = r.stdout.splitlines()[-1].split()
    assert forked[0] == "forked" and int(forked[1]) < 16 and forked[2] == "11", r  # EAGAIN at RLIMIT_NPROC
    assert_nothing_left(r)  # its sleeping children went with the call
    # the classic: every process forks on, until the time limit
    t = time.monotonic()
    r = run(box, NS + """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
""", time_limit=2, max_processes=16)
    assert r.limit == "time" and time.monotonic() - t < 4, r
    assert_nothing_left(r)


def test_memory_past_the_limit(box):
    r = run(box, "x = bytearray(600 << 20)", memory_mb=256)
    assert failed(r) and "MemoryError" in r.stderr, r
    r = run(box, """
import os
pid = os.fork()
if pid == 0:
    try:
        x = bytearray(600 << 20)
    except MemoryError:
        os._exit(3)
    os._exit(0)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
""", memory_mb=256)
    assert r.exit_code == 0 and r.stdout == "3\n", r  # children inherit the limit


def test_output_past_the_limit(box):
    t = time.monotonic()
    for code in ("while True: print('x' * 10000)", "import sys\nwhile True: sys.stderr.write('y' * 10000)"):
        r = run(box, code, max_output_bytes=100_000)
        assert r.limit == "output" and r.exit_code is None, r
        assert 100_000 < len(r.stdout) + len(r.stderr) <= 100_000 + (1 << 16) + 64, len(r.stdout + r.stderr)
    assert time.monotonic() - t < 8  # stopped at the limit, not at the time limit


def test_the_time_limit_kills_the_whole_tree(box, tmp_path):
    """A call past its time limit returns at the limit, with every process it made gone: a child that left its
    session (setsid), cleared its parent-death signal, double-forked and ignores SIGTERM and SIGHUP while
    holding the output pipes open."""
    escape = NS + """
import ctypes, os, signal, time
if os.fork() == 0:
    os.setsid()
    ctypes.CDLL(None).prctl(1, 0)  # PR_SET_PDEATHSIG 0
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        time.sleep(60)
    os._exit(0)
time.sleep(60)
"""
    t = time.monotonic()
    r = run(box, escape, time_limit=2)
    took = time.monotonic() - t
    assert r.limit == "time" and r.exit_code is None and took < 3.5, (took, r)
    assert_nothing_left(r)
    # the code's process ends at once, a daemon it left holds stdout: the call ends with it, not at the limit
    t = time.monotonic()
    r = run(box, NS + """
import os, time
if os.fork() == 0:
    os.setsid()
    time.sleep(60)
print("main done")
""", time_limit=20)
    took = time.monotonic() - t
    assert r.exit_code == 0 and r.stdout.endswith("main done\n") and took < 5, (took, r)
    assert_nothing_left(r)


def test_declared_paths_are_read_only(box, tmp_path):
    data, lib = tmp_path / "data", tmp_path / "lib"
    data.mkdir()
    lib.mkdir()
    (data / "table.txt").write_text("1 2 3")
    (lib / "helper_mod.py").write_text("VALUE = 42\n")
    for p in (tmp_path, data, lib, data / "table.txt", lib / "helper_mod.py"):  # writable by anyone, but
        p.chmod(0o777)  # the binds are read-only
    declared = sandbox_for(box.mechanism, (str(data),), (str(lib),))
    r = declared.run(f"import helper_mod; print(helper_mod.VALUE, open({str(data / 'table.txt')!r}).read())",
                     Limits(time_limit=10))
    assert r.exit_code == 0 and r.stdout == "42 1 2 3\n", r
    for target in (data / "table.txt", lib / "helper_mod.py", data / "new"):
        r = declared.run(f"open({str(target)!r}, 'w').write('x')", Limits(time_limit=10))
        assert failed(r) and "Read-only file system" in r.stderr, r
    assert (data / "table.txt").read_text() == "1 2 3" and sorted(os.listdir(data)) == ["table.txt"]
    # a run-directory file beside the declared one stays hidden
    r = declared.run(f"open({str(tmp_path / 'run.yaml')!r})", Limits(time_limit=10))
    assert failed(r) and "No such file" in r.stderr, r


def test_the_model_cannot_pose_as_a_sandbox_failure(box):
    """A setup failure is the sandbox's (SandboxError); code that exits as the helper would on one is the
    model's failed call."""
    r = run(box, "import os, sys; sys.stderr.write('sandbox setup: unshare: EPERM\\n'); os._exit(97)")
    assert r.exit_code == 97 and r.limit == "", r


def test_a_call_costs_under_50_ms_more_than_before(box):
    """tools/bench_sandbox.py's comparison, small: the old call (user + network namespaces) and the sandbox's,
    interleaved; the fastest of each (the least disturbed by a busy machine) 50 ms apart at most."""
    from tools.bench_sandbox import old_run_python

    old, new = [], []
    for _ in range(10):
        t = time.perf_counter()
        assert old_run_python("print(1)", 5.0, 512)[1] == "1\n"
        old.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert box.run("print(1)", Limits()).stdout == "1\n"
        new.append(time.perf_counter() - t)
    assert min(new) - min(old) < 0.050, (sorted(old), sorted(new))


# --------------------------------------------------------------------------------------------------------------
# The start: one line where no sandbox can be made; the python tool's steps

def test_the_environment_refuses_to_start_without_a_sandbox(monkeypatch):
    from rlpo_mega.config import ConfigError
    from rlpo_mega.environments import EnvRunner
    from rlpo_mega.errors import is_user_error, message

    monkeypatch.setattr(sb.shutil, "which", lambda name: None)  # no bwrap on PATH
    monkeypatch.setattr(sb, "PIVOT_ROOT", {})  # and no way to make the namespaces directly
    sandbox_for.cache_clear()
    try:
        with pytest.raises(SandboxError) as e:
            EnvRunner(EnvironmentConfig(name="python", options={"sandbox": "bwrap"}))
        assert "bwrap: not installed" in str(e.value) and "install bubblewrap" in str(e.value)
        with pytest.raises(SandboxError) as e:
            EnvRunner(EnvironmentConfig(name="python"))
        line = message(e.value)
        assert is_user_error(e.value) and "\n" not in line, line
        assert "bwrap: not installed" in line and "direct: no pivot_root" in line, line
        with pytest.raises(ConfigError, match="options.sandbox='docker' is not known"):
            EnvRunner(EnvironmentConfig(name="python", options={"sandbox": "docker"}))
        with pytest.raises(ConfigError, match="max_processes=0: must be > 0"):
            EnvRunner(EnvironmentConfig(name="python", options={"max_processes": 0}))
        with pytest.raises(ConfigError, match="does not exist"):
            EnvRunner(EnvironmentConfig(name="python", options={"paths": ["/no/such/dir"]}))
    finally:
        sandbox_for.cache_clear()


def test_the_python_tool_reports_each_limit_as_a_failed_call(box):
    from rlpo_mega.data.dataset import PromptRecord
    from rlpo_mega.environments import ENVIRONMENTS, Action, EnvRunner

    cfg = EnvironmentConfig(name="python", options={"sandbox": box.mechanism, "time_limit": 3,
                                                    "max_output_bytes": 50_000, "max_output": 200})
    runner = EnvRunner(cfg)  # the start-time check passes
    env = runner.make(PromptRecord(0, "What is 6*7?", "42"))
    assert env.sandbox.mechanism == box.mechanism
    fb = env.step(Action((), "<python>print(6*7)</python>", 0))
    assert fb.messages == [{"role": "tool", "content": "42\n"}] and fb.tool_errors == 0
    fb = env.step(Action((), "<python>while True: print('x' * 1000)</python>", 1))
    assert fb.tool_errors == 1 and fb.messages[0]["content"].endswith(
        "OutputLimitError: the call wrote more than 50000 bytes"), fb
    fb = env.step(Action((), "<python>open('/etc/passwd')</python>", 2))
    assert fb.tool_errors == 1 and "FileNotFoundError" in fb.messages[0]["content"], fb
    assert "File \"<string>\"" not in fb.messages[0]["content"]  # the sandbox's own frames are not shown


# --------------------------------------------------------------------------------------------------------------
# An unprivileged trainer: "userns" mode

_UNPRIVILEGED = r'''
import importlib.util, json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("sandbox", os.path.join(sys.argv[1], "rlpo_mega/environments/sandbox.py"))
sb = importlib.util.module_from_spec(spec); sys.modules["sandbox"] = sb; spec.loader.exec_module(sb)
d = tempfile.mkdtemp()
ckpt = os.path.join(d, "model.pt")
open(ckpt, "w").write("secret")
out = {"uid": os.getuid(), "root_mode": sb._real_root()}
for mech in sys.argv[2:]:
    try:
        box = sb.sandbox_for(mech)
    except sb.SandboxError as e:
        out[mech] = {"refused": str(e)}
        continue
    L = sb.Limits(time_limit=10)
    res = out[mech] = {}
    r = box.run("import os; print(os.getuid(), os.listdir('/proc'), os.listdir('/'))", L)
    res["who"] = [r.exit_code, r.stdout]
    for name, code in (("read", "print(open(%r).read())" % ckpt), ("delete", "import os; os.remove(%r)" % ckpt),
                       ("write", "open(%r, 'w')" % os.path.join(d, "evil"))):
        r = box.run(code, L)
        res[name] = [r.exit_code, "secret" in r.stdout, r.stderr.strip().splitlines()[-1:]]
    r = box.run("""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
print(libc.mount(None, b"/usr/lib", None, 32 | 4096, None), ctypes.get_errno())
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
print(status["CapEff"].strip())
import subprocess, sys
print(subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])"],
                     capture_output=True, text=True).stdout.strip())
""", L)
    res["remount"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]
    r = box.run("""
import os
n = 0
try:
    while True:
        if os.fork() == 0:
            import time; time.sleep(30); os._exit(0)
        n += 1
except OSError as e:
    print(n, e.errno)
""", sb.Limits(time_limit=10, max_processes=8))
    res["forkbomb"] = [r.exit_code, r.stdout.split()]
    r = box.run("import time; time.sleep(60)", sb.Limits(time_limit=1))
    res["time"] = r.limit
# could this user make a user namespace at all? (if not, the sandbox must refuse, never run weaker)
pid = os.fork()
if pid == 0:
    import ctypes
    os._exit(0 if ctypes.CDLL(None).unshare(0x10000000) == 0 else 1)
out["userns_allowed"] = os.waitpid(pid, 0)[1] == 0
out["intact"] = open(ckpt).read() == "secret" and os.listdir(d) == ["model.pt"]
print(json.dumps(out))
'''

# As root: a mount namespace of its own in which the directories the interpreter, the venv and the repository
# sit under are traversable (e.g. /root, 0700, holding pyenv), then uid/gid 65534 and the script.
_AS_NOBODY = r'''
import ctypes, json, os, sys
a = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
def ck(r, what):
    if r != 0:
        raise OSError(ctypes.get_errno(), what)
ck(libc.unshare(0x20000), "unshare")  # CLONE_NEWNS
ck(libc.mount(None, b"/", None, 16384 | (1 << 18), None), "make private")  # MS_REC | MS_PRIVATE
closed = {}
needed = sorted(set(map(os.path.realpath, a["needed"])))
for p in needed:
    if any(p.startswith(q + "/") for q in needed):
        continue  # inside another
    d = "/"
    for part in p.strip("/").split("/"):
        d = os.path.join(d, part)
        if not os.stat(d).st_mode & 0o001:
            closed.setdefault(d, []).append(p)
            break
for d, inside in closed.items():
    fds = [(p, os.open(p, os.O_PATH)) for p in inside]
    ck(libc.mount(b"tmpfs", d.encode(), b"tmpfs", 0, b"mode=0755"), "tmpfs on " + d)
    for p, fd in fds:
        os.makedirs(p, exist_ok=True)
        ck(libc.mount(("/proc/self/fd/%d" % fd).encode(), p.encode(), None, 4096 | 16384, None), "bind " + p)
os.setgroups([])
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)
os.execv(a["python"], [a["python"], "-c", a["script"], *a["args"]])
'''


def test_unprivileged_trainer(tmp_path):
    """The attacks again from an unprivileged trainer (as root: uid 65534; "userns" mode: the code in a user
    namespace of its own): run as that uid, can read, delete or write nothing of the trainer's, cannot remount
    (no capability, also after an execve), a fork bomb stops at max_processes, the time limit holds. Where
    this kernel forbids such a user a user namespace, the sandbox refuses to start (never runs weaker)."""
    py = os.path.join(ROOT, ".venv", "bin", "python")
    py = py if os.path.exists(py) else sys.executable
    if os.geteuid() == 0:
        argv = [sys.executable, "-c", _AS_NOBODY, json.dumps({
            "python": py, "script": _UNPRIVILEGED, "args": [ROOT, *MECHANISMS],
            "needed": [sys.base_prefix, sys.prefix, ROOT]})]
    else:
        argv = [py, "-c", _UNPRIVILEGED, ROOT, *MECHANISMS]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={"PATH": os.environ["PATH"]},
                       cwd="/")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["uid"] != 0 and not out["root_mode"] and out["intact"], out
    for mech in MECHANISMS:
        res = out[mech]
        if not out["userns_allowed"]:
            assert "refused" in res, res  # no user namespace for this user: refused, not weaker
            continue
        assert "refused" not in res, res
        who = res["who"][1].split(" ", 1)
        assert res["who"][0] == 0 and who[0] == str(out["uid"]), res
        for name in ("read", "delete", "write"):
            code, leaked, err = res[name]
            assert code != 0 and not leaked and ("No such file" in err[0] or "Read-only" in err[0]), (mech, name, res)
        assert res["remount"][0] == 0 and res["remount"][1] == ["-1", "1", "0000000000000000",
                                                                 "0000000000000000"], res
        assert res["forkbomb"][0] == 0 and int(res["forkbomb"][1][0]) < 8 and res["forkbomb"][1][1] == "11", res
        assert res["time"] == "time", res
