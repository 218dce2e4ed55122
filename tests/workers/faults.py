"""The fault harness's trainer side (tests/test_faults.py), several runs in one launch (start-up paid once).

A stop (SIGTERM to every rank, as `scancel --signal=TERM` does) in each phase of a step -- rollout, old
log-probs, update, sync (the servers alive, or dying with the job: the sync fails), evaluation, a save -- under
the sync and the async producer, and colocated (rollout.colocate); a failed weight sync (rebuilt and retried); a resume from a stop. Each run
records, per rank and step, the prompts it trained (their token ids), the steps saved and how it ended.

argv: out_dir. Rank 0 writes the report: {run: {"rc", "stopped", "steps", "saved", "trained", ...}}.
"""
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

import rlpo_mega.training.trainer as trainer_module
import tests.workers.train_hooks as hooks  # noqa: F401  (registers the test_flaky engine)
from rlpo_mega.checkpoint import run as state
from rlpo_mega.rollout import EngineError
from rlpo_mega.rollout.sglang_engine import SGLangEngine
from rlpo_mega.training.trainer import Trainer
from rlpo_mega.weight_sync.reshard import ReshardTransport
from tests.dist import write_report
from tests.workers.train_scenarios import _sglang_cfg, cfg, history, train

STEPS = 3


def _term():
    os.kill(os.getpid(), signal.SIGTERM)  # a real signal through the trainer's handler, on every rank


class Faults:
    """Patches the trainer's phases for one run: a SIGTERM at `phase` of step `at` (1-based, the step being
    made), and records the prompts each step trained (per rank: the samples whose ids this rank holds)."""

    def __init__(self, phase=None, at=2, sync_fails=False, sync_failures=0, bucket_fails_on=None):
        self.phase, self.at, self.sync_fails, self.sync_failures = phase, at, sync_fails, sync_failures
        self.bucket_fails_on = bucket_fails_on  # this rank's receiver fails at the first bucket of step 1's sync
        self.trained, self.saves, self.syncs = {}, [], 0
        self.saved = []

    def __enter__(self):
        self.orig = {"collect_plan": trainer_module.plan_and_exchange, "old": trainer_module.old_logprobs,
                     "update": trainer_module.update_phase, "sync": Trainer.sync, "eval": Trainer.evaluate,
                     "save": Trainer.save}
        f = self

        def plan_and_exchange(samples, *args, **kw):
            f.step_now = f.trainer.step + 1
            f.trained[f.step_now] = sorted(list(s.prompt_ids) for s in samples if s.prompt_ids is not None)
            return f.orig["collect_plan"](samples, *args, **kw)

        def old_logprobs(*args, **kw):
            f.fire("old_logprob", f.trainer.step + 1)
            return f.orig["old"](*args, **kw)

        def update_phase(*args, **kw):
            f.fire("update", f.trainer.step + 1)
            return f.orig["update"](*args, **kw)

        def sync(self):
            f.syncs += 1
            if f.trainer.started:  # not the run's first sync: the step's (or a rebuild's re-sync)
                f.fire("sync", f.trainer.step)  # the step is counted before its sync
                if f.sync_failures > 0:  # a server that fails the sync (a dead one, or one that went with the job)
                    f.sync_failures -= 1
                    raise EngineError("test: the weight sync failed (server gone)")
                if f.sync_fails and f.phase == "sync" and f.trainer.step == f.at:
                    raise EngineError("test: the weight sync failed (servers stopping with the job)")
            return f.orig["sync"](self)

        def evaluate(self):
            if self.started:
                f.fire("eval", self.step)
            return f.orig["eval"](self)

        def save(self, **kw):
            f.saves.append({"step": self.step, "on_signal": kw.get("on_signal", False)})
            f.fire("save", self.step + 1)  # the save of the step before `at`
            return f.orig["save"](self, **kw)

        trainer_module.plan_and_exchange, trainer_module.old_logprobs = plan_and_exchange, old_logprobs
        trainer_module.update_phase = update_phase
        Trainer.sync, Trainer.evaluate, Trainer.save = sync, evaluate, save
        self.init = Trainer.__init__

        def init(trainer, *args, **kw):
            f.trainer = trainer
            self.init(trainer, *args, **kw)
            collect = trainer.producer.collect

            def rollout(step, timer):
                f.fire("rollout", step + 1)
                return collect(step, timer)
            trainer.producer.collect = rollout
            receiver = getattr(trainer.engines.slot.transport, "receiver", None)
            if f.bucket_fails_on == dist.get_rank() and receiver is not None:
                load = receiver.load_weights_verified

                def failing(*a, **kw):  # half-way through an export the other ranks go on with
                    if trainer.started and not getattr(f, "bucket_failed", False):
                        f.bucket_failed = True
                        raise EngineError("test: this rank's engine failed mid-sync")
                    return load(*a, **kw)
                receiver.load_weights_verified = failing
        Trainer.__init__ = init
        return self

    def fire(self, phase, step):
        if phase == self.phase and step == self.at and not getattr(self, "fired", False):
            self.fired = True
            _term()

    def __exit__(self, *exc):
        trainer_module.plan_and_exchange, trainer_module.old_logprobs = self.orig["collect_plan"], self.orig["old"]
        trainer_module.update_phase = self.orig["update"]
        Trainer.sync, Trainer.evaluate, Trainer.save = self.orig["sync"], self.orig["eval"], self.orig["save"]
        Trainer.__init__ = self.init


