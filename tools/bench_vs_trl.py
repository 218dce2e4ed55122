"""rlpo_mega against TRL's GRPOTrainer, side by side on this machine: the demo task, one start policy, GSPO.

Both systems start from the same policy: the demo's supervised warm-up (configs/demo_cpu.yaml, trainer.warmup),
run once here and exported to HF. Both then run the demo's RL settings: 64 prompts x 8 samples per step,
GSPO clip 3e-4/4e-4, no KL, temperature 1.5, 4 new tokens, Adam lr 2e-3 constant, clip 1.0, no MoE aux loss,
one optimizer step per rollout batch, fp32. TRL runs in its own venv (.venv-trl, built by
tools/trl_support/build_env.sh; never a dependency of the product) through tools/trl_support/trl_grpo.py.

Runs are interleaved (seed by seed, 1 then 2 processes, the two systems alternately first) so that drifts in
machine load hit both. 1 process uses 2 threads; 2 processes use 1 thread each (2 cores here). rlpo_mega at 2
processes is data parallel (parallel.expert=1; --ep2 adds the demo's EP2 layout as another row).

Per run: the median step time over steps 3..N (the first two are warm-up). "step s" is each framework's own
step timer (rlpo_mega: time/step, rollout to weight sync; TRL: on_step_begin -> on_step_end, generation to
optimizer step); "wall s" is the median interval between consecutive step ends (everything in the loop: logging,
data loading). samples/s = 512 / step s. Per system: the median over seeds, and the range. Rewards: the mean
of the first 5 and of the last 10 steps per seed, then mean +- std over seeds, and the curve (mean over seeds).

    .venv/bin/python tools/bench_vs_trl.py [--steps 40] [--seeds 1234,1235,1236] [--procs 1,2] [--ep2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.path.join(ROOT, ".venv", "bin", "python")
TRL_VENV = os.path.join(ROOT, ".venv-trl")
DATA = os.path.join(ROOT, "configs", "data", "toy_add_train.jsonl")
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
BATCH = 64 * 8

START_CODE = """
import sys
sys.path.insert(0, {root!r})
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.training.trainer import Trainer
cfg = load_config({demo!r}, {overrides!r})
trainer = Trainer(cfg)
trainer.start()  # the demo's supervised warm-up (trainer.warmup) and the first sync
path = trainer.save()  # step 0: the warmed-up policy, exported to HF (checkpoint.export_hf)
trainer.close()
distributed.destroy()
print(path)
"""


def _run(cmd, env_extra, log_path, timeout):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **env_extra}
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"bench_vs_trl: {' '.join(cmd[:4])} ... failed (exit {proc.returncode}); log {log_path}:\n{tail}")


def make_start(work: str) -> str:
    """The start policy of both systems: the demo's warm-up, exported to HF."""
    overrides = ("train_iters=1", "parallel.expert=1", "trainer.eval_every=0", f"checkpoint.save_dir={work}/start",
                 "checkpoint.export_hf=true", "checkpoint.resume=false", f"logging.dir={work}/start_log",
                 "logging.mode=disabled", "logging.plot=false")
    code = START_CODE.format(root=ROOT, demo=DEMO, overrides=overrides)
    _run([PY, "-c", code], {"OMP_NUM_THREADS": "2"}, os.path.join(work, "start.log"), 900)
    hf = os.path.join(work, "start", "step_00000000", "hf_model")
    if not os.path.isfile(os.path.join(hf, "config.json")):
        raise SystemExit(f"bench_vs_trl: no exported start policy at {hf}; see {work}/start.log")
    return hf


