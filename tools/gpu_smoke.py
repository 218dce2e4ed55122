"""`make gpu-smoke`: the real trainer path on one GPU (configs/gpu_smoke.yaml), then a resume, and a summary.

Run A: 3 RL steps (CUDA, NCCL at world size 1, bf16 parameters + distributed optimizer, GSPO + R3, the embedded
engine on the GPU, in-process digest-checked sync), checkpoints at steps 2 and 3, the host syncs of each step
counted (logging.host_syncs: torch's sync debug mode). Run B: resume from step 2 and run step 3. Run C: no
warm-up, no step: the checkpoint of a never-stepped optimizer (FusedAdam creates its state lazily). Run D: resume
from C's step 0 and run step 1, checkpoint after it. Prints the environment, each step's figures (host syncs
included), and how far B's step 3 is from A's. Exit 0 only if every run finished and every sync verified (a
digest mismatch stops a run). Writes under runs/gpu_smoke/<UTC time>/ only (nothing else is touched).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/gpu_smoke.yaml"
# What the smoke's run needs beyond a lent GPU machine's image (Python 3.12, a CUDA torch, transformers and what
# those two depend on): {import name: the wheel's requirement}. tests/test_gpu_path.py runs the smoke's config with
# nothing else importable; tools/gpu_wheels.sh downloads these wheels (cp312, manylinux x86_64).
NEEDS = {
    "megatron.core": "megatron-core==0.16.1",
    "omegaconf": "omegaconf==2.4.0",
    "xxhash": "xxhash==4.1.0",
    "psutil": "psutil==7.2.2",  # megatron-core's dist_checkpointing
}
SHOWN = ("reward/mean", "loss/policy", "optim/grad_norm", "routing/agreement/mean", "mismatch/ratio_dev_max",
         "time/sync", "time/step", "perf/host_syncs_old_logprob", "perf/host_syncs_update")


def environment() -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for mod in ("megatron.core", "transformer_engine", "sglang", "apex"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            env[mod] = getattr(m, "__version__", "installed")
        except Exception as e:  # absent or broken: say which
            env[mod] = f"absent ({type(e).__name__})"
    return env


def missing() -> dict[str, str]:
    """NEEDS entries this environment cannot import (absent, or present but failing)."""
    out = {}
    for module, requirement in NEEDS.items():
        try:
            importlib.import_module(module)
        except Exception as e:
            out[module] = f"{requirement} ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"
    return out


MEGATRON_MOE = "megatron/core/transformer/moe/"  # where megatron's dropless MoE layer reads token counts (per layer)
DEEPER = 4  # run E's layers (configs/gpu_smoke.yaml's model has 2)


def plan(out: str) -> dict[str, list[str]]:
    """The runs (in order) and their overrides of configs/gpu_smoke.yaml (tests/test_gpu_path.py runs C and D)."""
    return {"A": [f"logging.dir={out}/A", f"checkpoint.save_dir={out}/A/ckpt", "logging.host_syncs=true"],
            "B": [f"logging.dir={out}/B", f"checkpoint.save_dir={out}/B/ckpt",
                  f"checkpoint.load_dir={out}/A/ckpt/step_00000002"],
            "C": [f"logging.dir={out}/C", f"checkpoint.save_dir={out}/C/ckpt", "train_iters=0",
                  "trainer.warmup.steps=0", "checkpoint.save_every=0"],
            "D": [f"logging.dir={out}/D", f"checkpoint.save_dir={out}/D/ckpt", "train_iters=1",
                  "trainer.warmup.steps=0", "checkpoint.save_every=0", f"checkpoint.load_dir={out}/C/ckpt/step_00000000",
                  "logging.host_syncs=true"],
            "E": [f"logging.dir={out}/E", f"model.hf_config={deeper_path(out)}", "train_iters=2", "trainer.warmup.steps=0",
                  "checkpoint.save_every=0", f"checkpoint.save_dir={out}/E/ckpt",
                  "logging.host_syncs=true"]}


def deeper_path(out: str) -> str:
    return f"{out}/E_model/config.json"


def deeper_model(out: str, config: str = CONFIG) -> str:
    """Run E's model: the smoke config's model with DEEPER layers, written to deeper_path(out)."""
    import yaml  # omegaconf's own dependency; the smoke runs as a script, without the repo on its path

    with open(os.path.join(ROOT, config)) as f:
        source = os.path.join(ROOT, yaml.safe_load(f)["model"]["hf_config"])
    with open(source if source.endswith(".json") else os.path.join(source, "config.json")) as f:
        hf = json.load(f)
    hf["num_hidden_layers"] = DEEPER
    path = deeper_path(out)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(hf, f, indent=1)
    return path


def sync_sites(logdir: str) -> dict[str, dict[str, int]]:
    """The last step's host syncs by place, per phase (host_syncs.jsonl), split into 'ours' (every place not in
    megatron's MoE layer) and 'megatron_moe'."""
    with open(os.path.join(logdir, "host_syncs.jsonl")) as f:
        last = [json.loads(line) for line in f if line.strip()][-1]
    out = {}
    for phase in ("old_logprob", "update"):
        for place, n in last.get(phase, {}).items():
            kind = "megatron_moe" if place.startswith(MEGATRON_MOE) else "ours"
            out.setdefault(f"{phase}/{kind}", {})[place] = n
    return out


