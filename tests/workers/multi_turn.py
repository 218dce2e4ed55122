"""Multi-turn episodes through the real trainer (embedded engine, fp32, R3), several layouts in one launch.

argv: out_dir data_dir layout... (layouts: "ep1", "ep2", "tp2", "async0", "async1", "ds", "async1_ds"). A short supervised warm-up
teaches the random tiny model to answer and close its turn (so episodes go on for several turns), then RL steps of
episodes with the scripted tool environment. The policy objective is wrapped (test only) to record the gradient
that reaches the new log-probs outside the loss mask (the observation, template, prompt and padding positions).

The rollout engine is test_recorded (tests/workers/train_hooks.py: the embedded engine keeping its own record of
every call), and each run's trained samples are recorded: "async0" (rollout.producer=async, max_staleness 0) must
train exactly "ep2"'s samples (run it after ep2); "async1" (max_staleness 1, partial rollout, a slow engine so
that syncs land mid-turn) is checked against the engine's record, episode-aware (`_check_episodes`).
Rank 0 writes {layout: {"rc", "history", "grad", ...}}.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import tests.workers.train_hooks as hooks
from rlpo_mega.config import load_config
from rlpo_mega.rollout.partial import span_versions
from rlpo_mega.training import update
from rlpo_mega.training.trainer import train
from tests.dist import write_report
from tests.multi_turn_support import ScriptEnv
from tests.workers.async_scenarios import _gathered, _same, recorded

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

ASYNC = ("parallel.expert=2", "rollout.producer=async")
DYNAMIC = ("algorithm.dynamic_sampling.enabled=true", "prompts.oversample=1.5",
           "algorithm.dynamic_sampling.max_carry_steps=1", "trainer.mini_batches=1")
LAYOUTS = {"ep1": ("parallel.expert=1",), "ep2": ("parallel.expert=2",),
           "tp2": ("parallel.expert=1", "parallel.tensor=2"),
           "async0": (*ASYNC, "trainer.max_staleness=0"),
           "async1": (*ASYNC, "trainer.max_staleness=1", "rollout.partial_rollout=true", "train_iters=4"),
           # dynamic sampling on episodes: a group is a prompt's n episodes, judged as its last one ends
           "ds": ("parallel.expert=2", *DYNAMIC),
           "async1_ds": (*ASYNC, "trainer.max_staleness=1", "rollout.partial_rollout=true", "train_iters=4", *DYNAMIC)}
SLOW = "0.05"  # seconds per forward of the rollout (async1): a step's episodes outlast the learner's step
TRAINED: dict = {}  # layout -> this rank's trained samples per step


def _check_episodes(trained: dict, versioned: bool = True, first_version: int = 0) -> dict:
    """Every trained episode of this rank against the engine's record. Its model tokens (outside obs_spans) are,
    region by region, the answers of the calls that continued from exactly the tokens before them (a turn
    interrupted by a sync: several calls), with their log-probs; each token's version is its call's weights' (an
    observation: its turn's); routing row t is the one of the call that sampled the next model token at or after
    t + 1 (the prompt's and an observation's rows: the next turn's prefill); no answer is used twice. A single
    answer is an episode without observations. versioned=False (the sync producer tags no versions): the versions
    its calls ran on are only reported, per step (`step_versions`). first_version: the version of the record's
    first sync (a resumed run's: the step it resumed from)."""
    record, syncs = hooks.RecordedEngine.record, hooks.RecordedEngine.syncs
    # a weights digest -> the syncs that sent those weights: more than one when a step left the weights as they
    # were (every group's rewards equal: no advantage, no update), and then a call on them may be either version
    version = {}
    for v, d in enumerate(syncs):
        version.setdefault(d, []).append(v + first_version)
    used, problems, continued, rows, versions_seen, step_versions = set(), [], 0, 0, set(), {}
    for step, samples in trained.items():
        for i, s in enumerate(samples):
            P, resp, lps = s["prompt"], s["response"], s["logprobs"]
            obs = {a: c for a, c in s["obs_spans"]}
            owner, want_v, pos, segs = [None] * len(resp), [], 0, 0
            while pos < len(resp):
                if pos in obs:
                    want_v += [want_v[-1]] * obs[pos]
                    pos += obs[pos]
                    continue
                end = min([a for a in obs if a > pos] + [len(resp)])
                found = None
                for c, call in enumerate(record):
                    for k, (r, lp, _, _) in enumerate(call["out"]):
                        m = min(len(r), end - pos)
                        if (c, k) not in used and r and call["prompts"][k // call["n"]] == P + resp[:pos] \
                                and r[:m] == resp[pos:pos + m] and torch.equal(lp[:m], lps[pos:pos + m]):
                            found = (c, k, m)
                            break
                    if found:
                        break
                if found is None:
                    problems.append(f"step {step} sample {i}: tokens from {pos} are no recorded answer to the episode")
                    break
                c, k, m = found
                used.add((c, k))
                owner[pos:pos + m] = [(c, k)] * m
                allowed = version[record[c]["weights"]]
                tagged = span_versions(s["versions"])[pos:pos + m].tolist() if versioned else []
                # the tagged version where the weights allow it (the same weights as another sync's), else the first
                # sync that sent them (a mismatch, reported below); untagged (the sync producer): the step's own sync
                # where it sent these weights
                claim = tagged[0] if tagged and len(set(tagged)) == 1 else None if versioned else step
                want = claim if claim in allowed else allowed[0]
                want_v += [want] * m
                versions_seen.add(want)
                continued += pos > 0 and pos not in {a + n for a, n in obs.items()}
                segs += 1
                pos += m
            if problems and problems[-1].startswith(f"step {step} sample {i}:"):
                continue
            step_versions.setdefault(step, set()).update(want_v)
            got = span_versions(s["versions"]).tolist() if versioned else want_v
            if got != want_v:
                problems.append(f"step {step} sample {i}: versions {s['versions']}, the calls' {want_v}")
            if versioned and (s["version_min"] != min(want_v) or step - s["version_min"] > 1):
                problems.append(f"step {step} sample {i}: version_min {s['version_min']} at step {step}")
            for t in range(s["routes"].shape[0]):
                j = max(t - len(P) + 1, 0)
                while owner[j] is None:  # an observation's position: the next turn's call
                    j += 1
                c, k = owner[j]
                if not torch.equal(s["routes"][t], record[c]["out"][k][2][t].to(torch.int32)):
                    problems.append(f"step {step} sample {i}: routing row {t} is not its call's")
                    break
                rows += 1
    return {"problems": problems[:10], "continued": continued, "rows": rows, "versions": sorted(versions_seen),
            "step_versions": {step: sorted(v) for step, v in step_versions.items()},
            "samples": sum(len(v) for v in trained.values()),
            "obs_tokens": sum(c for v in trained.values() for s in v for _, c in s["obs_spans"])}


def run(out, data, layout):
    run_dir = os.path.join(out, layout)
    cfg = load_config("configs/demo_cpu.yaml", (
        "train_iters=2", f"prompts.path={data}/prompts.jsonl", "prompts.tokenizer=configs/tokenizers/tiny_chatml",
        "prompts.prompts_per_step=4", "prompts.n_samples=2", "rollout.max_new_tokens=6",
        "rollout.temperature=1.0", "algorithm.temperature=1.0", "logging.progress_bar=false", "logging.plot=false",
        "logging.console_every=0", "logging.mode=disabled", f"logging.dir={run_dir}", "trainer.eval_every=0",
        "checkpoint.save_dir=null", f"trainer.warmup.path={data}/warmup.jsonl", "trainer.warmup.steps=40",
        "trainer.warmup.batch_size=8", "trainer.warmup.lr=3e-3", "environment.name=test_script",
        "environment.options.observations=[ab,cd]", "environment.options.vary_reward=true", "environment.max_turns=3", "environment.max_tokens=200",
        "routing.mode=r3", "algorithm.mismatch.mode=tis", "algorithm.mismatch.level=sequence",
        "rollout.engine=test_recorded", *LAYOUTS[layout]))
    GRAD.update(outside_max=0.0, inside_nonzero=0, inside=0)
    ScriptEnv.made = 0  # the environments' rewards follow their order of creation: the same in every run
    trained = TRAINED[layout] = {}
    # async1: every sync lands after the running call's first tokens (not by the race of the slow engine against
    # the learner's step)
    with recorded(trained, slow=SLOW if layout.startswith("async1") else None):
        rc = train(cfg, keep_world=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f]
    grad = torch.tensor([GRAD["outside_max"], GRAD["inside_nonzero"], GRAD["inside"]], dtype=torch.float64)
    dist.all_reduce(grad, op=dist.ReduceOp.MAX)  # each rank's own micro-batches
    rep = {"rc": rc, "history": history, "grad": grad.tolist()}
    if layout == "async0":
        rep["same_as_ep2"] = _gathered(_same(TRAINED["ep2"], trained))
    if layout.startswith("async1"):
        rep["checks"] = _gathered(_check_episodes(trained))
    if layout == "ds":  # this rank's groups per step: their sizes
        rep["groups"] = _gathered({step: len(v) for step, v in trained.items()})
    return rep


if __name__ == "__main__":
    out, data, *layouts = sys.argv[1:]
    result = {layout: run(out, data, layout) for layout in layouts}
    if int(os.environ.get("RANK", "0")) == 0:
        write_report(result)
