"""Benchmark routing replay: trace bytes per token on the wire, and the replayed update step's time vs
the same step without replay (interleaved in one run, same model and batch).

Bytes: the transport's cut for a DP x TP(SP) x PP layout (each rank: its DP rows, sequence shard, stage's
MoE layers), next to SGLang's own wire format (int32 over all hidden layers, base64) and a broadcast of the
whole int32 tensor to every rank (what slime did, its issue 2384). Target: <= MoE layers x topk bytes/token.

Step: one process, a small Qwen3-MoE-shaped model; `policy_step` (forward + backward over the micro-batches,
loss, routing metrics; no optimizer step so every repetition sees the same weights) with routing=None vs
R3 replay of recorded routes. Target: <= 5% overhead.

    .venv/bin/python tools/bench_routing.py [--reps 12] [--hidden 256] [--layers 4] [--seq 256]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe.routing.trace import TraceSpec, compact_dtype, validate_batch  # noqa: E402
from moe.routing.transport import Recipient, _pieces, pack, padded_placement  # noqa: E402

MODELS = {  # name: (hidden layers, MoE layer indices, experts, topk)
    "tiny_qwen3_moe": (2, tuple(range(2)), 4, 2),
    "qwen3_30b_a3b": (48, tuple(range(48)), 128, 8),
    "deepseek_v3": (61, tuple(range(3, 61)), 256, 8),
}


def wire_bytes(name, dp=4, tp=2, pp=4, n_samples=64, seed=0):
    hidden, moe, experts, topk = MODELS[name]
    spec = TraceSpec(experts, topk, moe)
    rng = random.Random(seed)
    lengths = [rng.randint(200, 2000) for _ in range(n_samples)]
    seq = -(-max(lengths) // tp) * tp
    per_stage = [tuple(c for c in range(len(moe)) if c * pp // len(moe) == s) for s in range(pp)]
    recipients = [Recipient(0, d, dp, t, tp, per_stage[s]) for d in range(dp) for t in range(tp) for s in range(pp)]
    itemsize = torch.empty(0, dtype=compact_dtype(experts)).element_size()
    placement = padded_placement(lengths)
    total = sum((t1 - t0) * len(r.layer_cols) * topk * itemsize
                for r in recipients for _, t0, t1, _, _ in _pieces(placement, r, n_samples, seq))
    if name == "tiny_qwen3_moe":  # the real pack agrees with the arithmetic
        traces = [torch.rand(n, len(moe), experts).argsort(dim=-1)[..., :topk] for n in lengths]
        traces, _ = validate_batch(traces, spec, lengths)
        packed = sum(pack(traces, _pieces(placement, r, n_samples, seq), r.layer_cols)[0].numel() * itemsize
                     for r in recipients)
        assert packed == total, (packed, total)
    tokens = sum(lengths)
    world = dp * tp * pp
    return {"model": name, "layout": f"DP{dp} x TP{tp}(SP) x PP{pp} = {world} ranks",
            "bytes_per_token": total / tokens, "target_moe_layers_x_topk": len(moe) * topk,
            "sglang_int32_all_layers": hidden * topk * 4, "sglang_base64": hidden * topk * 4 * 4 / 3,
            "broadcast_int32_to_every_rank": world * hidden * topk * 4}


def step_overhead(args):
    from moe.model import load_hf_config
    from moe.routing.replay import RoutingReplay
    from rlpo_mega import distributed
    from tools.batch_support import assemble_batch, prepare_micro_batches
    from rlpo_mega.training.update import policy_step
    from rlpo_mega.config import load_config
    from rlpo_mega.model_setup import build_policy

    with open("configs/models/tiny_qwen3_moe.json") as f:
        raw = json.load(f)
    raw.update(hidden_size=args.hidden, moe_intermediate_size=args.hidden, intermediate_size=2 * args.hidden,
               num_hidden_layers=args.layers, num_experts=args.experts, num_experts_per_tok=args.topk,
               head_dim=args.hidden // 4, vocab_size=1024)
    tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(raw, tmp)
    tmp.close()
    hf = load_hf_config(tmp.name)
    os.unlink(tmp.name)
    cfg = load_config(None, ("parallel.num_micro_batches=2", "algorithm.loss.name=gspo"))
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim, routing_replay=True)
    spec = TraceSpec.from_hf(hf)
    g = torch.Generator().manual_seed(0)
    n = args.batch
    prompts = [torch.randint(3, 1024, (16,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(3, 1024, (args.seq - 16 - i,), generator=g).tolist() for i in range(n)]
    batch, _ = assemble_batch(prompts, responses, torch.arange(n).float(), torch.zeros(n, dtype=torch.long),
                              cfg.algorithm, seq_length=args.seq)
    driver = RoutingReplay(chunks, spec, "r2")  # record the model's own routes once, then replay them (R3 path)
    micro = prepare_micro_batches(chunks, batch, cfg.algorithm, 2, routing=driver)
    driver.metrics()
    driver.mode = "r3"

    def timed(routing):
        if routing is None:
            driver.reset()
        t = time.perf_counter()
        policy_step(chunks, opt, micro, cfg.algorithm, step_optimizer=False, routing=routing)
        return time.perf_counter() - t

    timed(None), timed(driver)  # warm-up
    off, r3 = [], []
    for i in range(args.reps):  # interleaved, alternating order: drift and load hit both alike
        for name in (("off", "r3") if i % 2 == 0 else ("r3", "off")):
            (off if name == "off" else r3).append(timed(None if name == "off" else driver))
    distributed.destroy()
    med_off, med_r3 = statistics.median(off), statistics.median(r3)
    return {"model": f"{args.layers} MoE layers, hidden {args.hidden}, {args.experts} experts top-{args.topk}",
            "batch": f"{n} x {args.seq} tokens, 2 micro-batches", "reps": args.reps,
            "step_s_off_median": med_off, "step_s_r3_median": med_r3,
            "overhead_ratio_of_medians": med_r3 / med_off, "overhead_ratio_of_minima": min(r3) / min(off),
            "overhead_ratio_median_of_pairs": statistics.median(b / a for a, b in zip(off, r3))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    out = {"wire": [wire_bytes(m) for m in MODELS], "step": step_overhead(args)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
