"""Asynchronous RL on a CPU SGLang server: the same task with trainer.max_staleness 0 and 1, phase timers side by side.

As on a cluster, where generation and training share no GPU, they share no core here: the learner (one rank,
torchrun and all) runs on core 0 and the SGLang server it launches on core 1 (taskset). Each run: a tiny
Qwen3-MoE checkpoint, GSPO + R3, the recipes' sglang_distributed weight sync, --steps steps.

Reads each run's metrics.jsonl and prints, over the steady steps (the first --skip left out):
  sync:  generation = time/rollout + time/reward (waiting for the server and scoring), training = the rest of the step
  async: the step time, and `async: step/max(gen,train) = R` against the synchronous run's generation and training.

  .venv/bin/python tools/bench_async.py [--steps 10] [--prompts 32] [--n 4] [--tokens 24]
Needs the SGLang venv (make venv-sglang) and 2 cores.
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
SERVER_ARGS = dict(device="cpu", attention_backend="torch_native", disable_overlap_schedule=True,
                   max_total_tokens=16384, max_running_requests=128, chunked_prefill_size=2048,
                   mem_fraction_static=0.15, skip_server_warmup=True, enable_return_routed_experts=True,
                   skip_tokenizer_init=True, dtype="float32", sleep_on_idle=True)


def make_checkpoint(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, ROOT)
    from moe.model import load_hf_config

    hf = load_hf_config(os.path.join(ROOT, "configs/models/tiny_qwen3_moe.json"))
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(hf)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)


def run(out: str, staleness: int, args, hf: str, python: str, port: int) -> list[dict]:
    run_dir = os.path.join(out, f"staleness_{staleness}")
    over = [f"train_iters={args.steps}", "trainer.warmup.steps=0", "trainer.eval_every=0", "checkpoint.save_dir=null",
            "parallel.expert=1", f"model.init_from_hf={hf}", f"prompts.prompts_per_step={args.prompts}",
            f"prompts.n_samples={args.n}", f"rollout.max_new_tokens={args.tokens}", "rollout.engine=sglang",
            "rollout.sync_transport=sglang_distributed", "rollout.sglang.launch=true", f"rollout.sglang.python={python}",
            f"rollout.sglang.base_port={port}", "rollout.sglang.startup_timeout=300",
            f"rollout.sglang.log_dir={os.path.join(run_dir, 'sglang_logs')}", "rollout.sglang.env.SGLANG_USE_CPU_ENGINE=1",
            f"rollout.sglang.env.PYTHONPATH={os.path.join(ROOT, 'tests', 'sglang_support', 'path')}",
            f"rollout.sglang.max_in_flight_per_server={args.prompts * args.n}",
            f"logging.dir={run_dir}", "logging.wandb=false", "logging.progress_bar=false", "logging.plot=false",
            f"trainer.max_staleness={staleness}", "rollout.producer=async" if staleness else "rollout.producer=sync",
            *(f"rollout.sglang.server_args.{k}={str(v).lower() if isinstance(v, bool) else v}"
              for k, v in SERVER_ARGS.items())]
    cmd = ["taskset", "-c", "0", os.path.join(ROOT, ".venv", "bin", "rlpo-mega"), "train", "configs/demo_cpu.yaml",
           "--nproc-per-node", "1", *over]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    with open(os.path.join(out, f"staleness_{staleness}.log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"the staleness={staleness} run failed (rc {rc}): see {log.name}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the means (start-up)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    ap.add_argument("--port", type=int, default=31700)
    args = ap.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 cores: the learner on one, the SGLang server on the other")
    sgl = os.path.join(ROOT, ".venv-sglang", "bin", "python")
    if not os.path.exists(sgl):
        raise SystemExit("no SGLang venv at .venv-sglang: make venv-sglang")
    out = args.out or tempfile.mkdtemp(prefix="bench_async_")
    os.makedirs(out, exist_ok=True)
    hf = os.path.join(out, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        make_checkpoint(hf)
    python = os.path.join(out, "sglang_on_core1.sh")  # the server (and its scheduler processes) on core 1
    with open(python, "w") as f:
        f.write(f"#!/bin/sh\nexec taskset -c 1 {sgl} \"$@\"\n")
    os.chmod(python, 0o755)
    runs = {k: run(out, k, args, hf, python, args.port + 10 * k) for k in (0, 1)}

    def mean(hist, key):
        vals = [h.get(key, 0.0) for h in hist[args.skip:]]
        return statistics.mean(vals) if vals else float("nan")

    keys = ["time/step", "time/rollout", "time/reward", "time/gather", "time/prepare", "time/old_logprob",
            "time/update", "time/sync", "async/generate_s", "async/staleness_mean", "async/continued_samples"]
    print(f"{args.steps} steps ({args.skip} left out), {args.prompts} prompts x {args.n} samples, "
          f"{args.tokens} new tokens; learner on core 0, SGLang server on core 1; out: {out}")
    print(f"{'mean per steady step (s)':28s} {'staleness 0':>12s} {'staleness 1':>12s}")
    for k in keys:
        print(f"{k:28s} {mean(runs[0], k):12.3f} {mean(runs[1], k):12.3f}")
    gen = [h.get("time/rollout", 0.0) + h.get("time/reward", 0.0) for h in runs[0][args.skip:]]
    train = [h["time/step"] - g for h, g in zip(runs[0][args.skip:], gen)]
    g, t, step = statistics.mean(gen), statistics.mean(train), mean(runs[1], "time/step")
    print(f"sync: generation {g:.3f} s, training {t:.3f} s, step {mean(runs[0], 'time/step'):.3f} s")
    print(f"async: step {step:.3f} s; speed-up over sync {mean(runs[0], 'time/step') / step:.2f}x")
    print(f"async: step/max(gen,train) = {step / max(g, t):.3f}")
    rewards = {k: mean(runs[k], "reward/mean") for k in runs}
    print(f"reward/mean over the steady steps: staleness 0 {rewards[0]:.3f}, staleness 1 {rewards[1]:.3f}")


if __name__ == "__main__":
    main()