def run_rlpo(start: str, procs: int, expert: int, seed: int, steps: int, out: str) -> list[dict]:
    overrides = [f"model.init_from_hf={start}", "trainer.warmup.steps=0", "trainer.eval_every=0",
                 f"train_iters={steps}", f"seed={seed}", f"parallel.expert={expert}", "checkpoint.save_dir=null",
                 f"logging.dir={out}", "logging.mode=disabled", "logging.plot=false"]
    cmd = [os.path.join(ROOT, ".venv", "bin", "rlpo-mega"), "train", DEMO, *overrides, "--nproc-per-node", str(procs)]
    _run(cmd, {"OMP_NUM_THREADS": str(2 // procs)}, out + ".log", 1800)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"step": r["step"], "step_s": r["time/step"], "end": r["time"], "reward": r["reward/mean"]} for r in rows]


def run_trl(start: str, procs: int, seed: int, steps: int, out: str) -> list[dict]:
    script = os.path.join(ROOT, "tools", "trl_support", "trl_grpo.py")
    args = ["--model", start, "--data", DATA, "--steps", str(steps), "--seed", str(seed), "--out", out + ".jsonl"]
    if procs == 1:
        cmd = [os.path.join(TRL_VENV, "bin", "python"), script, *args]
    else:
        cmd = [os.path.join(TRL_VENV, "bin", "torchrun"), "--standalone", f"--nproc-per-node={procs}", script, *args]
    _run(cmd, {"OMP_NUM_THREADS": str(2 // procs)}, out + ".log", 1800)
    with open(out + ".jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"step": r["step"], "step_s": r["time_s"], "end": r["end"], "reward": r["reward_mean"]}
            for r in rows if "step" in r]


def summarize_run(rows: list[dict]) -> dict:
    timed = rows[2:]  # steps 3..N
    walls = [b["end"] - a["end"] for a, b in zip(rows[1:], rows[2:])]
    rewards = [r["reward"] for r in rows]
    return {"step_s": statistics.median(r["step_s"] for r in timed), "wall_s": statistics.median(walls),
            "first5": statistics.mean(rewards[:5]), "last10": statistics.mean(rewards[-10:]), "rewards": rewards}


def _mean_std(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def report(results: dict, steps: int):
    print("\n| system | processes | step s (median; range over seeds) | wall s | samples/s | reward first 5 | "
          "reward last 10 |")
    print("|---|---|---|---|---|---|---|")
    for (system, procs), runs in results.items():
        step = [r["step_s"] for r in runs]
        wall = [r["wall_s"] for r in runs]
        f5, l10 = _mean_std([r["first5"] for r in runs]), _mean_std([r["last10"] for r in runs])
        med = statistics.median(step)
        print(f"| {system} | {procs} | {med:.3f} ({min(step):.3f}-{max(step):.3f}) | {statistics.median(wall):.3f} | "
              f"{BATCH / med:.0f} | {f5[0]:.3f} +- {f5[1]:.3f} | {l10[0]:.3f} +- {l10[1]:.3f} |")
    print("\nreward/mean per step (mean over seeds):")
    names = [f"{s}/{p}" for s, p in results]
    print("step " + " ".join(f"{n:>16}" for n in names))
    for i in range(0, steps, 5):
        vals = [statistics.mean(r["rewards"][i] for r in runs) for runs in results.values()]
        print(f"{i + 1:>4} " + " ".join(f"{v:>16.3f}" for v in vals))
    for procs in sorted({p for _, p in results}):
        ours, trl = results.get(("rlpo_mega", procs)), results.get(("trl", procs))
        if ours and trl:
            a, b = statistics.median(r["step_s"] for r in ours), statistics.median(r["step_s"] for r in trl)
            print(f"{procs} process(es): rlpo_mega / TRL step time = {a / b:.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", default="1234,1235,1236")
    p.add_argument("--procs", default="1,2")
    p.add_argument("--ep2", action="store_true", help="also rlpo_mega at 2 processes with the demo's EP2 layout")
    p.add_argument("--work", help="keep the runs' files here (default: a temporary directory, removed)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    procs = [int(x) for x in args.procs.split(",")]
    subprocess.run(["bash", os.path.join(ROOT, "tools", "trl_support", "build_env.sh")], check=True)
    versions = subprocess.run([os.path.join(TRL_VENV, "bin", "python"),
                               os.path.join(ROOT, "tools", "trl_support", "trl_grpo.py"), "--meta"],
                              capture_output=True, text=True, check=True).stdout.strip()
    work = args.work or tempfile.mkdtemp(prefix="bench_vs_trl_")
    os.makedirs(work, exist_ok=True)
    try:
        t0 = time.time()
        start = make_start(work)
        print(f"start policy (demo warm-up, exported): {start} ({time.time() - t0:.0f} s); TRL side: {versions}",
              flush=True)
        results: dict = {}
        for k, seed in enumerate(seeds):
            for n in procs:
                systems = [("rlpo_mega", 1 if n > 1 else 1), ("trl", None)]
                if n > 1 and args.ep2:
                    systems.insert(1, ("rlpo_mega EP2", 2))
                if k % 2:
                    systems.reverse()
                for system, expert in systems:
                    out = os.path.join(work, f"{system.replace(' ', '_')}_p{n}_s{seed}")
                    rows = (run_trl(start, n, seed, args.steps, out) if system == "trl"
                            else run_rlpo(start, n, expert, seed, args.steps, out))
                    if len(rows) != args.steps:
                        raise SystemExit(f"bench_vs_trl: {system} logged {len(rows)} of {args.steps} steps ({out})")
                    s = summarize_run(rows)
                    results.setdefault((system, n), []).append(s)
                    print(f"seed {seed} {system} x{n}: step {s['step_s']:.3f} s, wall {s['wall_s']:.3f} s, reward "
                          f"{s['first5']:.3f} -> {s['last10']:.3f}", flush=True)
        report(results, args.steps)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)  # the temporary directory this run created


if __name__ == "__main__":
    main()