def _run(out, name, extra, **faults):
    ck = os.path.join(out, f"ckpt_{name}")
    with Faults(**faults) as f:
        rc = train(cfg(out, name, f"train_iters={STEPS}", f"checkpoint.save_dir={ck}", *extra))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, f.trained)
    hist = history(out, name)
    return {"rc": rc, "stopped": f.trainer.stopped, "steps": [h["step"] for h in hist],
            "restarts": [h.get("engine/restarts") for h in hist], "saved": state.complete_steps(ck),
            "saves": f.saves, "trained": every, "syncs": f.syncs, "ckpt": ck}


def stops(out):
    rep = {}
    save_every = ("checkpoint.save_every=1",)
    for producer, extra in (("sync", ()), ("async", ("rollout.producer=async", "trainer.max_staleness=1"))):
        rep[f"{producer}_clean"] = _run(out, f"{producer}_clean", extra + save_every)
        for phase in ("rollout", "old_logprob", "update", "sync", "sync_dead", "eval", "save"):
            if producer == "async" and phase in ("eval", "save", "old_logprob"):
                continue  # the async producer differs from the sync one at the rollout and the sync only
            more = ("trainer.eval_every=1",) if phase == "eval" else ()
            p = "sync" if phase == "sync_dead" else phase
            rep[f"{producer}_{phase}"] = _run(out, f"{producer}_{phase}", extra + save_every + more, phase=p,
                                              sync_fails=phase == "sync_dead")
    # rollout.colocate (the embedded engine on the learner's "GPUs"): a stop in each phase of the hand-over -- the
    # rollout and the evaluation with the learner's state on the host, the update, the sync, a save -- saves too
    for phase in ("rollout", "update", "sync", "eval", "save"):
        more = ("trainer.eval_every=1",) if phase == "eval" else ()
        rep[f"colocate_{phase}"] = _run(out, f"colocate_{phase}", ("rollout.colocate=true",) + save_every + more,
                                        phase=phase)
    # a stop during the rollout while the engine fails (a dead server): no rebuild, the last step saved
    os.environ["RLPO_FAIL_RANK"], os.environ["RLPO_FAIL_CALL"] = "1", "2"
    hooks.FlakyEngine.calls = 0
    rep["rollout_dead"] = _run(out, "rollout_dead", ("rollout.engine=test_flaky", "trainer.engine_restarts=2")
                               + save_every, phase="rollout")
    os.environ["RLPO_FAIL_CALL"] = "0"
    # a failed weight sync, twice in a row (the re-sync after the rebuild fails too): rebuilt and retried
    rep["sync_retry"] = _run(out, "sync_retry", ("trainer.engine_restarts=2",), sync_failures=2)
    # one rank's engine fails at the first bucket of a sync in small buckets: it drains the rest of the export
    # (the other rank's collectives complete), the failure is agreed, rebuilt, re-synced
    rep["sync_mid_bucket"] = _run(out, "sync_mid_bucket", ("trainer.engine_restarts=1", "rollout.sync_bucket_mb=1"),
                                  bucket_fails_on=1)
    # the resume of the update-phase stop: the run trains, over both parts, the prompts of the clean run
    name = "sync_update"
    ck = rep[name]["ckpt"]
    with Faults() as f:
        rc = train(cfg(out, "resumed", f"train_iters={STEPS}", f"checkpoint.save_dir={ck}",
                       "checkpoint.save_every=1", "checkpoint.resume=true", "checkpoint.overwrite=false"))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, f.trained)
    rep["resumed"] = {"rc": rc, "steps": [h["step"] for h in history(out, "resumed")], "trained": every,
                      "saved": state.complete_steps(ck)}
    return rep


