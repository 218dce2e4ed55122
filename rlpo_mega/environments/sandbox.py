"""The `python` tool's sandbox: model-written code in its own filesystem, processes, network and limits.

Each call runs a fresh interpreter (the trainer's base interpreter, `-I -S`: no site, no venv, no user paths)
in new mount, PID, network, IPC, UTS and cgroup namespaces:

* Filesystem: the root is an empty read-only tmpfs holding only, read-only and at their host paths, the
  interpreter, its library directory (the standard library, libpython), the system library directories (libc
  and friends: /usr/lib, /lib64...), /etc/ld.so.cache, and the paths the environment's options declare
  (`paths`, `python_path`); /dev holds null, zero, random and urandom; /proc is the new PID namespace's own. The
  working directory /sandbox (also HOME and TMPDIR) is a fresh, empty tmpfs of `scratch_mb`, the only writable
  place; it goes with the namespace at the end of the call. Nothing else of the host is there: not the run
  directory, checkpoints, prompts, home directories, /tmp, /etc, /sys. The environment is cleared.
* Processes: PID 1 of the namespace is a reaper the code cannot signal (the kernel drops signals to a namespace's
  init that it has no handler for, even from inside, see pid_namespaces(7)); the code runs as PID 2 in a session of
  its own, without capabilities, with PR_SET_NO_NEW_PRIVS, under RLIMIT_AS (memory_mb), RLIMIT_CPU,
  RLIMIT_NPROC (max_processes), RLIMIT_NOFILE (max_open_files), RLIMIT_FSIZE (scratch), RLIMIT_CORE 0.
  When its process ends, or at the call's time limit (the reaper and its parent are SIGKILLed), the reaper's
  death makes the kernel SIGKILL every process left in the namespace (zap_pid_ns_processes), daemons and
  setsid() escapees included, so no descendant outlives the call or holds its pipes open.
* Network: a new network namespace, whose only interface is a loopback that is down.
* Output: read by the trainer a chunk at a time; past max_output_bytes the call is killed.

Who the code runs as. RLIMIT_NPROC is not enforced for a task whose real kernel uid is 0 (copy_process checks
`cred->user != INIT_USER`, whatever the user namespace), and a root sandbox keeps capabilities that could remount
its read-only binds. So:
* "root" mode (the trainer is real root, as in CI): no user namespace; the code drops, before it runs, to a uid
  of its own per call (UID_BASE + pid-derived block + slot: owning no host file, sharing its process count with
  no other call); setresuid() from 0 to non-0 clears every capability (capabilities(7), "Effect of user ID
  changes on capabilities").
* "userns" mode (any other user, or root inside a container's user namespace): a new user namespace maps the
  trainer's own uid to the sandbox uid (its own, or 1000 when that is 0: an execve by uid 0 in a user namespace
  would regain every capability in it); RLIMIT_NPROC then counts this call's tasks (per user namespace and uid,
  kernel >= 5.14; older kernels count all of the trainer user's tasks, so max_processes is tighter there).

Two mechanisms make the same sandbox, picked once per process (options.sandbox: auto, bwrap, direct):
* bwrap: bubblewrap >= 0.7 (`--size` for a tmpfs came in 0.7.0). bwrap sets PR_SET_NO_NEW_PRIVS itself and, as
  root, keeps only the capabilities named by --cap-add (CAP_SETUID/SETGID: what the drop needs).
* direct: the same namespaces made by a small helper through libc (ctypes: Python 3.11 has no os.unshare),
  which forks the namespace's init and the code's process; it runs the code in that process (no second
  interpreter start), so it drops every capability itself (capset) -- in a user namespace a process that does
  not execve keeps them, and could remount the read-only binds read-write.
Where neither works the environment refuses to start (SandboxError, one line), never a weaker sandbox.
"""
from __future__ import annotations

import functools
import json
import os
import queue
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from rlpo_mega.config import ConfigError

