"""Asynchronous RL under torchrun (rollout.producer=async), several trainer runs in one launch.

Every run uses the test_recorded engine (tests/workers/train_hooks.py): the embedded engine keeping its own
record of each call (the weights it ran on, what it returned), which the checks compare the trained samples to.
Rank 0 writes the report; the checks that need a rank's own samples run on every rank and are all-gathered.
"""
import contextlib
import json
import os
import signal
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import tests.workers.train_hooks as hooks
from rlpo_mega.checkpoint import run as ckpt_state
from rlpo_mega.rollout.partial import span_versions, versions_of
from rlpo_mega.rollout.producers.asynchronous import AsyncProducer, RolloutWorker
from rlpo_mega.rollout.producers import SyncProducer
from rlpo_mega.training.trainer import Trainer
from tests.dist import write_report
from tests.workers.train_scenarios import cfg, history, train

ASYNC = ("rollout.producer=async", "rollout.engine=test_recorded")
SLOW = "0.12"  # seconds per forward of the rollout: a step's generation outlasts the learner's step


def _recording(trained: dict, extra=lambda s: {}):
    """Wrap both producers' collect: per step, this rank's own trained samples (payload and all; `extra(sample)`:
    more fields)."""
    originals = {SyncProducer: SyncProducer.collect, AsyncProducer: AsyncProducer.collect}

    def wrap(cls):
        def collect(self, step, timer):
            groups = originals[cls](self, step, timer)
            trained[step] = [{"prompt": [int(t) for t in s.prompt_ids], "response": list(map(int, s.response_ids)),
                              "logprobs": s.logprobs.clone(), "versions": versions_of(s),
                              "routes": None if s.routes is None else s.routes.to(torch.int32).clone(),
                              "version_min": s.version_min, "masked_prefix": s.masked_prefix, **extra(s)}
                             for s in groups.samples if s.prompt_ids is not None]
            return groups
        return collect

    for cls in originals:
        cls.collect = wrap(cls)
    return originals


def _restore(originals):
    for cls, fn in originals.items():
        cls.collect = fn


def _trained_run(config) -> dict:
    """Train `config` on a fresh engine record; returns this rank's trained samples per step (_recording)."""
    trained = {}
    originals = _recording(trained)
    _fresh_record()
    try:
        train(config)
    finally:
        _restore(originals)
    return trained


def _fresh_record():
    hooks.RecordedEngine.record.clear()
    hooks.RecordedEngine.syncs.clear()
    hooks.FlakyEngine.calls = 0


def _same(a: dict, b: dict) -> dict:
    """Two runs' trained samples, step by step: equal tokens and bitwise-equal log-probs and routes?"""
    bad = []
    for step in sorted(set(a) | set(b)):
        x, y = a.get(step, []), b.get(step, [])
        if len(x) != len(y):
            bad.append(f"step {step}: {len(x)} vs {len(y)} samples")
            continue
        for i, (s, t) in enumerate(zip(x, y)):
            if (s["prompt"], s["response"]) != (t["prompt"], t["response"]) or not torch.equal(s["logprobs"], t["logprobs"]):
                bad.append(f"step {step} sample {i}: tokens or log-probs differ")
            elif (s["routes"] is None) != (t["routes"] is None) or (s["routes"] is not None
                                                                    and not torch.equal(s["routes"], t["routes"])):
                bad.append(f"step {step} sample {i}: routes differ")
    return {"samples": sum(len(v) for v in a.values()), "differences": bad[:10]}


