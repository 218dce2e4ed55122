"""What a reader opens to follow one RL step of `make demo`: the package files and functions one `train_step` enters.

Runs the demo's trainer (configs/demo_cpu.yaml, 2 processes as `make demo`) for 2 steps with the warm-up cut to 1
step, and on rank 0 records, with sys.setprofile, every function of rlpo_mega/ and moe/ called during the second
`Trainer.train_step` (the first pays one-time work), in call order. Prints the files in the order a reader meets
them, the number of functions entered in each and of entry points (functions entered from another file), the files
a reader opens from the step's own modules (rlpo_mega/training/ and what they call directly), and the house counts: in-function own-package imports, modules in training/, the largest package file.

  python tools/step_reading.py            (from the repository root; about a minute on 2 CPU cores)
  python tools/step_reading.py --json F   also writes the numbers to F
  python tools/step_reading.py rollout.producer=async algorithm.dynamic_sampling.enabled=true   another step
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("rlpo_mega", "moe")


def house_counts() -> dict:
    """In-function imports of the own packages, modules in training/, the largest file (lines)."""
    inner, largest = 0, ("", 0)
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            text = p.read_text()
            lines = text.count("\n")
            if lines > largest[1]:
                largest = (str(p.relative_to(ROOT)), lines)
            tree = ast.parse(text)
            top = {id(n) for n in tree.body}
            for n in ast.walk(tree):
                if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top:
                    mod = n.module if isinstance(n, ast.ImportFrom) else n.names[0].name
                    if (mod or "").split(".")[0] in PACKAGES or (isinstance(n, ast.ImportFrom) and n.level):
                        inner += 1
    training = [p for p in (ROOT / "rlpo_mega" / "training").glob("*.py") if p.name != "__init__.py"]
    return {"in_function_own_imports": inner, "training_modules": len(training),
            "largest_file": largest[0], "largest_file_lines": largest[1], "name_branches": len(name_branches())}


CHOICES = ("engine", "producer", "sync_transport")  # the registries' configured names (rollout.*)


def name_branches() -> list[str]:
    """Where the package branches on a registry's configured name (`x.engine == "sglang"`, `x.producer in (...)`)
    instead of asking the registered class: file:line of each comparison."""
    out = []
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            for n in ast.walk(ast.parse(p.read_text())):
                if isinstance(n, ast.Compare) and isinstance(n.left, ast.Attribute) and n.left.attr in CHOICES \
                        and any(isinstance(c, ast.Constant) and isinstance(c.value, str)
                                or isinstance(c, (ast.Tuple, ast.List, ast.Set)) for c in n.comparators):
                    out.append(f"{p.relative_to(ROOT)}:{n.lineno}")
    return out


WORKER = r'''
import json, os, sys
sys.path.insert(0, {root!r})
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.training.trainer import Trainer

cfg = load_config("configs/demo_cpu.yaml", ("train_iters=2", "trainer.warmup.steps=1", "trainer.eval_every=0",
                                            "logging.mode=disabled", "logging.plot=false",
                                            "logging.dir=" + {out!r}) + tuple({overrides!r}))
trainer = Trainer(cfg)
calls, calls_made = [], [0]
roots = tuple(os.path.join({root!r}, p) + os.sep for p in ("rlpo_mega", "moe"))

def profile(frame, event, arg):
    if event == "call":
        f = frame.f_code.co_filename
        if f.startswith(roots):
            back = frame.f_back
            caller = back.f_code.co_filename if back is not None else ""
            calls.append((os.path.relpath(f, {root!r}), frame.f_code.co_qualname, os.path.relpath(caller, {root!r})))

original = Trainer.train_step

def step(self):
    calls_made[0] += 1
    if calls_made[0] == 2 and self.rank == 0:
        sys.setprofile(profile)
        try:
            return original(self)
        finally:
            sys.setprofile(None)
    return original(self)

Trainer.train_step = step
try:
    trainer.run()
finally:
    trainer.close()
    distributed.destroy()
if calls:
    with open(os.path.join({out!r}, "calls.json"), "w") as f:
        json.dump(calls, f)
'''


def trace_step(overrides=()) -> list:
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(out, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER.format(root=str(ROOT), out=out, overrides=list(overrides)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29561",
               script]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode != 0:
            raise SystemExit(f"step_reading: the traced run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, "calls.json")) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the numbers to this file")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides of the traced run, e.g. "
                    "rollout.producer=async algorithm.dynamic_sampling.enabled=true prompts.oversample=2.0")
    args = ap.parse_args()
    calls = trace_step(args.overrides)
    order, functions, entries = [], {}, {}
    for path, fn, caller in calls:
        if path not in functions:
            order.append(path)
            functions[path], entries[path] = set(), set()
        functions[path].add(fn)
        if caller != path:
            entries[path].add(fn)
    print(f"{'file':<48} {'functions':>9} {'entry points':>12}")
    for path in order:
        print(f"{path:<48} {len(functions[path]):>9} {len(entries[path]):>12}")
    own = [p for p in order if p.startswith("rlpo_mega")]
    # what a reader opens from the step's own pages: the training modules and what they call directly (not what
    # megatron or torch call back: platform patches, model internals)
    step_pages = {p for p in order if p.startswith("rlpo_mega/training/")}
    opened = step_pages | {path for path, _, caller in calls if caller in step_pages}
    summary = {"files": len(order), "rlpo_mega_files": len(own), "moe_files": len(order) - len(own),
               "functions": sum(len(v) for v in functions.values()),
               "rlpo_mega_functions": sum(len(functions[p]) for p in own),
               "files_entered_more_than_once": sum(len(entries[p]) > 1 for p in own),
               "files_opened_from_the_step_modules": len(opened), **house_counts()}
    print("branches on a configured engine/producer/transport name:", ", ".join(name_branches()) or "none")
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "files": {p: sorted(functions[p]) for p in order},
                       "opened": sorted(opened)}, f, indent=1)


if __name__ == "__main__":
    main()
