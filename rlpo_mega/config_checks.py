"""Cross-field checks of a whole RunConfig against the model, before anything expensive starts.

`load_config` already rejects unknown keys and wrong types; this module rejects *combinations* that cannot
work (routing replay on a dense model, a rollout temperature the learner does not use, a batch that does not
split over mini-batches / data-parallel ranks / micro-batches, unknown registry names, ...) with one
ConfigError naming the key(s) and the fix, and returns warnings for legal but suspicious settings (a PPO clip
range with GSPO, ...), which are also logged on the "rlpo_mega" logger.

    hf = moe.model.load_hf_config(cfg.model.hf_config)
    warnings = check_run_config(cfg, hf, world_size=int(os.environ.get("WORLD_SIZE", 1)))

`hf=None` reads cfg.model.hf_config itself; that path checks MoE-ness on the raw config.json first, so a
dense model with routing replay gets the routing message rather than the model-family registry's.
"""
from __future__ import annotations

import json
import logging
import math
import os
import warnings as _warnings
from typing import Any, Iterable, Optional

from moe.bridge.fp8 import server_alignment_problem
from moe.context_parallel import padded_length
from moe.families import FAMILIES, UnsupportedModelError, get_family
from moe.lora import TARGETS as LORA_TARGETS
from moe.model import have_transformer_engine, load_hf_config
from rlpo_mega.algorithms import objective
from rlpo_mega.algorithms.advantages import ADVANTAGES, CRITIC_ESTIMATORS
from rlpo_mega.algorithms.kl import KL_ESTIMATORS
from rlpo_mega.algorithms.losses import LOSSES
from rlpo_mega.config import ConfigError, at_least, response_budget, unknown_choice
from rlpo_mega.environments import ENVIRONMENTS, environment_tools
from rlpo_mega.distributed import ParallelLayoutError, resolve_layout
from rlpo_mega.model_setup import LR_DECAY_STYLES, optimizer_steps
from rlpo_mega.rewards import REWARDS
from rlpo_mega.rollout import ENGINES  # the package registers the engines
from rlpo_mega.rollout.producers import PRODUCERS
from rlpo_mega.weight_sync.transports import TRANSPORTS

log = logging.getLogger("rlpo_mega")

ROUTING_MODES = ("off", "r2", "r3")
ON_BAD_TRACE = ("error", "fallback")
PARAMS_DTYPES = ("float32", "bfloat16")
TOKEN_DISPATCHERS = ("alltoall", "allgather")
LOGGING_MODES = ("offline", "online", "disabled")
PROMPT_FORMATS = ("auto", "jsonl", "parquet")
CHAT_TEMPLATES = ("auto", "on", "off")
GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo")  # normalised within a prompt's group of n_samples responses
# GSPO's clip range is on the length-normalised sequence ratio: the paper's is 3e-4 / 4e-4, and a PPO-style
# 0.2 clips (almost) nothing. Anything at or above this is taken for a PPO-style range.
GSPO_PPO_LIKE_EPS = 0.01


def _choice(key: str, value: str, known: Iterable[str]) -> None:
    """ConfigError for a name outside `known`, listing them, with a did-you-mean."""
    known = list(known)
    if value not in known:
        raise ConfigError(unknown_choice(key, value, known))


def _moe_layers(hf: Any, model_type: Optional[str]) -> tuple[Optional[int], int]:
    """(number of experts, number of MoE decoder layers) of an HF config object or raw config.json dict.
    Which layers are sparse is the family's knowledge (moe_layer_pattern); an unknown model type counts
    every layer, and is refused by the family check that follows."""
    get = (lambda k, d=None: hf.get(k, d)) if isinstance(hf, dict) else (lambda k, d=None: getattr(hf, k, d))
    experts = get("num_experts")
    if experts is None:
        experts = get("num_local_experts")
    layers = int(get("num_hidden_layers", 0) or 0)
    family = FAMILIES.get(model_type)
    if family is None:
        return experts, (layers if experts else 0)
    if isinstance(hf, dict):
        try:
            hf = family.hf_config_class(**{k: v for k, v in hf.items() if k != "model_type"})
        except (TypeError, ValueError):  # reported, with its cause, by the family load in _check_model
            return experts, (layers if experts else 0)
    try:  # the family names its expert count (n_routed_experts for the sigmoid-router families)
        experts = family.num_experts(hf)
    except AttributeError:
        pass
    return experts, (sum(family.moe_layer_pattern(hf)) if experts else 0)


