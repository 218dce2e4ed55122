"""The rollout side's composition matrix through the real trainer, one process: {sync, async} x {single answers,
episodes} x {dynamic sampling off, on}, each on the embedded engine (test_recorded) and on two stub SGLang servers
backed by the same recorded engine (tests/model_sglang.py: SGLang's HTTP surface, so the SGLang client, its
route decoding and the weight sync over HTTP with in-server digests all run), its episodes in continuous turns.

argv: out_dir data_dir [cell prefix...] (default: every cell). Rank 0 writes {cell: {"rc", "history", "groups", "checks"}}: per step the trained groups
(sizes, one prompt per group) and every trained sample against the engine's own record (tests/workers/multi_turn.
_check_episodes: tokens and log-probs are recorded answers, each used once; each token's version is its call's
weights'; every R3 routing row is its call's)."""
import json
import os
import sys

import torch.distributed as dist

import tests.workers.train_hooks as hooks
from moe.model import load_hf_config
from rlpo_mega.config import load_config
from rlpo_mega.rollout.sglang_engine import SGLangEngine
from rlpo_mega.training.trainer import train
from tests.dist import write_report
from tests.model_sglang import ModelSGLang
from tests.multi_turn_support import ScriptEnv
from tests.workers.async_scenarios import recorded
from tests.workers.multi_turn import _check_episodes

SCHEDULES = {"sync": (), "async": ("rollout.producer=async", "trainer.max_staleness=1", "rollout.partial_rollout=true")}
# single answers: the demo's prompts and tokenizer, no warm-up (a random model's answers: mixed parities)
TASKS = {"single": ("reward.function=test_parity", "trainer.warmup.steps=0"),
         "episode": ("prompts.path={data}/prompts.jsonl", "prompts.tokenizer=configs/tokenizers/tiny_chatml",
                     "environment.name=test_script", "environment.options.observations=[ab,cd]",
                     "environment.options.vary_reward=true", "environment.max_turns=3", "environment.max_tokens=200",
                     "trainer.warmup.path={data}/warmup.jsonl", "trainer.warmup.steps=40", "trainer.warmup.batch_size=8", "trainer.warmup.lr=3e-3")}
# ds: up to 8 chunks of 6 prompts for a quota of 4 groups of 2 (a random model's parities: about half the groups
# mixed). At max_tries' default 3, a step ran out of chunks at 3 groups once in a CI run (sglang/sync/single/ds:
# a legal short step, which the cell's invariants do not expect); which groups a step keeps depends on which
# answers come first, so the cells are not replayed exactly
FILTERS = {"all": (), "ds": ("algorithm.dynamic_sampling.enabled=true", "prompts.oversample=1.5",
                            "algorithm.dynamic_sampling.max_carry_steps=1", "algorithm.dynamic_sampling.max_tries=8",
                            "trainer.mini_batches=1")}
N, PROMPTS, STEPS = 2, 4, 3


def _groups(trained: dict) -> dict:
    """Per step: the number of samples and whether every run of N consecutive samples shares one prompt."""
    return {step: {"samples": len(v), "whole": len(v) % N == 0 and all(
        v[i]["prompt"] == v[i + j]["prompt"] for i in range(0, len(v), N) for j in range(N))}
        for step, v in trained.items()}


def stub_servers(count: int = 2) -> list[ModelSGLang]:
    """Stub SGLang servers over the recorded engine (the first records the syncs)."""
    base = load_config("configs/demo_cpu.yaml", ("rollout.engine=test_recorded",))
    hf = load_hf_config(base.model.hf_config)
    return [ModelSGLang(hooks.RecordedEngine.from_config(base, hf), hf, primary=i == 0) for i in range(count)]


def sglang_extra(servers) -> tuple:
    return ("rollout.engine=sglang", f"rollout.sglang.urls=[{','.join(s.url for s in servers)}]",
            "rollout.sglang.drivers=1", "rollout.sglang.max_in_flight_per_server=4",
            "environment.turns=continuous")  # (single answers: unused)


