"""Trainer scenarios under torchrun, several runs in one launch (start-up is paid once).

argv: scenario out_dir. Rank 0 writes a report per scenario; runs log to out_dir/<run>/ (metrics.jsonl and
an offline W&B run that the test reads back).
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import tests.workers.train_hooks as hooks
from rlpo_mega.rollout import EngineError
from rlpo_mega.rollout.sglang_engine import SGLangEngine
from rlpo_mega.training.trainer import Trainer
from rlpo_mega.training.trainer import train as _train
from moe.model import load_hf_config
from tests.dist import write_report
from tests.workers.bridge import make_hf_checkpoint
from tests.workers.scenario_config import BASE, COLOCATE, cfg, history  # noqa: F401  (scenario modules import them from here too)


def train(config):
    return _train(config, keep_world=True)


def matrix(out):
    """Every loss with R3 replay (dapo with dynamic sampling), gspo also with replay off and R2: a few steps each."""
    runs = {}
    for loss, extra in (("gspo", ("parallel.num_micro_batches=2",)), ("sapo", ("trainer.epochs=2",)),
                        ("grpo", ("algorithm.kl.coef=0.04", "trainer.mini_batches=1")),
                        # no carry-over here: every step's samples come from the weights it syncs (the matrix
                        # checks engine/learner agreement); carried groups: test_demo_with_dynamic_sampling_learns
                        ("dapo", ("algorithm.dynamic_sampling.enabled=true", "prompts.oversample=2.0",
                                  "algorithm.dynamic_sampling.max_carry_steps=0"))):
        for mode in ("r3", "off", "r2") if loss == "gspo" else ("r3",):
            run = f"{loss}_{mode}"
            rc = train(cfg(out, run, f"algorithm.loss.name={loss}", f"routing.mode={mode}", *extra))
            runs[run] = {"rc": rc, "steps": [h["step"] for h in history(out, run)]}
    # context parallelism (CP2 = the EP2 group): R3 replays each CP rank's shard of the engine's routes
    rc = train(cfg(out, "gspo_r3_cp2", "algorithm.loss.name=gspo", "routing.mode=r3", "parallel.context=2"))
    runs["gspo_r3_cp2"] = {"rc": rc, "steps": [h["step"] for h in history(out, "gspo_r3_cp2")]}
    # PPO with a critic (GAE), R3 on and off; r3 folds a KL penalty into the rewards and warms the critic up
    for mode, extra in (("r3", ("algorithm.kl.coef=0.04", "algorithm.kl.in_reward=true", "critic.warmup_steps=1")),
                        ("r2", ("trainer.mini_batches=2",)), ("off", ())):
        run = f"ppo_gae_{mode}"
        rc = train(cfg(out, run, "algorithm.loss.name=ppo_clip", "algorithm.advantage.name=gae",
                       f"routing.mode={mode}", *extra))
        runs[run] = {"rc": rc, "steps": [h["step"] for h in history(out, run)]}
    return runs


# A learning-rate schedule long enough for the uninterrupted run (4 steps x 2 mini-batches) and a KL
# reference, so the resumed run must restore where it was on the schedule and the reference it started with.
LR_SCHEDULE = ("optim.lr_decay_style=cosine", "optim.lr_warmup_steps=2", "optim.lr_warmup_init=1e-4",
               "optim.lr_decay_steps=8", "optim.min_lr=2e-4", "algorithm.kl.coef=0.04")


def resume(out):
    """Uninterrupted 4 steps vs 2 steps + resume to 4 (same layout), then from there one step at TP2."""
    ck = os.path.join(out, "ckpt")
    train(cfg(out, "full", "train_iters=4", *LR_SCHEDULE))
    train(cfg(out, "first", "train_iters=2", f"checkpoint.save_dir={ck}", *LR_SCHEDULE))
    train(cfg(out, "second", "train_iters=4", f"checkpoint.save_dir={ck}", "checkpoint.keep_last=1",
              "checkpoint.resume=true", "checkpoint.export_hf=true", *LR_SCHEDULE))
    train(cfg(out, "tp2", "train_iters=5", f"checkpoint.load_dir={ck}", "parallel.expert=1",
              "parallel.tensor=2", *LR_SCHEDULE))
    # ... and at context parallelism 2 (the EP2 group split each sample instead of the data)
    train(cfg(out, "cp2", "train_iters=5", f"checkpoint.load_dir={ck}", "parallel.context=2", *LR_SCHEDULE))
    # dynamic sampling with groups carried to the next step: each rank's carried groups are saved with the
    # checkpoint (rank_state/) and trained after the resume where the uninterrupted run trains them
    ds, ck_ds = DYNAMIC + LR_SCHEDULE, os.path.join(out, "ckpt_ds")
    train(cfg(out, "full_ds", "train_iters=4", *ds))
    train(cfg(out, "first_ds", "train_iters=1", f"checkpoint.save_dir={ck_ds}", *ds))  # step 1 carries 4 groups
    saved = sorted(os.listdir(os.path.join(ck_ds, "step_00000001", "rank_state")))
    train(cfg(out, "second_ds", "train_iters=4", f"checkpoint.save_dir={ck_ds}", "checkpoint.resume=true", *ds))
    # the same through the async producer at max_staleness 0 (its saved state: the chunks drawn and not taken, the
    # carried groups, which the bound then counts as stale)
    ads, ck_ads = ds + ("rollout.producer=async", "trainer.max_staleness=0"), os.path.join(out, "ckpt_ads")
    train(cfg(out, "full_ads", "train_iters=3", *ads))
    train(cfg(out, "first_ads", "train_iters=1", f"checkpoint.save_dir={ck_ads}", *ads))
    train(cfg(out, "second_ads", "train_iters=3", f"checkpoint.save_dir={ck_ads}", "checkpoint.resume=true", *ads))
    # LoRA (model.lora): adapters only in the optimizer, the KL reference the base (adapters off), the engine
    # synced with merged weights; on an HF base (model.init_from_hf), so its checkpoints hold the adapters only
    # (model.lora.save=auto) and the resume loads the factors and their optimizer state onto the base it rebuilds
    base = os.path.join(out, "lora_base")
    if dist.get_rank() == 0:
        make_hf_checkpoint(load_hf_config("configs/models/tiny_qwen3_moe.json"), base)
    dist.barrier()
    lora = ("model.lora.rank=4", "model.lora.alpha=16", "algorithm.kl.coef=0.04", f"model.init_from_hf={base}")
    ck_lora = os.path.join(out, "ckpt_lora")
    train(cfg(out, "full_lora", "train_iters=3", *lora))
    train(cfg(out, "first_lora", "train_iters=2", f"checkpoint.save_dir={ck_lora}", "checkpoint.export_hf=true", *lora))
    train(cfg(out, "second_lora", "train_iters=3", f"checkpoint.save_dir={ck_lora}", "checkpoint.resume=true", *lora))
    runs = ("full", "first", "second", "tp2", "cp2", "full_ds", "first_ds", "second_ds", "full_ads", "second_ads",
            "full_lora", "second_lora")
    return {run: history(out, run) for run in runs} | {
        "ckpt_dirs": sorted(os.listdir(ck)) if dist.get_rank() == 0 else None, "ckpt": ck, "rank_state": saved,
        "ckpt_lora": ck_lora, "lora_base": base}


DYNAMIC = ("algorithm.loss.name=dapo", "algorithm.dynamic_sampling.enabled=true", "prompts.oversample=2.0",
           "algorithm.dynamic_sampling.max_carry_steps=1", "trainer.mini_batches=1")


PPO = ("algorithm.loss.name=ppo_clip", "algorithm.advantage.name=gae", "critic.optim.lr_decay_style=cosine",
       "critic.optim.lr=1e-3", "critic.optim.lr_warmup_steps=2", "critic.optim.lr_decay_steps=8", "critic.warmup_steps=1",
       "optim.lr_decay_style=cosine", "optim.lr_warmup_steps=2", "optim.lr_decay_steps=8")


def resume_ppo(out):
    """PPO with a critic: uninterrupted 4 steps vs 2 steps + resume to 4; then the checkpoint's critic loaded
    at the saved layout and at TP2 exports the same tensors (resharded exactly)."""
    from moe.bridge.megatron_io import export_hf_state
    from rlpo_mega import distributed

    ck = os.path.join(out, "ckpt")
    train(cfg(out, "full", "train_iters=4", *PPO))
    train(cfg(out, "first", "train_iters=2", f"checkpoint.save_dir={ck}", *PPO))
    train(cfg(out, "second", "train_iters=4", f"checkpoint.save_dir={ck}", "checkpoint.resume=true", *PPO))
    # bf16 parameters with both distributed optimizers (the recipes' setting): 2 steps + resume to 3
    bf16 = ("model.params_dtype=bfloat16", "optim.use_distributed_optimizer=true",
            "critic.optim.use_distributed_optimizer=true") + PPO
    ck16 = os.path.join(out, "ckpt_bf16")
    train(cfg(out, "full_bf16", "train_iters=3", *bf16))
    train(cfg(out, "first_bf16", "train_iters=2", f"checkpoint.save_dir={ck16}", *bf16))
    train(cfg(out, "second_bf16", "train_iters=3", f"checkpoint.save_dir={ck16}", "checkpoint.resume=true", *bf16))
    # adapters on both (model.lora on an HF base, critic.lora): the critic's checkpoints hold its adapters and head
    # alone (critic.lora.save=auto), its trunk copied again from the LoRA policy's frozen base at the resume
    base = os.path.join(out, "lora_base")
    if dist.get_rank() == 0:
        make_hf_checkpoint(load_hf_config("configs/models/tiny_qwen3_moe.json"), base)
    dist.barrier()
    lora = PPO + ("model.lora.rank=4", "critic.lora.rank=4", "critic.lora.alpha=8", f"model.init_from_hf={base}")
    ck_lora = os.path.join(out, "ckpt_lora")
    train(cfg(out, "full_lora", "train_iters=3", *lora))
    train(cfg(out, "first_lora", "train_iters=2", f"checkpoint.save_dir={ck_lora}", *lora))
    train(cfg(out, "second_lora", "train_iters=3", f"checkpoint.save_dir={ck_lora}", "checkpoint.resume=true", *lora))
    exports = {}
    for name, layout in (("ep2", ()), ("tp2", ("parallel.expert=1", "parallel.tensor=2"))):
        t = Trainer(cfg(out, f"load_{name}", "train_iters=4", f"checkpoint.load_dir={ck}", *layout, *PPO))
        try:
            exports[name] = export_hf_state(t.critic.chunks, dst=0)
        finally:
            t.close(True)
            distributed.destroy(keep_world=True)
    same = None
    if dist.get_rank() == 0:
        a, b = exports["ep2"], exports["tp2"]
        same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a) and "score.weight" in a
    runs = ("full", "first", "second", "full_bf16", "second_bf16", "full_lora", "second_lora")
    return {run: history(out, run) for run in runs} | {"resharded_equal": same, "ckpt_lora": ck_lora, "lora_base": base}


def nan(out):
    """One non-finite step is skipped; max_bad_steps in a row stop the run with a message."""
    t = Trainer(cfg(out, "nan_once", "train_iters=3"))
    h = hooks.inject_nan(t, {1})
    ok = True
    try:
        t.run()
    finally:
        h.remove()
        t.close(ok)
        from rlpo_mega import distributed
        distributed.destroy(keep_world=True)
    rep = {"nan_once": history(out, "nan_once")}
    t = Trainer(cfg(out, "nan_grad", "train_iters=3"))
    h = hooks.inject_nan_grad(t, {1})
    try:
        t.run()
    finally:
        h.remove()
        t.close(True)
        from rlpo_mega import distributed
        distributed.destroy(keep_world=True)
    rep["nan_grad"] = history(out, "nan_grad")
    t = Trainer(cfg(out, "nan_always", "train_iters=5", "trainer.max_bad_steps=2"))
    h = hooks.inject_nan(t, set(range(100)))
    try:
        t.run()
        rep["error"] = None
    except FloatingPointError as e:
        rep["error"] = str(e)
    finally:
        h.remove()
        t.close(False)
        from rlpo_mega import distributed
        distributed.destroy(keep_world=True)
    rep["nan_always"] = history(out, "nan_always")
    return rep


def engine(out):
    """A crash of rank 1's engine in step 2: rebuilt and re-synced with a restart left; without one the run
    stops with EngineError and the step-1 checkpoint intact."""
    from rlpo_mega.checkpoint import run as state

    os.environ["RLPO_FAIL_RANK"] = "1"
    os.environ["RLPO_FAIL_CALL"] = "2"
    hooks.FlakyEngine.calls = 0
    rc = train(cfg(out, "restart", "rollout.engine=test_flaky", "trainer.engine_restarts=1", "train_iters=3"))
    rep = {"restart_rc": rc, "restart": history(out, "restart")}
    hooks.FlakyEngine.calls = 0
    ck = os.path.join(out, "ckpt_dead")
    try:
        train(cfg(out, "dead", "rollout.engine=test_flaky", "trainer.engine_restarts=0", "train_iters=3",
                  f"checkpoint.save_dir={ck}", "checkpoint.save_every=1"))
        rep["dead_error"] = None
    except EngineError as e:
        rep["dead_error"] = str(e)
    rep["dead_latest"] = state.latest_checkpoint(ck)
    rep["dead_steps"] = state.complete_steps(ck)
    # dynamic sampling: the prompts of the failed attempt are the retry's (not skipped, not re-drawn), so the run
    # trains what a run without the crash trains
    ds = DYNAMIC[:3] + ("algorithm.dynamic_sampling.max_carry_steps=0", "trainer.mini_batches=1", "train_iters=3",
                        "rollout.engine=test_flaky", "trainer.engine_restarts=1")
    from rlpo_mega.rollout.dynamic_sampling import GroupCollector

    trained, collect = {}, GroupCollector.collect

    def recording(self, quota, version, *args, **kw):  # a retry's groups replace its failed attempt's
        kept, report = collect(self, quota, version, *args, **kw)
        trained[version] = sorted(tuple(g.item.input_ids) for g in kept)
        return kept, report

    GroupCollector.collect = recording
    try:
        os.environ["RLPO_FAIL_CALL"] = "0"  # never
        train(cfg(out, "ds_clean", *ds))
        clean, trained = trained, {}
        os.environ["RLPO_FAIL_CALL"], hooks.FlakyEngine.calls = "2", 0
        train(cfg(out, "ds_restart", *ds))
    finally:
        GroupCollector.collect = collect
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (clean, trained))
    rep["ds_clean"], rep["ds_restart"] = history(out, "ds_clean"), history(out, "ds_restart")
    rep["ds_prompts"] = [{"clean": c, "restart": t} for c, t in every]  # per rank: step -> prompts trained
    return rep


def warmup_reference(out):
    """With a supervised warm-up and KL on, the reference is the policy after the warm-up (RL's start)."""
    import rlpo_mega.training.trainer as trainer_module
    from rlpo_mega.model_setup import unwrap

    before, run_warmup = {}, trainer_module.supervised_warmup

    def snapshot_then_warm_up(cfg, chunks, *args):
        before.update((n, p.detach().clone()) for n, p in unwrap(chunks[0]).named_parameters())
        return run_warmup(cfg, chunks, *args)

    trainer_module.supervised_warmup = snapshot_then_warm_up
    try:
        t = Trainer(cfg(out, "warmup_ref", "train_iters=1", "trainer.warmup.steps=3", "trainer.warmup.lr=1e-2",
                        "algorithm.kl.coef=0.04"))
        t.start()  # the run's phases before RL: the warm-up, then the reference from the policy
    finally:
        trainer_module.supervised_warmup = run_warmup
    policy = dict(unwrap(t.policy.chunks[0]).named_parameters())
    rep = {"ref_equals_policy": all(torch.equal(q, policy[n]) for n, q in t.policy.ref_chunks[0].named_parameters()),
           "warmup_moved": bool(before) and any(not torch.equal(before[n], p) for n, p in policy.items())}
    t.close(True)
    return rep


def producer(out):
    """rollout.producer names a producer registered outside the package (train_hooks.ReplayProducer)."""
    rc = train(cfg(out, "replay", "rollout.producer=test_replay"))
    return {"rc": rc, "history": history(out, "replay")}


def colocate(out):
    """rollout.colocate=true against the same run without it (same seeds), 3 steps with an evaluation and a save after
    each, bf16, the distributed optimizer with optimizer CPU offload (slime's flags) and the KL reference on: per step
    the metrics, and the final weights. In the colocated run, per rank and phase, the bytes on the accelerator (the
    emulated device: the storages' sizes), counted from the tensors themselves (workers/plan_memory.allocated: the
    policy's parameters, main_grads and optimizer state; the reference's parameters) and the engine's: at the start of
    generation, at the start of the update, after the step (the sync and the save)."""
    import rlpo_mega.training.trainer as trainer_module
    from rlpo_mega.model_setup import unwrap
    from rlpo_mega.rollout.producers import SyncProducer
    from tests.workers.plan_memory import allocated

    extra = COLOCATE
    phases, live = [], {}

    def measure(phase):
        t = live["trainer"]
        ref = sum(p.untyped_storage().nbytes() for p in t.policy.ref_chunks[0].parameters())
        phases.append({"phase": phase, "step": t.step, **allocated(t.policy.chunks, t.policy.optimizer),
                       "reference_bytes": ref, "engine_bytes": t.engines.slot.engine.resident_bytes()})

    collect, update = SyncProducer.collect, trainer_module.update_phase

    def collect_measured(self, step, timer):
        measure("generation")
        return collect(self, step, timer)

    def update_measured(*args, **kwargs):
        measure("update")
        return update(*args, **kwargs)

    weights = {}
    for run in ("apart", "colocated"):
        config = cfg(out, run, *extra, f"checkpoint.save_dir={os.path.join(out, run, 'ckpt')}",
                     f"rollout.colocate={str(run == 'colocated').lower()}")
        SyncProducer.collect, trainer_module.update_phase = collect_measured, update_measured
        original_init = Trainer.__init__

        def init(self, *a, **k):
            original_init(self, *a, **k)
            live["trainer"] = self

        Trainer.__init__ = init
        try:
            trainer = _run_with(config, lambda t: measure("after step"))
        finally:
            SyncProducer.collect, trainer_module.update_phase, Trainer.__init__ = collect, update, original_init
        weights[run] = [p.detach().clone() for p in unwrap(trainer.policy.chunks[0]).parameters()]
        if run == "apart":
            phases.clear()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, phases)
    return {"apart": history(out, "apart"), "colocated": history(out, "colocated"), "phases": every,
            "weights_equal": all(torch.equal(a, b) for a, b in zip(weights["apart"], weights["colocated"]))}