def _check_model(cfg, hf):
    """Routing replay needs MoE layers: checked on the raw values before the family registry is consulted.
    Returns the loaded HF config (hf, or cfg.model.hf_config loaded)."""
    mode = cfg.routing.mode
    _choice("routing.mode", mode, ROUTING_MODES)
    _choice("routing.on_bad_trace", cfg.routing.on_bad_trace, ON_BAD_TRACE)
    raw = hf
    if hf is None:
        path = cfg.model.hf_config
        file = os.path.join(path, "config.json") if path and os.path.isdir(path) else path
        if not file or not os.path.isfile(file):
            raise ConfigError(f"model.hf_config={path!r}: no config.json there; point it at the model's "
                              "config.json or the directory holding it")
        try:
            with open(file) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.hf_config={path!r}: could not read {file}: {e}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else getattr(raw, "model_type", None)
    if mode != "off":
        experts, moe_layers = _moe_layers(raw, model_type)
        if not experts or not moe_layers:
            what = (f"has no experts (num_experts / num_local_experts = {experts!r})" if not experts
                    else "has no MoE layer (mlp_only_layers / decoder_sparse_step make every layer dense)")
            raise ConfigError(
                f"routing.mode={mode} (routing replay) needs a Mixture-of-Experts model, but model.hf_config "
                f"({cfg.model.hf_config}, model_type {model_type!r}) {what}. Set routing.mode=off, or use a "
                f"MoE model (supported model types: {', '.join(sorted(FAMILIES))}).")
    if model_type not in FAMILIES:
        raise ConfigError(f"model.hf_config ({cfg.model.hf_config}): model_type {model_type!r} is not supported; "
                          f"supported model types: {', '.join(sorted(FAMILIES))}. Add a family in moe/families/ "
                          "to support it.")
    if hf is None:
        try:
            hf = load_hf_config(cfg.model.hf_config)
        except (UnsupportedModelError, FileNotFoundError, TypeError, ValueError) as e:
            raise ConfigError(f"model.hf_config={cfg.model.hf_config!r}: {e}") from None
    _choice("model.params_dtype", cfg.model.params_dtype, PARAMS_DTYPES)
    _choice("model.token_dispatcher", cfg.model.token_dispatcher, TOKEN_DISPATCHERS)
    if cfg.model.vocab_divisible_by < 1:
        raise ConfigError(f"model.vocab_divisible_by={cfg.model.vocab_divisible_by} must be >= 1")
    rate = cfg.model.expert_bias_update_rate
    if rate < 0:
        raise ConfigError(f"model.expert_bias_update_rate={rate} must be >= 0 (0 keeps the routers' bias fixed)")
    if rate > 0 and not FAMILIES[model_type].expert_bias(hf):
        raise ConfigError(f"model.expert_bias_update_rate={rate}: {model_type} routers have no score-correction "
                          "bias to update; set it to 0")
    return hf


def _check_algorithm(cfg, warns: list[str]):
    alg = cfg.algorithm
    loss = alg.loss
    _choice("algorithm.loss.name", loss.name, LOSSES.names())
    _choice("algorithm.advantage.name", alg.advantage.name, ADVANTAGES.names())
    _choice("algorithm.kl.estimator", alg.kl.estimator, KL_ESTIMATORS.names())
    if not alg.kl.coef >= 0:
        raise ConfigError(f"algorithm.kl.coef={alg.kl.coef} must be >= 0 (0 turns the KL term off)")
    spec = LOSSES.get(loss.name)
    set_eps = {k: getattr(loss, k) for k in ("eps_low", "eps_high") if getattr(loss, k) is not None}
    if spec.eps_low is None and set_eps:
        raise ConfigError(
            f"algorithm.loss.name={loss.name} has no clip range (its soft gate is shaped by "
            f"algorithm.loss.tau_pos / tau_neg, paper defaults 1.0 / 1.05), but "
            f"{', '.join(f'algorithm.loss.{k}={v}' for k, v in set_eps.items())} is set: unset it (null)")
    if loss.name in ("gspo", "gspo_token"):
        wide = {k: v for k, v in set_eps.items() if v >= GSPO_PPO_LIKE_EPS}
        if wide:
            warns.append(
                f"algorithm.loss.name={loss.name} with a PPO-style clip range "
                f"({', '.join(f'{k}={v}' for k, v in wide.items())}): GSPO clips the length-normalised sequence "
                f"ratio, whose paper range is eps_low={spec.eps_low:g}, eps_high={spec.eps_high:g} (leave "
                "algorithm.loss.eps_low/eps_high unset for these); a range like 0.2 clips almost nothing")
    if alg.kl.coef > 0:
        log.info("algorithm.kl.coef=%s > 0: the trainer builds a reference model (frozen copy of the initial "
                 "policy) and runs an extra forward pass per rollout batch", alg.kl.coef)
    # Everything else the objective itself validates (clip bounds, symmetric clips, dual clip, taus,
    # aggregation and its pitfalls, advantage std/eps, mismatch correction, temperature): reuse it.
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        try:
            objective.validate(alg)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"algorithm: {e}") from None
    for w in caught:
        warns.append(f"algorithm.loss: {w.message}")
    sh = alg.shaping
    if sh.soft_overlong:
        # DAPO's soft overlong punishment: 0 up to L_max - L_cache, a ramp to -1 at L_max (shaping.py)
        if sh.max_response_length is None or sh.overlong_cache is None:
            raise ConfigError("algorithm.shaping.soft_overlong=true needs algorithm.shaping.max_response_length "
                              "(L_max) and algorithm.shaping.overlong_cache (L_cache), e.g. L_max = "
                              "rollout.max_new_tokens and L_cache = L_max / 4")
        if not 0 < sh.overlong_cache <= sh.max_response_length:
            raise ConfigError(f"algorithm.shaping.overlong_cache={sh.overlong_cache} must be in (0, "
                              f"max_response_length={sh.max_response_length}] (L_cache <= L_max)")
        if sh.max_response_length > cfg.rollout.max_new_tokens:
            warns.append(f"algorithm.shaping.max_response_length={sh.max_response_length} > rollout.max_new_tokens="
                         f"{cfg.rollout.max_new_tokens}: no response reaches the full punishment")
    if alg.logprob_chunk_size is not None and alg.logprob_chunk_size < 1:
        raise ConfigError(f"algorithm.logprob_chunk_size={alg.logprob_chunk_size} must be >= 1 (or null: auto)")


