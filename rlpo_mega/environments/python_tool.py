"""`python`: a Python-execution tool, the shape of code-RL environments.

A model turn holding a `<python>...</python>` block is a tool call: the code runs in a fresh interpreter in a
subprocess (isolated mode, its own session), with a wall-clock limit, an address-space limit and no network (a
new user and network namespace: only a loopback that is down), and its output (stdout, then stderr; the last
`max_output` characters) comes back as a tool message. A turn without a block is the final answer, scored by
the reward function `options.reward` (default math) against the record's reference; it ends the episode.

options: reward (a REWARDS name), time_limit (s, per call), memory_mb (per call), max_output (characters),
format: "tags" (the `<python>` block, default) or "tool_call": the tool is declared to the chat template as a
function schema (`tools()`: `python(code)`), and a call is `<tool_call>{"name": "python", "arguments":
{"code": ...}}</tool_call>` (the Hermes/Qwen format); a call that is not valid JSON naming `python` with a
string `code` is a failed tool call, its error the observation.
A call that fails (an exception, non-zero exit, its time or memory limit) is a failed tool call
(episode/tool_errors), its error text the observation: the episode goes on, as an agent would see it. Where
the namespaces cannot be made (a kernel or container that forbids user namespaces) the call does not run: the
step raises, which the runner counts as an environment failure and logs with this cause.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

from rlpo_mega.config import ConfigError
from rlpo_mega.rewards import REWARDS, RewardInput

from .base import ENVIRONMENTS, Environment, Feedback

BLOCK = re.compile(r"<python>(.*?)</python>", re.S)
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
SCHEMA = {"type": "function", "function": {
    "name": "python", "description": "Run Python code in a fresh interpreter; returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                   "required": ["code"]}}}
FORMATS = ("tags", "tool_call")

# Runs first in the child interpreter: limits, then the namespaces, then the model's code as __main__.
_BOOT = r"""
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
NO_SANDBOX = 97


class SandboxError(RuntimeError):
    """The tool's sandbox (user and network namespaces) cannot be made here."""


def run_python(code: str, time_limit: float, memory_mb: int) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `code` in the sandbox; exit code None when it ran past time_limit."""
    proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, str(memory_mb << 20)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8"}, cwd="/")
    try:
        out, err = proc.communicate(code, timeout=time_limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this call started (its own session)
        out, err = proc.communicate()
        return None, out, err
    if proc.returncode == NO_SANDBOX and err.startswith("NO_SANDBOX"):
        raise SandboxError("the python tool cannot make its sandbox (user and network namespaces: "
                           f"{err.strip()}); run where unprivileged user namespaces are allowed")
    return proc.returncode, out, err


@ENVIRONMENTS.register("python")
class PythonTool(Environment):
    @classmethod
    def tools(cls, cfg):
        return [SCHEMA] if _format(cfg) == "tool_call" else None

    def __init__(self, record, cfg):
        super().__init__(record, cfg)
        o = cfg.options
        self.format = _format(cfg)
        self.reward_fn = REWARDS.get(o.get("reward", "math"))
        self.time_limit = float(o.get("time_limit", 5.0))
        self.memory_mb = int(o.get("memory_mb", 512))
        self.max_output = int(o.get("max_output", 1000))

    def step(self, action):
        block = (BLOCK if self.format == "tags" else TOOL_CALL).search(action.text)
        if block is None:  # the final answer
            r = float(self.reward_fn(RewardInput(self.record.prompt, action.text, self.record.reference,
                                                 self.record.metadata), None))
            return Feedback(reward=r, done=True, correct=r >= 1.0)
        source = block.group(1)
        if self.format == "tool_call":
            source, bad = _call_code(source)
            if bad:
                return Feedback([{"role": "tool", "content": bad}], tool_calls=1, tool_errors=1)
        code, out, err = run_python(source, self.time_limit, self.memory_mb)
        if code is None:
            text, failed = out + f"\nTimeoutError: the call ran past {self.time_limit:g}s", True
        else:
            text, failed = out + err, code != 0
        return Feedback([{"role": "tool", "content": text[-self.max_output:]}], tool_calls=1, tool_errors=int(failed))


def _format(cfg) -> str:
    f = cfg.options.get("format", "tags")
    if f not in FORMATS:
        raise ConfigError(f"environment.options.format={f!r} is not known; known: {', '.join(FORMATS)}")
    return f


def _call_code(body: str) -> tuple[str, str]:
    """(the code, "") of a `<tool_call>` body, or ("", the error the model is shown)."""
    try:
        call = json.loads(body)
    except ValueError as e:
        return "", f"invalid tool call (not JSON: {e})"
    args = call.get("arguments") if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("name") != "python" or not isinstance(args, dict) \
            or not isinstance(args.get("code"), str):
        return "", 'invalid tool call: expected {"name": "python", "arguments": {"code": "..."}}'
    return args["code"], ""