def _sglang_cfg(out, run, *extra):
    """GSPO + R3 with launched SGLang servers (rank 0 launches; `extra` may add drivers), the recipes'
    sglang_distributed sync.
    RLPO_SGLANG_{HF,PYTHON,PORT,PATH,SERVER_ARGS} come from tests/test_sglang.py."""
    env = os.environ
    server_args = json.loads(env["RLPO_SGLANG_SERVER_ARGS"])  # tests/test_sglang.py's CPU recipe
    return cfg(out, run, "algorithm.loss.name=gspo", "routing.mode=r3",
               f"model.init_from_hf={env['RLPO_SGLANG_HF']}", "rollout.engine=sglang",
               "rollout.sync_transport=sglang_distributed",
               "rollout.sglang.launch=true", f"rollout.sglang.python={env['RLPO_SGLANG_PYTHON']}",
               f"rollout.sglang.base_port={env['RLPO_SGLANG_PORT']}", "rollout.sglang.startup_timeout=240",
               f"rollout.sglang.log_dir={os.path.join(out, 'sglang_logs')}", "rollout.sglang.max_restarts=0",
               "rollout.sglang.env.SGLANG_USE_CPU_ENGINE=1", "rollout.sglang.env.TORCHDYNAMO_DISABLE=1", f"rollout.sglang.env.PYTHONPATH={env['RLPO_SGLANG_PATH']}",
               *(f"rollout.sglang.server_args.{k}={str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in server_args.items()), *extra)


def _run_with(config, after_step):
    """Trainer.run with `after_step(trainer)` called after each train_step (all ranks); returns (rc, trainer
    attributes the report needs). The trainer is built, run and closed as rlpo_mega.training.trainer.train does."""
    from rlpo_mega import distributed

    original = Trainer.train_step

    def step(self):
        m = original(self)
        after_step(self)
        return m

    Trainer.train_step = step
    try:
        trainer = Trainer(config)
        try:
            trainer.run()
        finally:
            trainer.close()
            distributed.destroy(keep_world=True)
    finally:
        Trainer.train_step = original
    return trainer


def _kill_driver0_server_after_first(trainer):
    """After step 1 (an after_step of _run_with): driver 0's first server SIGKILLed."""
    if trainer.step == 1 and trainer.rank == 0:
        server = trainer.engines.slot.engine.servers[0].launched
        server.kill()
        server.proc.wait(30)


def sglang_distributed_run(out):
    """3 steps with 2 rollout drivers (ranks 0 and 1), each driving one of the 2 servers rank 0 launched, dynamic
    sampling streamed on each; driver 0's server is killed after step 1 (EngineGuard rebuilds every engine +
    transport, both re-sync), and again in step 2's sync as its bucket is sent (driver 0's sync fails, driver 1's
    completes; the failure is agreed, every engine rebuilt again, both re-sync). Every rank reports its syncs
    (with the servers it drove then; a failed one as "failed") and the /generate answers it got from each
    server."""
    syncs, answers, now = [], {}, {"step": 0}
    original_sync, original_answer, original_post = Trainer.sync, SGLangEngine._answer, SGLangEngine._post_ok

    def sync(self):
        now["step"] = self.step
        slot = self.engines.slot
        try:
            got = original_sync(self)
        except EngineError:
            syncs.append({"failed": True, "group": slot.transport.group_name})
            raise
        if slot.engine is not None:
            syncs.append({**got, "group": slot.transport.group_name, "servers": [s.url for s in slot.engine.servers]})
        return got

    def answer(self, server, *args):
        answers[server.url] = answers.get(server.url, 0) + 1
        return original_answer(self, server, *args)

    def post_ok(engine, server, path, *args, **kw):
        if (path == "/update_weights_from_distributed" and now["step"] == 2 and engine.driver == 0
                and server.launched is not None and server.launched.alive() and not now.get("killed")):
            now["killed"] = True  # driver 0's server dies as the bucket is sent
            server.launched.kill()
            server.launched.proc.wait(30)
        return original_post(engine, server, path, *args, **kw)

    Trainer.sync, SGLangEngine._answer, SGLangEngine._post_ok = sync, answer, post_ok
    try:
        # with streaming dynamic sampling: each driver sends 2x its share of prompts and ends its rollout (the
        # rest aborted on its server) once its groups are complete; no carry-over, so that every step trains on
        # the weights it synced (the mismatch check)
        _run_with(_sglang_cfg(out, "sgl", "train_iters=3", "trainer.engine_restarts=2", "rollout.sglang.drivers=2",
                              "rollout.sglang.num_servers=2", "algorithm.dynamic_sampling.enabled=true",
                              "algorithm.dynamic_sampling.max_carry_steps=0", "prompts.oversample=2.0"),
                  _kill_driver0_server_after_first)
    finally:
        Trainer.sync, SGLangEngine._answer, SGLangEngine._post_ok = original_sync, original_answer, original_post
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"syncs": syncs, "answers": answers})
    return {"rc": 0, "history": history(out, "sgl"), "drivers": every}


