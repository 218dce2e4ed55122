"""Benchmark the trainer's data path: packing efficiency, bytes per rank, step time, packed vs padded.

Synthetic rollouts with long-CoT lengths (response lognormal, mean ~3k tokens, cap 8k; prompts 100-400; token
counts, not generation) go through the real path on N CPU processes (DP >= 2 with TP or PP): every rank
owns a share of the samples as engine ranks do -> gather_scalars -> prepare_step (plan, exchange,
micro-batches; rlpo_mega/training/batches.py) -> old log-prob pass -> policy update (forward + backward),
once with trainer.layout=packed and once padded, alternated over --reps.

- packing efficiency = real tokens / computed tokens (the plan's positions over all DP replicas).
- bytes per rank = the largest bytes any rank received / that rank's own share (its rows' tokens,
  log-probs and every MoE layer's routes in the wire format). "padded G x" is what the previous path did:
  all_gather_object of every sample (pickled numpy, int32 routes) to every rank.
- step time: the update of one mini-batch (old pass + forward/backward) at lengths divided by --scale
  (default 8: the padded layout's [rows, 8k] attention does not fit a CPU's memory), same distribution.

    .venv/bin/python tools/bench_data_path.py [--nproc 4] [--layout tp2|pp2] [--samples 64] [--scale 8]
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODEL = "configs/models/tiny_qwen3_moe.json"
LAYOUTS = {"tp2": ["parallel.tensor=2"], "pp2": ["parallel.pipeline=2", "parallel.num_micro_batches=2"]}


def lengths(n, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    # lognormal with sigma 0.6: mean exp(mu + sigma^2/2) = 3000 tokens, capped at 8192 (max_new_tokens)
    sigma = 0.6
    mu = torch.log(torch.tensor(3000.0)) - sigma ** 2 / 2
    resp = torch.exp(mu + sigma * torch.randn(n, generator=g)).clamp(16, 8192)
    prompt = torch.randint(100, 400, (n,), generator=g).float()
    return [max(2, int(p / scale)) for p in prompt], [max(1, int(r / scale)) for r in resp]


def make_samples(hf, spec, plens, rlens, seed=1):
    from rlpo_mega.rollout import Sample as Scored

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(zip(plens, rlens)):
        routes = torch.randint(0, spec.num_experts, (p + r - 1, spec.num_layers, 1), generator=g)
        routes = (routes + torch.arange(spec.topk)) % spec.num_experts  # distinct ids per token
        out.append(Scored(torch.randint(3, hf.vocab_size, (p,), generator=g).tolist(),
                          torch.randint(3, hf.vocab_size, (r,), generator=g).tolist(), -torch.rand(r, generator=g),
                          "stop", routes.to(torch.uint8), reward=float(i % 2), failed=False, correct=bool(i % 2)))
    return out


def previous_gather_bytes(samples) -> int:
    """What every rank received from the previous rollout_phase.gather: each sample's wire tuple pickled
    (numpy arrays, int32 routes), all_gather_object'ed to every rank."""
    return sum(len(pickle.dumps((s.prompt_ids, s.response_ids, s.logprobs.numpy(), s.finish_reason,
                                 s.routes.to(torch.int32).numpy(), s.reward, s.failed, s.correct)))
               for s in samples)


