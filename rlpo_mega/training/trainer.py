"""The RL trainer: one SPMD loop on every rank (no Ray), from a RunConfig.

One step: draw prompts -> rollout (engine ranks, their share) -> rewards -> dynamic sampling ->
shaping + advantages (assemble_batch) -> per mini-batch: routes to this rank, old (and reference)
log-probs -> with a critic (advantage gae, training/critic.py): old values, GAE, returns -> `epochs` passes of
optimizer steps over the mini-batches (megatron schedule, global normalisation; the critic steps after the
policy on each mini-batch, alone during critic.warmup_steps) -> weight sync to the engine (digest-verified) -> metrics -> eval / checkpoint.
A non-finite loss or gradient skips the optimizer step (stop after trainer.max_bad_steps in a row);
SIGTERM saves at the end of the step and exits; a failed engine is rebuilt and re-synced.
"""
from __future__ import annotations

import logging
import math
import os
import time
import uuid

import torch
import torch.distributed as dist

from moe.families import get_family
from moe.model import load_hf_config
from moe.routing.trace import TraceSpec
from rlpo_mega import distributed, platform
from rlpo_mega.config import ConfigError, to_dict
from rlpo_mega.training import rollout_phase as rp
from rlpo_mega.checkpoint import run as ckpt_state
from rlpo_mega.checkpoint.files import HF_FILES
from rlpo_mega.training.step_report import mean_dicts as _mean_dicts
from rlpo_mega.training.step_report import policy_metrics as _policy_metrics
from rlpo_mega.training.step_report import rollout_metrics as _rollout_metrics

log = logging.getLogger("rlpo_mega")

def load_tokenizer(cfg):
    from transformers import AutoTokenizer

    path = cfg.prompts.tokenizer or cfg.model.init_from_hf
    if not path:
        raise ConfigError("prompts.tokenizer is not set and model.init_from_hf has no tokenizer to borrow: "
                          "set prompts.tokenizer to a tokenizer directory (e.g. configs/tokenizers/tiny_char)")
    return AutoTokenizer.from_pretrained(path)