def _check_rollout(cfg, warns: list[str]):
    ro = cfg.rollout
    _choice("reward.function", cfg.reward.function, REWARDS.names())
    _choice("rollout.engine", ro.engine, ENGINES.names())
    _choice("rollout.sync_transport", ro.sync_transport, TRANSPORTS.names())
    if cfg.reward.function == "remote" and not cfg.reward.remote.url:
        raise ConfigError("reward.function=remote needs reward.remote.url (the endpoint POSTed "
                          '{"prompts", "responses", "references"})')
    if ro.temperature != cfg.algorithm.temperature:
        raise ConfigError(
            f"rollout.temperature={ro.temperature} != algorithm.temperature={cfg.algorithm.temperature}: the "
            "learner's log-probs must be of the same tempered distribution the engine sampled from; set both "
            "to the same value")
    if not (ro.temperature > 0 and math.isfinite(ro.temperature)):
        raise ConfigError(f"rollout.temperature={ro.temperature} must be > 0")
    if not 0 < ro.top_p <= 1:
        raise ConfigError(f"rollout.top_p={ro.top_p} must be in (0, 1]")
    if ro.top_p < 1 or ro.top_k > 0:
        warns.append(f"rollout.top_p={ro.top_p} / top_k={ro.top_k} truncate the sampling distribution, but the "
                     "learner's log-probs are of the full distribution: the importance ratios are biased at "
                     "the first step (use a mismatch correction, algorithm.mismatch.mode=tis, or top_p=1, top_k=-1)")
    if ro.max_new_tokens < 1:
        raise ConfigError(f"rollout.max_new_tokens={ro.max_new_tokens} must be >= 1")
    if ro.sync_bucket_mb < 1:
        raise ConfigError(f"rollout.sync_bucket_mb={ro.sync_bucket_mb} must be >= 1")


def _existing_file(key: str, path: Optional[str], why: str) -> None:
    if not path:
        raise ConfigError(f"{key} is not set: {why}")
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path!r} does not exist (or is not a file); {why}")


def _check_data(cfg, warns: list[str], files: bool = True):
    p, tr = cfg.prompts, cfg.trainer
    existing = _existing_file if files else (lambda key, path, why: None)
    existing("prompts.path", p.path, "set it to the .jsonl or .parquet file of training prompts")
    _choice("prompts.format", p.format, PROMPT_FORMATS)
    _choice("prompts.chat_template", p.chat_template, CHAT_TEMPLATES)
    if tr.eval_every < 0:
        raise ConfigError(f"trainer.eval_every={tr.eval_every} must be >= 0 (0: never)")
    if tr.eval_every > 0:
        existing("trainer.eval_path", tr.eval_path,
                       f"trainer.eval_every={tr.eval_every} evaluates on it; set it or trainer.eval_every=0")
        if tr.eval_size < 1:
            raise ConfigError(f"trainer.eval_size={tr.eval_size} must be >= 1")
    if tr.warmup.steps < 0:
        raise ConfigError(f"trainer.warmup.steps={tr.warmup.steps} must be >= 0")
    if tr.warmup.steps > 0:
        existing("trainer.warmup.path", tr.warmup.path,
                       f"trainer.warmup.steps={tr.warmup.steps} trains on it; set it or trainer.warmup.steps=0")
        if tr.warmup.batch_size < 1:
            raise ConfigError(f"trainer.warmup.batch_size={tr.warmup.batch_size} must be >= 1")
    elif tr.warmup.path:
        warns.append(f"trainer.warmup.path is set but trainer.warmup.steps=0: no warm-up runs")


