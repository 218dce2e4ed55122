"""The RL trainer: one SPMD loop on every rank (no Ray), from a RunConfig.

`Trainer.__init__` builds (checks, data, process groups, models, engines, the rollout producer, a resume);
`run` starts RL (the supervised warm-up, the KL reference and the critic from the policy, the first weight
sync) then loops `train_step`, evaluating and saving. One step, phase by phase, and where each lives:

  rollout/producers/  the rollout producer's scored groups (rollout.producer: sync.py generates them for this step;
                      asynchronous.py while earlier steps train, trainer.max_staleness); what a round is, single
                      answers or episodes, in tasks.py; dynamic sampling in rollout/dynamic_sampling.py
  advantages          shaping + the advantage estimator on every sample's scalars (rlpo_mega.algorithms.advantages)
  batches.py          plan and exchange: where each sample trains, the samples there, this rank's micro-batches
  old_logprobs.py     the old (and reference) log-probs, before any update
  critic.py           with a critic (advantage gae): old values, GAE, returns
  update.py           trainer.epochs x mini-batches of policy (then critic) optimizer steps: the one update path
  sync.py             the weights to the engine, digest-verified (merged, or LoRA's adapter alone)
  report.py           the step's metrics
(training/ unless named otherwise.)

A non-finite loss or gradient skips the optimizer step (stop after trainer.max_bad_steps in a row). A stop
(SIGTERM, SIGINT) in any phase ends with the last completed step saved and exit 75: during the rollout or an
evaluation the wait ends (engines.StopRequested); during old log-probs or the update the step completes, the stop
is agreed before the sync and the sync skipped (it may need servers that are stopping too); during a save, once
it is written. A failed engine (rollout or sync) is rebuilt and re-synced unless a stop is requested (engines.py).
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
import time
import uuid
from collections import Counter

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from moe.bridge.hf_checkpoint import HFCheckpointWriter, write_stream
from moe.bridge.megatron_io import ExportStream, weight_tensors
from moe.families import get_family
from moe.model import FAST_PATH_FIELDS, load_hf_config
from moe.routing.replay import RoutingReplay
from moe.routing.trace import TraceSpec
from moe.routing.transport import gather_recipients
from rlpo_mega import distributed, platform
from rlpo_mega.algorithms.advantages import CRITIC_ESTIMATORS, sequence_advantages
from rlpo_mega.checkpoint import run as ckpt_state
from rlpo_mega.checkpoint.dist import CheckpointError, base_record, check_base
from rlpo_mega.checkpoint.files import HF_FILES
from rlpo_mega.config import ConfigError, response_budget, to_dict, unknown_choice
from rlpo_mega.config_checks import check_run_config
from rlpo_mega.data import PromptSampler, load_prompts
from rlpo_mega.environments import environment_tools
from rlpo_mega.errors import EXIT_STOPPED
from rlpo_mega.logging import MetricsLogger, PhaseTimer
from rlpo_mega.logging.metrics import count_host_syncs
from rlpo_mega.model_setup import build_lr_scheduler, build_policy, lora_setting, optimizer_steps, unwrap
from rlpo_mega.rewards.scorer import RewardScorer
from rlpo_mega.rollout import ENGINES
from rlpo_mega.training import report
from rlpo_mega.training.batches import plan_and_exchange
from rlpo_mega.residency import learner_residency
from rlpo_mega.rollout.producers import PRODUCERS, Rollouts, sampling_params, share
from rlpo_mega.training.colocate import HandOver
from rlpo_mega.training.critic import Critic
from rlpo_mega.rollout.engines import Engines, StopRequested
from rlpo_mega.training.garbage import StepCollector
from rlpo_mega.training.old_logprobs import old_logprobs, old_pass_needed
from rlpo_mega.training.sync import sync_weights
from rlpo_mega.training.update import Policy, update_phase
from rlpo_mega.training.warmup import supervised_warmup

log = logging.getLogger("rlpo_mega")


def load_tokenizer(cfg):
    path = cfg.prompts.tokenizer or cfg.model.init_from_hf
    if not path:
        raise ConfigError("prompts.tokenizer is not set and model.init_from_hf has no tokenizer to borrow: "
                          "set prompts.tokenizer to a tokenizer directory (e.g. configs/tokenizers/tiny_char)")
    return AutoTokenizer.from_pretrained(path)


class Trainer:
    def __init__(self, cfg):
        """Builds everything a run needs, in the order that fails cheapest first; runs nothing (see `run`)."""
        self.cfg = cfg
        self.hf = load_hf_config(cfg.model.hf_config)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_run_config(cfg, self.hf, world_size=world, nodes=world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if cfg.rollout.producer not in PRODUCERS:  # registered by the package or a plugin (collect.py)
            raise ConfigError(unknown_choice("rollout.producer", cfg.rollout.producer, PRODUCERS.names()))
        producer = PRODUCERS.get(cfg.rollout.producer)
        # where the run starts and what in its save_dir is not its own: refused here, before anything is built
        self.identity = get_family(self.hf.model_type).identity(self.hf)
        self.plan = ckpt_state.plan_checkpoints(cfg.checkpoint, self.identity)
        if self.plan.start is not None:  # a LoRA checkpoint of other adapters or on another base: refused now
            check_lora_resume(self.plan.start, cfg.model, cfg.critic if cfg.algorithm.advantage.name == "gae"
                              else None)
        # model.lora.save: adapter-only checkpoints record the base they need (its path and fingerprint); and the
        # critic's (critic.lora.save) where its trunk comes from: critic.init_from_hf, or the LoRA policy's base
        self.base = base_record(cfg.model.init_from_hf) if cfg.model.adapters_only() else None
        self.critic_base = None
        if cfg.algorithm.advantage.name == "gae" and cfg.critic.adapters_only(cfg.model):
            self.critic_base = (base_record(cfg.critic.init_from_hf) if cfg.critic.init_from_hf
                                else {"from": "policy"})
        self._check_engine_ranks(world)
        # every data file is read and validated before a process group or a model exists (a bad record is one
        # DataError naming file and line, not a failure after minutes of set-up)
        self.tokenizer = load_tokenizer(cfg)
        self.tools = environment_tools(cfg.environment)  # rendered into every prompt (None: no tools)
        self.sampler = PromptSampler.from_config(cfg.prompts, self.tokenizer, cfg.seed, self.tools)
        longest, key = response_budget(cfg)  # with multi-turn episodes, the whole episode follows the prompt
        self.sampler.check_lengths(longest, getattr(self.hf, "max_position_embeddings", None),
                                   f"prompts.path={cfg.prompts.path}", key)
        self.records = {key: load_prompts(path, "auto", cfg.prompts.prompt_key, cfg.prompts.answer_key)
                        for key, path, used in (("warmup", cfg.trainer.warmup.path, cfg.trainer.warmup.steps > 0),
                                                ("eval", cfg.trainer.eval_path, cfg.trainer.eval_every > 0))
                        if used}
        self.layout = distributed.init(cfg.parallel, self.hf, cfg.seed)
        # one id per run, kept across resumes: pruning only ever deletes this run's checkpoints
        run_id = [self.plan.run_id or uuid.uuid4().hex]
        dist.broadcast_object_list(run_id, src=0)
        self.run_id, self.stale_steps = run_id[0], tuple(self.plan.stale)
        self.rank, self.device = dist.get_rank(), platform.device()
        self.spec = TraceSpec.from_hf(self.hf)
        chunks, optimizer = build_policy(self.hf, self.layout, cfg.model, cfg.optim, routing_replay=True, seed=cfg.seed)
        why = old_pass_needed(cfg, self.hf)
        # the KL reference is the policy as RL starts (after any warm-up); a resumed run loads the one its
        # checkpoint saved, as the policy has moved since. With LoRA it is the frozen base: the adapters off.
        lora = bool(cfg.model.lora.rank)
        self.policy = Policy(chunks, optimizer, build_lr_scheduler(optimizer, cfg.optim, optimizer_steps(cfg)),
                             RoutingReplay(chunks, self.spec, mode=cfg.routing.mode),
                             ref_chunks=self._build_reference() if cfg.algorithm.kl.coef > 0 and not lora else None,
                             old_from_update=why is None, ref_is_base=lora)
        # every rank's DP rank and MoE layers: where each sample's payload goes (training/exchange.py)
        self.recipients = gather_recipients(chunks, self.spec)
        self.critic = None
        if cfg.algorithm.advantage.name in CRITIC_ESTIMATORS:  # PPO with a value model (training/critic.py)
            self.critic = Critic(cfg, self.hf, self.layout, self.spec)
        self.scorer = RewardScorer(cfg.reward)
        if self.rank == 0:
            inner = unwrap(chunks[0])
            fast = {f: getattr(inner.config, f) for f in FAST_PATH_FIELDS}
            log.info("fast path: %s; overlap_grad_reduce=%s", ", ".join(f"{k}={v}" for k, v in fast.items()),
                     getattr(getattr(chunks[0], "ddp_config", None), "overlap_grad_reduce", None))
            log.info("old log-probs: %s", "the update's own forward (one optimizer step per rollout batch)"
                     if why is None else f"a separate pass ({why})")
        self.step, self.bad_steps, self.warmup_done, self.stopped, self.started = 0, 0, False, False, False
        self.stopping = False  # a stop agreed by all ranks before this step's sync (which it skipped)
        self.critic_loaded, self.resumed_rank_state = False, {}
        self.critic_trunk_saved = False  # the critic's trunk came with the checkpoint (not an adapter-only one)
        self.reference_loaded = self._resume()
        self.logger = MetricsLogger(cfg.logging, to_dict(cfg), self.rank, dist.get_world_size(), cfg.train_iters)
        self.stop = ckpt_state.StopSignal()
        self.collector = StepCollector(cfg.trainer.gc, cfg.trainer.gc_full_every)
        control = distributed.control_group(cfg.rollout.wait_timeout)
        # rollout.colocate: the engine shares the learner's accelerators, the memory handed over each step; servers
        # the run launches start with the learner off the GPUs (before_launch), which returns in start()
        self.handover = HandOver(cfg.rollout.colocate, learner_residency(self.policy, self.critic), control)
        self.engines = Engines(cfg, self.hf, self.sync, should_stop=lambda: self.stop.received is not None,
                               group=control, before_launch=self.handover.before_launch)
        self.handover.attach(self.engines.slot, self.engines.guard)
        self.rollouts = Rollouts(cfg, self.engines, self.scorer, self.tokenizer, self.spec)
        self.producer = producer(cfg, self.sampler, self.rollouts, self._divisor())
        if self.resumed_rank_state.get("producer"):  # this rank's carried groups and unsent prompts
            self.producer.load_state_dict(self.resumed_rank_state["producer"])

    def start(self) -> bool:
        """The run's phases before RL (once): the supervised warm-up (unless the checkpoint is past it), the KL
        reference and the critic from the policy as RL starts, the first weight sync. False when a signal
        stopped the warm-up (within one warm-up step)."""
        if self.started:
            return True
        c, p = self.cfg, self.policy
        self.handover.learner_in()  # launched colocated servers released first: the warm-up trains beside none
        if not self.warmup_done and c.trainer.warmup.steps > 0:
            if supervised_warmup(c, p.chunks, p.optimizer, self.tokenizer, self.records.get("warmup"),
                                 self.layout.tensor, self.stop, self.rank) is None:
                self.stopped = True
                return False
            self.warmup_done = True
        if p.ref_chunks is not None and not self.reference_loaded:
            self._copy_policy_to_reference()
        if self.critic is not None and not self.critic_trunk_saved and not c.critic.init_from_hf:
            # the policy as RL starts (after any warm-up); at the resume of an adapter-only critic, the LoRA policy's
            # frozen base again, the critic's loaded adapters, head and optimizer state untouched
            self.critic.copy_trunk_from(p.chunks, reload_optimizer=not self.critic_loaded)
        with self.producer.paused(version=self.step):  # the policy version the engine holds: the step
            self.engines.guard.run(self.sync)
        self.started = True
        return True

    def sync(self) -> dict:
        """Learner -> engine(s) (training/sync.py); also the engine guard's re-sync after a rebuild."""
        with self.handover.weights_out():
            return sync_weights(self.policy.chunks, self.cfg, self.engines.slot)

    def _divisor(self) -> int:
        """Rows a rollout batch must be a multiple of: padded splits each rank's rows evenly into micro-batches;
        packed needs only equal mini-batches (each rank's micro-batch count follows from its samples)."""
        per_rank = self.cfg.parallel.num_micro_batches if self.cfg.trainer.layout == "padded" else 1
        return self.cfg.trainer.mini_batches * self.layout.data * per_rank

    # --- one RL step ---------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One RL step: the phases in order, each in the module named after it (the module docstring lists them)."""
        c, p, timer, t0 = self.cfg, self.policy, PhaseTimer(cuda_sync=torch.cuda.is_available()), time.perf_counter()
        syncs = c.logging.host_syncs and torch.cuda.is_available()
        sites = {"old_logprob": Counter(), "update": Counter()}  # where they happen: host_syncs.jsonl
        # 1. collect: the rollout producer's scored groups (every sample's scalars here, payloads on their owner)
        with self.handover.generation():  # rollout.colocate: the learner's state off the accelerator meanwhile
            groups = self.producer.collect(self.step, timer)
        metrics = {**groups.metrics, **report.rollout_metrics(groups.samples)}
        if not groups.samples:
            log.warning("step %d: no group to train on (dynamic sampling kept none, or all were older than "
                        "trainer.max_staleness allows); no update", self.step)
            self.step += 1
            return {**metrics, "train/skipped_step": 1}
        with timer("prepare"):
            # 2. advantages from the scalars, identical on every rank; 3. plan and exchange -> this rank's batches
            adv, keep, stats = sequence_advantages(c.algorithm, *groups.advantage_inputs())
            minis, plan_stats = plan_and_exchange(groups.samples, adv, keep, c, self.layout.data, self.layout.tensor,
                                                  self.recipients, self.spec, self.tokenizer.pad_token_id or 0, timer)
        metrics.update(report.advantage_metrics({**stats, **plan_stats}, adv, self.critic is not None))
        # 4. old (and reference) log-probs, before any update
        with timer("old_logprob"), count_host_syncs(metrics, "old_logprob", syncs, sites["old_logprob"]):
            prepared, mismatch = old_logprobs(p, minis, c)
        metrics.update(mismatch)
        # 5. with a critic: old values, GAE (the sequence rewards become token advantages), returns
        critic_batches = None
        if self.critic is not None:
            with timer("values"):
                critic_batches, critic_stats = self.critic.prepare(prepared)
            metrics.update(critic_stats)
        # 6. update: epochs x mini-batches of policy (then critic) optimizer steps
        with timer("update"), count_host_syncs(metrics, "update", syncs, sites["update"]):
            outs, critic_outs = update_phase(p, prepared, c, critic=self.critic, critic_batches=critic_batches,
                                             policy_moves=self.critic is None or self.step >= c.critic.warmup_steps)
        skipped = int(sum(o["skipped"] for o in outs + critic_outs))
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        # 7. sync: the new weights to the engine, unless a stop is agreed first (on the control group: a stop must
        # not depend on the servers, which a pre-emption may be stopping too); the step is complete either way, and
        # a resume's first sync sends the saved weights
        self.step += 1
        self.stopping = self.engines.stop_agreed()
        if not self.stopping:
            try:
                with timer("sync"), self.producer.paused(version=self.step):  # generation ahead pauses, resumes after
                    self.engines.guard.run(self.sync)  # a failed sync is rebuilt and retried as a failed rollout
            except StopRequested:  # agreed while the sync failed (servers stopping with the job): the step stands
                self.stopping = True
        # 8. report
        metrics.update(report.update_metrics(outs, self.critic.metrics(critic_outs) if critic_batches is not None
                                             else {}, skipped, self.bad_steps, p.old_from_update,
                                             float(p.optimizer.param_groups[0]["lr"])))
        metrics.update(report.throughput_metrics(groups.samples, c.trainer.epochs, time.perf_counter() - t0, timer))
        metrics["engine/restarts"] = self.engines.guard.restarts
        metrics.update(self.handover.metrics())
        metrics.update(self.engines.fault_metrics())
        if syncs:
            self.logger.log_sync_sites(self.step, sites)
        return metrics

    def evaluate(self) -> dict:
        c = self.cfg
        records = self.records["eval"]
        items = PromptSampler(records[:c.trainer.eval_size], self.tokenizer, shuffle=False,
                              chat_template=c.prompts.chat_template, system_prompt=c.prompts.system_prompt,
                              tools=self.tools).next_prompts(min(len(records), c.trainer.eval_size))
        with self.producer.paused(), self.handover.generation():  # async generation ahead waits for it
            scored = self.rollouts(items, 1, sampling_params(c, self.tokenizer, seed=c.seed, greedy=True),
                                   PhaseTimer())
        return {"eval/reward_mean": sum(s.reward for s in scored) / len(scored),
                "eval/accuracy": sum(s.correct for s in scored) / len(scored)}

    # --- set-up --------------------------------------------------------------------------------------
    def _resume(self) -> bool:
        """Load the checkpoint to start from, if any; True when it also restored the KL reference."""
        c = self.cfg.checkpoint
        path = self.plan.start
        if path is None:
            return False
        critic = (self.critic.chunks, self.critic.optimizer if c.load_optimizer else None) if self.critic else None
        p = self.policy
        st = ckpt_state.load(path, p.chunks, p.optimizer, c.load_optimizer, reference=p.ref_chunks,
                             verify=c.verify, critic=critic)
        self.step, self.bad_steps = int(st["step"]), int(st["bad_steps"])
        self.warmup_done = bool(st["warmup_done"])
        self.sampler.load_state_dict(st["sampler"])
        self.resumed_rank_state = st["rank_state"]
        p.lr_schedule.num_steps = int(st.get("lr_steps", 0))  # checkpoints before the schedule: from 0
        p.lr_schedule.step(0)
        self.critic_loaded = st["critic_loaded"]
        self.critic_trunk_saved = st["critic_trunk_saved"]
        if self.critic is not None and st["critic_loaded"]:
            self.critic.lr_schedule.num_steps = int(st.get("critic_lr_steps", 0))
            self.critic.lr_schedule.step(0)
        if self.rank == 0:
            log.info("resumed from %s at step %d", path, self.step)
            if self.critic is not None and not st["critic_loaded"]:
                log.warning("%s holds no critic (saved by a run without algorithm.advantage.name=gae): the critic "
                            "starts from %s", path, self.cfg.critic.init_from_hf or self.cfg.model.init_from_hf
                            or "its initialisation")
            saved = ckpt_state.read_meta(path).get("settings") or {}
            for key, now in self._settings().items():
                if key in saved and saved[key] != now:
                    log.warning("resuming with %s=%s; the run that saved %s used %s", key, now, path, saved[key])
            if p.ref_chunks is not None and not st["reference_loaded"]:
                log.warning("%s holds no KL reference (saved with algorithm.kl.coef=0 or by an older version): "
                            "the reference is the policy as loaded", path)
        return st["reference_loaded"]

    def _check_engine_ranks(self, world: int):
        """A checkpoint's per-rank rollout state (groups carried by dynamic sampling, the async producer's planned
        prompts) belongs to the ranks that drove the engine when it was saved: a resume that moves them (another
        rollout.sglang.drivers, engine or world size) is refused here, before anything is built or loaded. Without
        such state a resume may change them (every rank's prompt cursor is the same)."""
        start, c = self.plan.start, self.cfg
        if start is None or not os.path.isdir(os.path.join(start, os.path.dirname(ckpt_state.rank_state_file(0)))):
            return
        saved = (ckpt_state.read_meta(start).get("settings") or {}).get("engine_ranks")
        now = ENGINES.get(c.rollout.engine).ranks(c, world)
        if saved is not None and list(saved) != now:
            raise ConfigError(
                f"{start} holds rollout state of engine ranks {saved} (carried groups or planned prompts) but this run "
                f"drives the engine from ranks {now} (rollout.engine={c.rollout.engine}, rollout.sglang.drivers="
                f"{c.rollout.sglang.drivers}, world size {world}): resume with the settings that saved it, or start "
                "from its weights in a new run (checkpoint.load_dir and a new checkpoint.save_dir)")

    def _settings(self) -> dict:
        """The run's key settings, recorded in each checkpoint; a resume that changes one is told so."""
        c = self.cfg
        return {"algorithm.loss.name": c.algorithm.loss.name, "algorithm.advantage.name": c.algorithm.advantage.name,
                "routing.mode": c.routing.mode,
                "algorithm.kl.coef": c.algorithm.kl.coef, "model.params_dtype": c.model.params_dtype,
                "rollout.engine": c.rollout.engine, "world_size": dist.get_world_size(),
                "engine_ranks": ENGINES.get(c.rollout.engine).ranks(c, dist.get_world_size()),
                "model.lora": lora_setting(c.model.lora), "critic.lora": lora_setting(c.critic.lora)}

    def _build_reference(self):
        """A frozen model of the policy's layout for the KL reference (filled by a checkpoint or a copy)."""
        ref, _ = build_policy(self.hf, self.layout, self.cfg.model, None, with_ddp=False)
        ref[0].requires_grad_(False)
        return ref

    def _copy_policy_to_reference(self):
        with torch.no_grad():
            for (n, p), (n2, q) in zip(weight_tensors(unwrap(self.policy.chunks[0])),
                                       weight_tensors(self.policy.ref_chunks[0])):
                assert n == n2, (n, n2)
                q.copy_(p)

    def save(self, on_signal: bool = False):
        """on_signal: the save on SIGTERM, inside the pre-emption window (launch/slurm's --signal lead): the same save,
        every file's checksum taken as it is written (nothing read back), without the optional HF export."""
        c = self.cfg.checkpoint
        producer = self.producer.state_dict()  # this rank's carried groups and unsent prompts (often none)
        state = {"step": self.step, "bad_steps": self.bad_steps, "warmup_done": self.warmup_done,
                 "sampler": self.sampler.state_dict(), "lr_steps": self.policy.lr_schedule.num_steps}
        if self.critic is not None:
            state["critic_lr_steps"] = self.critic.lr_schedule.num_steps
        path = ckpt_state.save(c.save_dir, self.step, self.policy.chunks, self.policy.optimizer, state, c.keep_last,
                               meta={"model_type": self.hf.model_type, "model": self.identity,
                                     "run_id": self.run_id, "settings": self._settings(),
                                     **({"base": self.base} if self.base else {}),
                                     **({"critic_base": self.critic_base} if self.critic_base else {})},
                               adapters_only=self.base is not None, critic_adapters_only=self.critic_base is not None,
                               hf_files=self._hf_files(), reference=self.policy.ref_chunks, stale=self.stale_steps,
                               critic=(self.critic.chunks, self.critic.optimizer) if self.critic else None,
                               rank_state={"producer": producer} if producer else None)
        self.stale_steps = ()  # replaced (checkpoint.overwrite) once this run has a checkpoint of its own
        if c.export_hf and not on_signal:  # the HF copy is a convenience: `rlpo-mega export` makes it later
            stream = ExportStream(self.policy.chunks, bucket_bytes=self.cfg.rollout.sync_bucket_mb << 20, dst=0,
                                  vocab_divisible_by=self.cfg.model.vocab_divisible_by)

            write_stream(stream, HFCheckpointWriter(os.path.join(path, "hf_model"), self.hf,
                                                    source_dir=os.path.join(path, HF_FILES))
                         if stream.receives else None)
        if self.rank == 0:
            log.info("saved checkpoint %s", path)
        return path

    def _hf_files(self) -> dict[str, bytes]:
        """config.json and the tokenizer's files, stored with every checkpoint (rank 0)."""
        if self.rank != 0:
            return {}
        with tempfile.TemporaryDirectory() as tmp:
            self.tokenizer.save_pretrained(tmp)
            out = {}
            for name in os.listdir(tmp):
                with open(os.path.join(tmp, name), "rb") as f:
                    out[name] = f.read()
        out["config.json"] = self.hf.to_json_string().encode()
        return out

    def run(self) -> list[dict]:
        with self.collector:  # trainer.gc: no automatic collection while the run lasts, one after each step
            return self._run()

    def _run(self) -> list[dict]:
        c, history = self.cfg, []
        if not self.start():  # SIGTERM during the warm-up
            return history
        bar = self.logger.progress(total=c.train_iters, initial=self.step, desc="RL steps")
        if c.trainer.eval_every and self.step == 0:  # the starting point of the eval curve
            history.append(self.evaluate())
            self.logger.log(0, history[-1])
        try:
            while self.step < c.train_iters:
                try:
                    metrics = self.train_step()
                    if c.trainer.eval_every and self.step % c.trainer.eval_every == 0 and not self.stopping:
                        metrics.update(self.evaluate())
                    metrics["time/gc"] = self.collector.step(self.step)
                except StopRequested:  # agreed while ranks waited for the engine: the last completed step is saved
                    if c.checkpoint.save_dir and not os.path.isdir(ckpt_state.step_dir(c.checkpoint.save_dir,
                                                                                       self.step)):
                        self.save(on_signal=True)
                    if self.rank == 0:
                        log.warning("stopped by signal while waiting for the engine (step %d's rollout, an evaluation "
                                    "or a weight sync); saved step %d", self.step + 1, self.step)
                    self.stopped = True
                    return history
                self.logger.log(self.step, metrics)
                history.append(metrics)
                if bar is not None:
                    bar.update(1)
                if self.bad_steps >= c.trainer.max_bad_steps:
                    raise FloatingPointError(
                        f"{self.bad_steps} steps in a row had a non-finite loss or gradient (trainer.max_bad_steps="
                        f"{c.trainer.max_bad_steps}); stopping. Lower optim.lr or check the rewards; the last "
                        "checkpoint is intact")
                stopping = self.stopping or self.stop.any_rank(self.device)
                if c.checkpoint.save_dir and (stopping or (c.checkpoint.save_every
                                                           and self.step % c.checkpoint.save_every == 0)):
                    self.save(on_signal=stopping)
                    # a stop that arrived during this save: the step is saved, exit now rather than after another
                    stopping = stopping or self.stop.any_rank(self.device)
                if stopping:
                    if self.rank == 0:
                        log.warning("stopped by signal after step %d%s", self.step,
                                    " (its weight sync skipped)" if self.stopping else "")
                    self.stopped = True
                    return history
            if c.checkpoint.save_dir and not (c.checkpoint.save_every and self.step % c.checkpoint.save_every == 0):
                if not os.path.isdir(ckpt_state.step_dir(c.checkpoint.save_dir, self.step)):
                    self.save()
        finally:
            if bar is not None:
                bar.close()
        return history

    def close(self, ok: bool = True):
        self.stop.restore()
        self.logger.close(exit_code=0 if ok else 1)
        self.producer.close()  # first: its generation thread may be scoring
        self.scorer.close()
        self.engines.close()
        self.policy.routing.close()
        if self.critic is not None:
            self.critic.close()


