"""Asynchronous RL on a CPU SGLang server: the same task with trainer.max_staleness 0 and 1, phase timers side by side.

As on a cluster, where generation and training share no GPU, they share no core here: the learner (one rank,
torchrun and all) runs on core 0 and the SGLang server it launches on core 1 (taskset). Each run: a tiny
Qwen3-MoE checkpoint, GSPO + R3, the recipes' sglang_distributed weight sync, --steps steps.

Reads each run's metrics.jsonl and prints, over the steady steps (the first --skip left out):
  sync:  generation = time/rollout + time/reward (waiting for the server and scoring), training = the rest of the step
  async: the step time, and `async: step/max(gen,train) = R` against the synchronous run's generation and training;
         async/pause_s: the syncs' waits for the engine (partial rollout: aborting and collecting the running
         requests; without: the running call); async/continue_s: of async/generate_s, the calls after a step's
         first (its continued and restarted samples); async/held_s: of async/generate_s, the syncs that ran under
         its calls (partial_rollout_kv=keep): generation under async is generate_s less held_s.

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


def run(out: str, name: str, staleness: int, partial: bool, kv: str, args, hf: str, python: str,
        port: int) -> list[dict]:
    run_dir = os.path.join(out, name)
    over = [f"train_iters={args.steps}", "trainer.warmup.steps=0", "trainer.eval_every=0", "checkpoint.save_dir=null",
            "parallel.expert=1", f"model.init_from_hf={hf}", f"prompts.prompts_per_step={args.prompts}",
            f"prompts.n_samples={args.n}", f"trainer.epochs={args.epochs}", f"rollout.max_new_tokens={args.tokens}", "rollout.engine=sglang",
            "rollout.sync_transport=sglang_distributed", "rollout.sglang.launch=true", f"rollout.sglang.python={python}",
            f"rollout.sglang.base_port={port}", "rollout.sglang.startup_timeout=300",
            f"rollout.sglang.log_dir={os.path.join(run_dir, 'sglang_logs')}", "rollout.sglang.env.SGLANG_USE_CPU_ENGINE=1",
            f"rollout.sglang.env.PYTHONPATH={os.path.join(ROOT, 'tests', 'sglang_support', 'path')}",
            f"rollout.sglang.max_in_flight_per_server={args.prompts * args.n}",
            f"logging.dir={run_dir}", "logging.wandb=false", "logging.progress_bar=false", "logging.plot=false",
            f"trainer.max_staleness={staleness}", f"rollout.partial_rollout={str(partial).lower()}",
            "rollout.producer=async" if staleness else "rollout.producer=sync", f"rollout.partial_rollout_kv={kv}",
            *(["rollout.sglang.server_args.disable_radix_cache=true"] if kv == "keep" else []),
            *(f"rollout.sglang.server_args.{k}={str(v).lower() if isinstance(v, bool) else v}"
              for k, v in SERVER_ARGS.items())]
    cmd = ["taskset", "-c", "0", os.path.join(ROOT, ".venv", "bin", "rlpo-mega"), "train", "configs/demo_cpu.yaml",
           "--nproc-per-node", "1", *over]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"the {name} run failed (rc {rc}): see {log.name}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def learn(args):
    """The demo task (configs/demo_cpu.yaml: warm-up, then GSPO + R3 on the embedded engine, 2 ranks) for each seed,
    synchronous and with max_staleness=1: reward and eval accuracy at the end, per seed and their mean."""
    out = args.out or tempfile.mkdtemp(prefix="learn_async_")
    os.makedirs(out, exist_ok=True)
    modes = {"sync": ("rollout.producer=sync", *args.overrides),
             "async": ("rollout.producer=async", "trainer.max_staleness=1", *args.overrides, *args.async_overrides)}
    rows = {}
    for seed in args.seeds:
        for name, over in modes.items():
            run_dir = os.path.join(out, f"{name}_{seed}")
            cmd = [os.path.join(ROOT, ".venv", "bin", "rlpo-mega"), "train", "configs/demo_cpu.yaml", "--nproc-per-node",
                   "2", f"seed={seed}", "checkpoint.save_dir=null", f"logging.dir={run_dir}", "logging.wandb=false",
                   "logging.progress_bar=false", "logging.plot=false", *over]
            with open(run_dir + ".log", "w") as log:
                rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, stdout=log,
                                    stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise SystemExit(f"{name} seed {seed} failed (rc {rc}): see {run_dir}.log")
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                hist = [json.loads(line) for line in f]
            rewards = [h["reward/mean"] for h in hist if "reward/mean" in h]
            evals = [h["eval/accuracy"] for h in hist if "eval/accuracy" in h]
            rows[(name, seed)] = (statistics.mean(rewards[:5]), statistics.mean(rewards[-10:]), evals[0], evals[-1],
                                  statistics.mean(h["time/step"] for h in hist[1:] if "time/step" in h))
            print(f"{name:6s} seed {seed:5d}: reward first 5 {rows[(name, seed)][0]:.3f} -> last 10 "
                  f"{rows[(name, seed)][1]:.3f}; eval accuracy {evals[0]:.3f} -> {evals[-1]:.3f}; "
                  f"step {rows[(name, seed)][4]:.2f} s", flush=True)
    for name in modes:
        last = [rows[(name, s)][1] for s in args.seeds]
        ev = [rows[(name, s)][3] for s in args.seeds]
        print(f"{name:6s} over seeds {args.seeds}: reward last 10 mean {statistics.mean(last):.3f} (sd "
              f"{statistics.stdev(last) if len(last) > 1 else 0:.3f}); final eval accuracy mean {statistics.mean(ev):.3f} "
              f"(sd {statistics.stdev(ev) if len(ev) > 1 else 0:.3f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the means (start-up)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=1, help="trainer.epochs: the learner's share of a step")
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", nargs="+", default=["async_partial", "async_keep", "async_wait"],
                    help="async runs beside sync")
    ap.add_argument("--port", type=int, default=31700)
    ap.add_argument("--learn", action="store_true", help="the demo task over --seeds, sync vs max_staleness=1")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    ap.add_argument("--overrides", nargs="*", default=[], help="--learn: config overrides for both runs")
    ap.add_argument("--async-overrides", nargs="*", default=[], help="--learn: config overrides for the async runs")
    args = ap.parse_args()
    if args.learn:
        return learn(args)
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
    modes = {"sync": (0, False, "recompute"), "async_partial": (1, True, "recompute"), "async_keep": (1, True, "keep"),
             "async_wait": (1, False, "recompute")}
    runs = {name: run(out, name, k, partial, kv, args, hf, python, args.port + 10 * i)
            for i, (name, (k, partial, kv)) in enumerate(modes.items()) if name in args.modes or name == "sync"}

    def mean(hist, key):
        vals = [h.get(key, 0.0) for h in hist[args.skip:]]
        return statistics.mean(vals) if vals else float("nan")

    keys = ["time/step", "time/rollout", "time/reward", "time/gather", "time/prepare", "time/old_logprob",
            "time/update", "time/sync", "async/pause_s", "async/generate_s", "async/continue_s", "async/held_s",
            "async/staleness_mean", "async/continued_samples", "async/restarted_samples", "reward/mean"]
    print(f"{args.steps} steps ({args.skip} left out), {args.prompts} prompts x {args.n} samples, "
          f"{args.tokens} new tokens, {args.epochs} epochs; learner on core 0, SGLang server on core 1; out: {out}")
    print("staleness 0: the sync producer; async_partial: max_staleness=1, partial_rollout=true (a sync aborts the "
          "running requests and sends them again, prefilled anew); async_keep: the same with partial_rollout_kv=keep "
          "(a sync holds them in place, KV cache and all; radix cache off); async_wait: max_staleness=1, "
          "partial_rollout=false (a sync waits for them)")
    print(f"{'mean per steady step (s)':28s}" + "".join(f"{name:>15s}" for name in runs))
    for k in keys:
        print(f"{k:28s}" + "".join(f"{mean(h, k):15.3f}" for h in runs.values()))
    sync = runs["sync"][args.skip:]
    gen = [h.get("time/rollout", 0.0) + h.get("time/reward", 0.0) for h in sync]
    g, t = statistics.mean(gen), statistics.mean(h["time/step"] - x for h, x in zip(sync, gen))
    print(f"sync: generation {g:.3f} s, training {t:.3f} s, step {mean(runs['sync'], 'time/step'):.3f} s")
    for name in [m for m in ("async_partial", "async_keep", "async_wait") if m in runs]:
        step = mean(runs[name], "time/step")
        print(f"{name}: step {step:.3f} s, {mean(runs['sync'], 'time/step') / step:.2f}x the sync step's speed")
        print(f"async: step/max(gen,train) = {step / max(g, t):.3f}  ({name}); generation under async "
              f"{mean(runs[name], 'async/generate_s') - mean(runs[name], 'async/held_s'):.3f} s against {g:.3f} s "
              "alone")


if __name__ == "__main__":
    main()
