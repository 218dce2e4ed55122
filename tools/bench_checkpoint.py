"""Benchmark the cost of checkpoint integrity: the checksums at save (taken as the files are written) and their
verification at load.

A Qwen3-MoE model widened to ~30M parameters (fp32 weights, ~0.1 GB of checkpoint) is saved through
the trainer's path (rlpo_mega.checkpoint.dist.save_checkpoint, which hashes every file), verified (what
load_checkpoint runs first unless checkpoint.verify=false) and loaded without it, over --reps, in one process (the files are in the page cache, so the
verification cost is hashing, not disk; on a cold parallel filesystem reading dominates and the share is
smaller). Prints one line:

  checkpoint: S MB; save X s (checksums taken while writing; a read-back would add C s); load U s + verification V s (+P%)

    .venv/bin/python tools/bench_checkpoint.py [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODEL = "configs/models/tiny_qwen3_moe.json"


def worker(out_dir: str, reps: int):
    from moe.model import load_hf_config
    from rlpo_mega import distributed
    from rlpo_mega.checkpoint.dist import load_checkpoint, read_meta, save_checkpoint
    from rlpo_mega.checkpoint.files import checkpoint_files, digest_files, verify_files
    from rlpo_mega.config import load_config
    from rlpo_mega.model_setup import build_policy

    hf = load_hf_config(os.path.join(ROOT, MODEL))
    hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim = 512, 8, 4, 64
    hf.num_hidden_layers, hf.num_experts, hf.moe_intermediate_size, hf.intermediate_size = 4, 8, 512, 1024
    hf.mlp_only_layers, hf.decoder_sparse_step = [], 1
    cfg = load_config(None, (f"model.hf_config={MODEL}",))
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    chunks, _ = build_policy(hf, layout, cfg.model, None, with_ddp=False)
    params = sum(p.numel() for p in chunks[0].parameters())
    path = os.path.join(out_dir, "step")
    saves, hashes, verified, unverified = [], [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        save_checkpoint(path, chunks, meta={"model_type": hf.model_type})
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        digest_files(path, checkpoint_files(path, skip=("rlpo_meta.json",)))
        hashes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert verify_files(path, read_meta(path)["files"]) is None
        verified.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        load_checkpoint(path, chunks, verify=False)
        unverified.append(time.perf_counter() - t0)
    size = sum(v[0] for v in read_meta(path)["files"].values()) / 2**20
    med = statistics.median
    v, u = med(verified), med(unverified)
    print(f"model: {params / 1e6:.1f}M parameters; reps {reps} (medians)")
    print(f"checkpoint: {size:.0f} MB; save {med(saves):.2f} s (checksums taken while writing; a read-back, as "
          f"saves did before, would add {med(hashes):.2f} s); "
          f"load {u:.2f} s + verification {v:.2f} s (+{100 * v / u:.0f}%)", flush=True)
    distributed.destroy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.reps)
    tmp = tempfile.mkdtemp(prefix="bench-ckpt-")
    try:
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "PYTHONWARNINGS": "ignore"}
        return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                                os.path.abspath(__file__), "--worker", tmp, "--reps", str(args.reps)], env=env, cwd=ROOT)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