class StopsWithServers(Faults):
    """A stop as `scancel --signal=TERM` makes it with servers the trainer launched: the SIGTERM reaches each
    rank and the servers together (each rank TERMs the servers it launched, waits for them to exit, then itself:
    the phase meets dead servers). With `first_answer`, rank 0 (the driver) fires at its first /generate answer of
    the rollout, the other ranks at the rollout's start. Records the prompts each engine call was sent per step."""

    def __init__(self, *args, first_answer=False, kill_in_sync=None, **kw):
        super().__init__(*args, **kw)
        self.first_answer, self.sent = first_answer, {}
        self.kill_in_sync, self.killed = kill_in_sync, []  # a step whose sync SIGKILLs the last server mid-bucket
        self.failed_syncs = []  # seconds each failed Trainer.sync took

    def __enter__(self):
        super().__enter__()
        f, self.orig_stream, self.orig_answer = self, SGLangEngine.stream, SGLangEngine._answer
        self.orig_post = SGLangEngine._post_ok

        def post_ok(engine, server, path, *a, **kw):
            # the last server dies as its bucket's update is asked for: the driver's broadcast meets a dead member
            if (path == "/update_weights_from_distributed" and f.trainer.started and f.trainer.step == f.kill_in_sync
                    and not f.killed and server is engine.servers[-1] and server.launched is not None):
                f.killed.append(server.url)
                os.killpg(server.launched.proc.pid, signal.SIGKILL)
                server.launched.proc.wait(30)
            return f.orig_post(engine, server, path, *a, **kw)
        SGLangEngine._post_ok = post_ok
        self.orig_send = ReshardTransport._send

        def send(transport, *a, **kw):
            # rollout.sync_transport=reshard: the last server dies as the learner ranks' shards leave
            e = transport.engine
            if (e is not None and f.trainer.started and f.trainer.step == f.kill_in_sync and not f.killed
                    and e.servers[-1].launched is not None):
                f.killed.append(e.servers[-1].url)
                os.killpg(e.servers[-1].launched.proc.pid, signal.SIGKILL)
                e.servers[-1].launched.proc.wait(30)
            return f.orig_send(transport, *a, **kw)
        ReshardTransport._send = send
        self.faulted_sync = Trainer.sync

        def sync(trainer):
            t0 = time.monotonic()
            try:
                return f.faulted_sync(trainer)
            except EngineError:
                f.failed_syncs.append(time.monotonic() - t0)
                raise
        Trainer.sync = sync

        def stream(engine, prompts, *a, **kw):
            f.sent.setdefault(f.trainer.step + 1, []).extend(tuple(int(t) for t in p) for p in prompts)
            return f.orig_stream(engine, prompts, *a, **kw)

        def answer(engine, *a):
            if f.first_answer and f.phase == "rollout":
                f.fire("answer", f.trainer.step + 1)
            return f.orig_answer(engine, *a)
        SGLangEngine.stream, SGLangEngine._answer = stream, answer
        return self

    def __exit__(self, *exc):
        SGLangEngine.stream, SGLangEngine._answer = self.orig_stream, self.orig_answer
        SGLangEngine._post_ok = self.orig_post
        ReshardTransport._send = self.orig_send
        Trainer.sync = self.faulted_sync
        return super().__exit__(*exc)

    def fire(self, phase, step):
        if self.first_answer and self.phase == "rollout" and dist.get_rank() == 0:
            phase = "rollout" if phase == "answer" else None  # the driver: at its first answer
        if phase != self.phase or step != self.at or getattr(self, "fired", False):
            return
        self.fired = True
        engine = self.trainer.engines.slot.engine
        launched = [s.launched for s in (engine.servers if isinstance(engine, SGLangEngine) else [])
                    if s.launched is not None and s.launched.alive()]
        _term()  # first, as the job's TERM reaches everyone at once: the learner knows of the stop when its
        for server in launched:  # servers' deaths show
            os.killpg(server.proc.pid, signal.SIGTERM)
        for server in launched:
            try:
                server.proc.wait(60)
            except subprocess.TimeoutExpired:  # SGLang ignored TERM for a minute: as the job's KILL would end it
                os.killpg(server.proc.pid, signal.SIGKILL)
                server.proc.wait(30)


