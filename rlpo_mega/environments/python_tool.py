"""`python`: a Python-execution tool, the shape of code-RL environments.

A model turn holding a `<python>...</python>` block is a tool call: the code runs in a fresh interpreter in the
sandbox of environments/sandbox.py -- its own filesystem (the interpreter and its standard library read-only, an
empty scratch directory /sandbox as the only writable place, nothing else of the host), its own PID, network,
IPC and UTS namespaces, limits on time, memory, processes, open files, file size and output -- and its output
(stdout, then stderr; the last `max_output` characters) comes back as a tool message. A turn without a block is
the final answer, scored by the reward function `options.reward` (default math) against the record's reference;
it ends the episode.

options: reward (a REWARDS name), time_limit (s, per call, wall clock), memory_mb (address space per process),
max_output (characters shown), format: "tags" (the `<python>` block, default) or "tool_call": the tool is
declared to the chat template as a function schema (`tools()`: `python(code)`), and a call is
`<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>` (the Hermes/Qwen format); a call that is
not valid JSON naming `python` with a string `code` is a failed tool call, its error the observation.
The sandbox's: sandbox ("auto": bubblewrap >= 0.7 where installed, else the namespaces made directly; "bwrap";
"direct"), scratch_mb (64), max_processes (32: processes and threads), max_open_files (64), max_output_bytes
(1 MiB read from the call; past it the call is killed), paths (host paths the code may read, bound read-only
at the same place), python_path (the same, and put on the code's sys.path: e.g. a site-packages directory, for
numpy; by default the code imports the standard library only).
A call that fails (an exception, non-zero exit, one of its limits) is a failed tool call (episode/tool_errors),
its error text the observation: the episode goes on, as an agent would see it. Where the sandbox cannot be made
(no bubblewrap and a kernel or container that forbids the namespaces) the environment refuses to start
(`check`, called by the runner at start: one line naming what was tried), never a weaker sandbox.
"""
from __future__ import annotations

import json
import re

from rlpo_mega.config import ConfigError
from rlpo_mega.rewards import REWARDS, RewardInput

from .base import ENVIRONMENTS, Environment, Feedback
from .sandbox import Limits, Sandbox, SandboxError, sandbox_for  # noqa: F401  (SandboxError: the refusal)

BLOCK = re.compile(r"<python>(.*?)</python>", re.S)
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
SCHEMA = {"type": "function", "function": {
    "name": "python", "description": "Run Python code in a fresh interpreter; returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                   "required": ["code"]}}}
FORMATS = ("tags", "tool_call")


@ENVIRONMENTS.register("python")
class PythonTool(Environment):
    @classmethod
    def tools(cls, cfg):
        return [SCHEMA] if _format(cfg) == "tool_call" else None

    @classmethod
    def check(cls, cfg):
        """At start: the sandbox is made and tested once (SandboxError, one line, where it cannot be)."""
        _format(cfg)
        _limits(cfg)
        _sandbox(cfg)

    def __init__(self, record, cfg):
        super().__init__(record, cfg)
        o = cfg.options
        self.format = _format(cfg)
        self.reward_fn = REWARDS.get(o.get("reward", "math"))
        self.limits = _limits(cfg)
        self.max_output = int(o.get("max_output", 1000))
        self.sandbox: Sandbox = _sandbox(cfg)  # made and tested once per process (cached)

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
        r = self.sandbox.run(source, self.limits)
        if r.limit == "time":
            text, failed = r.stdout + f"\nTimeoutError: the call ran past {self.limits.time_limit:g}s", True
        elif r.limit == "output":
            text, failed = (r.stdout + r.stderr + "\nOutputLimitError: the call wrote more than "
                            f"{self.limits.max_output_bytes} bytes"), True
        else:
            text, failed = r.stdout + r.stderr, r.exit_code != 0
        return Feedback([{"role": "tool", "content": text[-self.max_output:]}], tool_calls=1, tool_errors=int(failed))


def _format(cfg) -> str:
    f = cfg.options.get("format", "tags")
    if f not in FORMATS:
        raise ConfigError(f"environment.options.format={f!r} is not known; known: {', '.join(FORMATS)}")
    return f


def _limits(cfg) -> Limits:
    o, d = cfg.options, Limits()
    try:
        limits = Limits(time_limit=float(o.get("time_limit", d.time_limit)),
                        memory_mb=int(o.get("memory_mb", d.memory_mb)),
                        scratch_mb=int(o.get("scratch_mb", d.scratch_mb)),
                        max_processes=int(o.get("max_processes", d.max_processes)),
                        max_open_files=int(o.get("max_open_files", d.max_open_files)),
                        max_output_bytes=int(o.get("max_output_bytes", d.max_output_bytes)))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"environment.options of the python tool: {e}") from None
    bad = [k for k, v in vars(limits).items() if not v > 0]
    if bad:
        raise ConfigError(f"environment.options.{bad[0]}={getattr(limits, bad[0])!r}: must be > 0")
    return limits


def _sandbox(cfg) -> Sandbox:
    o = cfg.options
    paths, python_path = o.get("paths") or [], o.get("python_path") or []
    if isinstance(paths, str) or isinstance(python_path, str):
        raise ConfigError("environment.options.paths and .python_path are lists of paths")
    return sandbox_for(str(o.get("sandbox", "auto")), tuple(map(str, paths)), tuple(map(str, python_path)))


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
