"""`rlpo-mega plot RUN_DIR [--out PNG] [--metrics reward/mean,time/,...]`: learning curves from metrics.jsonl.

One subplot per entry of --metrics: an exact name draws that metric; a name ending in "/" or "_" (or "*")
draws every metric starting with it in one subplot (e.g. "time/" = all phases, "routing/agreement/layer_"
= all layers). Without --metrics, a default set of panels, limited to what the run logged.
Also callable as `python -m rlpo_mega.logging.plot`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

from .metrics import METRICS_FILE

PANEL_WIDTH, PANEL_HEIGHT, DPI, MAX_COLUMNS = 5.0, 3.2, 100, 3  # inches; a panel is 500 x 320 px
DEFAULT_PANELS = (
    ["reward/mean", "reward/accuracy"],
    ["eval/accuracy", "eval/reward_mean"],
    ["response/length_mean", "response/length_max"],
    ["response/truncated_frac"],
    ["loss/policy"],
    ["loss/clip_frac_low", "loss/clip_frac_high"],
    ["loss/gate_mean", "loss/gate_weight_mean"],
    ["ratio/seq_mean", "ratio/seq_min", "ratio/seq_max"],
    ["kl/policy", "kl/ref"],
    ["entropy/mean"],
    ["optim/grad_norm"],
    ["optim/lr"],
    ["mismatch/k3_kl"],
    ["routing/agreement/"],
    ["experts/load_max/"],
    ["dynamic_sampling/kept", "dynamic_sampling/dropped"],
    ["time/"],
    ["perf/tokens_per_s"],
)


class PlotError(Exception):
    pass


def load_metrics(run: str) -> dict[str, tuple[list[int], list[float]]]:
    """metric -> (steps, values) from RUN/metrics.jsonl (or that file itself). A step logged again (a run
    resumed from a checkpoint) keeps its last value; a line cut short by a live writer is skipped."""
    path = run if os.path.isfile(run) else os.path.join(run, METRICS_FILE)
    if not os.path.isfile(path):
        raise PlotError(f"no metrics in {run!r}: {path} does not exist (the trainer writes it on rank 0)")
    by_key: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):
                continue
            for key, value in row.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    by_key.setdefault(key, {})[step] = float(value)
    if not by_key:
        raise PlotError(f"no metrics in {run!r}: {path} has no logged steps")
    return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in sorted(by_key.items())}


def _is_prefix(name: str) -> bool:
    return name.endswith(("/", "_", "*"))


def _select(spec: list[str], available) -> list[str]:
    keys = []
    for name in spec:
        if _is_prefix(name):
            keys += [k for k in available if k.startswith(name.rstrip("*")) and k not in keys]
        elif name in available and name not in keys:
            keys.append(name)
    return keys


def panels_for(metrics, requested: Optional[list[str]] = None) -> list[tuple[str, list[str]]]:
    """(title, metric names) per subplot."""
    if requested:
        panels = []
        for name in requested:
            keys = _select([name], metrics)
            if not keys:
                raise PlotError(f"metric {name!r} was not logged; logged: {', '.join(metrics)}")
            panels.append((name.rstrip("*"), keys))
        return panels
    panels = [(keys[0] if len(keys) == 1 else ", ".join(s.rstrip("/_") for s in spec), keys)
              for spec in DEFAULT_PANELS if (keys := _select(spec, metrics))]
    # a run with none of the trainer's names (another tool's jsonl): every metric, up to a readable number
    return panels or [(k, [k]) for k in list(metrics)[:24]]


def plot(run: str, out: Optional[str] = None, requested: Optional[list[str]] = None) -> str:
    """Draws the learning curves of `run` to `out` (default RUN/curves.png); returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metrics = load_metrics(run)
    panels = panels_for(metrics, requested)
    cols = min(MAX_COLUMNS, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(PANEL_WIDTH * cols, PANEL_HEIGHT * rows), dpi=DPI,
                             squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        for key in keys:
            steps, values = metrics[key]
            # markers so that a run of one or a few steps still shows its points
            ax.plot(steps, values, label=key, marker="." if len(steps) < 50 else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if 1 < len(keys) <= 12:  # 48 layers' legend would hide the curves
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(os.path.basename(os.path.normpath(run if os.path.isdir(run) else os.path.dirname(run) or ".")))
    fig.tight_layout()
    out = out or os.path.join(run if os.path.isdir(run) else os.path.dirname(run) or ".", "curves.png")
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=DPI)  # no bbox_inches="tight": the size stays panels x (500 x 320) px
    plt.close(fig)
    return out


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="rlpo-mega plot", description=__doc__.splitlines()[0])
    parser.add_argument("run", metavar="RUN_DIR", help="run directory holding metrics.jsonl (or the file)")
    parser.add_argument("--out", help="PNG to write (default RUN_DIR/curves.png)")
    parser.add_argument("--metrics", help="comma-separated metric names or prefixes, one subplot each")
    return parser


def run_args(args) -> int:
    requested = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    try:
        out = plot(args.run, args.out, requested)
    except PlotError as e:
        print(f"rlpo-mega plot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def main(argv=None) -> int:
    return run_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