def reshard_run(out):
    """sglang_distributed_run's shape with rollout.sync_transport=reshard (every learner rank sends its own shards
    to the server ranks holding them): 3 steps, 2 drivers, 2 launched servers; driver 0's server is killed after
    step 1 (every engine and transport rebuilt, a new refit group, both servers re-synced), and again in step 2's
    sync as the learner ranks start sending (the sync fails on every rank, the failure is agreed, everything is
    rebuilt once more and re-synced). Every rank reports its syncs (a failed one as "failed")."""
    from rlpo_mega.weight_sync.reshard import ReshardTransport

    syncs, now = [], {"step": 0}
    original_sync, original_send = Trainer.sync, ReshardTransport._send

    def sync(self):
        now["step"] = self.step
        slot = self.engines.slot
        try:
            got = original_sync(self)
        except EngineError:
            syncs.append({"failed": True, "group": slot.transport.group_name if slot.transport else None})
            raise
        syncs.append({**got, "group": slot.transport.group_name})
        return got

    def send(self, *args):
        e = self.engine
        if now["step"] == 2 and not now.get("killed") and e is not None and e.driver == 0:
            server = e.servers[0].launched
            if server is not None and server.alive():
                now["killed"] = True  # driver 0's server dies as the shards leave
                server.kill()
                server.proc.wait(30)
        return original_send(self, *args)

    Trainer.sync, ReshardTransport._send = sync, send
    try:
        _run_with(_sglang_cfg(out, "rs", "train_iters=3", "trainer.engine_restarts=2", "rollout.sglang.drivers=2",
                              "rollout.sglang.num_servers=2", "rollout.sync_transport=reshard"),
                  _kill_driver0_server_after_first)
    finally:
        Trainer.sync, ReshardTransport._send = original_sync, original_send
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"syncs": syncs})
    return {"rc": 0, "history": history(out, "rs"), "ranks": every}