MECHANISMS = ("auto", "bwrap", "direct")
BWRAP_MIN = (0, 7, 0)  # --size (a tmpfs's size) came in bubblewrap 0.7.0
SCRATCH = "/sandbox"  # the code's working directory, HOME and TMPDIR: the only writable path
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache")
UID_BASE = 0x70000000  # root mode: per-call uids 0x70000000..0x7fffffff, above the usual container ranges and
UID_SLOTS = 64  # below 2**31; a block of 64 per trainer pid (pid_max <= 2**22)
USERNS_UID = 1000  # userns mode, trainer uid 0 (a container's root): the uid the code gets instead
SETUP_FAILED = 97  # the sandbox could not be made (the code never ran)
READY = b"\0rlpo-sandbox-ready\0"  # written by the trusted boot code right before the model's code runs
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217, "riscv64": 41}


class SandboxError(ConfigError):
    """The python tool's sandbox cannot be made here (at start: the environment refuses to start)."""


@dataclass(frozen=True)
class Limits:
    time_limit: float = 5.0  # s, wall clock from the spawn (start-up included)
    memory_mb: int = 512  # RLIMIT_AS of each process
    scratch_mb: int = 64  # the scratch directory.s tmpfs, and RLIMIT_FSIZE
    max_processes: int = 32  # RLIMIT_NPROC: tasks (processes and threads) of the call
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # stdout + stderr; past it the call is killed


@dataclass
class Result:
    exit_code: Optional[int]  # None: killed at a limit
    limit: str  # "" | "time" | "output": the limit it was killed at
    stdout: str
    stderr: str


# --------------------------------------------------------------------------------------------------------------
# Code that runs inside the sandbox, before the model's (trusted). _ENTER is shared by both mechanisms.

_ENTER = r'''
def _enter(uid, limits, sys_path):
    """Become the code's process: the per-call uid (root mode), the limits, the declared sys.path, then the
    model's code as __main__ (read from stdin after the READY mark, so the trainer knows setup succeeded)."""
    import os, resource, sys
    if uid >= 0:  # root mode: every capability goes with uid 0 (capabilities(7)); groups first, while allowed
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    # RLIMIT_NPROC only now, inside the namespaces: set before a user namespace exists, it would be checked
    # against all of the user's tasks at the parent level (kernel/ucount.c, is_rlimit_overlimit)
    for name, v in limits:
        resource.setrlimit(getattr(resource, name), (v, v))
    if sys_path:
        import site
        for p in sys_path:
            site.addsitedir(p)
    os.write(1, READY)
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    sys.argv = ["tool"]
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as e:  # as the interpreter reports it, without this function's frame
        import traceback
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)
'''

# bwrap runs this as the code's process: `python -I -S -X utf8 -c _BOOT SPEC`
_BOOT = "import json, sys\nREADY = %r\n" % READY + _ENTER + r'''
_spec = json.loads(sys.argv[1])
_enter(_spec["uid"], _spec["limits"], _spec["sys_path"])
'''