def cell_config(run_dir, data, extra, schedule, task, filt, *more):
    return load_config("configs/demo_cpu.yaml", (
        f"train_iters={STEPS}", f"prompts.prompts_per_step={PROMPTS}", f"prompts.n_samples={N}", "rollout.max_new_tokens=6",
        "rollout.temperature=1.0", "algorithm.temperature=1.0", "logging.progress_bar=false", "logging.console_every=0",
        "logging.plot=false", "logging.mode=disabled", f"logging.dir={run_dir}", "trainer.eval_every=0", "checkpoint.save_dir=null",
        "routing.mode=r3", "algorithm.mismatch.mode=tis",
        "algorithm.mismatch.level=sequence", "parallel.expert=1",
        *extra, *SCHEDULES[schedule], *(o.format(data=data) for o in TASKS[task]), *FILTERS[filt], *more))


class Continuations:
    """SGLang cells: each answer in a partial rollout's continuation round (the async producer's call for the
    unfinished samples of single answers: each continued from its interrupted answer, or sent again from its
    prompt; the calls that pass routes_from) by engine call, with the server that answered it and its group's
    affinity key (the producer's group index: two groups of one prompt text may go to two servers)."""

    def __enter__(self):
        self.calls, self.answers, self.continuing, self.keys = 0, [], False, None
        self.stream, self.answer = SGLangEngine.stream, SGLangEngine._answer
        c = self

        def stream(engine, *a, **kw):
            c.calls += 1
            c.continuing = kw.get("routes_from") is not None and kw.get("more") is None and kw.get("n") == 1
            c.keys = kw.get("affinity")
            return c.stream(engine, *a, **kw)

        def answer(engine, server, prompt_index, prompt, rid, status, body, size, start=0):
            if c.continuing:
                c.answers.append((c.calls, list(prompt), server.url, c.keys[prompt_index]))
            return c.answer(engine, server, prompt_index, prompt, rid, status, body, size, start)
        SGLangEngine.stream, SGLangEngine._answer = stream, answer
        return self

    def __exit__(self, *exc):
        SGLangEngine.stream, SGLangEngine._answer = self.stream, self.answer

    def split(self, trained: dict) -> dict:
        """Per engine call and group (its affinity key), the servers its continuations went to; -> the count of
        (call, group) with more than one, and of (call, group) in all; unmatched: answers of no trained prompt."""
        prompts = {tuple(s["prompt"]) for v in trained.values() for s in v}
        servers: dict = {}
        unmatched = 0
        for call, request, url, key in self.answers:
            p = next((p for p in prompts if tuple(request[:len(p)]) == p), None)
            unmatched += p is None  # (dynamic sampling: a group not trained)
            if p is not None:
                servers.setdefault((call, key), set()).add(url)
        return {"split": sum(len(v) > 1 for v in servers.values()), "groups": len(servers), "unmatched": unmatched,
                "answers": len(self.answers)}


def run(out, data, engine, schedule, task, filt):
    name = f"{engine}/{schedule}/{task}/{filt}"
    run_dir = os.path.join(out, name.replace("/", "_"))
    servers, extra = [], ("rollout.engine=test_recorded",)
    if engine == "sglang":
        servers = stub_servers()
        extra = sglang_extra(servers)
    cfg = cell_config(run_dir, data, extra, schedule, task, filt)
    ScriptEnv.made = 0
    trained: dict = {}
    try:  # async: a slow engine, the next step's calls still running when the learner syncs, each sync after their
        # first tokens (partial rollouts happen)
        with recorded(trained, slow="0.02" if schedule == "async" else None), Continuations() as continued:
            rc = train(cfg, keep_world=True)
    finally:
        for s in servers:
            s.close()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f]
    return name, {"rc": rc, "history": history, "groups": _groups(trained),
                  "checks": _check_episodes(trained, versioned=schedule == "async"),
                  "requests": sum(s.requests for s in servers), "continuations": continued.split(trained)}


if __name__ == "__main__":
    out, data, *only = sys.argv[1:]
    report = dict(run(out, data, engine, schedule, task, filt) for engine in ("embedded", "sglang")
                  for schedule in SCHEDULES for task in TASKS for filt in FILTERS
                  if not only or any(f"{engine}/{schedule}/{task}/{filt}".startswith(o) for o in only))
    if dist.get_rank() == 0:
        write_report(report)