def sglang_external_failover(out):
    """Two external servers on one driver (rank 0), started as the sbatch starts them (launch/sglang_server.py, by
    the test: RLPO_SGLANG_URLS, their process groups RLPO_SGLANG_PIDS), the demo's in_process sync (the first sync
    with two servers per driver failed before the per-driver store was made once). 4 steps: after step 1 the
    second server is SIGKILLed (step 2's requests to it are sent to the first; it leaves the weight group); after
    step 2 it is started again on its port (an operator's restart), and the sync after step 3 takes it back with
    the full weights, digest-verified; step 4 generates on both, and its sync kills it again half-way (after the
    first server's load): the sync fails, the guard rebuilds the engine (trainer.engine_restarts=1) and the
    re-sync leaves the dead one out; step 5 generates on the first. Rank 0 reports its answers per server and
    step."""
    import signal

    from launch.sglang_server import SGLangServer

    env = os.environ
    urls, pids = env["RLPO_SGLANG_URLS"].split(","), [int(p) for p in env["RLPO_SGLANG_PIDS"].split(",")]
    answers, original_answer, original_load = {}, SGLangEngine._answer, SGLangEngine.load_weights
    restarted = []

    def load_weights(self, named_tensors, load_format=None):
        # step 4's sync: the restarted server is SIGKILLed half-way through (after the first server's load)
        if current["step"] == 3 and restarted and restarted[0].proc.poll() is None and len(self.live) == 2:
            os.killpg(restarted[0].proc.pid, signal.SIGKILL)
            restarted[0].proc.wait(30)
        return original_load(self, named_tensors, load_format)

    def answer(self, server, *args):
        step = answers.setdefault(str(current["step"] + 1), {})
        step[server.url] = step.get(server.url, 0) + 1
        return original_answer(self, server, *args)

    current = {"step": 0}

    def faults(trainer):
        current["step"] = trainer.step
        if trainer.rank != 0:
            return
        if trainer.step == 1:
            os.killpg(pids[1], signal.SIGKILL)
        if trainer.step == 2:
            port = int(urls[1].rsplit(":", 1)[1])
            server = SGLangServer(env["RLPO_SGLANG_HF"], port=port, server_args=json.loads(env["RLPO_SGLANG_SERVER_ARGS"]),
                                  python=env["RLPO_SGLANG_PYTHON"], log_dir=os.path.join(out, "sglang_logs"),
                                  env={"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": env["RLPO_SGLANG_PATH"]})
            restarted.append(server.start(240))

    SGLangEngine._answer, SGLangEngine.load_weights = answer, load_weights
    try:
        config = cfg(out, "ext", "algorithm.loss.name=gspo", "routing.mode=r3", "train_iters=5",
                     f"model.init_from_hf={env['RLPO_SGLANG_HF']}", "rollout.engine=sglang",
                     f"rollout.sglang.urls=[{','.join(urls)}]", "rollout.sglang.drivers=1",
                     "rollout.sglang.health_timeout=2", "trainer.engine_restarts=1")
        trainer = _run_with(config, faults)
    finally:
        SGLangEngine._answer, SGLangEngine.load_weights = original_answer, original_load
        for server in restarted:
            server.stop()
    return {"rc": 0, "stopped": trainer.stopped, "history": history(out, "ext"), "answers": answers}