def run(args: list[str], log: str) -> int:
    cmd = [sys.executable, "-m", "rlpo_mega.cli", "train", CONFIG, *args]
    print("$", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode


def history(logdir: str) -> list[dict]:
    with open(os.path.join(logdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output directory (default runs/gpu_smoke/<UTC time>)")
    p.add_argument("--check-imports", action="store_true", help="only check the imports the smoke needs and exit")
    p.add_argument("--requirements", action="store_true", help="print the wheels it needs (tools/gpu_wheels.sh)")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    a = p.parse_args(argv)
    if a.requirements:
        print("\n".join(NEEDS.values()))
        return 0
    absent = missing()  # first: a bare GPU machine has none of them, and the runs would fail on the first
    print(f"gpu-smoke: needs {len(NEEDS)} modules beyond torch and transformers: {', '.join(NEEDS)}; "
          + ("all import" if not absent else f"{len(absent)} do not"), flush=True)
    if absent:
        for module, why in absent.items():
            print(f"  missing {module}: {why}", file=sys.stderr)
        print("gpu-smoke: on a machine with network run `bash tools/gpu_wheels.sh wheels/` (under 64 MiB), carry "
              "wheels/ here, `pip install --no-index --no-deps wheels/*.whl`, then run it again", file=sys.stderr)
        return 2
    if a.check_imports:
        return 0
    env = environment()
    print(json.dumps(env, indent=1))
    if env["gpu"] is None:
        print("gpu-smoke: no CUDA device visible (torch.cuda.is_available() is False): run it on a GPU node, in "
              "an environment with a CUDA build of torch and `pip install -e .`", file=sys.stderr)
        return 2
    out = os.path.abspath(a.out or os.path.join(ROOT, "runs", "gpu_smoke", time.strftime("%Y%m%d-%H%M%S", time.gmtime())))
    if os.path.exists(out) and os.listdir(out):
        print(f"gpu-smoke: {out} is not empty; give another --out", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    t0, rcs = time.monotonic(), {}
    deeper_model(out)
    for name, extra in plan(out).items():
        rcs[name] = run([*extra, *a.overrides], os.path.join(out, f"{name}.log"))
        print(f"run {name}: exit {rcs[name]} ({out}/{name}.log)", flush=True)
        if rcs[name]:
            print(open(os.path.join(out, f"{name}.log")).read()[-4000:])
            return 1
    full, resumed, first = history(f"{out}/A"), history(f"{out}/B"), history(f"{out}/D")
    print(f"\n{'run':<4}{'step':>5} " + " ".join(f"{k:>28}" for k in SHOWN))
    for name, hist in (("A", full), ("B", resumed), ("D", first)):
        for h in hist:
            print(f"{name:<4}{h['step']:>5} " + " ".join(f"{h.get(k, float('nan')):>28.6g}" for k in SHOWN))
    a3, b3 = full[-1], resumed[-1]
    # the training's figures, not the process's: its timings, host syncs and CUDA peaks (memory/peak_gb/<phase>: a
    # resumed process allocates differently); the largest difference is named (an H200 run showed 0.0336 among 77
    # metrics with these peaks included, and no name)
    keys = [k for k in a3 if isinstance(a3[k], (int, float)) and k != "time"
            and not k.startswith(("time/", "perf/", "memory/"))]
    diffs = {k: abs(a3[k] - b3.get(k, math.nan)) for k in keys}
    worst = max(diffs, key=lambda k: (not math.isnan(diffs[k]), diffs[k]), default=None)
    print(f"\nsteps A {[h['step'] for h in full]}, B {[h['step'] for h in resumed]}; step 3 resumed vs "
          f"uninterrupted: max |diff| over {len(keys)} metrics = {diffs[worst] if worst else math.nan:.3g}"
          f"{f' ({worst})' if worst and diffs[worst] else ''}; wall {time.monotonic() - t0:.0f} s")
    before_first = os.path.isdir(f"{out}/C/ckpt/step_00000000")
    after_first = os.path.isdir(f"{out}/D/ckpt/step_00000001")
    syncs = [h.get("perf/host_syncs_update") for h in full]
    print(f"checkpoint before the first step (C, step 0): {'written' if before_first else 'MISSING'}; resumed from it and "
          f"saved after step 1 (D): {'written' if after_first else 'MISSING'}; host syncs per update step (A): {syncs}")
    ok = ([h["step"] for h in full] == [1, 2, 3] and [h["step"] for h in resumed] == [3]
          and [h["step"] for h in first] == [1] and before_first and after_first
          and [h["step"] for h in history(f"{out}/E")] == [1, 2])
    layers = compare_sync_sites(sync_sites(f"{out}/A"), sync_sites(f"{out}/E"))
    ok = ok and layers
    print("gpu-smoke:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


def compare_sync_sites(shallow: dict, deep: dict) -> bool:
    """Prints A's (2 layers) and E's (DEEPER layers) host syncs by place; True when ours are the same in both."""
    print(f"\nhost syncs of a steady step by place, 2 layers (A) vs {DEEPER} layers (E):")
    same = True
    for group in sorted(set(shallow) | set(deep)):
        a, b = shallow.get(group, {}), deep.get(group, {})
        print(f"  {group}: {sum(a.values())} vs {sum(b.values())}")
        for place in sorted(set(a) | set(b), key=lambda k: -max(a.get(k, 0), b.get(k, 0))):
            print(f"    {a.get(place, 0):>4} {b.get(place, 0):>4}  {place}")
        if group.endswith("/ours") and a != b:
            same = False
    print(f"our host syncs {'do not grow' if same else 'GROW'} with the layers")
    return same


if __name__ == "__main__":
    sys.exit(main())
