"""Benchmark: chunked vocab-parallel log-probs (+ entropy) vs a naive log_softmax, on one logits shard.

Reports, for forward + backward of one [tokens, vocab_shard] shard, the extra peak memory as a multiple of
the shard's size (the logits themselves excluded; the logits gradient, 1x, is included for every
variant) and the median time. Targets for the chunked kernel: <= 1.25x peak, <= 1.2x naive time.

Memory on CPU: the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) above the baseline,
each variant in a fresh subprocess with glibc forced to mmap (so freed buffers leave the RSS); on CUDA:
torch.cuda.max_memory_allocated. Single process (tp=1): the TP collectives act on [tokens] vectors.

    .venv/bin/python tools/bench_logprobs.py [--tokens 2048] [--vocab 32768] [--dtype float32]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlpo_mega.algorithms.logprobs import vocab_parallel_logprobs  # noqa: E402

VARIANTS = ("naive_logp", "chunked_logp", "naive_logp_entropy", "chunked_logp_entropy")


def run_variant(name, logits, labels, g_lp, g_h, temperature):
    if name.startswith("naive"):
        lsm = torch.log_softmax(logits.float() / temperature, dim=-1)
        lp = lsm.gather(-1, labels[:, None])[:, 0]
        loss = (lp * g_lp).sum()
        if name.endswith("entropy"):
            loss = loss + (-(lsm.exp() * lsm).sum(-1) * g_h).sum()
        del lsm
    else:
        lp, h = vocab_parallel_logprobs(logits, labels, temperature=temperature, group=None,
                                        with_entropy=name.endswith("entropy"))
        loss = (lp * g_lp).sum() + ((h * g_h).sum() if name.endswith("entropy") else 0)
    loss.backward()


def make_inputs(args):
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    logits = (torch.randn(args.tokens, args.vocab, generator=g) * 3).to(dev, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(dev)
    g_lp = torch.randn(args.tokens, generator=g).to(dev)
    g_h = torch.randn(args.tokens, generator=g).to(dev)
    return logits, labels, g_lp, g_h


def _rss(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def measure_memory(args, name) -> float:
    """Extra peak bytes of one forward+backward, as a multiple of the shard's bytes."""
    logits, labels, g_lp, g_h = make_inputs(args)
    shard = logits.numel() * logits.element_size()
    run_variant(name, logits, labels, g_lp, g_h, args.temperature)  # warm-up (lazy inits, imports)
    logits.grad = None
    gc.collect()
    if logits.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run_variant(name, logits, labels, g_lp, g_h, args.temperature)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / shard
    base = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    run_variant(name, logits, labels, g_lp, g_h, args.temperature)
    return (_rss("VmHWM") - base) / shard


def measure_times(args, reps) -> dict:
    logits, labels, g_lp, g_h = make_inputs(args)
    times = {v: [] for v in VARIANTS}
    for rep in range(reps + 1):
        for v in VARIANTS:  # interleaved, so machine load drifts hit every variant alike
            logits.grad = None
            if logits.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run_variant(v, logits, labels, g_lp, g_h, args.temperature)
            if logits.is_cuda:
                torch.cuda.synchronize()
            if rep:  # first round is warm-up
                times[v].append(time.perf_counter() - t0)
    return {v: statistics.median(t) for v, t in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary shard size (V/tp)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--memory-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_only:
        print(json.dumps({"peak": measure_memory(args, args.memory_only)}))
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    shard_mib = args.tokens * args.vocab * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size() / 2**20
    print(f"shard [{args.tokens} x {args.vocab}] {args.dtype} = {shard_mib:.0f} MiB, T={args.temperature}, "
          f"device={'cuda' if torch.cuda.is_available() else 'cpu'}, threads={torch.get_num_threads()}")
    peaks = {}
    for v in VARIANTS:
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-only", v, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--dtype", args.dtype, "--temperature", str(args.temperature)]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONWARNINGS": "ignore"}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        peaks[v] = json.loads(out.strip().splitlines()[-1])["peak"]
    times = measure_times(args, args.reps)
    print(f"{'variant':24s} {'peak/shard':>10s} {'time ms':>9s}")
    for v in VARIANTS:
        print(f"{v:24s} {peaks[v]:10.3f} {times[v] * 1e3:9.1f}")
    for what in ("logp", "logp_entropy"):
        p, t = peaks[f"chunked_{what}"], times[f"chunked_{what}"] / times[f"naive_{what}"]
        ok = "OK" if p <= 1.25 and t <= 1.2 else "MISSED"
        print(f"chunked {what}: peak {p:.3f}x shard (target <= 1.25), time {t:.2f}x naive (target <= 1.2): {ok}")


if __name__ == "__main__":
    main()