def sglang_hang_sigterm(out):
    """After step 1 rank 0 freezes the server (SIGSTOP), then SIGTERMs itself 3 s into step 2's rollout."""
    import signal
    import threading
    import time

    save_dir = os.path.join(out, "ckpt")
    sent = {}

    def freeze(trainer):
        if trainer.step == 1 and trainer.rank == 0:
            os.killpg(trainer.engines.slot.engine.servers[0].launched.proc.pid, signal.SIGSTOP)

            def term():
                time.sleep(3)
                sent["t"] = time.monotonic()
                os.kill(os.getpid(), signal.SIGTERM)
            threading.Thread(target=term, daemon=True).start()

    original_save = Trainer.save

    def save(self, **kw):
        sent.setdefault("save", time.monotonic())
        sent["on_signal"] = kw.get("on_signal", False)
        return original_save(self, **kw)

    Trainer.save = save
    try:
        trainer = _run_with(_sglang_cfg(out, "hang", "train_iters=3", f"checkpoint.save_dir={save_dir}",
                                        "checkpoint.save_every=0", "rollout.sglang.hang_timeout=600",
                                        "rollout.sglang.request_timeout=600"), freeze)
    finally:
        Trainer.save = original_save
    done = time.monotonic()
    if "t" not in sent:  # the other ranks: rank 0 sent the signal and reports
        return {}
    return {"rc": 0, "stopped": trainer.stopped, "history": history(out, "hang"),
            "saved": sorted(n for n in os.listdir(save_dir) if n.startswith("step_")),
            "sigterm_to_save_s": sent["save"] - sent["t"], "sigterm_to_exit_s": done - sent["t"],
            "save_on_signal": sent["on_signal"]}


