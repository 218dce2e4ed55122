"""Metrics of the RL trainer: cross-rank reduction, W&B + metrics.jsonl + console.

The trainer logs the metrics; tests/metric_catalogue.py names those every step must log (tests read the W&B
run back), and `rlpo-mega plot` draws them from metrics.jsonl.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
import warnings
import zlib
from collections import Counter
from contextlib import contextmanager
from typing import Mapping, Optional

from rlpo_mega.config import LoggingConfig  # the typed config lives with the others
from rlpo_mega.reductions import Key, stat

METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step: {"step", "time", <metric>: value, ...}
CONFIG_FILE = "config.json"  # the run config, next to it (W&B gets it too)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # rlpo_mega/: sync_site's "ours"
SYNC_SITES_FILE = "host_syncs.jsonl"  # logging.host_syncs: {"step", <phase>: {place: syncs}} per step
MODES = ("offline", "online", "disabled")


# ----------------------------------------------------------------------------------------- reduction
def _as_float(value) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def reduce_metrics(metrics: Mapping[Key, object], group=None) -> dict[str, float]:
    """Scalars reduced over the ranks of `group` (default: world) by their keys' reductions
    (rlpo_mega/reductions.py: a plain name is averaged; Stat(x, "max" / "min" / "sum") reduces x by that), named
    by the Stat's name. NaN (a rank with nothing to measure) is skipped by the mean, max and min. Every rank gets
    the result.

    One collective: an all_gather of the sorted values as one float64 tensor on platform.device(), as every
    metric reduction of the learner (NCCL takes device tensors only; gloo takes CPU and CUDA ones), so
    `group` may be any group. A hash of the key names travels along: ranks that pass different keys get
    an error instead of silently mixed values (a different *number* of keys is a size mismatch the
    backend reports).
    """
    stats = {stat(k): v for k, v in metrics.items()}
    keys = sorted(stats)
    if any(k.how == "fault" for k in keys):
        raise ValueError("reduce_metrics: fault counts are raised (algorithms/objective.raise_input_faults), not logged")
    values = [_as_float(stats[k]) for k in keys]
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        rows = [[0.0] + values]
    else:
        import torch

        # lazy, as torch: platform imports transformers, and every CLI command imports this package (plot's parser)
        from rlpo_mega import platform

        local = torch.tensor([float(zlib.crc32(repr(keys).encode()))] + values, dtype=torch.float64,
                             device=platform.device())
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        rows = torch.stack(gathered).tolist()  # one device-to-host copy
        if len({r[0] for r in rows}) != 1:
            raise ValueError(f"reduce_metrics: ranks passed different metric names (this rank: {[k.name for k in keys]})")
    out = {}
    for i, key in enumerate(keys, start=1):
        column = [r[i] for r in rows]
        finite = [v for v in column if not math.isnan(v)]
        op, name = key.how, key.name
        if op == "sum":
            out[name] = math.fsum(column)
        elif not finite:
            out[name] = math.nan
        elif op == "max":
            out[name] = max(finite)
        elif op == "min":
            out[name] = min(finite)
        else:
            out[name] = math.fsum(finite) / len(finite)
    return out


# ----------------------------------------------------------------------------------- timing, progress
class PhaseTimer:
    """`with timer("rollout"): ...` adds the block's wall time to time/rollout (a phase entered several
    times in a step, e.g. dynamic-sampling retries, accumulates). `metrics()` returns and resets them.
    With CUDA, synchronizes at both ends so asynchronous kernels are charged to the phase that ran them, and records
    the phase's peak of allocated memory as memory/peak_gb/<phase> (torch.cuda.max_memory_allocated, reset as an
    outermost phase starts; a phase inside another reports the peak since the outer one began): what
    `rlpo-mega plan` predicts per GPU, measured (tools/gpu_checklist.py)."""

    def __init__(self, cuda_sync: bool = True):
        self.times: dict[str, float] = {}
        self.peaks: dict[str, int] = {}
        self._sync = self._cuda = None
        self._depth = 0
        if cuda_sync:
            import torch

            if torch.cuda.is_available():
                self._sync, self._cuda = torch.cuda.synchronize, torch.cuda

    @contextmanager
    def __call__(self, phase: str):
        if self._sync:
            self._sync()
            if not self._depth:
                self._cuda.reset_peak_memory_stats()
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._sync:
                self._sync()
                self.peaks[phase] = max(self.peaks.get(phase, 0), self._cuda.max_memory_allocated())
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self, reset: bool = True) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.times.items()}
        out.update({f"memory/peak_gb/{k}": v / 1e9 for k, v in self.peaks.items()})
        if reset:
            self.times, self.peaks = {}, {}
        return out


@contextmanager
def count_host_syncs(into: dict, phase: str, enabled: bool, sites: Optional[Counter] = None):
    """CUDA (logging.host_syncs): the host syncs of the block as perf/host_syncs_<phase>, counted by torch's own
    sync debug mode (torch.cuda.set_sync_debug_mode, one warning per synchronizing CUDA call: copies to the
    host, item(), ops sized by values). With `sites`, each sync's place is counted there too (sync_site: the
    count says how many, the place says which to remove). Off: nothing is counted or logged. Other warnings
    pass through."""
    if not enabled:
        yield
        return
    import torch

    previous, syncs, others = torch.cuda.get_sync_debug_mode(), [], []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            syncs.append(sync_site() if sites is not None else "")
        else:
            others.append((message, category, filename, lineno))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # restored by catch_warnings; called where the warning is raised
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    into[f"perf/host_syncs_{phase}"] = into.get(f"perf/host_syncs_{phase}", 0) + len(syncs)
    if sites is not None:
        sites.update(syncs)
    for message, category, filename, lineno in others:
        warnings.warn_explicit(message, category, filename, lineno)


def sync_site(stack: Optional[list] = None) -> str:
    """Where a host sync happens: 'file:line function' of the innermost frame outside the warnings machinery,
    and, when that frame is not rlpo_mega's (torch, megatron), ' <- ' the innermost rlpo_mega frame that led
    there: the line of our code to change."""
    machinery = {os.path.abspath(warnings.__file__), os.path.abspath(__file__)}
    frames = [f for f in (stack if stack is not None else traceback.extract_stack())
              if os.path.abspath(f.filename) not in machinery]
    if not frames:
        return "?"

    def ours(f) -> bool:
        return os.path.abspath(f.filename).startswith(_PACKAGE + os.sep)

    roots = sorted({os.path.abspath(p) for p in sys.path if p}, key=len, reverse=True)

    def place(f) -> str:  # relative to its import root: rlpo_mega/..., torch/..., megatron/core/...
        path = os.path.abspath(f.filename)
        root = os.path.dirname(_PACKAGE) if ours(f) else next(
            (r for r in roots if path.startswith(r + os.sep)), os.path.dirname(path))
        return f"{os.path.relpath(path, root)}:{f.lineno} {f.name}"

    inner, caller = frames[-1], next((f for f in reversed(frames) if ours(f)), None)
    return place(inner) if caller is None or caller is inner else f"{place(inner)} <- {place(caller)}"


def progress_bar(iterable=None, *, total: Optional[int] = None, desc: Optional[str] = None,
                 enabled: bool = True, rank: int = 0, **kwargs):
    """A tqdm bar on rank 0 when `enabled` and stderr is a terminal (no bar spam in log files); a disabled
    bar otherwise, which still accepts update()/close()."""
    from tqdm.auto import tqdm

    show = enabled and rank == 0 and sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, disable=not show, dynamic_ncols=True, leave=False, **kwargs)


# ------------------------------------------------------------------------------------------ console
CONSOLE_FIELDS = (  # (label, metric, format)
    ("reward", "reward/mean", "{:.3f}"),
    ("acc", "reward/accuracy", "{:.3f}"),
    ("len", "response/length_mean", "{:.1f}"),
    ("turns", "episode/turns_mean", "{:.2f}"),  # multi-turn episodes (environment.name)
    ("tools", "episode/tool_calls_mean", "{:.2f}"),
    ("useful", "episode/useful_tool_calls_mean", "{:.2f}"),
    ("tool_err", "episode/tool_errors", "{:.0f}"),
    ("loss", "loss/policy", "{:.4g}"),
    ("gnorm", "optim/grad_norm", "{:.3g}"),
    ("kl", "kl/policy", "{:.2e}"),
    ("time", "time/step", "{:.2f}s"),
)


def format_console_line(step: int, metrics: Mapping[str, float], total_steps: Optional[int] = None) -> str:
    """'step 3/10 | reward 0.500 | acc 0.375 | ... | time 1.23s' with the fields present in `metrics`."""
    parts = [f"step {step}" + (f"/{total_steps}" if total_steps else "")]
    for label, key, fmt in CONSOLE_FIELDS:
        if key in metrics:
            parts.append(f"{label} " + fmt.format(metrics[key]))
    failed = int(metrics.get("reward/failed", 0))
    if failed:  # the reward of these samples is the configured default: never only in the metrics file
        of = f"/{int(metrics['reward/samples'])}" if "reward/samples" in metrics else ""
        parts.append(f"REWARD FAILED {failed}{of} (see the log)")
    env_failed = int(metrics.get("episode/env_failures", 0))
    if env_failed:  # episodes whose environment raised or timed out: their reward is environment.failure_reward
        parts.append(f"ENVIRONMENT FAILED {env_failed} (see the log)")
    return " | ".join(parts)


# ------------------------------------------------------------------------------------------- logger
def _jsonable(config):
    return json.loads(json.dumps(config, default=str))


class MetricsLogger:
    """Writes on global rank 0 only (other ranks get no-ops): W&B, metrics.jsonl (flushed every line, so
    `rlpo-mega plot` works on a live run) and a console line every `console_every` steps.

    metrics.jsonl is appended to, so a resumed run keeps its earlier steps (the plot keeps the last value
    logged for a step)."""

    def __init__(self, cfg: LoggingConfig, run_config: Optional[dict] = None, rank: int = 0, world_size: int = 1,
                 total_steps: Optional[int] = None):
        if cfg.mode not in MODES:
            raise ValueError(f"logging.mode={cfg.mode!r}: expected one of {', '.join(MODES)}")
        if cfg.console_every < 0:
            raise ValueError(f"logging.console_every={cfg.console_every} must be >= 0")
        self.cfg, self.rank, self.world_size, self.total_steps = cfg, rank, world_size, total_steps
        self.enabled = rank == 0
        self.run_name = cfg.run_name or "run-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self.run_dir = cfg.dir or os.path.join("runs", self.run_name)
        self.wandb_run = None
        self._file = None
        if not self.enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        config = _jsonable(run_config or {})
        with open(os.path.join(self.run_dir, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=1)
        self._file = open(os.path.join(self.run_dir, METRICS_FILE), "a")
        mode = os.environ.get("WANDB_MODE") or cfg.mode  # W&B's own convention: the environment wins
        if cfg.wandb and mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(project=cfg.project, name=self.run_name, entity=cfg.entity,
                                        dir=self.run_dir, config=config, mode=mode)

    @property
    def wandb_dir(self) -> Optional[str]:
        """The W&B run directory (offline: <run_dir>/wandb/offline-run-*), for read_wandb_offline_run."""
        return os.path.dirname(self.wandb_run.dir) if self.wandb_run is not None else None

    def log(self, step: int, metrics: Mapping[str, object]):
        if not self.enabled:
            return
        values = {k: _as_float(v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": int(step), "time": time.time(), **values}) + "\n")
        self._file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=int(step))
        every = self.cfg.console_every
        if every and step % every == 0:
            from tqdm.auto import tqdm

            tqdm.write(format_console_line(step, values, self.total_steps), file=sys.stdout)  # keeps bars intact
            sys.stdout.flush()

    def log_sync_sites(self, step: int, sites: Mapping[str, Counter]):
        """logging.host_syncs: this step's host syncs by place, per phase, most frequent first, one line per
        step in <run_dir>/host_syncs.jsonl (rank 0's; perf/host_syncs_* are their totals)."""
        if not self.enabled:
            return
        line = {"step": int(step), **{phase: dict(c.most_common()) for phase, c in sites.items()}}
        with open(os.path.join(self.run_dir, SYNC_SITES_FILE), "a") as f:
            f.write(json.dumps(line) + "\n")

    def progress(self, iterable=None, *, total: Optional[int] = None, desc: Optional[str] = None, **kwargs):
        """progress_bar() with this run's rank and progress_bar setting."""
        return progress_bar(iterable, total=total, desc=desc, enabled=self.cfg.progress_bar, rank=self.rank,
                            **kwargs)

    def close(self, exit_code: int = 0):
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(exit_code=0 if exc_type is None else 1)