# The direct mechanism: `python -I -S -X utf8 -c _HELPER SPEC`, started by the trainer in a session of its own.
_HELPER = ("import ctypes, json, os, sys\nREADY, SETUP_FAILED, SCRATCH, DEVICES = %r, %d, %r, %r\n"
           % (READY, SETUP_FAILED, SCRATCH, DEVICES)) + _ENTER + r'''
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
libc.syscall.argtypes = (ctypes.c_long, ctypes.c_char_p, ctypes.c_char_p)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_PRIVATE = 1 << 18
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38


def fail(what, errno=None):
    errno = ctypes.get_errno() if errno is None else errno
    os.write(2, ("sandbox setup: %s: %s\n" % (what, os.strerror(errno))).encode())
    os._exit(SETUP_FAILED)


def ck(r, what):
    if r != 0:
        fail(what)


def mount(src, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None
    ck(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), "mount " + target)


def waited(pid):  # a child's end as an exit code (128 + signal when killed, as a shell reports it)
    _, st = os.waitpid(pid, 0)
    return os.WEXITSTATUS(st) if os.WIFEXITED(st) else 128 + os.WTERMSIG(st)


# The trainer's thread that spawned us gone: so are we (as bwrap --die-with-parent); the trainer is our parent.
libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
if os.getppid() != spec["parent"]:
    os._exit(SETUP_FAILED)
os.umask(0o022)  # the sandbox's directories readable whatever the trainer's umask
userns = spec["uid"] < 0
uid, gid = os.geteuid(), os.getegid()
ck(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
                | (CLONE_NEWUSER if userns else 0)), "unshare")
if userns:  # map only our own ids (all an unprivileged process may map); setgroups must be denied first
    try:
        for f, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (spec["inner"][0], uid)),
                        ("gid_map", "%d %d 1" % (spec["inner"][1], gid))):
            with open("/proc/self/" + f, "w") as fh:
                fh.write(text)
    except OSError as e:
        fail("user namespace id map", e.errno)
mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted from here on propagates to the host
pid = os.fork()
if pid:  # outside the new PID namespace: wait for its init and end as it did
    os._exit(waited(pid))

# PID 1 of the new namespace. Its death (the helper killed at the time limit) ends every process in it.
libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
# What gets bound, opened (O_PATH) before the new root hides part of the host (a path under /tmp); bound
# through /proc/self/fd, as bwrap's --bind-fd
sources = {}
for path in [a[0] for kind, *a in spec["layout"] if kind == "ro"] + list(DEVICES):
    try:
        sources[path] = (os.open(path, os.O_PATH | os.O_CLOEXEC), os.path.isdir(path))
    except OSError as e:
        fail("open " + path, e.errno)
R = "/tmp"  # where the new root is built: any directory, the mount is private to this namespace
mount("tmpfs", R, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")


def bind(path, flags):
    fd, isdir = sources[path]
    if isdir:
        os.mkdir(R + path)
    else:
        open(R + path, "a").close()
    mount("/proc/self/fd/%d" % fd, R + path, None, MS_BIND)
    if flags:
        mount(None, R + path, None, MS_BIND | MS_REMOUNT | flags)


for kind, *a in spec["layout"]:
    if kind == "dir":
        os.mkdir(R + a[0], 0o755)
    elif kind == "link":  # a host symlink such as /lib -> usr/lib (merged /usr): the same link
        os.symlink(a[0], R + a[1])
    else:
        # Not MS_REC: mounts below a bound path stay out (bwrap binds them too, each read-only); in a user
        # namespace the kernel refuses such a bind of a path with mounts below it (EINVAL), which the probe
        # reports. A bind ignores MS_RDONLY: the remount makes it read-only (mount(2), "Creating a bind mount").
        bind(a[0], MS_RDONLY | MS_NOSUID | MS_NODEV)
os.mkdir(R + "/dev")
for d in DEVICES:
    bind(d, 0)
for fd, _ in sources.values():  # an O_PATH fd of a host directory would be a way out: openat(fd, "..")
    os.close(fd)
os.makedirs(R + "/proc")
os.makedirs(R + SCRATCH)
owner = spec["inner"] if userns else (spec["uid"], spec["uid"])
mount("tmpfs", R + SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV,
      "size=%dk,mode=0700,uid=%d,gid=%d" % (spec["scratch_kb"], owner[0], owner[1]))
# proc of the new PID namespace; mounted while the host's /proc is still visible: the kernel lets a user
# namespace mount proc only then (fs/namespace.c, mount_too_revealing)
mount("proc", R + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
os.makedirs(R + "/.old")
os.chdir(R)
ck(libc.syscall(spec["pivot_root"], b".", b".old"), "pivot_root")
ck(libc.umount2(b"/.old", 2), "umount the host's root")  # MNT_DETACH: the host's tree is gone from here
os.rmdir("/.old")
mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
libc.sethostname(b"sandbox", 7)
os.chdir(SCRATCH)
worker = os.fork()
if worker == 0:
    os.closerange(3, 1 << 16)  # the code gets stdin, stdout and stderr only
    os.setsid()  # its own session and group: a kill(0, ...) reaches neither the init nor the helper
    os.environ.clear()
    os.environ.update(spec["env"])
    ck(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")  # no setuid or file-capability gain on exec
    if not userns:  # root mode: the uid drop also clears every capability
        _enter(spec["uid"], spec["limits"], spec["sys_path"])
    else:
        # capset(2), version 3, all sets empty: no capability in the user namespace (a process that does not
        # execve keeps the full set the namespace's creator got, enough to remount the binds read-write)
        hdr, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
        ck(libc.capset(hdr, data), "capset")
        _enter(-1, spec["limits"], spec["sys_path"])
    sys.exit(0)
while True:  # init: reap every orphan; end with the code's process (taking the namespace with it)
    p, st = os.wait()
    if p == worker:
        os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 128 + os.WTERMSIG(st))
'''


# --------------------------------------------------------------------------------------------------------------
# The trainer's side.