def sglang_colocate(out):
    """GSPO + R3 on a launched SGLang server, 3 steps, the weights by update_weights_from_tensor (in_process): apart,
    then colocated (rollout.colocate=true: the server on the learner's "GPUs"). The server samples with each
    request's seed (--enable-deterministic-inference; on CPU through tests/sglang_support's plugin) and without a
    prefix cache, so both runs sample alike from the same weights. Rank 0 (the driver) records every control call it
    makes to the server, in order; both runs report their metrics and every rank whether its final weights equal."""
    from rlpo_mega.model_setup import unwrap

    import rlpo_mega.rollout.engines as engines_module
    import rlpo_mega.training.trainer as trainer_module
    from rlpo_mega.residency import distinct_storages

    calls, post = [], SGLangEngine._post_ok
    # the learner's bytes on this rank's (emulated) device when its node's servers are launched: SGLang sizes its
    # KV pool from the memory free at that moment
    learner, at_launch = [], []
    residency, launch = trainer_module.learner_residency, engines_module.launch_node_servers

    def kept(*args):
        learner.append(residency(*args))
        return learner[-1]

    def launching(*args, **kwargs):
        at_launch[-1].append(sum(s.nbytes() for s in distinct_storages(learner[-1].keep())))
        return launch(*args, **kwargs)

    trainer_module.learner_residency, engines_module.launch_node_servers = kept, launching

    def recording(self, server, path, payload=None, timeout=None):
        if path not in ("/update_weight_version",):
            calls[-1].append(path + (f" {payload['tags']}" if "memory_occupation" in path else ""))
        return post(self, server, path, payload, timeout)

    SGLangEngine._post_ok = recording
    rep, weights = {}, {}
    # colocated_reshard: colocated, each server rank's own shard packed on its GPU (rollout.sync_transport=reshard)
    runs = {"apart": "in_process", "colocated": "in_process", "colocated_reshard": "reshard"}
    try:
        for run, transport in runs.items():
            calls.append([])
            at_launch.append([])
            trainer = _run_with(_sglang_cfg(out, run, "train_iters=3", f"rollout.sync_transport={transport}",
                                            "rollout.sglang.server_args.enable_deterministic_inference=true",
                                            "rollout.sglang.server_args.disable_radix_cache=true",
                                            f"rollout.colocate={str(run != 'apart').lower()}"), lambda t: None)
            weights[run] = [p.detach().clone() for p in unwrap(trainer.policy.chunks[0]).parameters()]
            rep[run] = history(out, run)
    finally:
        SGLangEngine._post_ok = post
        trainer_module.learner_residency, engines_module.launch_node_servers = residency, launch
    rep["calls"] = dict(zip(runs, calls))
    rep["learner_bytes_at_launch"] = dict(zip(runs, at_launch))
    for run in ("colocated", "colocated_reshard"):
        equal = [None] * dist.get_world_size()
        dist.all_gather_object(equal, all(torch.equal(a, b) for a, b in zip(weights["apart"], weights[run])))
        rep["weights_equal" if run == "colocated" else f"weights_equal_{run}"] = equal
    return rep


