"""FP8 rollout against bf16 on the CPU demo: the demo (configs/demo_cpu.yaml: warm-up, then GSPO + R3, 80 steps,
2 learner ranks) generating on a launched CPU SGLang server, rollout.weights=fp8 beside bf16, over --seeds.

The model is configs/models/tiny_qwen3_moe_fp8.json (the demo's tiny Qwen3-MoE widened so that every projection is
whole 128-blocks, which block FP8 needs), from a checkpoint this tool makes. bf16 serves the learner's fp32 weights
in fp32 (the demo's CPU server); fp8 serves block-FP8 weights in bf16, with the mismatch correction on (TIS, the
FP8 default). Prints per run: the best 5-step reward mean (the demo's claim: >= 0.85 here), the first/last 5, the
final greedy eval accuracy, and the mismatch curve -- mismatch/k3_kl and the routing agreement (the learner's live
router vs the server's routes) per step, every 10th step -- then means over the seeds.

  .venv/bin/python tools/bench_fp8.py [--seeds 1234 1 2] [--modes fp8 bf16] [--out DIR]
Needs the SGLang venv (make venv-sglang).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "configs/models/tiny_qwen3_moe_fp8.json")
SERVER_ARGS = dict(device="cpu", attention_backend="torch_native", disable_overlap_schedule=True,
                   max_total_tokens=16384, max_running_requests=128, chunked_prefill_size=2048,
                   mem_fraction_static=0.15, skip_server_warmup=True, enable_return_routed_experts=True,
                   skip_tokenizer_init=True, sleep_on_idle=True)


def make_checkpoint(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, ROOT)
    from moe.model import load_hf_config

    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(load_hf_config(MODEL))
    model.save_pretrained(path)


def run(out: str, mode: str, seed: int, hf: str, args) -> list[dict]:
    run_dir = os.path.join(out, f"{mode}_{seed}")
    server = {**SERVER_ARGS, **({"dtype": "float32"} if mode == "bf16" else {})}
    over = [f"seed={seed}", f"model.init_from_hf={hf}", f"model.hf_config={MODEL}", "checkpoint.save_dir=null", f"logging.dir={run_dir}",
            "logging.wandb=false", "logging.progress_bar=false", "logging.plot=false", f"rollout.weights={mode}",
            "rollout.engine=sglang", "rollout.sync_transport=in_process", "rollout.sglang.launch=true",
            f"rollout.sglang.python={args.python}", f"rollout.sglang.base_port={args.port}",
            "rollout.sglang.startup_timeout=300", f"rollout.sglang.log_dir={os.path.join(run_dir, 'sglang_logs')}",
            "rollout.sglang.env.SGLANG_USE_CPU_ENGINE=1", "rollout.sglang.max_in_flight_per_server=512",
            f"rollout.sglang.env.PYTHONPATH={os.path.join(ROOT, 'tests', 'sglang_support', 'path')}",
            *(f"rollout.sglang.server_args.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in server.items()),
            *args.overrides]
    cmd = [os.path.join(ROOT, ".venv", "bin", "rlpo-mega"), "train", "configs/demo_cpu.yaml", "--nproc-per-node", "2",
           *over]
    with open(run_dir + ".log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"},
                            stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{mode} seed {seed} failed (rc {rc}): see {run_dir}.log")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summary(hist: list[dict]) -> dict:
    rewards = [h["reward/mean"] for h in hist if "reward/mean" in h]
    fives = [statistics.mean(rewards[i:i + 5]) for i in range(len(rewards) - 4)]
    evals = [h["eval/accuracy"] for h in hist if "eval/accuracy" in h]
    steps = [h for h in hist if "mismatch/k3_kl" in h]
    layers = sorted(k for k in steps[0] if k.startswith("routing/agreement/layer_")) if steps else []
    return {"best5": max(fives), "first5": fives[0], "last5": fives[-1], "eval": evals[-1] if evals else float("nan"),
            "k3": [h["mismatch/k3_kl"] for h in steps], "agree": [[h[k] for k in layers] for h in steps],
            "step_s": statistics.mean(h["time/step"] for h in hist[1:] if "time/step" in h)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    ap.add_argument("--modes", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--port", type=int, default=31900)
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv-sglang", "bin", "python"))
    ap.add_argument("--overrides", nargs="*", default=[], help="config overrides for every run")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="bench_fp8_")
    os.makedirs(out, exist_ok=True)
    hf = os.path.join(out, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        make_checkpoint(hf)
    rows = {}
    for seed in args.seeds:
        for mode in args.modes:
            s = rows[(mode, seed)] = summary(run(out, mode, seed, hf, args))
            curve = ", ".join(f"{i + 1}: {k:.1e} {[round(a, 3) for a in ag]}"
                              for i, (k, ag) in enumerate(zip(s["k3"], s["agree"])) if i == 0 or (i + 1) % 10 == 0)
            print(f"{mode:4s} seed {seed:5d}: best 5-step mean {s['best5']:.3f} (first/last 5 {s['first5']:.3f} -> "
                  f"{s['last5']:.3f}); final eval accuracy {s['eval']:.3f}; step {s['step_s']:.2f} s\n"
                  f"     mismatch curve (step: k3 KL [routing agreement per layer]): {curve}", flush=True)
    for mode in args.modes:
        best = [rows[(mode, s)]["best5"] for s in args.seeds]
        k3 = [statistics.mean(rows[(mode, s)]["k3"]) for s in args.seeds]
        agree = [statistics.mean(sum(a) / len(a) for a in rows[(mode, s)]["agree"]) for s in args.seeds]
        print(f"{mode:4s} over seeds {args.seeds}: best 5-step means {[round(b, 3) for b in best]} (min {min(best):.3f}); "
              f"k3 KL mean per run {[f'{k:.1e}' for k in k3]}; routing agreement mean {[round(a, 3) for a in agree]}")


if __name__ == "__main__":
    main()