def _check_counts(cfg, warns: list[str]):
    if cfg.train_iters < 0:
        raise ConfigError(f"train_iters={cfg.train_iters} must be >= 0 (0: no RL step; the warm-up, if any, runs "
                          "and the run's checkpoint is saved: e.g. the starting point of later runs)")
    positive = {"trainer.epochs": cfg.trainer.epochs,
                "trainer.mini_batches": cfg.trainer.mini_batches, "checkpoint.keep_last": cfg.checkpoint.keep_last,
                "prompts.prompts_per_step": cfg.prompts.prompts_per_step, "prompts.n_samples": cfg.prompts.n_samples,
                "parallel.num_micro_batches": cfg.parallel.num_micro_batches,
                "parallel.micro_batch_size": cfg.parallel.micro_batch_size,
                "trainer.max_bad_steps": cfg.trainer.max_bad_steps, "trainer.gc_full_every": cfg.trainer.gc_full_every}
    for key, v in positive.items():
        if v < 1:
            raise ConfigError(f"{key}={v} must be >= 1")
    if cfg.checkpoint.save_every < 0:
        raise ConfigError(f"checkpoint.save_every={cfg.checkpoint.save_every} must be >= 0 "
                          "(0: save only at the end and on SIGTERM)")
    if cfg.trainer.engine_restarts < 0:
        raise ConfigError(f"trainer.engine_restarts={cfg.trainer.engine_restarts} must be >= 0")
    if cfg.checkpoint.save_every > 0 and not cfg.checkpoint.save_dir:
        warns.append(f"checkpoint.save_every={cfg.checkpoint.save_every} but checkpoint.save_dir is not set: "
                     "nothing is saved")
    _choice("logging.mode", cfg.logging.mode, LOGGING_MODES)
    if cfg.logging.console_every < 0:
        raise ConfigError(f"logging.console_every={cfg.logging.console_every} must be >= 0 (0: never)")
    if cfg.prompts.oversample < 1:
        raise ConfigError(f"prompts.oversample={cfg.prompts.oversample} must be >= 1")
    ds = cfg.algorithm.dynamic_sampling
    at_least("trainer.max_staleness", cfg.trainer.max_staleness, 0, "0: synchronous steps")
    if cfg.trainer.max_staleness > 0 and cfg.algorithm.mismatch.mode == "none":
        warns.append(f"trainer.max_staleness={cfg.trainer.max_staleness} with algorithm.mismatch.mode=none trains "
                     "tokens sampled by older policy versions as if on-policy: algorithm.mismatch.mode=tis with "
                     "level=sequence and a high tis_cap weights each sample by pi_old / mu (README, "
                     "\"Asynchronous RL\")")
    env = cfg.environment
    if env.name is not None:
        if env.name not in ENVIRONMENTS:
            raise ConfigError(unknown_choice("environment.name", env.name, ENVIRONMENTS.names()))
        at_least("environment.max_turns", env.max_turns, 1, "model turns per episode")
        at_least("environment.max_tokens", env.max_tokens, 1, "response tokens per episode")
        at_least("environment.num_workers", env.num_workers, 1, "threads running environment steps")
        if env.timeout is not None and not env.timeout > 0:
            raise ConfigError(f"environment.timeout={env.timeout} must be > 0 seconds (or null: no limit)")
        environment_tools(env)  # the environment's own options, read as a run reads them
    if cfg.rollout.client_switch_interval is not None and not cfg.rollout.client_switch_interval > 0:
        raise ConfigError(f"rollout.client_switch_interval={cfg.rollout.client_switch_interval} must be > 0 seconds "
                          "(or null: Python's own)")
    at_least("algorithm.dynamic_sampling.max_tries", ds.max_tries, 1, "chunks of prompts per step and engine rank")
    at_least("algorithm.dynamic_sampling.max_carry_steps", ds.max_carry_steps, 0,
             "0: surplus groups are never carried to a later step")
    _check_lr_schedule(cfg)


def _check_offload(o, key: str = "optim") -> None:
    """Optimizer CPU offload and the precision-aware optimizer: what megatron-core 0.16.1 builds, in one line each
    (its own checks are asserts, some only at the first step)."""
    if o.cpu_offload and not o.use_distributed_optimizer:
        # the bf16/fp32 optimizers swap their params into the HybridDeviceOptimizer's groups after building it
        # (optimizer.py), whose maps then miss them: KeyError at the first step (hybrid_optimizer.py:339); only the
        # distributed optimizer rebuilds it over its shards (distrib_optimizer.py:603)
        raise ConfigError(f"{key}.cpu_offload=true needs {key}.use_distributed_optimizer=true (megatron-core offloads "
                          "the distributed optimizer's shards only)")
    if o.cpu_offload and not 0 < o.offload_fraction <= 1:
        raise ConfigError(f"{key}.offload_fraction={o.offload_fraction} must be in (0, 1]: the share of each rank's "
                          "optimizer state kept and stepped on the host")
    if not o.cpu_offload and (o.overlap_cpu_optimizer_d2h_h2d or o.offload_fraction != 1.0):
        raise ConfigError(f"{key}.overlap_cpu_optimizer_d2h_h2d / {key}.offload_fraction are set without "
                          f"{key}.cpu_offload=true, where they do nothing: set {key}.cpu_offload=true or unset them")
    if o.precision_aware and not o.use_distributed_optimizer:
        raise ConfigError(f"{key}.precision_aware=true needs {key}.use_distributed_optimizer=true (megatron-core's "
                          "precision-aware optimizer is the distributed optimizer's)")
    moments = {n: getattr(o, n) for n in ("exp_avg_dtype", "exp_avg_sq_dtype") if getattr(o, n) != "float32"}
    if moments and not o.precision_aware:
        raise ConfigError(f"{key}.{'/'.join(moments)}={'/'.join(moments.values())} needs {key}.precision_aware=true "
                          "(other optimizers keep fp32 moments)")
    if moments and o.cpu_offload:
        # megatron/core/optimizer/__init__.py:336-346 passes no moment dtype to the HybridDeviceOptimizer: its
        # AdamW keeps the moments in the fp32 master's dtype
        raise ConfigError(f"{key}.{'/'.join(moments)} other than float32 with {key}.cpu_offload=true: the host "
                          "optimizer keeps fp32 moments (megatron-core passes it no moment dtype): set them to float32")
    if o.precision_aware and not o.cpu_offload and not have_transformer_engine():
        raise ConfigError(f"{key}.precision_aware=true without {key}.cpu_offload needs Transformer Engine's FusedAdam, "
                          "which is not installed: pip install -e '.[gpu]', or set "
                          f"{key}.cpu_offload=true (the host optimizer needs no TE)")


