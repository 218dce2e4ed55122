"""Benchmark: rlpo_mega.algorithms.gae.gae (no Python loop over positions) vs the loop it replaced, side by side.

`gae_loop` below is the former implementation (one step of the recursion per position, every row at once),
kept here as the float64 reference for this benchmark and for tests/test_algorithms_gae.py; the package has
only the vectorised one. For each answer length both run on the same inputs, one after the other, in this one
process: the median of --repeats calls each, their ratio (loop / vectorised) and the largest difference.

Inputs: --rows rows of a micro-batch's [n, s] loss view: a prompt, then a multi-turn answer of about `tokens`
positions (model turns with observation gaps the mask leaves out), right padding of different lengths.

    .venv/bin/python tools/bench_gae.py [--tokens 8192 32768] [--rows 8] [--device cpu|cuda] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlpo_mega.algorithms.gae import gae  # noqa: E402


def gae_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
             lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop implementation rlpo_mega.algorithms.gae.gae had (float64, backwards over positions): a position
    outside the mask passes V and A through unchanged; V and A are zero after a row's last response token."""
    mask = mask.bool()
    m = mask.double()
    r, v = rewards.double() * m, values.detach().double() * m
    adv = torch.zeros_like(r)
    next_v = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
    next_a = torch.zeros_like(next_v)
    for t in range(r.shape[1] - 1, -1, -1):  # backwards over positions, every row at once
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = (delta + gamma * lam * next_a) * m[:, t]
        adv[:, t] = a
        on = mask[:, t]
        next_v, next_a = torch.where(on, v[:, t], next_v), torch.where(on, a, next_a)
    returns = (adv + v) * m
    return adv.to(values.dtype), returns.to(values.dtype)


def make_batch(rows: int, tokens: int, device, seed: int = 0):
    """[rows, width] rewards, values (float32, as the critic gives them) and a multi-turn response mask."""
    g = torch.Generator().manual_seed(seed)
    prompt = 512
    width = prompt + tokens + 64
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for i in range(rows):
        at, end = prompt, prompt + tokens - int(torch.randint(0, 64, (1,), generator=g))
        while at < end:  # model turns of 256-4096 tokens, observations of 16-256 between them
            n = int(torch.randint(256, 4097, (1,), generator=g))
            mask[i, at:min(at + n, end)] = True
            at += n + int(torch.randint(16, 257, (1,), generator=g))
    values = torch.randn(rows, width, generator=g)
    rewards = 0.01 * torch.randn(rows, width, generator=g)
    return rewards.to(device), values.to(device), mask.to(device)


def timed(fn, repeats: int, device) -> tuple[float, tuple]:
    times, out = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="answer lengths")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    results = []
    for tokens in a.tokens:
        rewards, values, mask = make_batch(a.rows, tokens, device)
        gae(rewards, values, mask, a.gamma, a.lam)  # warm-up (CUDA context, kernels)
        t_vec, (adv, ret) = timed(lambda: gae(rewards, values, mask, a.gamma, a.lam), a.repeats, device)
        t_loop, (adv0, ret0) = timed(lambda: gae_loop(rewards, values, mask, a.gamma, a.lam), a.repeats, device)
        # the float64 results, before the cast to the inputs' dtype
        adv64, ret64 = gae(rewards.double(), values.double(), mask, a.gamma, a.lam)
        ref64, rret64 = gae_loop(rewards.double(), values.double(), mask, a.gamma, a.lam)
        res = {"tokens": tokens, "rows": a.rows, "width": mask.shape[1], "model_tokens": int(mask.sum()),
               "device": str(device), "gamma": a.gamma, "lam": a.lam,
               "loop_s": round(t_loop, 5), "vectorised_s": round(t_vec, 5), "ratio": round(t_loop / t_vec, 1),
               "max_abs_diff_f64": float(max((adv64 - ref64).abs().max(), (ret64 - rret64).abs().max())),
               "max_abs_adv_f64": float(ref64.abs().max()),
               "max_abs_diff_out": float(max((adv - adv0).abs().max(), (ret - ret0).abs().max()))}
        results.append(res)
        print(json.dumps(res), flush=True)
    print("loop / vectorised: " + ", ".join(f"{r['tokens']} tokens {r['ratio']}x" for r in results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