def worker(args):
    import torch.distributed as dist

    from moe.model import load_hf_config
    from moe.routing.replay import RoutingReplay
    from moe.routing.trace import TraceSpec
    from moe.routing.transport import gather_recipients
    from rlpo_mega import distributed
    from rlpo_mega.training.old_logprobs import attach_old_logprobs
    from rlpo_mega.training.update import policy_step
    from rlpo_mega.config import load_config
    from tools.batch_support import prepare_step
    from rlpo_mega.rollout.gather import gather_scalars
    from rlpo_mega.training.exchange import own_share_bytes
    from rlpo_mega.model_setup import build_policy
    from rlpo_mega.rollout.producers import share

    hf = load_hf_config(MODEL)
    spec = TraceSpec.from_hf(hf)
    over = tuple(LAYOUTS[args.layout]) + ("algorithm.loss.name=gspo", "routing.mode=r3")
    cfg = load_config(None, over)
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim, routing_replay=True)
    routing = RoutingReplay(chunks, spec, mode="r3")
    recipients = gather_recipients(chunks, spec)
    world, me = dist.get_world_size(), dist.get_rank()
    n, dp, tp = args.samples, layout.data, layout.tensor
    gids = torch.arange(n) // 8
    report = {}

    # bytes and efficiency at full length (no model pass)
    plens, rlens = lengths(n, 1)
    full = make_samples(hf, spec, plens, rlens)
    for mode in ("packed", "padded"):
        cfg.trainer.layout = mode
        cfg.trainer.max_tokens_per_micro_batch = 16384 if mode == "packed" else None
        cfg.parallel.num_micro_batches = 1 if mode == "packed" else n // dp // 4
        samples = gather_scalars(share(full, list(range(world))), spec, "error", None)
        _, _, stats = prepare_step(samples, gids, cfg, dp, tp, recipients, spec, 0)
        ratio = torch.tensor([stats["data/bytes_over_own_share"]], dtype=torch.float64)
        dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
        report[mode] = {"efficiency": stats["data/packing_efficiency"], "bytes_ratio": float(ratio)}
    from rlpo_mega.training.exchange import own_share_bytes

    # the previous path: every rank received the whole batch; over the mean own share of a DP replica
    report["previous_ratio"] = previous_gather_bytes(full) / (own_share_bytes(samples, list(range(n)), spec) / dp)

    # step time at --scale
    plens, rlens = lengths(n, args.scale)
    small = make_samples(hf, spec, plens, rlens)
    times = {"packed": [], "padded": []}
    for rep in range(args.reps + 1):
        for mode in ("packed", "padded"):
            cfg.trainer.layout = mode
            cfg.trainer.max_tokens_per_micro_batch = (16384 // args.scale) if mode == "packed" else None
            cfg.parallel.num_micro_batches = max(1, n // dp // 4) if mode == "padded" else \
                (2 if args.layout == "pp2" else 1)
            dist.barrier()
            t0 = time.perf_counter()
            samples = gather_scalars(share(small, list(range(world))), spec, "error", None)
            minis, _, _ = prepare_step(samples, gids, cfg, dp, tp, recipients, spec, 0)
            micro = attach_old_logprobs(chunks, [mb.to() for mb in minis[0]], cfg.algorithm, routing=routing)
            policy_step(chunks, opt, micro, cfg.algorithm, step_optimizer=False, routing=routing)
            dist.barrier()
            if rep:  # the first round warms up
                times[mode].append(time.perf_counter() - t0)
    report["time"] = {m: statistics.median(v) for m, v in times.items()}
    report["tokens"] = {"mean_response": sum(lengths(n, 1)[1]) / n, "max_response": max(lengths(n, 1)[1])}
    if me == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)
    routing.close()
    distributed.destroy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--layout", default="tp2", choices=sorted(LAYOUTS))
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--scale", type=int, default=8, help="lengths are divided by this for the timed step")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--standalone",
               os.path.abspath(__file__), "--worker", "--out", out, "--layout", args.layout,
               "--samples", str(args.samples), "--scale", str(args.scale), "--reps", str(args.reps)]
        env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"benchmark failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        with open(out) as f:
            r = json.load(f)
    t = r["time"]
    print(f"{args.nproc} processes, {args.layout}, {args.samples} samples: responses mean "
          f"{r['tokens']['mean_response']:.0f} tokens, max {r['tokens']['max_response']}; step time at 1/{args.scale} "
          f"length: packed {t['packed']:.2f} s, padded {t['padded']:.2f} s (median of {args.reps})")
    print(f"data path: packing efficiency {r['packed']['efficiency']:.3f} (padded {r['padded']['efficiency']:.3f}); "
          f"bytes per rank {r['packed']['bytes_ratio']:.2f} x own share (padded {r['previous_ratio']:.1f} x); "
          f"step time packed/padded {t['packed'] / t['padded']:.2f}")


if __name__ == "__main__":
    main()