def sglang_async(out, *extra):
    """max_staleness=1 with partial rollout on a launched SGLang server (rank 0 drives it): every sync aborts the
    running requests (one abort per server) and continues them on the new weights. Each answer's weight version,
    as the server names it (POST /update_weight_version after each sync), must be the one the request was sent
    on (rollout/partial.tag raises otherwise); rank 0 reports its trained samples' per-token versions."""
    from rlpo_mega.rollout.producers.asynchronous import AsyncProducer

    original, seen = AsyncProducer.collect, []

    def collect(self, step, timer):
        groups = original(self, step, timer)
        seen.extend({"step": step, "versions": s.meta.versions, "routes": s.routes is not None,
                     "len": s.response_len} for s in groups.samples if s.prompt_ids is not None)
        return groups

    AsyncProducer.collect = collect
    try:
        rc = train(_sglang_cfg(out, "async", "train_iters=4", "rollout.producer=async", "trainer.max_staleness=1",
                               "rollout.partial_rollout=true", "rollout.max_new_tokens=64", *extra))
    finally:
        AsyncProducer.collect = original
    return {"rc": rc, "history": history(out, "async"), "samples": seen}


def sglang_async_keep(out):
    """sglang_async with rollout.partial_rollout_kv=keep: every sync holds the running requests in place on the
    server (POST /pause_generation mode=in_place), loads the weights under them and lets them go on; the server's
    weight_versions spans name each token's version (rollout/partial.tag, held)."""
    return sglang_async(out, "rollout.partial_rollout_kv=keep", "rollout.sglang.server_args.disable_radix_cache=true")


