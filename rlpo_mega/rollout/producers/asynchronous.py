"""Asynchronous RL (rollout.producer=async): the next steps' rollouts generate while the learner trains.

With trainer.max_staleness = k, the groups of step s may be generated from the moment the engine holds policy
version s - k (version v: the weights after v optimizer steps' syncs; the run's first sync is its start step).
A thread on each engine rank (RolloutWorker) generates the planned steps in order, as far ahead as that rule
allows, and scores each group as it completes; the learner's step takes its groups when they are ready. So at
most k + 1 steps of samples are in flight or ready (bounded memory), and every token of step s was sampled by a
version in [s - k, s]. k = 0 is the synchronous step: step s generates on version s, after the sync that ends
step s - 1, with the prompts and seeds of the sync producer: the same samples.

Every weight sync pauses generation (`paused`): the running requests are aborted and come back with the tokens,
log-probs and routes they have; the engine is idle while the new weights load and their digests are checked;
then each interrupted sample continues from its tokens with max_new_tokens reduced (rollout/partial.py: a
partial rollout), on the new version. Every token carries the version that sampled it (meta.versions), each
sample its oldest (`version_min`, a scalar every rank sees); at the step, a group holding a token older than
s - k is not trained on (dropped and counted: the schedule above never makes one, a resumed or a held sample
could). Routes of a continued sample: each token keeps the routes it was sampled under (rollout/partial.py).
With rollout.partial_rollout_kv=keep a sync aborts nothing: the engine holds the running requests in place
(RolloutEngine.pause: SGLang's pause_generation mode=in_place, KV cache kept), the weights load under them, and
they go on (`hold`); the engine names each token's version (SGLang's weight_versions spans: partial.tag, held),
and a token's routes are those of the forward that sampled it, as the server recorded them. Nothing is sent
again; a token after the sync attends to KV the older weights computed (PipelineRL's in-flight update), its
log-prob being the one it was sampled with.

The objective on these samples is the configured loss, with the rollout/train mismatch correction
(algorithm.mismatch) as the off-policy weight. Per response token t of sample i, with mu_v the policy that
sampled it (version v = v_it, the rollout's log-probs), pi_old the learner as the step starts (the old-log-prob
pass, or the update's own detached forward) and pi_theta the policy being optimised:

    w_it = pi_old(o_it) / mu_{v_it}(o_it)          the behaviour correction (no gradient)
    r_it = pi_theta(o_it) / pi_old(o_it)           the ratio the loss clips (GSPO: its sequence mean in log)
    l_it = -c(w_it) * min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)

c(w) = min(w, C) with mismatch.mode=tis (the decoupled PPO objective of AReaL, its weight truncated at C);
c(w) = 1[C_min <= w <= C_max] with mis (the token leaves the loss and its counts); c = 1 with none (trained as
if on-policy: only the clip around pi_old holds the step). w_it covers both the staleness (pi_old against an
older version) and the engine's numerics (the same version in another kernel). With mismatch.level=sequence the
weight is the whole sample's, W_i = prod_t w_it, in place of w_it (geometric: its per-token mean in log), as in
algorithms/mismatch.py. The advantage is the sample's, so only W_i turns an expectation under the versions that
sampled it into one under pi_old: on the demo, level=sequence with a high cap (tis_cap=100) raised one step of
staleness from a reward of 0.53 to 0.81 (synchronous: 0.90; README, "Asynchronous RL"), more than per-token
weights did; at half the demo's learning rate, 0.88 against 0.90 (the weight's variance grows with the step).
tests/test_async.py checks both levels against a float64 transcription.

DAPO dynamic sampling (algorithm.dynamic_sampling) composes with this schedule: a step's job holds a chunk of
prompts (oversample x its share), each group is judged as it is scored (kept while the step's quota is open, then
surplus, or dropped when its rewards are all equal), and once the quota is kept the job's running requests end
(those that complete meanwhile are surplus). A job whose chunk is spent short of its quota gets another, up to
max_tries; chunks are drawn collectively (`_chunk`), so each rank takes the same chunks as under the sync producer
and the prompt cursor is equal on every rank at every moment. Surplus groups are carried to later steps and trained
on only within both bounds, max_carry_steps and the staleness bound (counted as carry_stale otherwise). At
max_staleness 0 with nothing carried this is the sync producer's dynamic sampling exactly (tests/test_async.py).

The engine guard's rebuild pauses the thread (EngineGuard.quiesce); a failure inside the thread reaches the
step as the engine error it is (rebuilt and re-synced as in a synchronous step); SIGTERM while the step waits
stops it. A checkpoint saves the prompts of the steps planned and not yet trained (their samples are generated
again after the resume, on the resumed weights).
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from rlpo_mega.config import ConfigError
from rlpo_mega.rollout.base import ENGINES, STOP, EngineError, RolloutInterrupted, Sample, drive
from rlpo_mega.rollout.dynamic_sampling import DynamicSamplingReport, Group, judge_group
from rlpo_mega.rollout.engines import agree
from rlpo_mega.rollout.episode import EpisodeBatch, with_call_seed
from rlpo_mega.rollout.gather import gather_scalars
from rlpo_mega.rollout.partial import continuable, continuation_prompt, join, tag, versions_of
from rlpo_mega.rollout.producers.base import (MASK_NEEDS_PARTIAL, PRODUCERS, RolloutProducer, ScoredGroups, mix_seed,
                                              share, trim_to_divisor)
from rlpo_mega.rollout.producers.tasks import Episodes, Task, sampling_params

log = logging.getLogger("rlpo_mega")


@dataclass
class _Job:
    """One step's groups on this rank: its share of the step's prompts, n samples each. With dynamic sampling
    (`quota`: the groups to keep), the prompts come in chunks (`extend`), each group is judged as it is scored,
    and the job is done once `quota` groups are kept or every group sent is judged (`exhausted`)."""
    step: int
    items: list
    seed: int
    n: int
    quota: Optional[int] = None  # dynamic sampling: the groups to keep (None: every group is trained on)
    groups: list = None  # per item: n slots, each a finished Sample or None
    scored: list = None  # per item: the group has been scored
    parts: dict = field(default_factory=dict)  # (item, sample) -> interrupted Sample, continuable
    chunks: list = None  # (first item, seed) of each chunk of prompts; one chunk without dynamic sampling
    sent: int = 0  # items whose fresh requests were sent (a chunk at a time)
    rounds: int = 0  # engine calls so far
    continued: int = 0  # samples finished by a continuation
    restarted: int = 0  # samples generated again from their prompt after an interruption
    generate_s: float = 0.0
    continue_s: float = 0.0  # of generate_s, the rounds after the first (single answers: continued and restarted)
    held_s: float = 0.0  # of generate_s, held for syncs (rollout.partial_rollout_kv=keep: they run under its calls)
    confirmed: int = 0  # answers whose weight version the engine itself named (checked: partial.tag)
    batch: Optional[EpisodeBatch] = None  # multi-turn: the job's episodes, advanced one engine call per round
    kept: list = field(default_factory=list)  # dynamic sampling: items kept, in the order they were judged
    surplus: list = field(default_factory=list)  # kept beyond the quota (carried to a later step)
    report: Optional[DynamicSamplingReport] = None
    running: bool = False  # the thread is in one of its rounds (groups may still end there)

    def __post_init__(self):
        self.groups = [[None] * self.n for _ in self.items]
        self.scored = [False] * len(self.items)
        self.chunks = [(0, self.seed)] if self.items else []
        if self.quota is not None:
            self.report = DynamicSamplingReport(self.quota, tries=len(self.chunks), prompts_drawn=len(self.items))

    def extend(self, items: list, seed: int):
        """Dynamic sampling: another chunk of prompts (sampled with its own seed)."""
        self.chunks.append((len(self.items), seed))
        self.items = self.items + list(items)
        self.groups += [[None] * self.n for _ in items]
        self.scored += [False] * len(items)
        self.report.tries += 1
        self.report.prompts_drawn += len(items)

    @property
    def reached(self) -> bool:
        return self.quota is not None and len(self.kept) >= self.quota

    @property
    def exhausted(self) -> bool:
        return self.sent == len(self.items) and all(self.scored)

    @property
    def complete(self) -> bool:
        return self.reached or (self.exhausted if self.quota is not None else all(self.scored))

    def samples(self) -> list[Sample]:
        if self.quota is not None:
            return [s for i in self.kept for s in self.groups[i]]
        return [s for g in self.groups for s in g]


class RolloutWorker:
    """The generation thread of one engine rank: runs the planned jobs' engine calls (rounds) in step order,
    each on the engine's current version, while allowed (`lag`), and not while paused."""

    def __init__(self, cfg, engines, task: Task, tokenizer, lag: int):
        self.cfg, self.engines, self.tokenizer, self.lag = cfg, engines, tokenizer, lag
        self.task = task
        self.episodes = task if isinstance(task, Episodes) else None  # multi-turn: advanced round by round
        self.cond = threading.Condition()
        self.jobs: dict[int, _Job] = {}
        self.version: Optional[int] = None  # the weights the engine holds (None before the first sync)
        self.pausing = 0
        self.pause_s = 0.0  # the pauses' waits for the engine (abort and collect, or the running round), summed
        self.held_total = 0.0  # the holds' durations (hold=True: pause to resume), summed over the run
        self.busy = False
        self.error: Optional[BaseException] = None
        self.closing = False
        self.thread: Optional[threading.Thread] = None
        self.switch_interval: Optional[float] = None  # Python's, while rollout.client_switch_interval applies
        r = cfg.rollout
        self.max_new = r.max_new_tokens
        self.stops = tuple(sampling_params(cfg, tokenizer, seed=0).stop_token_ids)
        self.mask = r.partial_rollout_mask
        self.hold = r.holds_requests  # a sync holds the running requests (RolloutEngine.pause)
        self.carry_steps = cfg.algorithm.dynamic_sampling.max_carry_steps

    # --- the learner's side --------------------------------------------------------------------------
    def add(self, job: _Job):
        with self.cond:
            self.jobs[job.step] = job
            if self.thread is None and job.items:
                if self.cfg.rollout.client_switch_interval is not None:  # restored by close()
                    self.switch_interval = sys.getswitchinterval()
                    sys.setswitchinterval(self.cfg.rollout.client_switch_interval)
                self.thread = threading.Thread(target=self._loop, name="rlpo-rollout", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def extend(self, step: int, items: list, seed: int):
        """Dynamic sampling: another chunk of prompts for `step`'s job (which is exhausted: the thread is not on it)."""
        with self.cond:
            self.jobs[step].extend(items, seed)
            self.cond.notify_all()

    def take(self, step: int, should_stop) -> list[Sample]:
        """This rank's samples of `step` once its job is complete: every group scored; with dynamic sampling, its
        quota kept or every group sent judged (the job stays until `drop`)."""
        with self.cond:
            while True:
                if self.error is not None:
                    raise self.error
                job = self.jobs[step]
                if job.complete and not job.running:  # (a round told to finish still ends its running groups)
                    return job.samples()
                if should_stop is not None and should_stop():
                    raise RolloutInterrupted(f"stop requested while step {step}'s rollout was generating")
                self.cond.wait(0.2)

    def drop(self, step: int) -> Optional[_Job]:
        with self.cond:
            job = self.jobs.pop(step, None)
        if job is not None and job.batch is not None:
            job.batch.close()
        return job

    @contextlib.contextmanager
    def paused(self, version: Optional[int] = None, clear_error: bool = False, abort: bool = True,
               hold: bool = False):
        """No engine call runs inside: the running one is aborted (its samples continue after), or with
        abort=False waited for, or with hold=True held where it is on the engine (RolloutEngine.pause; its calls
        go on after, the new weights under them). On a clean exit the engine holds `version` (a weight sync), and
        clear_error forgets a failure (the engine was rebuilt)."""
        with self.cond:
            self.pausing += not hold  # a held call goes on sending: its requests wait on the engine
        t0, held = time.perf_counter(), None
        try:
            if hold:
                held = self.engines.slot.engine
                if held is not None:
                    try:
                        held.pause()
                    except EngineError as e:  # a dead server: its requests fail on their own; the sync's refresh
                        log.debug("pause before a sync raised %s", e)  # takes it out
            elif abort:
                self._quiesce()
            else:
                with self.cond:
                    while self.busy:
                        self.cond.wait()
            with self.cond:
                self.pause_s += time.perf_counter() - t0
            yield
            engine, named = self.engines.slot.engine, version if version is not None else (
                self.version if clear_error else None)  # a rebuilt engine holds the re-synced version
            if named is not None and engine is not None:
                engine.set_weight_version(str(named))  # each answer then names the version that generated it
            with self.cond:
                if version is not None:
                    self.version = version
                if clear_error:
                    self.error = None
        finally:
            if held is not None:
                try:
                    held.resume()
                except EngineError as e:  # as pause: a server that died meanwhile fails its own requests
                    log.warning("resuming generation after a sync: %s", e)
                with self.cond:
                    self.held_total += time.perf_counter() - t0
            with self.cond:
                self.pausing -= not hold
                self.cond.notify_all()

    def _quiesce(self):
        """Abort every running request (one abort of everything per server) until the running call has ended;
        repeated: a request sent after one abort and before the thread saw the pause is caught by the next."""
        wait = 0.02
        while True:
            with self.cond:
                if not self.busy:
                    return
            engine = self.engines.slot.engine
            try:
                if engine is not None:
                    engine.abort()
            except Exception as e:  # a dead engine: its call fails on its own, within the engine's timeouts
                log.debug("abort during a pause raised %s", e)
            with self.cond:
                if self.busy:
                    self.cond.wait(wait)
            wait = min(wait * 2, 0.2)

    def paused_s(self) -> float:
        """The pauses' waits for the engine since the last call (the learner's collect reports them)."""
        with self.cond:
            waited, self.pause_s = self.pause_s, 0.0
        return waited

    def close(self):
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self._quiesce()
        if self.thread is not None:
            self.thread.join(timeout=60)
        with self.cond:
            batches = [j.batch for j in self.jobs.values() if j.batch is not None]
        for b in batches:
            b.close()
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
            self.switch_interval = None

    # --- the thread ----------------------------------------------------------------------------------
    def _next_job(self) -> Optional[_Job]:
        for step in sorted(self.jobs):
            job = self.jobs[step]
            if not job.complete and self.version is not None and step - self.lag <= self.version:
                return job
        return None

    def _loop(self):
        while True:
            with self.cond:
                while True:
                    if self.closing:
                        return
                    job = None if (self.pausing or self.error is not None) else self._next_job()
                    if job is not None:
                        break
                    self.cond.wait()
                self.busy, version, job.running = True, self.version, True
                held0 = self.held_total
            try:
                self._round(job, version)
            except BaseException as e:  # the step that waits for it raises it (EngineGuard: rebuild, or stop)
                with self.cond:
                    self.error = e
            finally:
                with self.cond:
                    self.busy = job.running = False
                    job.held_s += self.held_total - held0  # (a hold still open is counted by the next round)
                    self.cond.notify_all()

    def _round(self, job: _Job, version: int):
        """One engine call for `job` on `version`: its fresh groups (the first), else every unfinished sample
        (continued from its part, or from its prompt); stops early when a pause is asked for."""
        if self.episodes is not None:
            return self._episode_round(job, version)
        engine, t0 = self.engines.slot.engine, time.perf_counter()
        fresh = job.sent < len(job.items)
        if fresh:  # a chunk's fresh groups (the first round: the sync producer's one call)
            first, seed = next(c for c in job.chunks if c[0] == job.sent)
            end = next((c[0] for c in job.chunks if c[0] > first), len(job.items))
            slots = [[(i, j) for j in range(job.n)] for i in range(first, end)]
            gen = engine.stream([it.input_ids for it in job.items[first:end]],
                                sampling_params(self.cfg, self.tokenizer, seed), n=job.n)
            job.sent = end
        else:
            todo = [(i, j) for i, g in enumerate(job.groups) if not job.scored[i] for j, s in enumerate(g) if s is None]
            job.restarted += sum(1 for key in todo if key not in job.parts)
            slots = [[key] for key in todo]
            prompts = [continuation_prompt(job.parts[k]) if k in job.parts else job.items[k[0]].input_ids
                       for k in todo]
            budgets = [self.max_new - (len(job.parts[k].response_ids) if k in job.parts else 0) for k in todo]
            # a continuation needs the routing rows from its part's last token on only (SGLang returns those); a
            # prompt's samples go on together on one server, as its n samples started (its prefix prefilled once)
            held = [len(p) - 1 if k in job.parts else 0 for k, p in zip(todo, prompts)]
            gen = engine.stream(prompts, sampling_params(self.cfg, self.tokenizer, mix_seed(job.seed, job.rounds)),
                                n=1, max_new_tokens=budgets, routes_from=held,
                                affinity=[("prompt", k[0]) for k in todo])
        job.rounds += 1

        def answered(k, answers):
            for key, answer in zip(slots[k], answers):
                job.confirmed += answer.meta.weight_version is not None
                self._settle(job, key, tag(answer, version, self.hold))
            for i in sorted({key[0] for key in slots[k]}):
                if not job.scored[i] and all(s is not None for s in job.groups[i]):
                    self._score(job, i)
            if job.reached and not self.carry_steps:  # no surplus wanted: everything ends now
                return STOP
            with self.cond:  # a pause aborts every running request itself (_quiesce): only stop sending
                # dynamic sampling's quota kept: nothing more is sent, the running requests end (the groups that
                # complete meanwhile are carried)
                return "finish" if job.reached else "stop_sending" if (self.pausing or self.closing) else None

        try:
            drive(gen, answered)
        finally:
            took = time.perf_counter() - t0
            job.generate_s += took
            if not fresh:
                job.continue_s += took

    def _episode_round(self, job: _Job, version: int):
        """Multi-turn: one engine call for the job's live episodes on `version` (each one's next turn, or the rest
        of the turn a pause interrupted; a pause stops the sending), then their environment steps, with the engine
        released: a weight sync need not wait for a tool. An episode's turns may so be sampled by successive
        versions, each token tagged with its own."""
        engine, t0 = self.engines.slot.engine, time.perf_counter()
        if job.batch is None:
            job.batch = self.episodes.batch(job.items, job.n)
        elif job.sent < len(job.items):  # dynamic sampling's next chunk: its episodes join the running ones
            job.batch.extend([(it.input_ids, it.record) for it in job.items[job.sent:]])
        job.sent = len(job.items)
        params = with_call_seed(sampling_params(self.cfg, self.tokenizer, job.seed), job.batch.calls)
        job.rounds += 1

        def interrupt():
            with self.cond:
                return "stop_sending" if (self.pausing or self.closing) else None

        try:
            ended = job.batch.generate(engine, params, version, interrupt, self.hold)
        finally:
            job.confirmed = job.batch.confirmed
            job.generate_s += time.perf_counter() - t0
        with self.cond:  # the engine is idle from here: a pause waiting for it goes ahead
            self.busy = False
            self.cond.notify_all()
        for i, group in job.batch.settle(ended):
            job.groups[i] = group
            job.continued += sum(s.meta.parts > 1 for s in group)
            self._score(job, i)
        if job.reached:  # dynamic sampling's quota kept: the episodes still running end here
            job.batch.close()

    def _settle(self, job: _Job, key, answer: Sample):
        prev = job.parts.pop(key, None)
        if prev is not None:
            if not answer.response_ids or (answer.finish_reason == "abort" and not continuable(answer)):
                job.parts[key] = prev  # nothing usable came back: continue from the part it had
                return
            answer = join(prev, answer, self.max_new, self.stops)
        if answer.finish_reason != "abort":
            job.groups[key[0]][key[1]] = answer
            job.continued += prev is not None or len(versions_of(answer)) > 1  # (held: spanning a sync)
        elif continuable(answer):
            job.parts[key] = answer
        # else: aborted before it had a token (or without its routes): generated again from its prompt

    def _score(self, job: _Job, i: int):
        group = job.groups[i]
        self.task.score(job.items[i], group)
        for s in group:
            spans = versions_of(s)
            if not spans:  # no token (an episode ended by its environment's failure before it sampled one)
                continue
            s.version_min = min(v for v, _ in spans)
            s.meta.policy_version = spans[-1][0]
            if self.mask:
                s.masked_prefix = sum(c for v, c in spans if v < spans[-1][0])
        with self.cond:  # the step waiting for its last group wakes now
            if job.quota is not None and judge_group([s.reward for s in group], job.report):
                (job.surplus if job.reached else job.kept).append(i)
            job.scored[i] = True
            self.cond.notify_all()


@PRODUCERS.register("async")
class AsyncProducer(RolloutProducer):
    """Generation overlapped with training, bounded by trainer.max_staleness (the module docstring)."""

    @classmethod
    def check_config(cls, cfg, warns: list) -> None:
        r, ds = cfg.rollout, cfg.algorithm.dynamic_sampling
        if r.colocate:
            raise ConfigError(f"rollout.colocate=true with rollout.producer={r.producer}: generation ahead of training "
                              "would need the learner's accelerators while it trains; use rollout.producer=sync")
        if ds.enabled and ds.max_carry_steps > 0:
            # a job for step t starts on version t - k when it can, so its oldest tokens are as old as the bound
            # allows
            warns.append(f"algorithm.dynamic_sampling.max_carry_steps={ds.max_carry_steps} with rollout.producer="
                         f"async (trainer.max_staleness={cfg.trainer.max_staleness}): a step's groups start generating "
                         "as soon as the staleness bound allows, so its surplus groups are mostly too old for a later "
                         "step (counted in dynamic_sampling/carry_stale); set algorithm.dynamic_sampling."
                         "max_carry_steps=0 to end a step's requests once its groups are kept")
        if r.partial_rollout_mask and not r.partial_rollout:
            raise ConfigError(MASK_NEEDS_PARTIAL)
        if r.partial_rollout_kv == "keep":
            if not r.partial_rollout:
                raise ConfigError("rollout.partial_rollout_kv=keep says how an interrupted request continues: set "
                                  "rollout.partial_rollout=true with it, or leave it recompute")
            if not ENGINES.get(r.engine).pauses_in_place:
                raise ConfigError(f"rollout.partial_rollout_kv=keep: the {r.engine} engine cannot hold its requests "
                                  "across a weight update; use rollout.engine=sglang or partial_rollout_kv=recompute")

    @classmethod
    def steps_held(cls, cfg) -> int:
        """The step trained, and up to max_staleness steps generating ahead."""
        return 1 + cfg.trainer.max_staleness

    def __init__(self, cfg, sampler, rollouts, divisor: int):
        super().__init__(cfg, sampler, rollouts, divisor)
        self.lag = cfg.trainer.max_staleness
        self.engines = rollouts.engines
        self.worker = RolloutWorker(cfg, self.engines, rollouts.task, rollouts.tokenizer, self.lag)
        self.planned = None  # the last step whose prompts are drawn
        ds = cfg.algorithm.dynamic_sampling
        self.ds = ds if ds.enabled else None
        self.pending: list[list] = []  # dynamic sampling: this rank's shares of chunks drawn, not yet taken (_chunk)
        self.carry: list[Group] = []  # dynamic sampling: surplus groups kept for later steps
        self.engines.guard.quiesce.append(lambda: self.worker.paused(clear_error=True))

    @contextlib.contextmanager
    def paused(self, version: Optional[int] = None):
        """A weight sync (version given) interrupts the running requests with rollout.partial_rollout (aborted, or
        held in place with partial_rollout_kv=keep), else waits for them; an evaluation waits for them. Before a
        sync every rank agrees it is past its pause: a driver waiting for its running round (partial_rollout=false:
        up to a whole generation) holds the others on the gloo control group (rollout.wait_timeout, as the sync
        producer's rollout wait), not in the export's collectives under NCCL's timeout."""
        sync = version is not None and self.cfg.rollout.partial_rollout
        with self.worker.paused(version, abort=sync, hold=sync and self.worker.hold):
            if version is not None:
                agree(0, self.engines.guard.group)
            yield

    def _plan(self, step: int):
        """Draw the prompts of the steps up to step + k (in step order: the sync producer's prompts per step)."""
        p = self.cfg.prompts
        last = min(step + self.worker.lag, self.cfg.train_iters - 1)  # as far ahead as the thread may generate
        first = step if self.planned is None else max(step, self.planned + 1)
        for s in range(first, last + 1):
            seed = mix_seed(self.cfg.seed, s, 0, dist.get_rank())
            if self.ds is None:
                items = share(self.sampler.next_prompts(p.prompts_per_step), self.engines.ranks)
                self.worker.add(_Job(s, items, seed, p.n_samples))
            else:  # the quota less the carried groups it will take (known when the step is the one collected)
                quota = max(self._quota() - (len(self._usable(s)[0]) if s == step else 0), 0)
                chunk = self._chunk(quota > 0)
                self.worker.add(_Job(s, chunk or [], seed, p.n_samples, quota=quota))
            self.planned = s

    # --- dynamic sampling ----------------------------------------------------------------------------
    def _quota(self) -> int:
        """This rank's share of a step's groups (0 on a rank without an engine)."""
        return len(share(list(range(self.cfg.prompts.prompts_per_step)), self.engines.ranks))

    def _chunk(self, need: bool) -> Optional[list]:
        """Collective: a chunk of prompts for the ranks that `need` one. Each rank takes the chunks in one order, its
        shares of them drawn and not yet taken first (`pending`); when one that needs a chunk has none left, every
        rank draws the next (ceil(largest share x oversample) prompts each: the cursor stays equal everywhere) and
        keeps its share for later. So each rank's t-th chunk is the sync producer's, whatever the others took."""
        p, ranks = self.cfg.prompts, self.engines.ranks
        flags = torch.tensor([int(need), int(need and not self.pending)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.engines.guard.group)
        if not flags[0]:
            return None
        if flags[1]:
            per_rank = math.ceil(-(-p.prompts_per_step // len(ranks)) * p.oversample)
            drawn = share(self.sampler.next_prompts(per_rank * len(ranks)), ranks)
            if drawn:
                self.pending.append(drawn)
        return self.pending.pop(0) if need else []

    def _usable(self, step: int) -> tuple[list, int]:
        """The carried groups `step` may train on (at most max_carry_steps steps old, no token older than the
        staleness bound), and how many are too old."""
        fresh = [g for g in self.carry if step - g.version <= self.ds.max_carry_steps
                 and all(s.version_min < 0 or s.version_min >= step - self.lag for s in g.samples)]
        return fresh, len(self.carry) - len(fresh)

    def _take_dynamic(self, step: int) -> tuple[list[Sample], DynamicSamplingReport]:
        """This rank's groups of `step`: carried ones first, then the job's; a job exhausted short of its quota gets
        another chunk (every rank agrees, `_chunk`), up to max_tries chunks; surplus groups are carried."""
        job, stop = self.worker.jobs[step], self.engines.slot.should_stop
        while True:
            self.engines.guard.run(lambda: self.worker.take(step, stop))
            need = not job.reached and len(job.chunks) < self.ds.max_tries and job.quota > 0
            chunk = self._chunk(need)
            if chunk is None:
                break
            if need:
                self.worker.extend(step, chunk, mix_seed(self.cfg.seed, step, len(job.chunks), dist.get_rank()))
        quota = self._quota()
        report = job.report
        report.target_groups, report.aborted = quota, sum(1 for done in job.scored if not done)
        usable, report.carry_stale = self._usable(step)
        taken, carry = usable[:quota], usable[quota:]
        report.carried_in = len(taken)
        groups = taken + [Group(job.items[i], job.groups[i], [s.reward for s in job.groups[i]], step)
                          for i in job.kept]
        extra = groups[quota:] + [Group(job.items[i], job.groups[i], [s.reward for s in job.groups[i]], step)
                                  for i in job.surplus]
        groups = groups[:quota]
        if self.ds.max_carry_steps:
            carry += extra
            report.carried_out = len(extra)
        else:
            report.surplus_dropped = len(extra)
        self.carry = carry
        report.groups_kept = len(groups)
        return [s for g in groups for s in g.samples], report

    def collect(self, step: int, timer) -> ScoredGroups:
        cfg, n = self.cfg, self.cfg.prompts.n_samples
        self._plan(step)
        with timer("rollout"):  # the wait for this step's groups (generated meanwhile)
            if self.ds is None:
                local = self.engines.guard.run(lambda: self.worker.take(step, self.engines.slot.should_stop))
            else:
                local, report = self._take_dynamic(step)
        job = self.worker.drop(step)
        with timer("gather"):
            samples = gather_scalars(local, self.rollouts.spec, cfg.routing.on_bad_trace, self.engines.guard.group)
        counts = torch.tensor([job.continued, job.restarted, job.rounds, job.confirmed] if job else [0] * 4,
                              dtype=torch.float64)
        dist.all_reduce(counts, group=self.engines.guard.group)
        metrics = {}
        if self.ds is not None:
            ds = torch.tensor(report.counts(), dtype=torch.int64)
            dist.all_reduce(ds, group=self.engines.guard.group)
            metrics.update(DynamicSamplingReport(*ds.tolist()).stats())
        # the staleness bound, on every rank alike (the versions are scalars): a group with a token sampled more
        # than k versions before this step's learner is not trained on
        stale = {g for g in range(len(samples) // n)
                 if any(0 <= s.version_min < step - self.lag for s in samples[g * n:(g + 1) * n])}
        if stale:
            log.warning("step %d: %d groups hold tokens older than trainer.max_staleness=%d allows: not trained on",
                        step, len(stale), self.lag)
            samples = [s for k, s in enumerate(samples) if k // n not in stale]
        ages = [step - s.version_min for s in samples if s.version_min >= 0]
        metrics.update({"async/stale_dropped_groups": len(stale), "async/continued_samples": int(counts[0]),
                        "async/restarted_samples": int(counts[1]), "async/engine_calls": int(counts[2]),
                        "async/versions_confirmed": int(counts[3]),
                        "async/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
                        "async/staleness_max": max(ages, default=0)})
        if job is not None:
            metrics["async/generate_s"] = job.generate_s  # this rank's engine calls for the step, end to end
            metrics["async/continue_s"] = job.continue_s  # of those, the calls after its first (partial rollout)
            metrics["async/held_s"] = job.held_s  # of those, held for syncs that ran under them (kv=keep)
        # the last syncs' waits for the engine (partial rollout: aborting the running requests and collecting
        # their answers; without: the running call): time/sync less this is the weight sync itself
        metrics["async/pause_s"] = self.worker.paused_s()
        samples, trimmed = trim_to_divisor(samples, n, self.divisor)
        if trimmed:
            metrics["async/trimmed_groups"] = trimmed
        return ScoredGroups(samples, torch.arange(len(samples) // n).repeat_interleave(n), metrics)

    def state_dict(self) -> dict:
        """The prompts of the steps planned and not trained (this rank's shares): generated again after a resume;
        with dynamic sampling, the prompts drawn and not taken and the carried groups."""
        with self.worker.cond:
            jobs = [(s, j.items) for s, j in sorted(self.worker.jobs.items())]
        state = {"async_jobs": jobs} if jobs else {}
        if self.pending or self.carry:
            state.update(pending=self.pending, carry=self.carry)
        return state

    def load_state_dict(self, state: dict) -> None:
        ds = self.ds is not None
        for s, items in state.get("async_jobs", []):
            self.worker.add(_Job(s, list(items), mix_seed(self.cfg.seed, s, 0, dist.get_rank()),
                                 self.cfg.prompts.n_samples, quota=self._quota() if ds else None))
            self.planned = s if self.planned is None else max(self.planned, s)
        if ds:
            n = self.cfg.prompts.n_samples
            self.pending = list(state.get("pending", []))
            self.carry = [g for g in state.get("carry", []) if len(g.samples) == n]

    def close(self):
        self.worker.close()