def _check_lr_schedule(cfg, o=None, key: str = "optim"):
    """What megatron's OptimizerParamScheduler would otherwise stop with a bare assert (the policy's optim, or
    the critic's critic.optim: both step once per mini-batch and epoch)."""
    o = cfg.optim if o is None else o
    _check_offload(o, key)
    _choice(f"{key}.lr_decay_style", o.lr_decay_style, LR_DECAY_STYLES)
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"{key}.min_lr={o.min_lr} must be in [0, {key}.lr={o.lr}]")
    if not 0 <= o.lr_warmup_init <= o.lr:
        raise ConfigError(f"{key}.lr_warmup_init={o.lr_warmup_init} must be in [0, {key}.lr={o.lr}]")
    if o.lr_warmup_steps < 0 or o.lr_decay_steps < 0:
        raise ConfigError(f"{key}.lr_warmup_steps={o.lr_warmup_steps} and {key}.lr_decay_steps={o.lr_decay_steps} "
                          "must be >= 0 (decay 0: the whole run)")
    total = optimizer_steps(cfg)
    decay = o.lr_decay_steps or total
    if o.lr_decay_style != "constant" and o.lr_warmup_steps >= decay:
        raise ConfigError(f"{key}.lr_warmup_steps={o.lr_warmup_steps} leaves no optimizer step to decay over "
                          f"({key}.lr_decay_steps={decay}; the run has train_iters x trainer.mini_batches x "
                          f"trainer.epochs = {total}): shorten the warm-up or lengthen the decay")


def _check_critic(cfg, warns: list[str]):
    """PPO with a value model: on exactly when the advantage estimator needs one (gae)."""
    alg, c = cfg.algorithm, cfg.critic
    if alg.advantage.name not in CRITIC_ESTIMATORS:
        if alg.kl.in_reward:
            raise ConfigError(f"algorithm.kl.in_reward=true folds the KL penalty into GAE's token rewards, but "
                              f"algorithm.advantage.name={alg.advantage.name} has none: set algorithm.advantage.name=gae "
                              "or algorithm.kl.in_reward=false (the KL term then goes into the loss)")
        if c.init_from_hf is not None:
            raise ConfigError(f"critic.init_from_hf is set but algorithm.advantage.name={alg.advantage.name} trains no "
                              "critic: set algorithm.advantage.name=gae or unset critic.init_from_hf")
        return
    if LOSSES.get(alg.loss.name).per_sequence_advantage:
        # GSPO's ratio is one number per sequence and needs one advantage per sequence; GAE gives one per
        # token. We define no sequence-level reduction of GAE: refused, not silently averaged.
        raise ConfigError(f"algorithm.loss.name={alg.loss.name} clips a sequence-level ratio with one advantage per "
                          "sequence, but GAE (algorithm.advantage.name=gae) gives each token its own: use "
                          "algorithm.loss.name=gspo_token (GSPO's ratio, per-token advantages), ppo_clip, grpo, dapo or sapo")
    if c.vf_clip is not None and not c.vf_clip > 0:
        raise ConfigError(f"critic.vf_clip={c.vf_clip} must be > 0 (or null: no value clipping)")
    if not c.vf_coef > 0:
        raise ConfigError(f"critic.vf_coef={c.vf_coef} must be > 0")
    if c.warmup_steps < 0:
        raise ConfigError(f"critic.warmup_steps={c.warmup_steps} must be >= 0")
    if c.warmup_steps >= cfg.train_iters:
        warns.append(f"critic.warmup_steps={c.warmup_steps} >= train_iters={cfg.train_iters}: the policy never moves")
    if alg.kl.in_reward and not alg.kl.coef > 0:
        warns.append("algorithm.kl.in_reward=true with algorithm.kl.coef=0: no KL penalty is folded in")
    if alg.dynamic_sampling.enabled:
        warns.append("algorithm.dynamic_sampling drops groups whose rewards are all equal; with GAE they still "
                     "train the critic and carry non-zero advantages: consider turning it off")
    _check_lr_schedule(cfg, c.optim, "critic.optim")


def _check_context(cfg, hf):
    """Context parallelism (parallel.context > 1): what megatron-core 0.16.1 and this trainer run under it."""
    cp = cfg.parallel.context
    if cp <= 1:
        return  # below 1: resolve_layout names it
    if cfg.trainer.layout != "packed":
        raise ConfigError(f"parallel.context={cp} splits packed (THD) micro-batches over the CP ranks; "
                          "trainer.layout=padded is not supported with it: set trainer.layout=packed")
    if cfg.trainer.warmup.steps > 0:
        raise ConfigError(f"trainer.warmup.steps={cfg.trainer.warmup.steps} with parallel.context={cp}: the "
                          "supervised warm-up trains padded rows, which context parallelism does not split; run "
                          "the warm-up at parallel.context=1 (its checkpoint resumes at any context size) or set "
                          "trainer.warmup.steps=0")
    dropout = float(getattr(hf, "attention_dropout", 0.0) or 0.0)
    if dropout > 0 and not have_transformer_engine():
        raise ConfigError(f"parallel.context={cp} without Transformer Engine: the all-gather-KV attention "
                          f"(moe/context_parallel.py) has no attention dropout, and model.hf_config sets "
                          f"attention_dropout={dropout}; set it to 0 or install Transformer Engine")
    budget = cfg.trainer.max_tokens_per_micro_batch
    if budget is not None:
        response, key = response_budget(cfg)
        need = padded_length(response + 1, cp, cfg.parallel.tensor)
        if budget < need:
            raise ConfigError(f"trainer.max_tokens_per_micro_batch={budget} is per CP group and counts each sample "
                              f"padded to 2 x parallel.context x parallel.tensor = "
                              f"{2 * cp * cfg.parallel.tensor}: the longest sample ({key} + a prompt token) takes "
                              f"{need}; raise it to at least {need}")