def check_lora_resume(path: str, model_cfg, critic_cfg=None):
    """The adapters are part of the model: a checkpoint saved with other ones (or none) would load partly, silently;
    an adapter-only one onto another base would load fully and be wrong. Refused in one line before anything is
    loaded."""
    meta = ckpt_state.read_meta(path)
    saved = (meta.get("settings") or {}).get("model.lora")
    now = lora_setting(model_cfg.lora)
    if saved != now:
        raise CheckpointError(f"{path} was saved with model.lora {saved or 'off'}, this run has {now or 'off'}: resume "
                              "with the same model.lora, or start from an HF model (model.init_from_hf; `rlpo-mega "
                              "export` of a LoRA checkpoint merges its adapters)")
    check_base(path, meta, model_cfg.init_from_hf)
    if critic_cfg is not None and meta.get("has_critic") and "critic.lora" in (meta.get("settings") or {}):
        saved, now = meta["settings"]["critic.lora"], lora_setting(critic_cfg.lora)
        if saved != now:
            raise CheckpointError(f"{path} holds a critic saved with critic.lora {saved or 'off'}, this run has "
                                  f"{now or 'off'}: resume with the same critic.lora")
    trunk = meta.get("critic_base") or {}
    if critic_cfg is not None and meta.get("critic_adapters_only"):
        if trunk.get("from") == "policy":
            if critic_cfg.init_from_hf:
                raise CheckpointError(f"{path} holds a critic's adapters whose trunk is the LoRA policy's base, and "
                                      f"critic.init_from_hf={critic_cfg.init_from_hf} would give it another: unset "
                                      "critic.init_from_hf")
        else:
            check_base(path, {"adapters_only": True, "base": trunk}, critic_cfg.init_from_hf, "critic.init_from_hf")