def interpreter() -> str:
    """The base interpreter (never a venv's launcher: -S keeps the venv out anyway, and its path is all we bind)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _layout(extra: Sequence[str]) -> list[list[str]]:
    """What the sandbox sees, read-only at the host's paths, in order: ["dir", path] (a 0755 directory on the
    sandbox's root, a bound path's parent: bwrap would make it 0700, unreadable to the code's uid in root mode),
    ["ro", path] binds and ["link", target, path] symlinks; nothing bound twice."""
    # the base installation's lib directories: the standard library (lib/pythonX.Y, its lib-dynload) and the
    # shared libraries it links (libpython; a conda build's libssl, libffi...); on a system Python (prefix /usr)
    # that is /usr/lib, bound anyway
    libs = [os.path.join(prefix, lib) for prefix in (sys.base_prefix, sys.base_exec_prefix) for lib in ("lib", "lib64")]
    paths = [os.path.realpath(p) for p in (interpreter(), *libs) if os.path.exists(p)]
    paths += [p for p in SYSTEM_LIBS if os.path.lexists(p)] + list(extra)
    out, seen, dirs = [], [], set()
    for p in sorted(dict.fromkeys(paths), key=lambda p: (p.count("/"), p)):
        if any(p == s or p.startswith(s.rstrip("/") + "/") for s in seen):
            continue  # inside what is bound already
        seen.append(p)
        parents = []
        d = os.path.dirname(p)
        while d != "/" and d not in dirs:
            parents.append(d)
            dirs.add(d)
            d = os.path.dirname(d)
        out += [["dir", d] for d in reversed(parents)]
        if p in SYSTEM_LIBS and os.path.islink(p):  # /lib -> usr/lib (merged /usr) stays a link; any other
            out.append(["link", os.readlink(p), p])  # path is bound where it is named, from what it resolves to
        else:
            out.append(["ro", p])
    return out


def _bwrap_version(path: str) -> Optional[tuple[int, ...]]:
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g or 0) for g in m.groups()) if m else None


def _real_root() -> bool:
    """uid 0 of the initial user namespace (its identity map covers every uid): the only case where the code's
    uid 0 would be the kernel's uid 0."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return False


class _UidPool:
    """Root mode: a uid per call in flight, unique on the host (the block is the trainer's pid's); a call
    waits for a free slot when UID_SLOTS calls already run in this process."""

    def __init__(self):
        self._pid, self._free, self._lock = -1, None, threading.Lock()

    def get(self) -> int:
        with self._lock:
            if self._pid != os.getpid():  # a forked trainer process gets its own block
                self._pid, self._free = os.getpid(), queue.SimpleQueue()
                base = UID_BASE + (os.getpid() % (1 << 22)) * UID_SLOTS
                for i in range(UID_SLOTS):
                    self._free.put(base + i)
            free = self._free
        return free.get()

    def put(self, uid: int) -> None:
        self._free.put(uid)


_UIDS = _UidPool()


