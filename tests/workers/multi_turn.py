"""Multi-turn episodes through the real trainer (embedded engine, fp32, R3), several layouts in one launch.

argv: out_dir data_dir layout... (layouts: "ep1", "ep2", "tp2"). A short supervised warm-up teaches the random
tiny model to answer and close its turn (so episodes go on for several turns), then 2 RL steps of episodes with
the scripted tool environment. The policy objective is wrapped (test only) to record the gradient that reaches
the new log-probs outside the loss mask (the observation, template, prompt and padding positions).
Rank 0 writes {layout: {"rc", "history", "grad"}}.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import tests.multi_turn_support  # noqa: F401  (registers the test_script environment)
from rlpo_mega.config import load_config
from rlpo_mega.training import update
from rlpo_mega.training.trainer import train
from tests.dist import write_report

GRAD = {"outside_max": 0.0, "inside_nonzero": 0, "inside": 0}
_objective = update.policy_objective


def _recording_objective(logp, batch, *args, **kw):
    mask = batch.loss_mask.bool()

    def record(g):
        GRAD["outside_max"] = max(GRAD["outside_max"], float(g[~mask].abs().max()) if (~mask).any() else 0.0)
        GRAD["inside_nonzero"] += int((g[mask] != 0).sum())
        GRAD["inside"] += int(mask.sum())

    if logp.requires_grad:
        logp.register_hook(record)
    return _objective(logp, batch, *args, **kw)


update.policy_objective = _recording_objective

LAYOUTS = {"ep1": ("parallel.expert=1",), "ep2": ("parallel.expert=2",),
           "tp2": ("parallel.expert=1", "parallel.tensor=2")}


def run(out, data, layout):
    run_dir = os.path.join(out, layout)
    cfg = load_config("configs/demo_cpu.yaml", (
        "train_iters=2", f"prompts.path={data}/prompts.jsonl", "prompts.tokenizer=configs/tokenizers/tiny_chatml",
        "prompts.prompts_per_step=4", "prompts.n_samples=2", "rollout.max_new_tokens=6",
        "rollout.temperature=1.0", "algorithm.temperature=1.0", "logging.progress_bar=false",
        "logging.console_every=0", "logging.mode=disabled", f"logging.dir={run_dir}", "trainer.eval_every=0",
        "checkpoint.save_dir=null", f"trainer.warmup.path={data}/warmup.jsonl", "trainer.warmup.steps=40",
        "trainer.warmup.batch_size=8", "trainer.warmup.lr=3e-3", "environment.name=test_script",
        "environment.options.observations=[ab,cd]", "environment.options.vary_reward=true", "environment.max_turns=3", "environment.max_tokens=200",
        "routing.mode=r3", "algorithm.mismatch.mode=tis", "algorithm.mismatch.level=sequence", *LAYOUTS[layout]))
    GRAD.update(outside_max=0.0, inside_nonzero=0, inside=0)
    rc = train(cfg, keep_world=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f]
    grad = torch.tensor([GRAD["outside_max"], GRAD["inside_nonzero"], GRAD["inside"]], dtype=torch.float64)
    dist.all_reduce(grad, op=dist.ReduceOp.MAX)  # each rank's own micro-batches
    return {"rc": rc, "history": history, "grad": grad.tolist()}


if __name__ == "__main__":
    out, data, *layouts = sys.argv[1:]
    result = {layout: run(out, data, layout) for layout in layouts}
    if int(os.environ.get("RANK", "0")) == 0:
        write_report(result)