def train(cfg, keep_world: bool = False) -> int:
    """`rlpo-mega train`: build, (resume,) run, close. Returns the process exit code. keep_world: leave
    the world process group up for another run in this process (tests)."""
    trainer = Trainer(cfg)
    ok = False
    try:
        history = trainer.run()
        ok = True
        if trainer.rank == 0 and history:
            summarize(history, trainer.logger.run_dir, cfg.logging.plot)
    finally:
        trainer.close(ok)
        distributed.destroy(keep_world, barrier=ok)
    return EXIT_STOPPED if trainer.stopped else 0


def summarize(history: list[dict], run_dir: str, with_plot: bool = True):
    """The end of a run on the console: reward (and eval accuracy) at the start and the end, the plot."""
    def span(key, k=5):
        vals = [h[key] for h in history if key in h and math.isfinite(h[key])]
        if not vals:
            return None
        return sum(vals[:k]) / len(vals[:k]), sum(vals[-k:]) / len(vals[-k:]), len(vals)

    lines = []
    for key, what in (("reward/mean", "reward (mean of the first/last 5 steps)"),
                      ("eval/accuracy", "eval accuracy (first/last evaluation)")):
        got = span(key, 5 if key == "reward/mean" else 1)
        if got:
            lines.append(f"{what}: {got[0]:.3f} -> {got[1]:.3f} over {got[2]} values")
    if with_plot:
        from rlpo_mega.logging.plot import plot  # matplotlib: only at the end of a run that plots

        lines.append(f"learning curves: {plot(run_dir)}")
    print("\n".join(["", *lines]), flush=True)
