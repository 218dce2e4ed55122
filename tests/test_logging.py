"""Metrics/logging layer: W&B offline run read back, metrics.jsonl, console lines, cross-rank reduction, plot."""
import json
import math
import os
import struct
import subprocess
import sys
import traceback
import warnings
from collections import Counter

import pytest
from omegaconf import OmegaConf

from rlpo_mega.reductions import Stat
from rlpo_mega.logging import (METRICS_FILE, LoggingConfig, MetricsLogger, PhaseTimer, format_console_line,
                               progress_bar, reduce_metrics)
from rlpo_mega.logging import plot as plot_mod
from tests.dist import ROOT, torchrun
from tests.metric_catalogue import missing_metrics, required_metrics
from tests.wandb_reader import read_wandb_offline_run

LAYERS = 3


def _step_metrics(step: int, loss: str = "grpo") -> dict:
    """One value for every required metric (plus per-layer ones), distinct per step and per key."""
    out = {}
    for i, m in enumerate(required_metrics(loss, kl_ref=True)):
        names = [f"{m.name}{layer}" for layer in range(LAYERS)] if m.prefix else [m.name]
        for j, name in enumerate(names):
            out[name] = round(0.001 * step + i + 0.1 * j, 6)
    return out


@pytest.fixture
def offline_env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # wins over logging.mode
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # any attempt to go online fails fast
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "30")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_wandb_offline_run_read_back(tmp_path, offline_env):
    run_config = {"algorithm": {"loss": {"name": "grpo", "eps_high": 0.28}}, "seed": 7, "stop": [1, 2],
                  "note": "x" * 70000}  # > 2 blocks: a record split into first/middle/last chunks
    cfg = LoggingConfig(project="rlpo-test", run_name="roundtrip", mode="online", dir=str(tmp_path / "run"),
                        console_every=0)
    logger = MetricsLogger(cfg, run_config, rank=0, world_size=2)
    logged = {}
    for step in range(1, 41):  # ~40 KiB of history: records cross block boundaries
        metrics = _step_metrics(step)
        logger.log(step, metrics)
        logged[step] = metrics
    with open(os.path.join(cfg.dir, METRICS_FILE)) as f:  # flushed per line: readable before close
        assert len(f.readlines()) == 40
    wandb_dir = logger.wandb_dir
    logger.close()
    assert os.path.basename(wandb_dir).startswith("offline-run-")
    assert os.path.getsize(read_wandb_offline_run(cfg.dir).path) > 2 * 32768

    run = read_wandb_offline_run(cfg.dir)
    assert (run.project, run.name) == ("rlpo-test", "roundtrip")
    assert run.config == run_config
    assert missing_metrics(run.history, "grpo", kl_ref=True) == []
    assert set(run.history) == set(logged[1])
    for key in logged[1]:
        assert run.steps[key] == list(range(1, 41))
        assert run.history[key] == pytest.approx([logged[s][key] for s in range(1, 41)], rel=0, abs=1e-12)
    assert run.summary["reward/mean"] == pytest.approx(logged[40]["reward/mean"])

    # wandb's own reader (the `wandb leet inspect --json` CLI) sees the same run
    leet = read_wandb_offline_run(wandb_dir, backend="leet")
    assert (leet.history, leet.steps, leet.config) == (run.history, run.steps, run.config)

    # a log cut short (a killed run) reads up to its last whole record; a flipped byte is an error
    data = open(run.path, "rb").read()
    cut = tmp_path / "cut.wandb"
    cut.write_bytes(data[:len(data) - 5000])
    part = read_wandb_offline_run(str(cut)).history.get("reward/mean", [])
    assert 0 < len(part) < 40 and part == run.history["reward/mean"][:len(part)]
    i = data.rfind(b"optim/grad_norm")  # inside a record payload, never a chunk length
    cut.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    with pytest.raises(ValueError, match="checksum"):
        read_wandb_offline_run(str(cut))

    with open(os.path.join(cfg.dir, METRICS_FILE)) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all({k: v for k, v in r.items() if k not in ("step", "time")} == logged[r["step"]] for r in rows)
    with open(os.path.join(cfg.dir, "config.json")) as f:
        assert json.load(f) == run_config