class Trainer:
    def __init__(self, cfg):
        from rlpo_mega.config_checks import check_run_config
        from rlpo_mega.data import PromptSampler, load_prompts
        from rlpo_mega.logging import MetricsLogger
        from rlpo_mega.rewards.scorer import RewardScorer
        from rlpo_mega.model_setup import build_lr_scheduler, build_policy, optimizer_steps

        self.cfg = cfg
        self.hf = load_hf_config(cfg.model.hf_config)
        check_run_config(cfg, self.hf, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        # where the run starts and what in its save_dir is not its own: refused here, before anything is built
        self.identity = get_family(self.hf.model_type).identity(self.hf)
        self.plan = ckpt_state.plan_checkpoints(cfg.checkpoint, self.identity)
        # every data file is read and validated before a process group or a model exists (a bad record is one
        # DataError naming file and line, not a failure after minutes of set-up)
        self.tokenizer = load_tokenizer(cfg)
        self.sampler = PromptSampler.from_config(cfg.prompts, self.tokenizer, cfg.seed)
        self.sampler.check_lengths(cfg.rollout.max_new_tokens, getattr(self.hf, "max_position_embeddings", None),
                                   f"prompts.path={cfg.prompts.path}")
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
        self.chunks, self.optimizer = build_policy(self.hf, self.layout, cfg.model, cfg.optim, routing_replay=True)
        self.lr_schedule = build_lr_scheduler(self.optimizer, cfg.optim, optimizer_steps(cfg))
        from moe.routing.replay import RoutingReplay

        self.routing = RoutingReplay(self.chunks, self.spec, mode=cfg.routing.mode)
        from moe.routing.transport import gather_recipients

        # every rank's DP rank and MoE layers: where each sample's payload goes (training/exchange.py)
        self.recipients = gather_recipients(self.chunks, self.spec)
        from rlpo_mega.algorithms.advantages import CRITIC_ESTIMATORS

        self.critic = None
        if cfg.algorithm.advantage.name in CRITIC_ESTIMATORS:  # PPO with a value model (training/critic.py)
            from rlpo_mega.training.critic import Critic

            self.critic = Critic(cfg, self.hf, self.layout, self.spec)
        self.scorer = RewardScorer(cfg.reward)
        from rlpo_mega.training.policy_step import old_pass_needed

        why = old_pass_needed(cfg, self.hf)
        self.old_from_update = why is None
        if self.rank == 0:
            from moe.model import FAST_PATH_FIELDS

            inner = self.chunks[0].module if hasattr(self.chunks[0], "module") else self.chunks[0]
            fast = {f: getattr(inner.config, f) for f in FAST_PATH_FIELDS}
            log.info("fast path: %s; overlap_grad_reduce=%s", ", ".join(f"{k}={v}" for k, v in fast.items()),
                     getattr(getattr(self.chunks[0], "ddp_config", None), "overlap_grad_reduce", None))
            log.info("old log-probs: %s", "the update's own forward (one optimizer step per rollout batch)"
                     if why is None else f"a separate pass ({why})")
        self.step, self.bad_steps, self.warmup_done, self.stopped = 0, 0, False, False
        # The KL reference is the policy as RL starts (after any warm-up); a resumed run loads the one its
        # checkpoint saved, as the policy has moved since.
        self.ref_chunks = self._build_reference() if cfg.algorithm.kl.coef > 0 else None
        self.critic_loaded = False
        reference_loaded = self._resume()
        self.logger = MetricsLogger(cfg.logging, to_dict(cfg), self.rank, dist.get_world_size(), cfg.train_iters)
        self.ranks = rp.engine_ranks(cfg)
        self.stop = ckpt_state.StopSignal()
        control = distributed.control_group(cfg.rollout.wait_timeout)
        self.slot = rp.EngineSlot(cfg, self.hf, should_stop=lambda: self.stop.received is not None, group=control)
        self.guard = rp.EngineGuard(self.slot, self.sync, cfg.trainer.engine_restarts, control)
        if not self.warmup_done and cfg.trainer.warmup.steps > 0:
            from rlpo_mega.training.warmup import supervised_warmup

            if supervised_warmup(self) is None:  # SIGTERM during the warm-up: stopped within one warm-up step
                self.stopped = True
                return
            self.warmup_done = True
        if self.ref_chunks is not None and not reference_loaded:
            self._copy_policy_to_reference()
        if self.critic is not None and not self.critic_loaded and not self.cfg.critic.init_from_hf:
            self.critic.copy_trunk_from(self.chunks)  # the policy as RL starts (after any warm-up)
        self.sync()

    # --- set-up --------------------------------------------------------------------------------------
    def _resume(self) -> bool:
        """Load the checkpoint to start from, if any; True when it also restored the KL reference."""
        c = self.cfg.checkpoint
        path = self.plan.start
        if path is None:
            return False
        critic = (self.critic.chunks, self.critic.optimizer if c.load_optimizer else None) if self.critic else None
        st = ckpt_state.load(path, self.chunks, self.optimizer, c.load_optimizer, reference=self.ref_chunks,
                             verify=c.verify, critic=critic)
        self.step, self.bad_steps = int(st["step"]), int(st["bad_steps"])
        self.warmup_done = bool(st["warmup_done"])
        self.sampler.load_state_dict(st["sampler"])
        self.lr_schedule.num_steps = int(st.get("lr_steps", 0))  # checkpoints before the schedule: from 0
        self.lr_schedule.step(0)
        self.critic_loaded = st["critic_loaded"]
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
            if self.ref_chunks is not None and not st["reference_loaded"]:
                log.warning("%s holds no KL reference (saved with algorithm.kl.coef=0 or by an older version): "
                            "the reference is the policy as loaded", path)
        return st["reference_loaded"]

    def _settings(self) -> dict:
        """The run's key settings, recorded in each checkpoint; a resume that changes one is told so."""
        c = self.cfg
        return {"algorithm.loss.name": c.algorithm.loss.name, "algorithm.advantage.name": c.algorithm.advantage.name,
                "routing.mode": c.routing.mode,
                "algorithm.kl.coef": c.algorithm.kl.coef, "model.params_dtype": c.model.params_dtype,
                "rollout.engine": c.rollout.engine, "world_size": dist.get_world_size()}

    def _build_reference(self):
        """A frozen model of the policy's layout for the KL reference (filled by a checkpoint or a copy)."""
        from rlpo_mega.model_setup import build_policy

        ref, _ = build_policy(self.hf, self.layout, self.cfg.model, None, with_ddp=False)
        ref[0].requires_grad_(False)
        return ref

    def _copy_policy_to_reference(self):
        from moe.bridge.megatron_io import weight_tensors
        from rlpo_mega.model_setup import unwrap

        with torch.no_grad():
            for (n, p), (n2, q) in zip(weight_tensors(unwrap(self.chunks[0])), weight_tensors(self.ref_chunks[0])):
                assert n == n2, (n, n2)
                q.copy_(p)

    def sync(self) -> dict:
        """Learner -> engine(s): the export stream through the configured transport, digest-verified."""
        from moe.bridge.megatron_io import ExportStream

        from rlpo_mega.model_setup import PARAMS_DTYPES

        dst = None if self.cfg.rollout.engine != "sglang" else 0
        # every tensor in the engine's dtype (= model.params_dtype): megatron's local spec keeps some
        # parameters (torch norms) in fp32 under bf16, and the engine holds the checkpoint dtype
        stream = ExportStream(self.chunks, bucket_bytes=self.cfg.rollout.sync_bucket_mb << 20, dst=dst,
                              vocab_divisible_by=self.cfg.model.vocab_divisible_by,
                              dtype=PARAMS_DTYPES[self.cfg.model.params_dtype])
        if not stream.receives:  # ranks without an engine take part in the collective export only
            for _ in stream:
                pass
            return {}
        return self.slot.transport.sync(stream)

    # --- one RL step ---------------------------------------------------------------------------------
    def _rollout(self, items, timer, call: int):
        params = rp.sampling_params(self.cfg, self.tokenizer, rp.mix_seed(self.cfg.seed, self.step, call, self.rank))
        mine = rp.share(items, self.ranks)
        n = self.cfg.prompts.n_samples
        local = self.guard.run(lambda: rp.generate_local(
            self.slot.engine, mine, n, params, self.scorer, self.tokenizer, timer))
        with timer("gather"):
            samples = self._scalars(local)
        return torch.tensor([s.reward for s in samples]), samples

    def _scalars(self, local):
        from rlpo_mega.training.exchange import gather_scalars

        return gather_scalars(local, self.spec, self.cfg.routing.on_bad_trace, self.guard.group)

    def _collect(self, timer):
        from rlpo_mega.data.sampling import collect_groups

        p, ds = self.cfg.prompts, self.cfg.algorithm.dynamic_sampling
        calls = iter(range(1 << 30))
        return collect_groups(self.sampler, lambda items: self._rollout(items, timer, next(calls)),
                              p.prompts_per_step, p.n_samples, enabled=ds.enabled, max_tries=ds.max_tries,
                              oversample=p.oversample)

    def _divisor(self) -> int:
        """Rows a rollout batch must be a multiple of: padded splits each rank's rows evenly into micro-batches;
        packed needs only equal mini-batches (each rank's micro-batch count follows from its samples)."""
        per_rank = self.cfg.parallel.num_micro_batches if self.cfg.trainer.layout == "padded" else 1
        return self.cfg.trainer.mini_batches * self.layout.data * per_rank

    def _prepare(self, samples, group_ids, timer):
        from rlpo_mega.training.batches import prepare_step

        return prepare_step(samples, group_ids, self.cfg, self.layout.data, self.layout.tensor, self.recipients,
                            self.spec, self.tokenizer.pad_token_id or 0, timer)

    def _old_logprobs(self, minis):
        from rlpo_mega.algorithms.mismatch import mismatch_metrics
        from rlpo_mega.training.policy_step import attach_old_logprobs
        from rlpo_mega.training.step import reduce_report, to_device

        prepared, reports = [], []
        for mini in minis:
            micro = attach_old_logprobs(self.chunks, [to_device(mb) for mb in mini], self.cfg.algorithm,
                                        ref_chunks=self.ref_chunks, routing=self.routing,
                                        old_pass=not self.old_from_update)
            for m in micro:
                if "old_logp" in m:  # last pipeline stage
                    reports.append(mismatch_metrics(m["old_logp"], m["rollout_logp"], m["loss_mask"].bool()))
            prepared.append(micro)
        return prepared, reduce_report(reports)

    def _update(self, prepared, critic_batches=None) -> tuple[dict, int, dict]:
        """epochs x mini-batches: a policy step (not during the critic's warm-up), then a critic step."""
        from rlpo_mega.training.policy_step import policy_step

        outs, skipped, critic_outs = [], 0, []
        policy_moves = self.critic is None or self.step >= self.cfg.critic.warmup_steps
        for _ in range(self.cfg.trainer.epochs):
            for i, micro in enumerate(prepared):
                if policy_moves:
                    out = policy_step(self.chunks, self.optimizer, micro, self.cfg.algorithm, routing=self.routing,
                                      old_from_update=self.old_from_update, lr_schedule=self.lr_schedule)
                    skipped += int(out.pop("skipped"))
                    outs.append(out)
                if critic_batches is not None:
                    critic_outs.append(self.critic.update(critic_batches[i]))
                    skipped += int(critic_outs[-1]["skipped"])
        return _mean_dicts(outs), skipped, (self.critic.metrics(critic_outs) if critic_batches is not None else {})

    def train_step(self) -> dict:
        from rlpo_mega.logging import PhaseTimer
        from rlpo_mega.logging.metrics import count_host_syncs

        timer = PhaseTimer(cuda_sync=torch.cuda.is_available())
        t0 = time.perf_counter()
        metrics = {}
        group = self._collect(timer)
        metrics.update(group.report.stats())
        metrics["dynamic_sampling/kept"] = group.report.groups_kept
        metrics["dynamic_sampling/dropped"] = (group.report.dropped_all_zero + group.report.dropped_all_one
                                               + group.report.dropped_other_constant)
        scored, gids = group.samples, group.group_ids
        n = self.cfg.prompts.n_samples
        unit = self._divisor() // math.gcd(self._divisor(), n)  # groups whose rows split evenly
        keep_groups = (len(scored) // n) // unit * unit
        if keep_groups * n < len(scored):  # a short dynamic-sampling batch: whole groups dropped to divide evenly
            metrics["dynamic_sampling/trimmed_groups"] = len(scored) // n - keep_groups
            scored, gids = scored[:keep_groups * n], gids[:keep_groups * n]
        metrics.update(_rollout_metrics(scored))
        if not scored:
            log.warning("step %d: no group with mixed rewards after dynamic sampling; no update", self.step)
            self.step += 1
            metrics["train/skipped_step"] = 1
            return metrics
        with timer("prepare"):
            minis, adv, stats = self._prepare(scored, gids, timer)
        metrics.update({("advantages/" + k if k in ("groups", "zero_advantage_groups") else k): v
                        for k, v in stats.items()})
        adv = adv.float()
        if self.critic is None:  # with a critic these are the sequence rewards; GAE's stats come with the values
            metrics.update({"advantages/mean": float(adv.mean()), "advantages/std": float(adv.std(unbiased=False)),
                            "advantages/min": float(adv.min()), "advantages/max": float(adv.max())})
        syncs = self.cfg.logging.host_syncs and torch.cuda.is_available()
        with timer("old_logprob"), count_host_syncs(metrics, "old_logprob", syncs):
            prepared, mismatch = self._old_logprobs(minis)
        metrics.update(mismatch)
        critic_batches = None
        if self.critic is not None:  # values, GAE (the sequence rewards become token advantages), returns
            with timer("values"):
                critic_batches, critic_stats = self.critic.prepare(prepared)
            metrics.update(critic_stats)
        with timer("update"), count_host_syncs(metrics, "update", syncs):
            out, skipped, critic_metrics = self._update(prepared, critic_batches)
        metrics.update(critic_metrics)
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        metrics["train/skipped_updates"] = skipped
        metrics["train/bad_steps_in_a_row"] = self.bad_steps
        metrics.update(_policy_metrics(out, "update" if self.old_from_update else "old"))
        metrics["optim/lr"] = float(self.optimizer.param_groups[0]["lr"])
        with timer("sync"):
            self.sync()
        self.step += 1
        metrics.update(timer.metrics())
        metrics["time/step"] = time.perf_counter() - t0
        tokens = sum(s.prompt_len + s.response_len for s in scored)
        metrics["perf/tokens_per_s"] = tokens * self.cfg.trainer.epochs / metrics["time/step"]
        metrics["engine/restarts"] = self.guard.restarts
        return metrics

    def evaluate(self) -> dict:
        from rlpo_mega.data import PromptSampler

        c = self.cfg
        records = self.records["eval"]
        items = PromptSampler(records[:c.trainer.eval_size], self.tokenizer, shuffle=False,
                              chat_template=c.prompts.chat_template, system_prompt=c.prompts.system_prompt
                              ).next_prompts(min(len(records), c.trainer.eval_size))
        params = rp.sampling_params(c, self.tokenizer, seed=c.seed, greedy=True)
        from rlpo_mega.logging import PhaseTimer

        local = self.guard.run(lambda: rp.generate_local(
            self.slot.engine, rp.share(items, self.ranks), 1, params, self.scorer, self.tokenizer, PhaseTimer()))
        scored = self._scalars(local)
        return {"eval/reward_mean": sum(s.reward for s in scored) / len(scored),
                "eval/accuracy": sum(s.correct for s in scored) / len(scored)}

    def save(self, on_signal: bool = False):
        """on_signal: the save on SIGTERM, inside the pre-emption window (launch/slurm's --signal lead): file sizes
        are recorded, the checksums' full re-read is left out (`rlpo-mega plan` sizes the window for the save)."""
        c = self.cfg.checkpoint
        state = {"step": self.step, "bad_steps": self.bad_steps, "warmup_done": self.warmup_done,
                 "sampler": self.sampler.state_dict(), "lr_steps": self.lr_schedule.num_steps}
        if self.critic is not None:
            state["critic_lr_steps"] = self.critic.lr_schedule.num_steps
        path = ckpt_state.save(c.save_dir, self.step, self.chunks, self.optimizer, state, c.keep_last,
                               meta={"model_type": self.hf.model_type, "model": self.identity,
                                     "run_id": self.run_id, "settings": self._settings()},
                               hf_files=self._hf_files(), reference=self.ref_chunks, stale=self.stale_steps,
                               critic=(self.critic.chunks, self.critic.optimizer) if self.critic else None,
                               checksums=not on_signal)
        self.stale_steps = ()  # replaced (checkpoint.overwrite) once this run has a checkpoint of its own
        if c.export_hf and not on_signal:  # the HF copy is a convenience: `rlpo-mega export` makes it later
            from moe.bridge.hf_checkpoint import HFCheckpointWriter, write_stream
            from moe.bridge.megatron_io import ExportStream

            stream = ExportStream(self.chunks, bucket_bytes=self.cfg.rollout.sync_bucket_mb << 20, dst=0,
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
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            self.tokenizer.save_pretrained(tmp)
            out = {}
            for name in os.listdir(tmp):
                with open(os.path.join(tmp, name), "rb") as f:
                    out[name] = f.read()
        out["config.json"] = self.hf.to_json_string().encode()
        return out

    def run(self) -> list[dict]:
        c, history = self.cfg, []
        bar = self.logger.progress(total=c.train_iters, initial=self.step, desc="RL steps")
        if c.trainer.eval_every and self.step == 0:  # the starting point of the eval curve
            history.append(self.evaluate())
            self.logger.log(0, history[-1])
        try:
            while self.step < c.train_iters:
                try:
                    metrics = self.train_step()
                    if c.trainer.eval_every and self.step % c.trainer.eval_every == 0:
                        metrics.update(self.evaluate())
                except rp.StopRequested:  # SIGTERM while ranks waited for a rollout: this step never happened
                    if c.checkpoint.save_dir:
                        self.save(on_signal=True)
                    if self.rank == 0:
                        log.warning("stopped by signal during the rollout of step %d; saved step %d",
                                    self.step + 1, self.step)
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
                stopping = self.stop.any_rank(self.device)
                if c.checkpoint.save_dir and (stopping or (c.checkpoint.save_every
                                                           and self.step % c.checkpoint.save_every == 0)):
                    self.save(on_signal=stopping)
                if stopping:
                    if self.rank == 0:
                        log.warning("stopped by signal after step %d", self.step)
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
        self.scorer.close()
        self.slot.close()
        self.routing.close()
        if self.critic is not None:
            self.critic.close()


def train(cfg, keep_world: bool = False) -> int:
    """`rlpo-mega train`: build, (resume,) run, close. Returns the process exit code. keep_world: leave
    the world process group up for another run in this process (tests)."""
    from rlpo_mega.errors import EXIT_STOPPED

    trainer = Trainer(cfg)
    ok = False
    try:
        history = [] if trainer.stopped else trainer.run()
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
        from rlpo_mega.logging.plot import plot

        lines.append(f"learning curves: {plot(run_dir)}")
    print("\n".join(["", *lines]), flush=True)
