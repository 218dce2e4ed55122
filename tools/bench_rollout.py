"""Benchmark the embedded rollout engine: generated tokens/s with and without routing capture.

Two engines with the same weights (one with router hooks, one without) generate the same seeded batch,
interleaved (off, on, off, on, ...) so drifts in machine load hit both; best-of-N per mode, ratio printed.
The model is Qwen3-MoE-shaped, a few tens of MB in float32.

    .venv/bin/python tools/bench_rollout.py [--reps 5] [--prompts 16] [--prompt-len 32] [--new 64]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe.bridge.hf_inmemory import HFModelWeights  # noqa: E402
from moe.routing.decoders import HFRouteCapture  # noqa: E402
from moe.routing.trace import TraceSpec, validate_trace  # noqa: E402
from rlpo_mega.config import EmbeddedEngineConfig  # noqa: E402
from rlpo_mega.rollout import SamplingParams  # noqa: E402
from rlpo_mega.rollout.embedded import EmbeddedEngine  # noqa: E402


def bench_config(hidden, layers, experts, vocab):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=hidden // 8, num_experts=experts, num_experts_per_tok=2,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=64, help="max_new_tokens (no stop token: every sample runs to it)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    hf = bench_config(args.hidden, args.layers, args.experts, args.vocab)
    spec = TraceSpec.from_hf(hf)
    ecfg = EmbeddedEngineConfig(batch_size=args.batch_size)
    torch.manual_seed(0)
    engines = {"off": EmbeddedEngine(hf, ecfg, None), "on": EmbeddedEngine(hf, ecfg, spec)}
    src = HFModelWeights(engines["off"].model)
    with torch.no_grad():
        for p in engines["off"].model.parameters():  # routers start at zero: give them real choices
            p.add_(torch.randn_like(p) * 0.02)
    on = engines["on"]
    on.begin_weight_update()
    on.load_weights([(n, src.read(n)) for n in src.names()])
    on.end_weight_update()
    mb = sum(p.numel() * p.element_size() for p in on.model.parameters()) / 2 ** 20

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new, seed=0)
    for e in engines.values():  # warm-up (allocator, kernels)
        e.generate(prompts[:2], SamplingParams(max_new_tokens=4, seed=0))
    times = {"off": [], "on": []}
    tokens = {}
    outs = {}
    for _ in range(args.reps):
        for mode, e in engines.items():
            t0 = time.perf_counter()
            outs[mode] = e.generate(prompts, params)
            times[mode].append(time.perf_counter() - t0)
            tokens[mode] = sum(len(s.response_ids) for s in outs[mode])
    # same weights, same seed: capture must not change what is generated; its traces must validate
    same = [s.response_ids for s in outs["on"]] == [s.response_ids for s in outs["off"]]
    for i, s in enumerate(outs["on"]):
        validate_trace(s.routes, spec, s.num_tokens - 1, i)
    # cached incremental routing vs one full forward of the same tokens (the mismatch R3 replay removes)
    agree = total = 0
    with HFRouteCapture(engines["off"].model, spec) as cap, torch.no_grad():
        for s in outs["on"][:8]:
            engines["off"].model(torch.tensor([s.prompt_ids + s.response_ids]))
            eq = (cap.sample(0)[:-1].sort(-1).values == s.routes.sort(-1).values).all(-1)
            cap.clear()
            agree, total = agree + int(eq.sum()), total + eq.numel()
    tps = {m: tokens[m] / min(times[m]) for m in engines}
    result = {
        "model_mb": round(mb, 1), "threads": torch.get_num_threads(),
        "batch": f"{args.prompts} prompts x {args.prompt_len} tokens, {args.new} new, batch_size {args.batch_size}",
        "tokens_per_call": tokens["on"], "reps": args.reps,
        "tokens_per_s_no_capture": round(tps["off"], 1), "tokens_per_s_capture": round(tps["on"], 1),
        "capture_over_no_capture": round(tps["on"] / tps["off"], 3),
        "best_s": {m: round(min(v), 3) for m, v in times.items()},
        "median_s": {m: round(sorted(v)[len(v) // 2], 3) for m, v in times.items()},
        "identical_samples": same,
        "route_agreement_vs_full_forward": round(agree / total, 4),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