def _segments(sample, record):
    """The engine calls whose answers make up a trained sample, in order: [(call, answer index, start)]; None when
    the record holds no such sequence (a sample the engine never returned)."""
    p, resp, lps = sample["prompt"], sample["response"], sample["logprobs"]
    out, pos = [], 0
    while pos < len(resp):
        prefix = p + resp[:pos]
        found = None
        for c, call in enumerate(record):
            for k, (r, lp, _, fin) in enumerate(call["out"]):
                if call["prompts"][k // call["n"]] != prefix or not r:
                    continue
                m = min(len(r), len(resp) - pos)
                if r[:m] == resp[pos:pos + m] and torch.equal(lp[:m], lps[pos:pos + m]):
                    found = (c, k, pos)
                    break
            if found:
                break
        if found is None:
            return None
        out.append(found)
        pos += min(len(record[found[0]]["out"][found[1]][0]), len(resp) - pos)
    return out


def _check_against_record(trained: dict) -> dict:
    """Every trained sample of this rank against the engine's own record: its tokens and log-probs are the
    answers of the calls that made it, each token's version is that of the weights its call ran on (the n-th
    weight update = version n), each routing row is the one of the call that sampled the next token, no answer
    is used twice."""
    record, syncs = hooks.RecordedEngine.record, hooks.RecordedEngine.syncs
    version = {}
    for v, d in enumerate(syncs):
        version.setdefault(d, v)
    used, problems, continued, checked_rows = set(), [], 0, 0
    for step, samples in trained.items():
        for i, s in enumerate(samples):
            segs = _segments(s, record)
            if segs is None:
                problems.append(f"step {step} sample {i}: not in the engine's record")
                continue
            continued += len(segs) > 1
            for c, k, _ in segs:
                if (c, k) in used:
                    problems.append(f"step {step} sample {i}: answer {c}:{k} used twice")
                used.add((c, k))
            # versions, token by token
            want = torch.cat([torch.full((min(len(record[c]["out"][k][0]), len(s["response"]) - pos),),
                                         version[record[c]["weights"]]) for c, k, pos in segs])
            got = span_versions(s["versions"])
            if not torch.equal(want, got):
                problems.append(f"step {step} sample {i}: versions {s['versions']} but the calls ran on {want.tolist()}")
            if s["version_min"] != int(want.min()) or step - s["version_min"] > 1:
                problems.append(f"step {step} sample {i}: version_min {s['version_min']} (step {step})")
            # routes: row t belongs to the call that sampled response token t - P + 1 (the prompt's rows: the first)
            if s["routes"] is not None:
                P = len(s["prompt"])
                for t in range(s["routes"].shape[0]):
                    j = max(t - P + 1, 0)
                    c, k, _ = next(seg for seg in reversed(segs) if seg[2] <= j)
                    ref = record[c]["out"][k][2]
                    if not torch.equal(s["routes"][t], ref[t].to(torch.int32)):
                        problems.append(f"step {step} sample {i}: routing row {t} is not its call's")
                        break
                    checked_rows += 1
    return {"problems": problems[:10], "continued": continued, "rows": checked_rows,
            "samples": sum(len(v) for v in trained.values())}


def _gathered(obj):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def equal_at_zero(out):
    """max_staleness=0 through the async producer vs the sync producer: the same samples (tokens, log-probs,
    routes), losses, gradients, and final weights."""
    runs, weights = {}, {}
    for run, extra in (("sync", ()), ("async0", ("rollout.producer=async", "trainer.max_staleness=0"))):
        trained = _trained_run(cfg(out, run, "train_iters=3", "rollout.engine=test_recorded", *extra))
        runs[run], weights[run] = trained, hooks.RecordedEngine.syncs[-1]
    return {"sync": history(out, "sync"), "async0": history(out, "async0"),
            "samples": _gathered(_same(runs["sync"], runs["async0"])), "weights": _gathered(weights)}


def _sync_after_first_tokens(forwards: int = 3, hold: bool = False):
    """A weight sync's pause first waits until the running engine call has made `forwards` forwards (its prefill
    and first decoding steps: every sample holds tokens), so that it lands mid-generation by construction, not by
    the race of the slow engine against a learner's step (0.12 s on a fast machine: inside the prefill).
    hold: and a call that has made them waits there for the next pause (a sync, an evaluation, the close) unless
    the learner is waiting for its step: on a loaded machine a learner's step can outlast a whole generation, and
    the sync would then find no call to interrupt (stop 66's CI, step 4 of test_async's mid-generation run)."""
    original, take = AsyncProducer.paused, RolloutWorker.take
    state = {"pauses": 0, "call": None, "mark": 0, "waiting": None, "worker": None}

    @contextlib.contextmanager
    def paused(self, version=None):
        state["worker"] = self.worker
        state["pauses"] += 1
        deadline = time.monotonic() + 30
        while version is not None and time.monotonic() < deadline:
            with self.worker.cond:
                if not self.worker.busy or hooks.RecordedEngine.forwards >= forwards:
                    break
            time.sleep(0.005)
        with original(self, version):
            yield

    def waiting(self, step, should_stop):
        state["worker"], state["waiting"] = self, step
        try:
            return take(self, step, should_stop)
        finally:
            state["waiting"] = None

    def held() -> bool:
        worker = state["worker"]
        if hooks.RecordedEngine.forwards < forwards or worker is None:
            return False
        call = len(hooks.RecordedEngine.record)  # this process's calls run one at a time: the running one's index
        if state["call"] != call:
            state["call"], state["mark"] = call, state["pauses"]
        with worker.cond:
            running = [j.step for j in worker.jobs.values() if j.running]
            awaited = state["waiting"] in running or worker.closing
        return state["pauses"] == state["mark"] and not awaited

    AsyncProducer.paused, RolloutWorker.take = paused, waiting
    hooks.RecordedEngine.hold = held if hold else None
    return original, take


@contextlib.contextmanager
def slow_mid_call(delay: str = SLOW, hold: bool = False):
    """A slow engine (RLPO_DECODE_DELAY seconds per forward) whose every sync lands after the running call's first
    tokens (_sync_after_first_tokens; hold: and finds a call to interrupt), restored after."""
    os.environ["RLPO_DECODE_DELAY"] = delay
    original, take = _sync_after_first_tokens(hold=hold)
    try:
        yield
    finally:
        os.environ.pop("RLPO_DECODE_DELAY", None)
        AsyncProducer.paused, RolloutWorker.take = original, take
        hooks.RecordedEngine.hold = None


@contextlib.contextmanager
def recorded(trained: dict, slow: Optional[str] = None):
    """Around a training run: this rank's trained samples per step into `trained` (_recording, with their
    observation spans) on a fresh engine record; slow: slow_mid_call(slow) too."""
    originals = _recording(trained, extra=lambda s: {"obs_spans": list(s.obs_spans)})
    _fresh_record()
    try:
        with slow_mid_call(slow) if slow is not None else contextlib.nullcontext():
            yield
    finally:
        _restore(originals)


def mid_generation(out):
    """max_staleness=1 with a slow engine: every sync lands while the next step generates. The trained samples
    against the engine's record: with partial rollout, then with rollout.partial_rollout_mask, then waiting."""
    rep = {}
    with slow_mid_call(hold=True):
        for run, extra in (("k1", ("rollout.partial_rollout=true",)),
                           ("k1_mask", ("rollout.partial_rollout=true", "rollout.partial_rollout_mask=true")),
                           ("k1_wait", ())):  # the default: a sync waits for the running call
            trained = _trained_run(cfg(out, run, "train_iters=4", "trainer.max_staleness=1", *ASYNC, *extra))
            rep[run] = {"history": history(out, run), "checks": _gathered(_check_against_record(trained)),
                        "masked": _gathered(sum(s["masked_prefix"] for v in trained.values() for s in v)),
                        "old_tokens": _gathered(sum(int((span_versions(s["versions"]) < max(v for v, _ in s["versions"])).sum())
                                                    for v in trained.values() for s in v if s["versions"]))}
    return rep


def held_past_bound(out):
    """The generation thread allowed one version further ahead (2) than the bound (1): step 2's groups are all
    sampled by version 0, two behind its learner, and none is trained on."""
    init = AsyncProducer.__init__

    def ahead(self, *args):
        init(self, *args)
        self.worker.lag = self.lag + 1

    AsyncProducer.__init__ = ahead
    _fresh_record()
    try:
        rc = train(cfg(out, "held", "train_iters=3", "trainer.max_staleness=1", *ASYNC))
    finally:
        AsyncProducer.__init__ = init
    return {"rc": rc, "history": history(out, "held")}


def sigterm_and_restart(out):
    """SIGTERM on rank 0 while step 1's rollout generates (after step 0): the run saves step 1 with the planned
    prompts, exits with the thread stopped; the resumed run trains those prompts at step 1. Then an engine
    crash on rank 1 during a rollout overlapped with training: rebuilt, re-synced, the run goes on."""
    ck = os.path.join(out, "ckpt")
    # step 1's rollout (about 9 s) outlasts step 1's training: at 0.4 s a forward (about 3 s) a loaded machine's
    # learner step outlasted it once (a fresh-clone suite run of 2026-11-30: the signal found the rollout done)
    os.environ["RLPO_DECODE_DELAY"] = "1.2"
    step, original = Trainer.train_step, {}

    def signalled(self):
        m = step(self)
        if self.step == 1 and dist.get_rank() == 0:
            job = self.producer.worker.jobs.get(1)  # the next step's rollout, still generating
            original["busy"] = job is not None and not job.complete
            os.kill(os.getpid(), signal.SIGTERM)
        return m

    trained = {}
    originals = _recording(trained)
    Trainer.train_step = signalled
    _fresh_record()
    try:
        rc = train(cfg(out, "stopped", "train_iters=3", "trainer.max_staleness=1", f"checkpoint.save_dir={ck}",
                       "checkpoint.save_every=0", "rollout.partial_rollout=true", *ASYNC))
    finally:
        Trainer.train_step = step
        os.environ["RLPO_DECODE_DELAY"] = SLOW
    rep = {"stopped_rc": rc, "busy_at_signal": original.get("busy"), "saved": ckpt_state.complete_steps(ck),
           "threads": sorted(t.name for t in __import__("threading").enumerate() if t.name == "rlpo-rollout")}
    saved = trained.copy()
    trained.clear()
    try:
        rc = train(cfg(out, "resumed", "train_iters=3", "trainer.max_staleness=1", f"checkpoint.save_dir={ck}",
                       "checkpoint.resume=true", *ASYNC))
    finally:
        _restore(originals)
    rep["resumed_rc"] = rc
    rep["resumed"] = history(out, "resumed")
    # the uninterrupted run's step 1 prompts: drawn at step 0 (the producer plans one step ahead)
    full = {}
    originals = _recording(full)
    _fresh_record()
    try:
        train(cfg(out, "uninterrupted", "train_iters=2", "trainer.max_staleness=1", *ASYNC))
    finally:
        _restore(originals)
    rep["prompts"] = _gathered({"stopped_0": sorted(map(tuple, (s["prompt"] for s in saved.get(0, [])))),
                                "resumed_1": sorted(map(tuple, (s["prompt"] for s in trained.get(1, [])))),
                                "full_1": sorted(map(tuple, (s["prompt"] for s in full.get(1, []))))})
    # a crash of rank 1's engine in its third call (step 2's rollout, generated while step 1 trains)
    os.environ["RLPO_FAIL_RANK"], os.environ["RLPO_FAIL_CALL"] = "1", "3"
    _fresh_record()
    try:
        rep["crash_rc"] = train(cfg(out, "crash", "train_iters=4", "trainer.max_staleness=1",
                                    "trainer.engine_restarts=1", "rollout.partial_rollout=true", *ASYNC))
    finally:
        os.environ["RLPO_FAIL_CALL"] = "0"
        os.environ.pop("RLPO_DECODE_DELAY")
    rep["crash"] = history(out, "crash")
    return rep


DYNAMIC = ("algorithm.loss.name=dapo", "algorithm.dynamic_sampling.enabled=true", "prompts.oversample=1.5",
           "trainer.mini_batches=1", "rollout.engine=test_recorded")


def dynamic(out):
    """DAPO dynamic sampling through the async producer. At max_staleness 0 (groups not carried) it trains exactly
    the sync producer's samples, chunk for chunk. At max_staleness 1 with partial rollout, a slow engine (every sync
    lands mid-generation) and groups carried one step: the trained samples against the engine's record, and per
    step the group counts."""
    runs, rep = {}, {}
    for run, extra in (("sync", ()), ("async0", ("rollout.producer=async", "trainer.max_staleness=0"))):
        runs[run] = _trained_run(cfg(out, run, "train_iters=3", "algorithm.dynamic_sampling.max_carry_steps=0",
                                     *DYNAMIC, *extra))
        rep[run] = history(out, run)
    rep["samples"] = _gathered(_same(runs["sync"], runs["async0"]))
    with slow_mid_call():
        trained = _trained_run(cfg(out, "async1", "train_iters=4", "trainer.max_staleness=1", "rollout.producer=async",
                                   "rollout.partial_rollout=true", "algorithm.dynamic_sampling.max_carry_steps=1",
                                   *DYNAMIC))
    rep["async1"] = history(out, "async1")
    rep["async1_checks"] = _gathered(_check_against_record(trained))
    rep.update(_dynamic_sigterm(out))
    return rep


def _dynamic_sigterm(out) -> dict:
    """SIGTERM on rank 0 after step 1 of async dynamic sampling (max_staleness 1, partial rollout, groups carried),
    while step 2's groups generate: the run saves step 1 with the producer's state (the chunks drawn and not taken,
    the carried groups, the planned prompts) and stops; the resumed run trains steps 2 and 3, each its full quota
    of whole groups, no prompt trained twice over both runs."""
    ck, data = os.path.join(out, "ckpt_ds"), os.path.join(out, "distinct.jsonl")
    if dist.get_rank() == 0:  # the demo's data repeats prompts: distinct ones, so that a group trained twice shows
        with open(data, "w") as f:
            for i in range(300):
                f.write(json.dumps({"prompt": f"{i // 20}+{i % 20}=", "answer": str(i // 20 + i % 20)}) + "\n")
    dist.barrier()
    step, seen = Trainer.train_step, {}
    config = (f"prompts.path={data}", "train_iters=3", "trainer.max_staleness=1", "rollout.producer=async", "rollout.partial_rollout=true",
              "algorithm.dynamic_sampling.max_carry_steps=1", f"checkpoint.save_dir={ck}", *DYNAMIC)

    def signalled(self):
        m = step(self)
        if self.step == 1 and dist.get_rank() == 0:
            job = self.producer.worker.jobs.get(1)
            seen["busy"] = job is not None and not job.complete
            seen["state"] = sorted(self.producer.state_dict())
            os.kill(os.getpid(), signal.SIGTERM)
        return m

    trained: dict = {}
    originals = _recording(trained)
    os.environ["RLPO_DECODE_DELAY"] = SLOW
    Trainer.train_step = signalled
    _fresh_record()
    try:
        stopped_rc = train(cfg(out, "ds_stopped", "checkpoint.save_every=0", *config))
        saved = ckpt_state.complete_steps(ck)
        Trainer.train_step = step
        first = {k: list(v) for k, v in trained.items()}
        trained.clear()
        resumed_rc = train(cfg(out, "ds_resumed", "checkpoint.resume=true", *config))
    finally:
        Trainer.train_step = step
        _restore(originals)
        os.environ.pop("RLPO_DECODE_DELAY")
    prompts = [tuple(s["prompt"]) for v in (first, trained) for samples in v.values() for s in samples[::4]]
    return {"ds_sigterm": {"stopped_rc": stopped_rc, "busy_at_signal": seen.get("busy"), "state": seen.get("state"),
                           "saved": saved, "resumed_rc": resumed_rc,
                           "resumed": history(out, "ds_resumed"),
                           "trained": _gathered({"stopped": sorted(first), "resumed": sorted(trained),
                                                 "groups": len(prompts), "distinct": len(set(prompts))})}}


def everything(out):
    return {name: fn(os.path.join(out, name)) for name, fn in (
        ("equal_at_zero", equal_at_zero), ("mid_generation", mid_generation), ("held_past_bound", held_past_bound),
        ("sigterm_and_restart", sigterm_and_restart), ("dynamic", dynamic))}


if __name__ == "__main__":
    scenario, out = sys.argv[1:3]
    result = globals()[scenario](out)
    if int(os.environ.get("RANK", "0")) == 0:
        write_report(result)
