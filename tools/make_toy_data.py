"""Generate the toy-task prompt files of the CPU demo (small enough to commit).

Tasks a tiny random MoE with the character tokenizer (tools/make_tiny_tokenizer.py) can learn with RL
on CPU in minutes: short answers over a handful of symbols, so random sampling already hits some right
answers and groups have mixed scores (a gradient) from the first step.

  copy     "copy: cab"  -> "cab"   reward toy_sequence (per-position partial credit)
  reverse  "reverse: cab" -> "bac" reward toy_sequence
  add      "3+4="       -> "7"     reward toy_arith (first integer in the response)
  add_off_by_one "3+4=" -> "8": a wrong rule for the demo's warm-up (reading the digits is learnt,
             every answer is wrong), so RL starts near zero reward and has to find a+b itself

    python tools/make_toy_data.py [--out configs/data] [--train 512] [--test 64] [--seed 0]

writes {out}/toy_{task}_{train,test}.jsonl with fields prompt, answer, task. Test prompts are disjoint
from training prompts (except for add, which has only 100 distinct prompts).
"""
from __future__ import annotations

import argparse
import json
import os
import random

LETTERS = "abcde"  # few symbols: a random policy's first guesses are often partly right


def _word(rng: random.Random, lo: int = 2, hi: int = 4) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def make(task: str, rng: random.Random) -> dict:
    if task == "copy":
        w = _word(rng)
        return {"prompt": f"copy: {w}", "answer": w, "task": task}
    if task == "reverse":
        w = _word(rng)
        return {"prompt": f"reverse: {w}", "answer": w[::-1], "task": task}
    if task == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b), "task": task}
    if task == "add_off_by_one":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b + 1), "task": task}
    raise ValueError(f"unknown task {task!r}")


def generate(task: str, n_train: int, n_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(f"{task}:{seed}")
    test, seen = [], set()
    for _ in range(n_test * 20):  # distinct test prompts (add has only 100)
        if len(test) == n_test:
            break
        r = make(task, rng)
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            test.append(r)
    train = []
    while len(train) < n_train:
        r = make(task, rng)
        # keep test prompts out of training, except for add: 100 prompts in all, too few to split
        if task.startswith("add") or r["prompt"] not in seen:
            train.append(r)
    return train, test


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="configs/data")
    ap.add_argument("--tasks", default="copy,reverse,add")
    ap.add_argument("--train", type=int, default=512)
    ap.add_argument("--test", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for task in args.tasks.split(","):
        for split, rows in zip(("train", "test"), generate(task, args.train, args.test, args.seed)):
            path = os.path.join(args.out, f"toy_{task}_{split}.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            print(f"wrote {path}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