def sglang_lora_adapter(out):
    """rollout.lora_sync=adapter on a launched SGLang server: LoRA rank 4 on the attention (what SGLang's CPU build
    serves: its MoE LoRA kernels are triton's), TP2 + SP learners (q/k/v's B and the output projection's A gathered
    from their TP shards), one driver, the in_process sync (the adapter from tensors, sha256-checked inside the
    server). 3 steps; the server is SIGKILLed as step 1's adapter-only sync posts it the adapter: the sync fails, the
    guard's rebuild restarts the server from the checkpoint, and its re-sync sends the base again before the
    adapter. Then the disk transport, with a SIGTERM to the driver as step 1's adapter-only sync loads the adapter:
    the run stops and step 1 is saved. Every rank reports its syncs and the largest |B| of its adapters at the end;
    the KL reference is the base (the adapters off), so kl/ref says how far the adapters moved the policy."""
    import signal

    from moe.lora import adapters

    syncs, now, faults = [], {"step": 0}, {}
    original_sync, original_post = Trainer.sync, SGLangEngine._post_ok
    original_disk = SGLangEngine.load_adapter_from_disk

    def sync(self):
        now["step"] = self.step
        got = original_sync(self)
        if self.engines.slot.engine is not None:
            syncs.append(got)
        return got

    def post(self, server, path, *args, **kw):
        if path == "/load_lora_adapter_from_tensors" and now["step"] == 1 and "killed" not in faults:
            faults["killed"] = now["step"]  # the server dies as the adapter alone is sent to it
            server.launched.kill()
            server.launched.proc.wait(30)
        return original_post(self, server, path, *args, **kw)

    def load_from_disk(self, path):
        if now["step"] == 1 and "sigterm" not in faults:
            faults["sigterm"] = now["step"]  # SIGTERM as the adapter alone is loaded by the server
            os.kill(os.getpid(), signal.SIGTERM)
        return original_disk(self, path)

    lora = ("rollout.lora_sync=adapter", "parallel.expert=1", "parallel.tensor=2", "model.lora.rank=4",
            "model.lora.alpha=8", "model.lora.targets=[attention]", "optim.lr=0.01", "algorithm.kl.coef=0.01")
    disk_ckpt = os.path.join(out, "ad_disk_ckpt")
    Trainer.sync, SGLangEngine._post_ok, SGLangEngine.load_adapter_from_disk = sync, post, load_from_disk
    try:
        trainer = _run_with(_sglang_cfg(out, "ad", "train_iters=3", "trainer.engine_restarts=1",
                                        "rollout.sync_transport=in_process", *lora), lambda trainer: None)
        moved = max(float(m.lora.b.abs().max()) for chunk in trainer.policy.chunks for _, m in adapters(chunk))
        on_disk = len(syncs)
        # the disk transport: the base as an HF checkpoint, then each adapter as a PEFT directory the server loads
        disk = _run_with(_sglang_cfg(out, "ad_disk", "train_iters=2", "rollout.sync_transport=disk",
                                     f"rollout.sync_dir={os.path.join(out, 'sync')}", f"checkpoint.save_dir={disk_ckpt}",
                                     "checkpoint.save_every=0", *lora), lambda trainer: None)
    finally:
        Trainer.sync, SGLangEngine._post_ok, SGLangEngine.load_adapter_from_disk = (original_sync, original_post,
                                                                                    original_disk)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"syncs": syncs[:on_disk], "disk_syncs": syncs[on_disk:], "moved": moved,
                                   "faults": faults})
    return {"rc": 0, "history": history(out, "ad"), "disk_history": history(out, "ad_disk"), "ranks": every,
            "disk_dir": sorted(os.listdir(os.path.join(out, "sync-lora_adapter"))), "disk_stopped": disk.stopped,
            "disk_saved": sorted(n for n in os.listdir(disk_ckpt) if n.startswith("step_"))}


if __name__ == "__main__":
    scenario, out = sys.argv[1:3]
    result = globals()[scenario](out)
    if dist.is_initialized() and dist.get_rank() != 0:
        sys.exit(0)
    if int(os.environ.get("RANK", "0")) == 0:
        write_report(result)