def _check_batch(cfg, world_size: Optional[int]):
    """rollout batch = prompts_per_step * n_samples sequences -> trainer.mini_batches mini-batches -> DP ranks
    -> parallel.num_micro_batches micro-batches per rank (rlpo_mega.training.warmup.shard_and_split)."""
    p, par = cfg.prompts, cfg.parallel
    if cfg.algorithm.advantage.name in GROUP_ADVANTAGES and p.n_samples < 2:
        raise ConfigError(
            f"prompts.n_samples={p.n_samples} with algorithm.advantage.name={cfg.algorithm.advantage.name}: "
            "group-normalised advantages compare the responses of one prompt, so a group of 1 has zero advantage "
            "everywhere; set prompts.n_samples >= 2 (e.g. 8)")
    batch = p.prompts_per_step * p.n_samples
    where = f"the rollout batch of prompts.prompts_per_step*prompts.n_samples = {p.prompts_per_step}*{p.n_samples} = {batch} sequences"
    mb = cfg.trainer.mini_batches
    if batch % mb:
        ok = [d for d in range(1, batch + 1) if batch % d == 0][:8]
        raise ConfigError(f"{where} does not split into trainer.mini_batches={mb} mini-batches; make "
                          f"trainer.mini_batches a divisor of {batch} (e.g. {', '.join(map(str, ok))}) or change "
                          "prompts.prompts_per_step")
    mini = batch // mb
    nmb, mbs = par.num_micro_batches, par.micro_batch_size
    budget = cfg.trainer.max_tokens_per_micro_batch
    if budget is not None:
        if cfg.trainer.layout != "packed":
            raise ConfigError(f"trainer.max_tokens_per_micro_batch={budget} cuts packed micro-batches; with "
                              "trainer.layout=padded set parallel.num_micro_batches instead (or unset the budget)")
        response, key = response_budget(cfg)
        longest = response + 1
        if budget < longest:
            raise ConfigError(f"trainer.max_tokens_per_micro_batch={budget} is below one sample's length (at least "
                              f"{key} + a prompt token = {longest}); raise it to hold the longest prompt + response")
    if (cfg.trainer.layout == "packed" and par.pipeline > 1 and cfg.model.token_dispatcher == "allgather"):
        raise ConfigError("trainer.layout=packed with parallel.pipeline > 1 needs variable micro-batch shapes, which "
                          "megatron refuses with model.token_dispatcher=allgather; use alltoall (or layout=padded)")
    if world_size is not None:
        if world_size < 1:
            raise ConfigError(f"world size {world_size} must be >= 1")
        model_par = par.tensor * par.pipeline * par.context
        if model_par < 1 or world_size % model_par:
            return  # resolve_layout reports the layout itself
        dp = world_size // model_par
        if mini % dp:
            raise ConfigError(
                f"a mini-batch of {mini} sequences ({where} / trainer.mini_batches={mb}) does not split over "
                f"{dp} data-parallel ranks (world size {world_size} / (parallel.tensor*parallel.pipeline*"
                f"parallel.context = {par.tensor}*{par.pipeline}*{par.context})); make "
                f"prompts.prompts_per_step*prompts.n_samples/trainer.mini_batches a multiple of {dp}")
        share, what = mini // dp, f"each data-parallel rank's share of a mini-batch ({mini}/{dp} = {mini // dp})"
    else:
        share, what = mini, f"a mini-batch ({mini} sequences, before the data-parallel split)"
    # packed: the DP split balances tokens, so ranks hold uneven sample counts and a rank short of samples runs
    # empty (masked pad) micro-batches; only the padded layout needs equal rows per micro-batch
    if cfg.trainer.layout == "padded" and share % nmb:
        raise ConfigError(f"{what} does not split into parallel.num_micro_batches={nmb} micro-batches; make it a "
                          f"multiple of {nmb} or change parallel.num_micro_batches")
    if world_size is not None and mbs != 1 and mbs * nmb != share:
        raise ConfigError(
            f"parallel.micro_batch_size={mbs} * parallel.num_micro_batches={nmb} = {mbs * nmb} != {what}; set "
            f"parallel.micro_batch_size={share // nmb} (or leave it at 1: the trainer splits by num_micro_batches)")
    if world_size is None and mbs != 1 and share % (mbs * nmb):
        raise ConfigError(f"{what} is not a multiple of parallel.micro_batch_size*parallel.num_micro_batches = "
                          f"{mbs}*{nmb}; change parallel.micro_batch_size or parallel.num_micro_batches")


