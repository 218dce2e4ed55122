"""The LoRA demo over seeds, beside full-weight RL from the same base (issue: LoRA on MoE).

Per seed: the demo's supervised warm-up alone (configs/demo_cpu.yaml, train_iters=0: the whole model learns the
wrong rule a+b+1) saved and exported to HF -- the base; then from that base, side by side on the same 2 cores one
after the other, (a) `make demo-lora`'s RL (configs/demo_lora_cpu.yaml: rank-16 adapters on attention and experts)
and (b) the full-weight demo's RL (configs/demo_cpu.yaml without its warm-up, model.init_from_hf the base).
Reported: the sampled reward's first, best and last 5-step means and the last greedy eval; what each run's optimizer
holds (its checkpoint's optimizer tensors: Adam's two fp32 moments per trainable element) and its checkpoint's size.

  .venv/bin/python tools/bench_lora.py [--seeds 1234 1 2] [--out /tmp/bench_lora]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def train(config: str, *overrides: str):
    cmd = [sys.executable, "-m", "rlpo_mega.cli", "train", config, "--nproc-per-node", "2", "logging.wandb=false",
           "logging.plot=false", "logging.progress_bar=false", *overrides]
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def curve(logdir: str) -> dict:
    with open(os.path.join(logdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    reward = [r["reward/mean"] for r in rows if "reward/mean" in r]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    means = [sum(reward[i:i + 5]) / 5 for i in range(len(reward) - 4)]
    return {"first5": means[0], "best5": max(means), "last5": means[-1], "eval_last": evals[-1] if evals else None}


def checkpoint_bytes(save_dir: str) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with open(os.path.join(save_dir, "latest")) as f:
        step = os.path.join(save_dir, f.read().strip())
    meta = FileSystemReader(step).read_metadata().state_dict_metadata
    out = {"optimizer": 0, "model": 0, "files": 0}
    for key, m in meta.items():
        if isinstance(m, TensorStorageMetadata):
            n = 1
            for d in m.size:
                n *= d
            out["optimizer" if key.startswith("optimizer.") else "model"] += n * m.properties.dtype.itemsize
    for root, _, files in os.walk(step):
        out["files"] += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    ap.add_argument("--out", default="/tmp/bench_lora")
    args = ap.parse_args()
    rows = {}
    for seed in args.seeds:
        out = os.path.join(args.out, str(seed))
        train("configs/demo_cpu.yaml", f"seed={seed}", "train_iters=0", "trainer.eval_every=0",
              f"logging.dir={out}/base_log", f"checkpoint.save_dir={out}/base", "checkpoint.save_every=0",
              "checkpoint.export_hf=true")
        base = f"{out}/base/step_00000000/hf_model"
        for name, config, extra in (("lora", "configs/demo_lora_cpu.yaml", ()),
                                    ("full", "configs/demo_cpu.yaml", ("trainer.warmup.steps=0",))):
            train(config, f"seed={seed}", f"model.init_from_hf={base}", f"logging.dir={out}/{name}",
                  f"checkpoint.save_dir={out}/{name}_ckpt", "checkpoint.save_every=0", *extra)
            rows[(name, seed)] = {**curve(f"{out}/{name}"), **checkpoint_bytes(f"{out}/{name}_ckpt")}
            print(name, seed, json.dumps(rows[(name, seed)]), flush=True)
    print(f"\n{'run':5s} {'seed':>5s} {'first5':>7s} {'best5':>7s} {'last5':>7s} {'eval':>6s} {'optimizer B':>12s} "
          f"{'model B':>10s} {'ckpt files B':>13s}")
    for (name, seed), r in sorted(rows.items()):
        print(f"{name:5s} {seed:5d} {r['first5']:7.3f} {r['best5']:7.3f} {r['last5']:7.3f} {r['eval_last']:6.3f} "
              f"{r['optimizer']:12,d} {r['model']:10,d} {r['files']:13,d}")
    for name in ("lora", "full"):
        best = [rows[(name, s)]["best5"] for s in args.seeds]
        print(f"{name}: best 5-step mean over seeds {args.seeds}: {' / '.join(f'{b:.3f}' for b in best)}, "
              f"min {min(best):.3f}")
    lora_opt = rows[("lora", args.seeds[0])]["optimizer"]
    full_opt = rows[("full", args.seeds[0])]["optimizer"]
    print(f"optimizer state: LoRA {lora_opt:,d} B, full {full_opt:,d} B ({full_opt / lora_opt:.1f}x)")


if __name__ == "__main__":
    main()