def test_wandb_disabled_and_other_ranks(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    quiet = MetricsLogger(LoggingConfig(dir=str(tmp_path / "r1")), {}, rank=1, world_size=2)
    quiet.log(1, {"reward/mean": 1.0})
    quiet.close()
    assert not (tmp_path / "r1").exists()  # only global rank 0 writes

    cfg = LoggingConfig(mode="disabled", dir=str(tmp_path / "r0"), console_every=2)
    with MetricsLogger(cfg, {"a": 1}, total_steps=4) as logger:
        for step in range(1, 5):
            logger.log(step, {"reward/mean": 0.25 * step, "loss/policy": -0.5, "time/step": 2.0})
    assert not (tmp_path / "r0" / "wandb").exists()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert lines == ["step 2/4 | reward 0.500 | loss -0.5 | time 2.00s",
                     "step 4/4 | reward 1.000 | loss -0.5 | time 2.00s"]
    with pytest.raises(ValueError, match="logging.mode"):
        MetricsLogger(LoggingConfig(mode="dryrun", dir=str(tmp_path / "bad")))


def test_console_line_format():
    m = {"reward/mean": 0.5, "reward/accuracy": 0.375, "response/length_mean": 12.25, "loss/policy": -0.012345,
         "optim/grad_norm": 0.8412, "kl/policy": 0.00123, "time/step": 3.456, "entropy/mean": 1.0}
    assert format_console_line(3, m, total_steps=10) == (
        "step 3/10 | reward 0.500 | acc 0.375 | len 12.2 | loss -0.01235 | gnorm 0.841 | kl 1.23e-03 | time 3.46s")
    assert format_console_line(7, {}) == "step 7"


def test_missing_metrics():
    full = _step_metrics(1, "grpo")
    assert missing_metrics(full, "grpo") == []
    assert missing_metrics({k: v for k, v in full.items() if k != "loss/clip_frac_high"}, "grpo") == [
        "loss/clip_frac_high"]
    no_layers = {k: v for k, v in full.items() if not k.startswith("routing/agreement/layer_")}
    assert missing_metrics(no_layers, "dapo") == ["routing/agreement/layer_*"]
    # SAPO logs gate statistics instead of clip fractions
    sapo = missing_metrics(full, "sapo")
    assert sapo == ["loss/gate_mean", "loss/gate_weight_mean", "loss/gate_weight_below_half_frac"]
    assert missing_metrics(_step_metrics(1, "sapo"), "sapo") == []
    # kl/ref only with a KL penalty, dynamic-sampling counts only when it is on
    no_ref = {k: v for k, v in full.items() if k != "kl/ref"}
    assert missing_metrics(no_ref, "grpo") == [] and missing_metrics(no_ref, "grpo", kl_ref=True) == ["kl/ref"]
    no_ds = {k: v for k, v in full.items() if not k.startswith("dynamic_sampling/")}
    assert missing_metrics(no_ds, "grpo", dynamic_sampling=False) == []
    with pytest.raises(KeyError, match="known"):
        missing_metrics(full, "nope")


def test_reduce_metrics_single_process():
    out = reduce_metrics({"b": 2, Stat("a", "max"): 3.0, Stat("c", "sum"): 4})
    assert out == {"a": 3.0, "b": 2.0, "c": 4.0}


def test_reduce_metrics_two_ranks():
    report = torchrun("logging_reduce.py", 2, timeout=120)
    assert report["out"] == {"reward/mean": 2.0, "response/length_max": 20.0, "ratio/seq_min": 10.0,
                             "dynamic_sampling/kept": 12.0, "entropy/mean": 4.0, "kl/policy": None}
    assert report["same"]  # every rank gets the result
    assert "different metric names" in report["mismatch"]


def test_phase_timer_and_progress_bar():
    timer = PhaseTimer()
    for _ in range(2):
        with timer("rollout"):
            pass
    with pytest.raises(RuntimeError):
        with timer("update"):
            raise RuntimeError
    m = timer.metrics()
    assert set(m) == {"time/rollout", "time/update"} and all(v >= 0 for v in m.values())
    assert timer.metrics() == {}
    # pytest's stderr is no terminal: no bar, but the API still works
    with progress_bar(range(3), desc="steps") as bar:
        assert bar.disable and list(bar) == [0, 1, 2]
    assert progress_bar(total=3, enabled=False).disable and progress_bar(total=3, rank=1).disable


def test_phase_timer_records_each_phases_cuda_peak():
    """With CUDA the timer logs memory/peak_gb/<phase> (what tools/gpu_checklist.py compares with `rlpo-mega plan`):
    the peak reset as an outermost phase starts, a phase entered twice keeps its larger peak, an inner phase reports
    the peak since its outer one began. Here torch.cuda's three calls are a recorder of allocations (a CPU has none):
    the bookkeeping is the timer's own."""
    class Allocator:
        def __init__(self):
            self.now = self.peak = 0

        def alloc(self, n):
            self.now += n
            self.peak = max(self.peak, self.now)

        def reset_peak_memory_stats(self):
            self.peak = self.now

        def max_memory_allocated(self):
            return self.peak

    cuda = Allocator()
    timer = PhaseTimer(cuda_sync=False)
    timer._sync, timer._cuda = lambda: None, cuda
    with timer("old_logprob"):
        cuda.alloc(3e9)
        cuda.alloc(-3e9)
    with timer("update"):
        cuda.alloc(5e9)
        with timer("exchange"):
            cuda.alloc(1e9)
            cuda.alloc(-1e9)
        cuda.alloc(-5e9)
    with timer("old_logprob"):
        cuda.alloc(2e9)
        cuda.alloc(-2e9)
    m = timer.metrics()
    assert {k: v for k, v in m.items() if k.startswith("memory/")} == {
        "memory/peak_gb/old_logprob": 3.0, "memory/peak_gb/update": 6.0, "memory/peak_gb/exchange": 6.0}
    assert timer.metrics() == {}


def test_logging_config_is_a_structured_config():
    cfg = OmegaConf.merge(OmegaConf.structured(LoggingConfig), OmegaConf.from_dotlist(["mode=disabled", "dir=/x"]))
    cfg = OmegaConf.to_object(cfg)
    assert isinstance(cfg, LoggingConfig) and (cfg.mode, cfg.dir, cfg.run_name) == ("disabled", "/x", None)


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plot(tmp_path, capsys):
    run = tmp_path / "run"
    with MetricsLogger(LoggingConfig(mode="disabled", dir=str(run), console_every=0)) as logger:
        for step in range(1, 11):
            logger.log(step, {**_step_metrics(step), "reward/mean": math.sin(step)})
    with open(run / METRICS_FILE, "a") as f:
        f.write('{"step": 11, "reward/me')  # a line a live writer has not finished
    out = tmp_path / "curves.png"
    assert plot_mod.main([str(run), "--out", str(out), "--metrics", "reward/mean,time/,loss/policy,routing/"]) == 0
    assert out.stat().st_size > 10000
    assert _png_size(out) == (3 * 500, 2 * 320)  # 4 panels: 3 columns x 2 rows of 500 x 320 px

    default = plot_mod.plot(str(run))
    assert default == str(run / "curves.png") and _png_size(default)[0] == 1500
    assert plot_mod.load_metrics(str(run))["reward/mean"][0] == list(range(1, 11))

    capsys.readouterr()
    assert plot_mod.main([str(run), "--metrics", "reward/nope"]) == 2
    assert "'reward/nope' was not logged" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert plot_mod.main([str(tmp_path / "empty")]) == 2
    assert "no metrics in" in capsys.readouterr().err


def test_plot_module_entry_point(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / METRICS_FILE).write_text('{"step": 1, "time": 0, "x": 1.0}\n{"step": 2, "time": 1, "x": 0.5}\n')
    proc = subprocess.run([sys.executable, "-m", "rlpo_mega.logging.plot", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _png_size(run / "curves.png") == (500, 320)  # a run with none of the trainer's names: its own


def test_host_sync_count_reads_torchs_sync_warnings(monkeypatch):
    """logging.host_syncs on CUDA: torch's sync debug mode warns once per synchronizing call (its message says
    "called a synchronizing CUDA operation"); those are counted per phase and swallowed, every other warning
    passes through, and the previous mode is restored. torch.cuda's mode calls are stood in (no CUDA here);
    tools/gpu_smoke.py reads the real count on a GPU."""
    import torch

    from rlpo_mega.logging.metrics import count_host_syncs

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    metrics, sites = {}, Counter()
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        for _ in range(2):  # a phase entered twice accumulates
            with count_host_syncs(metrics, "update", True, sites):
                warnings.warn("called a synchronizing CUDA operation")
                warnings.warn("something else", DeprecationWarning)
        with count_host_syncs(metrics, "old_logprob", False, sites):
            warnings.warn("called a synchronizing CUDA operation")
    assert metrics == {"perf/host_syncs_update": 2}
    # the place of each: the line that raised it (past the warnings machinery), here this test's
    (place, n), = sites.items()
    where, function = place.split(" ")
    assert n == 2 and function == "test_host_sync_count_reads_torchs_sync_warnings" and where.startswith(
        "test_logging.py:"), place
    with open(__file__) as f:
        assert 'warnings.warn("called a synchronizing' in f.readlines()[int(where.split(":")[1]) - 1]
    assert modes == ["warn", 0, "warn", 0]
    assert [str(w.message) for w in outside] == ["something else", "something else",
                                                 "called a synchronizing CUDA operation"]


def test_a_host_sync_is_placed_in_our_code_and_in_the_library(monkeypatch, tmp_path):
    """A sync inside a library (megatron, torch) is named by the library's file relative to its import root and
    by the innermost rlpo_mega line that called into it; a sync on our own line by that line alone."""
    from rlpo_mega.logging import metrics as metrics_mod

    site_packages = tmp_path / "site-packages"
    monkeypatch.setattr(sys, "path", [str(site_packages), *sys.path])
    ours = os.path.join(ROOT, "rlpo_mega", "training", "update.py")
    theirs = str(site_packages / "megatron" / "core" / "transformer" / "moe" / "moe_utils.py")
    frame = traceback.FrameSummary
    stack = [frame("/usr/lib/python3/runpy.py", 1, "_run"), frame(ours, 40, "update_phase"),
             frame(theirs, 7, "permute"), frame(warnings.__file__, 3, "_showwarnmsg"),
             frame(metrics_mod.__file__, 5, "record")]
    assert metrics_mod.sync_site(stack) == ("megatron/core/transformer/moe/moe_utils.py:7 permute <- "
                                            "rlpo_mega/training/update.py:40 update_phase")
    assert metrics_mod.sync_site(stack[:2]) == "rlpo_mega/training/update.py:40 update_phase"


def test_a_report_key_declares_its_reduction_once():
    """rlpo_mega/reductions.py is the one schema: a plain name is a mean, a Stat names another reduction; an
    unknown one is refused where it is written, and fault counts are never logged."""
    from rlpo_mega.reductions import by_reduction

    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        Stat("x", "median")
    groups = by_reduction(["b", Stat("a", "max"), Stat("labels", "fault"), "a"])
    assert groups["mean"] == [Stat("a"), Stat("b")] and groups["max"] == [Stat("a", "max")]
    assert groups["fault"] == [Stat("labels", "fault")]
    with pytest.raises(ValueError, match="fault counts are raised"):
        reduce_metrics({Stat("labels", "fault"): 1})