def sglang_launched_stops(out, transport=None, weights=None):
    """Real SGLang, two servers the trainer launched on its one driver (rollout.sglang.num_servers=2, drivers=1;
    the first sync with several servers per driver), the recipes' sglang_distributed sync; 3 steps, each saved:
    a: the second server SIGKILLed in step 1's sync, as its bucket is sent (the driver's broadcast meets a dead
       member: the sync fails, is retried under the guard); then SIGTERM to learners and servers during step 2's
       sync (the servers dead when it runs): step 2 saved, 75.
    b: resumed with one server fewer (num_servers=1); SIGTERM to learners and server in step 3's rollout (the
       driver at its first answer): nothing newer to save, 75.
    c: resumed again with one server: step 3 trained, on the prompts b's rollout was sent.
    transport="reshard": run a only, with rollout.sync_transport=reshard (the second server killed as the learner
    ranks' shards leave in step 1's sync; SIGTERM to learners and servers in step 2's). weights="fp8": the servers
    in block FP8 (rollout.weights=fp8; the checkpoint the test made is of the FP8 tiny model)."""
    ck, rep = os.path.join(out, "ckpt"), {}
    runs = (("a", 2, {"phase": "sync", "at": 2, "kill_in_sync": 1}),
            ("b", 1, {"phase": "rollout", "at": 3, "first_answer": True}),
            ("c", 1, {}))
    extra = ()
    if transport is not None:
        runs, extra = runs[:1], (f"rollout.sync_transport={transport}",)
    if weights == "fp8":  # (SGLang's fp8 serves in bf16)
        extra += ("rollout.weights=fp8", "rollout.sglang.server_args.dtype=bfloat16",
                  "model.hf_config=configs/models/tiny_qwen3_moe_fp8.json")
    for run, servers, faults in runs:
        resume = ("checkpoint.resume=true", "checkpoint.overwrite=false") if run != "a" else ()
        with StopsWithServers(**faults) as f:
            rc = train(_sglang_cfg(out, run, f"train_iters={STEPS}", f"checkpoint.save_dir={ck}",
                                   "checkpoint.save_every=1", "rollout.sglang.drivers=1", "trainer.engine_restarts=1",
                                   f"rollout.sglang.num_servers={servers}", *resume, *extra))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, f.trained)
        hist = history(out, run) if os.path.exists(os.path.join(out, run, "metrics.jsonl")) else []
        rep[run] = {"rc": rc, "stopped": f.trainer.stopped, "steps": [h["step"] for h in hist], "trained": every,
                    "alive": [h.get("engine/servers_alive") for h in hist],
                    "restarts": [h.get("engine/restarts") for h in hist], "saved": state.complete_steps(ck),
                    "saves": f.saves, "sent": f.sent, "killed": f.killed, "failed_syncs": f.failed_syncs,
                    "lost": [h.get("engine/servers_lost") for h in hist],
                    "mismatch": [h.get("mismatch/ratio_dev_max") for h in hist],
                    "k3": [h.get("mismatch/k3_kl") for h in hist], "tis": [h.get("mismatch/tis_truncated_frac") for h in hist]}
    return rep


if __name__ == "__main__":
    if sys.argv[2:3] == ["sglang"]:
        result = sglang_launched_stops(sys.argv[1], *sys.argv[3:5])
    else:
        result = stops(sys.argv[1])
    if dist.get_rank() == 0:
        write_report(result)