def _check_fp8(cfg, hf, warns: list[str]):
    """rollout.weights=fp8: what is built for it (moe/bridge/fp8.py), and servers that can hold it."""
    ro = cfg.rollout
    if ro.weights != "fp8":
        return
    if ro.engine != "sglang":
        raise ConfigError(f"rollout.weights=fp8 serves block-FP8 weights from SGLang servers; rollout.engine="
                          f"{ro.engine} serves the learner's own: set rollout.engine=sglang or rollout.weights=bf16")
    dtype = ro.sglang.server_args.get("dtype", "bfloat16")
    if dtype not in ("bfloat16", "auto"):
        raise ConfigError(f"rollout.weights=fp8 with rollout.sglang.server_args.dtype={dtype}: FP8 servers serve in "
                          "bfloat16 (the sync sends the unquantised tensors in it); remove the key or set bfloat16")
    try:
        problem = server_alignment_problem(hf, ro.sglang.tp_size, int(ro.sglang.server_args.get("ep_size", 1)))
    except UnsupportedModelError as e:
        raise ConfigError(str(e)) from None
    if problem:
        raise ConfigError(problem)
    if cfg.algorithm.mismatch.mode == "none":
        warns.append("rollout.weights=fp8 with algorithm.mismatch.mode=none: the tokens were sampled by the FP8 "
                     "weights and are trained as if the learner's bf16 ones had sampled them; "
                     "algorithm.mismatch.mode=tis (the default with FP8) corrects for it")


def _check_lora(cfg, hf):
    """model.lora and critic.lora: what moe/lora.py builds, refused before any launch where it would not."""
    if cfg.critic.lora.rank and cfg.algorithm.advantage.name != "gae":
        raise ConfigError(f"critic.lora.rank={cfg.critic.lora.rank} but algorithm.advantage.name="
                          f"{cfg.algorithm.advantage.name} trains no critic: set algorithm.advantage.name=gae or "
                          "critic.lora.rank=0")
    lo = cfg.model.lora
    if lo.rank and lo.save == "adapters" and not cfg.model.init_from_hf:
        raise ConfigError("model.lora.save=adapters without model.init_from_hf: an adapter-only checkpoint reloads "
                          "its base from model.init_from_hf at a resume or an export; set it, or model.lora.save=full")
    cl = cfg.critic.lora
    if cl.rank and cl.save == "adapters" and not cfg.critic.trunk_rebuilt(cfg.model):
        raise ConfigError("critic.lora.save=adapters without critic.init_from_hf, with a policy trained whole: the "
                          "critic's trunk is copied from the policy as RL starts, which no resume can rebuild; set "
                          "critic.init_from_hf to the HF checkpoint to start the critic from, or critic.lora.save=full")
    rate = cfg.model.expert_bias_update_rate
    if rate > 0 and (lo.rank or cfg.critic.lora.rank):
        # the routers' score-correction bias is model state updated outside the optimizer: under LoRA it would move
        # a base that is frozen everywhere else -- lost by an adapter-only save (a resume routes with the old
        # bias), never carried by an adapter-only sync (the servers route with the HF base's)
        key, adapted = ("model.lora", lo) if lo.rank else ("critic.lora", cl)
        raise ConfigError(f"model.expert_bias_update_rate={rate} with {key}.rank={adapted.rank}: LoRA keeps the base "
                          f"frozen, routers included; set model.expert_bias_update_rate=0, or {key}.rank=0 to train "
                          "the whole model")
    for key, lo in (("model.lora", cfg.model.lora), ("critic.lora", cfg.critic.lora)):
        if lo.rank:
            _check_adapters(key, lo, cfg, hf)
    if cfg.rollout.lora_sync == "adapter":
        _check_adapter_sync(cfg)


def _check_adapter_sync(cfg):
    """rollout.lora_sync=adapter: an engine that serves adapters beside the base, and a way there the adapter takes
    (SGLang 0.5.23: from tensors through this host's shared memory, or a PEFT directory the servers read)."""
    ro, lo = cfg.rollout, cfg.model.lora
    if not lo.rank:
        raise ConfigError("rollout.lora_sync=adapter without model.lora (rank 0 trains the whole model: there is no "
                          "adapter to send); set model.lora.rank, or rollout.lora_sync=merged")
    if not getattr(ENGINES.get(ro.engine), "serves_adapters", False):
        raise ConfigError(f"rollout.lora_sync=adapter: rollout.engine={ro.engine} takes merged weights only; set "
                          "rollout.lora_sync=merged, or rollout.engine=sglang")
    if ro.weights == "fp8":
        raise ConfigError("rollout.lora_sync=adapter with rollout.weights=fp8: an adapter beside a block-FP8 base is "
                          "not built; set rollout.lora_sync=merged (merged, then quantised) or rollout.weights=bf16")
    if ro.sync_transport not in ("in_process", "disk"):
        raise ConfigError(f"rollout.lora_sync=adapter with rollout.sync_transport={ro.sync_transport}: SGLang 0.5.23 "
                          "takes an adapter from tensors on its own host (in_process) or from a directory it can read "
                          "(disk, rollout.sync_dir on a filesystem the servers share), not over a weight-update group")
    if ro.holds_requests:
        raise ConfigError("rollout.lora_sync=adapter with rollout.partial_rollout_kv=keep: a held request would go on "
                          "under an adapter replaced beneath it (not built); set partial_rollout_kv=recompute or "
                          "rollout.lora_sync=merged")
    given = sorted(k for k in ("enable_lora", "max_lora_rank", "lora_target_modules", "lora_paths",
                               "experts_shared_outer_loras") if k in ro.sglang.server_args)
    if given and ro.sglang.launch and not ro.sglang.urls:
        raise ConfigError(f"rollout.sglang.server_args.{given[0]} with rollout.lora_sync=adapter: launched servers "
                          "get their LoRA flags from model.lora (rank, targets, expert layout); remove it")
    backend = ro.sglang.server_args.get("lora_backend")
    if "experts" in lo.targets and backend in ("csgmv",):
        raise ConfigError(f"rollout.sglang.server_args.lora_backend={backend} with model.lora.targets having experts: "
                          "SGLang's csgmv backend skips MoE layers (the experts' adapter would be dropped); remove it "
                          "(launched servers take triton on a GPU)")