class Sandbox:
    """Runs code in the sandbox with one mechanism ("bwrap" or "direct"); `paths` are bound read-only,
    `python_path` too and put on the code's sys.path (site.addsitedir: .pth files apply)."""

    def __init__(self, mechanism: str, paths: Sequence[str] = (), python_path: Sequence[str] = (),
                 bwrap: Optional[str] = None):
        if mechanism not in ("bwrap", "direct"):
            raise ValueError(mechanism)
        self.mechanism = mechanism
        self.python = interpreter()
        self.root = _real_root()
        self.python_path = [os.path.abspath(p) for p in python_path]
        self.layout = _layout([os.path.abspath(p) for p in (*paths, *python_path)])
        self.bwrap = bwrap or shutil.which("bwrap") or "bwrap"
        uid = os.geteuid() or USERNS_UID
        gid = os.getegid() or USERNS_UID
        self.inner = (uid, gid)  # userns mode: the code's ids inside its user namespace
        self.env = {"PATH": os.path.dirname(self.python), "LANG": "C.UTF-8", "HOME": SCRATCH, "TMPDIR": SCRATCH,
                    # one thread per numeric library: a call has max_processes tasks, not the node's cores
                    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def _spec(self, uid: int, limits: Limits) -> dict:
        scratch = limits.scratch_mb << 20
        return {"uid": uid, "sys_path": self.python_path, "limits": [
            ["RLIMIT_AS", limits.memory_mb << 20], ["RLIMIT_CPU", int(limits.time_limit) + 1],
            ["RLIMIT_NPROC", limits.max_processes], ["RLIMIT_NOFILE", limits.max_open_files],
            ["RLIMIT_FSIZE", scratch], ["RLIMIT_CORE", 0]]}

    def _bwrap_argv(self, uid: int, limits: Limits) -> list[str]:
        a = [self.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
        for k, v in self.env.items():
            a += ["--setenv", k, v]
        if self.root:
            # No user namespace: bwrap would map the code's uid to kernel uid 0. As root bwrap keeps every
            # capability unless told (bubblewrap.c, "If our uid is 0, default to inheriting all caps"): keep
            # only what the drop to `uid` needs, which then clears them.
            a += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            a += ["--unshare-user", "--uid", str(self.inner[0]), "--gid", str(self.inner[1]), "--cap-drop", "ALL"]
        for kind, *p in self.layout:
            a += {"dir": ["--perms", "0755", "--dir", p[0]], "link": ["--symlink", *p],
                  "ro": ["--ro-bind", p[0], p[0]]}[kind]
        for d in DEVICES:
            a += ["--dev-bind", d, d]
        # --size then --perms apply to the next --tmpfs; root mode: no chown in bwrap, so the sticky 1777 of /tmp
        # (only this call's uid exists in there)
        a += ["--proc", "/proc", "--size", str(limits.scratch_mb << 20), "--perms", "01777" if self.root else "0700",
              "--tmpfs", SCRATCH, "--chdir", SCRATCH,
              "--remount-ro", "/"]  # non-recursive (bwrap(1)): the root tmpfs only, the scratch stays writable
        spec = self._spec(uid, limits)
        return a + ["--", self.python, "-I", "-S", "-X", "utf8", "-c", _BOOT, json.dumps(spec)]

    def _direct_argv(self, uid: int, limits: Limits) -> list[str]:
        spec = self._spec(uid, limits)
        spec.update(parent=os.getpid(), layout=self.layout, env=self.env, inner=list(self.inner),
                    scratch_kb=limits.scratch_mb << 10, pivot_root=PIVOT_ROOT.get(os.uname().machine, -1))
        return [self.python, "-I", "-S", "-X", "utf8", "-c", _HELPER, json.dumps(spec)]

    def run(self, code: str, limits: Limits = Limits()) -> Result:
        """`code` as __main__ in the sandbox. Raises SandboxError when the sandbox could not be made."""
        uid = _UIDS.get() if self.root else -1
        try:
            argv = (self._bwrap_argv if self.mechanism == "bwrap" else self._direct_argv)(uid, limits)
            return self._run(argv, code.encode("utf-8", "replace"), limits)
        finally:
            if uid >= 0:
                _UIDS.put(uid)

    def _run(self, argv: list[str], code: bytes, limits: Limits) -> Result:
        deadline = time.monotonic() + limits.time_limit
        # its own session: the group killed at a limit holds the helper (or bwrap) and the namespace's init,
        # whatever the code does with its own processes
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, env={}, cwd="/", close_fds=True)
        out, err = bytearray(), bytearray()
        try:
            limit = _pump(proc, code, out, err, deadline, limits.max_output_bytes + len(READY))
            if not limit:  # both pipes closed: every process of the call is ending
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0) + 1.0)
                except subprocess.TimeoutExpired:
                    limit = "time"
        except BaseException:
            _kill(proc)
            raise
        finally:
            for f in (proc.stdin, proc.stdout, proc.stderr):
                f.close()
        if limit:
            _kill(proc)
        rc = proc.wait()
        ready = out.startswith(READY)
        if not ready and not limit:  # the code never ran: the sandbox's failure, not the model's
            why = err.decode("utf-8", "replace").strip().splitlines()
            raise SandboxError(f"the python tool's sandbox ({self.mechanism}) could not be made: "
                               f"{why[-1] if why else f'exit code {rc}'}")
        del out[:len(READY) if ready else 0]
        return Result(None if limit else rc, limit, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _pump(proc, code: bytes, out: bytearray, err: bytearray, deadline: float, max_output: int) -> str:
    """Write the code to the call's stdin and read its stdout and stderr until both close: "" then, or the limit
    ("time", "output") reached first. Never more than max_output bytes (+ one chunk) held."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: out, proc.stderr: err}
    for f in (proc.stdin, proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_WRITE if f is proc.stdin else selectors.EVENT_READ)
    pending, reading = memoryview(code), 2
    try:
        while reading:
            left = deadline - time.monotonic()
            if left <= 0:
                return "time"
            for key, _ in sel.select(left):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        pending = pending[os.write(f.fileno(), pending[:1 << 16]):]
                    except BrokenPipeError:  # the call ended before reading it all
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(f)
                        f.close()  # EOF: the boot code reads the whole program before running it
                    continue
                chunk = os.read(f.fileno(), 1 << 16)
                if not chunk:
                    sel.unregister(f)
                    reading -= 1
                    continue
                bufs[f] += chunk
                if len(out) + len(err) > max_output:
                    return "output"
        return ""
    finally:
        sel.close()


def _kill(proc) -> None:
    """SIGKILL the call's process group: the helper or bwrap, and the PID namespace's init (which the code, in a
    session of its own, has left): the init's death kills every process of the namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_PROBE = r"""
import os
assert os.getcwd() == "/sandbox" and os.listdir() == [], "scratch"
open("probe", "w").write("x")
pid = os.fork()
if pid == 0:
    os._exit(0)
assert os.waitpid(pid, 0)[1] == 0
print("ok", os.getpid())
"""


def _probe(box: Sandbox) -> str:
    """"" when `box` runs a call here (its mounts, a write to its scratch, a fork, PID 2 of its own namespace),
    else why not."""
    try:
        r = box.run(_PROBE, Limits(time_limit=20))
    except (SandboxError, OSError) as e:
        return str(e)
    if r.exit_code != 0 or r.stdout.split() != ["ok", "2"]:
        tail = (r.stderr.strip().splitlines() or [f"exit code {r.exit_code}, {r.limit or 'no'} limit"])[-1]
        return f"its test call failed: {tail}"
    return ""


@functools.lru_cache(maxsize=None)
def sandbox_for(mechanism: str = "auto", paths: tuple = (), python_path: tuple = ()) -> Sandbox:
    """The sandbox of these options, tested once per process by a real call. auto: bwrap (>= 0.7) where it is
    installed and works, else the namespaces made directly. SandboxError (one line) when none works."""
    if mechanism not in MECHANISMS:
        raise ConfigError(f"environment.options.sandbox={mechanism!r} is not known; known: {', '.join(MECHANISMS)}")
    for p in (*paths, *python_path):
        if not os.path.exists(p):
            raise ConfigError(f"environment.options: {p!r} (a path to show the python tool) does not exist")
        a = os.path.abspath(p)
        if any(a == own or a.startswith(own + "/") for own in (SCRATCH, "/proc", "/dev")) or a == "/":
            raise ConfigError(f"environment.options: {p!r} cannot be shown to the python tool: the sandbox has "
                              f"its own {SCRATCH}, /proc and /dev, and / is never bound")
    tried = []
    if mechanism in ("auto", "bwrap"):
        path = shutil.which("bwrap")
        version = _bwrap_version(path) if path else None
        if path is None:
            tried.append("bwrap: not installed")
        elif version is None or version < BWRAP_MIN:
            tried.append(f"bwrap: {path} is {'.'.join(map(str, version)) if version else 'of unknown version'},"
                         f" needs >= {'.'.join(map(str, BWRAP_MIN))}")
        else:
            box = Sandbox("bwrap", paths, python_path, bwrap=path)
            why = _probe(box)
            if not why:
                return box
            tried.append(f"bwrap: {why}")
    if mechanism in ("auto", "direct"):
        if PIVOT_ROOT.get(os.uname().machine) is None:
            tried.append(f"direct: no pivot_root syscall number known for {os.uname().machine}")
        else:
            box = Sandbox("direct", paths, python_path)
            why = _probe(box)
            if not why:
                return box
            tried.append(f"direct: {why}")
    raise SandboxError(
        f"the python tool cannot make its sandbox here ({'; '.join(tried)}): install bubblewrap >= 0.7 "
        "(apt-get install bubblewrap) or allow unprivileged user namespaces (sysctl user.max_user_namespaces, "
        "kernel.apparmor_restrict_unprivileged_userns=0), or run the trainer as root")