def _check_adapters(key: str, lo, cfg, hf):
    at_least(f"{key}.rank", lo.rank, 1, "0 trains the whole model")
    if lo.alpha <= 0:
        raise ConfigError(f"{key}.alpha={lo.alpha} must be > 0 (the side path is scaled by alpha / rank)")
    if lo.dropout != 0:
        raise ConfigError(f"{key}.dropout={lo.dropout}: only 0 is built (a dropped adapter input would make the "
                          "learner's log-probs differ from the ones the engine sampled with); set it to 0")
    for t in lo.targets:
        if t not in LORA_TARGETS:
            raise ConfigError(unknown_choice(f"{key}.targets", t, LORA_TARGETS))
    if not lo.targets:
        raise ConfigError(f"{key}.targets is empty: name at least one of {', '.join(LORA_TARGETS)}")
    if have_transformer_engine():
        raise ConfigError(f"{key} with Transformer Engine installed: the adapters sit on megatron-core's local "
                          "linears (moe/lora.py), not TE's fused ones yet; run in an environment without TE")
    if "attention" in lo.targets and get_family(hf.model_type).transformer_fields(hf).get("multi_latent_attention"):
        raise ConfigError(f"{key}.targets has attention, and {hf.model_type}'s multi-latent attention has no "
                          "fused qkv projection for the adapters (not built); drop attention from the targets")
    etp = cfg.parallel.expert_tensor if cfg.parallel.expert_tensor is not None else cfg.parallel.tensor
    if "experts" in lo.targets and lo.expert_layout == "shared" and etp > 1:
        raise ConfigError(f"{key}.expert_layout=shared at expert-tensor-parallel size {etp} is not built (its "
                          "fc1 B and fc2 A would be split over expert-TP and shared by the experts); use shared_outer "
                          "or per_expert, or parallel.expert_tensor=1")


def check_run_config(cfg, hf=None, world_size: Optional[int] = None, log_warnings: bool = True,
                     files: bool = True, nodes: Optional[int] = None) -> list[str]:
    """Check a RunConfig against the HF model config `hf` (None: read cfg.model.hf_config) and, when given, the
    world size (data-parallel split and parallel layout) and node count (servers launched per node). Raises
    ConfigError for an impossible combination; returns (and logs) warnings for suspicious ones. files=False: data
    files may be placeholders (`plan`)."""
    warns: list[str] = []
    hf = _check_model(cfg, hf)
    context = getattr(hf, "max_position_embeddings", None)
    longest, key = response_budget(cfg)
    if context and longest >= context:
        raise ConfigError(f"{key}={longest} leaves no room for a prompt in the model's context "
                          f"(max_position_embeddings={context} in model.hf_config): lower it")
    _check_algorithm(cfg, warns)
    _check_rollout(cfg, warns)
    if cfg.rollout.producer in PRODUCERS:  # an unknown one: the trainer names it (a plugin may register it)
        PRODUCERS.get(cfg.rollout.producer).check_config(cfg, warns)  # the producer's own settings
    engine = ENGINES.get(cfg.rollout.engine)
    engine.check_config(cfg, warns, world_size, nodes)  # the engine's own settings
    transport = TRANSPORTS.get(cfg.rollout.sync_transport)
    if hasattr(transport, "check_config"):  # what the transport needs of the engine
        transport.check_config(cfg, engine)
    _check_fp8(cfg, hf, warns)
    _check_lora(cfg, hf)
    _check_counts(cfg, warns)
    _check_critic(cfg, warns)
    if cfg.model.expert_bias_update_rate > 0 and cfg.routing.mode != "off":
        warns.append(f"model.expert_bias_update_rate={cfg.model.expert_bias_update_rate} with routing.mode="
                     f"{cfg.routing.mode}: the routers' bias is updated from the replayed routes' expert loads "
                     "(the rollout's or the old pass's), and every sync moves the engine's routing with it")
    if world_size is not None:
        try:
            layout = resolve_layout(cfg.parallel, world_size, hf)
        except ParallelLayoutError as e:
            raise ConfigError(f"{e} (world size {world_size})") from None
        if hasattr(transport, "check_layout"):  # what the transport needs of the learner's and servers' layouts
            transport.check_layout(cfg, hf, layout, world_size)
    _check_context(cfg, hf)
    _check_batch(cfg, world_size)
    _check_data(cfg, warns, files)
    for w in warns if log_warnings else ():  # the launcher checks quietly: its workers say them
        log.warning("config: %s", w)
    return warns


__all__ = ["check_run_config", "ConfigError"]
