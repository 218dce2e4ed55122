"""rlpo_mega.config_checks.check_run_config: every error names its key(s) and fix; warnings are returned and logged;
the shipped recipes pass (and their parallel layout resolves at their world size)."""
from __future__ import annotations

import glob
import json
import logging
import re
from pathlib import Path

import pytest
from transformers import Qwen3Config, Qwen3MoeConfig

from moe.model import load_hf_config
from rlpo_mega.config import ConfigError, load_config
from rlpo_mega.config_checks import check_run_config
from rlpo_mega.distributed import resolve_layout

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = "configs/data/toy_add_train.jsonl"
BASE = (f"prompts.path={PROMPTS}", "reward.function=toy_arith")
RECIPES = sorted(glob.glob(str(ROOT / "configs" / "recipes" / "*.yaml")))


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def tiny_hf():
    return load_hf_config(str(ROOT / "configs" / "models" / "tiny_qwen3_moe.json"))


def _cfg(*overrides):
    return load_config(None, BASE + overrides)


def _err(hf, *overrides, world_size=None, nodes=None):
    with pytest.raises(ConfigError) as e:
        check_run_config(_cfg(*overrides), hf, world_size=world_size, nodes=nodes)
    return str(e.value)


def test_defaults_pass(tiny_hf):
    assert check_run_config(_cfg(), tiny_hf, world_size=1) == []
    assert check_run_config(_cfg("parallel.expert=2"), tiny_hf, world_size=2) == []


def test_demo_config_passes(tiny_hf):
    cfg = load_config(str(ROOT / "configs" / "demo_cpu.yaml"))
    # the demo runs on 2 processes (parallel.expert=2): no error and not a single warning
    assert check_run_config(cfg, None, world_size=2) == []


# ---- routing replay needs a MoE model, checked before the family registry
def test_routing_on_dense_model():
    dense = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=256)
    for mode in ("r2", "r3"):
        msg = _err(dense, f"routing.mode={mode}")
        assert f"routing.mode={mode}" in msg and "Mixture-of-Experts" in msg and "routing.mode=off" in msg
        assert "'qwen3'" in msg
    # routing off: the family registry's message (wrapped)
    assert "model_type 'qwen3' is not supported" in _err(dense)


def test_routing_on_dense_config_file(tmp_path):
    """hf=None reads config.json itself: a dense model_type gets the routing message, not the registry's."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "vocab_size": 256}))
    msg = _err(None, f"model.hf_config={path}", "routing.mode=r3")
    assert "needs a Mixture-of-Experts model" in msg and "num_local_experts = None" in msg
    path.write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 0, "num_hidden_layers": 2}))
    assert "needs a Mixture-of-Experts model" in _err(None, f"model.hf_config={path}", "routing.mode=r2")


def test_routing_on_moe_model_without_moe_layers(tiny_hf):
    hf = Qwen3MoeConfig(**{**tiny_hf.to_dict(), "mlp_only_layers": list(range(tiny_hf.num_hidden_layers))})
    assert "has no MoE layer" in _err(hf, "routing.mode=r3")
    check_run_config(_cfg("routing.mode=r3"), tiny_hf)


def test_unknown_routing_mode(tiny_hf):
    msg = _err(tiny_hf, "routing.mode=r33")
    assert "routing.mode='r33' is not known; known: off, r2, r3. Did you mean 'r3'?" in msg


# ---- algorithm
def test_gspo_with_ppo_clip_warns(tiny_hf, caplog):
    for name in ("gspo", "gspo_token"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlpo_mega"):
            warns = check_run_config(_cfg(f"algorithm.loss.name={name}", "algorithm.loss.eps_low=0.2",
                                          "algorithm.loss.eps_high=0.2"), tiny_hf)
        assert len(warns) == 1 and "PPO-style clip range" in warns[0]
        assert "eps_low=0.0003, eps_high=0.0004" in warns[0]
        assert "PPO-style clip range" in caplog.text
    assert check_run_config(_cfg("algorithm.loss.name=gspo", "algorithm.loss.eps_low=3e-4",
                                 "algorithm.loss.eps_high=4e-4"), tiny_hf) == []
    assert check_run_config(_cfg("algorithm.loss.name=gspo"), tiny_hf) == []


def test_sapo_with_eps_is_an_error(tiny_hf):
    # the objective (rlpo_mega.algorithms.objective.resolve_loss) refuses it too: no clip range to set
    msg = _err(tiny_hf, "algorithm.loss.name=sapo", "algorithm.loss.eps_high=0.2")
    assert "has no clip range" in msg and "algorithm.loss.eps_high=0.2" in msg and "tau_pos" in msg
    assert check_run_config(_cfg("algorithm.loss.name=sapo"), tiny_hf) == []


def test_aggregation_pitfall_is_a_returned_warning(tiny_hf):
    warns = check_run_config(_cfg("algorithm.loss.name=gspo", "algorithm.loss.aggregation=token-mean"), tiny_hf)
    assert len(warns) == 1 and "token-mean" in warns[0]


def test_objective_validation_is_wrapped(tiny_hf):
    assert "algorithm: " in _err(tiny_hf, "algorithm.loss.name=grpo", "algorithm.loss.eps_low=0.1")


def test_temperatures_must_match(tiny_hf):
    msg = _err(tiny_hf, "rollout.temperature=0.7")
    assert "rollout.temperature=0.7 != algorithm.temperature=1.0" in msg and "same tempered distribution" in msg
    check_run_config(_cfg("rollout.temperature=0.7", "algorithm.temperature=0.7"), tiny_hf)


@pytest.mark.parametrize("key,value,suggest", [
    ("algorithm.loss.name", "gpso", "gspo"),
    ("algorithm.advantage.name", "rlo", "rloo"),
    ("algorithm.kl.estimator", "k4", None),
    ("reward.function", "maths", "math"),
    ("rollout.engine", "sglng", "sglang"),
    ("rollout.sync_transport", "in-process", "in_process"),
    ("optim.lr_decay_style", "cosin", "cosine"),
])
def test_unknown_names(tiny_hf, key, value, suggest):
    msg = _err(tiny_hf, f"{key}={value}")
    assert f"{key}={value!r} is not known; known: " in msg
    if suggest:
        assert f"Did you mean {suggest!r}?" in msg


def test_kl_coef(tiny_hf):
    assert "algorithm.kl.coef=-0.1 must be >= 0" in _err(tiny_hf, "algorithm.kl.coef=-0.1")
    assert check_run_config(_cfg("algorithm.kl.coef=0.04"), tiny_hf) == []  # legal: a reference model is built


# ---- rollout
def test_r3_needs_captured_routes(tiny_hf):
    msg = _err(tiny_hf, "routing.mode=r3", "rollout.embedded.capture_routes=false")
    assert "rollout.embedded.capture_routes=true" in msg
    check_run_config(_cfg("routing.mode=r2", "rollout.embedded.capture_routes=false"), tiny_hf)


def test_transport_engine_combinations(tiny_hf):
    # the generic engine-rank transport ("distributed") is test-only (tests/weight_sync_support.py): no config names it
    assert "rollout.sync_transport='distributed' is not known" in _err(tiny_hf, "rollout.sync_transport=distributed")
    assert "use in_process" in _err(tiny_hf, "rollout.sync_transport=sglang_distributed")
    sg = ("rollout.engine=sglang", "rollout.sglang.urls=[http://n3:30000]")
    assert "Did you mean 'sglang_distributed'?" in _err(tiny_hf, *sg, "rollout.sync_transport=distributed")
    warns = check_run_config(_cfg(*sg), tiny_hf)
    assert len(warns) == 1 and "http://n3:30000 may be on other nodes" in warns[0]
    assert check_run_config(_cfg(*sg, "rollout.sync_transport=sglang_distributed"), tiny_hf) == []
    assert check_run_config(_cfg(*sg, "rollout.sync_transport=reshard"), tiny_hf, world_size=2) == []
    # a server layout the shard-to-shard plan does not cover: one line, what and the transport that syncs it
    msg = _err(tiny_hf, *sg, "rollout.sync_transport=reshard", "rollout.sglang.tp_size=2",
               "rollout.sglang.server_args.enable_dp_attention=true", "rollout.sglang.server_args.dp_size=2",
               world_size=2)
    assert "reshard: no shard-to-shard refit plan: DP attention" in msg and "sync_transport=sglang_distributed syncs it" \
        in msg and "\n" not in msg, msg
    tied = load_hf_config(str(ROOT / "configs" / "models" / "tiny_mixtral.json"))  # tie_word_embeddings=true
    msg = _err(tied, *sg, "rollout.sync_transport=reshard", world_size=2)
    assert "reshard with a tied output layer" in msg and "use rollout.sync_transport=sglang_distributed" in msg, msg
    msg = _err(tiny_hf, *sg, "rollout.sync_transport=reshard", "rollout.sglang.server_args.ep_size=3", world_size=2)
    assert "reshard: SGLang layout: tp_size=1 with ep_size=3 attn_dp_size=1 is not a layout" in msg, msg
    assert "embedded engine lives in the learner's process; use in_process" in _err(tiny_hf, "rollout.sync_transport=reshard")
    launched = ("rollout.engine=sglang", "rollout.sglang.launch=true", "model.init_from_hf=/m")
    assert "enable_return_routed_experts=true" in _err(tiny_hf, *launched, "routing.mode=r3")
    check_run_config(_cfg(*launched, "routing.mode=r3",
                          "rollout.sglang.server_args.enable_return_routed_experts=true"), tiny_hf)
    assert "set model.init_from_hf" in _err(tiny_hf, "rollout.engine=sglang", "rollout.sglang.launch=true")
    warns = check_run_config(_cfg("rollout.engine=sglang", "rollout.sync_transport=sglang_distributed"), tiny_hf)
    assert len(warns) == 1 and "no rollout.sglang.urls" in warns[0]


def test_sglang_drivers(tiny_hf):
    """rollout.sglang.drivers: evenly spaced ranks dividing the world, each with a server of its own."""
    sg = ("rollout.engine=sglang", "rollout.sync_transport=sglang_distributed",
          "rollout.sglang.urls=[http://n3:30000,http://n3:30001]", "parallel.expert=2")
    assert check_run_config(_cfg(*sg, "rollout.sglang.drivers=2"), tiny_hf, world_size=4) == []
    assert "rollout.sglang.drivers=0 must be >= 1" in _err(tiny_hf, *sg, "rollout.sglang.drivers=0")
    msg = _err(tiny_hf, *sg, "rollout.sglang.drivers=3", world_size=4)
    assert "rollout.sglang.drivers=3 does not divide the world size 4" in msg and "one of 1, 2, 4" in msg
    assert "does not divide the world size 2" in _err(tiny_hf, *sg, "rollout.sglang.drivers=4", world_size=2)
    msg = _err(tiny_hf, *sg, "rollout.sglang.drivers=4", world_size=4)
    assert "drivers=4 but 2 SGLang server(s) in rollout.sglang.urls" in msg and "drivers <= 2" in msg
    # launched servers: num_servers per node x nodes (known to the trainer and `rlpo-mega train`'s launcher)
    launched = ("rollout.engine=sglang", "rollout.sglang.launch=true", "model.init_from_hf=/m", "routing.mode=off",
                "parallel.expert=2", "rollout.sglang.drivers=2")
    msg = _err(tiny_hf, *launched, world_size=2, nodes=1)
    assert "drivers=2 but 1 SGLang server(s) launched (rollout.sglang.num_servers=1 x 1 node(s))" in msg
    check_run_config(_cfg(*launched, "rollout.sglang.num_servers=2"), tiny_hf, world_size=2, nodes=1)
    check_run_config(_cfg(*launched), tiny_hf, world_size=2, nodes=2)
    assert len(msg.splitlines()) == 1


def test_truncated_sampling_warns(tiny_hf):
    warns = check_run_config(_cfg("rollout.top_p=0.9"), tiny_hf)
    assert len(warns) == 1 and "rollout.top_p=0.9" in warns[0]


# ---- data paths
def test_paths(tiny_hf, tmp_path):
    with pytest.raises(ConfigError, match=r"prompts.path is not set"):
        check_run_config(load_config(None, ("reward.function=toy_arith",)), tiny_hf)
    assert "prompts.path='nope.jsonl' does not exist" in _err(tiny_hf, "prompts.path=nope.jsonl")
    assert "trainer.eval_path is not set" in _err(tiny_hf, "trainer.eval_every=5")
    assert "trainer.eval_path='x.jsonl' does not exist" in _err(tiny_hf, "trainer.eval_every=5",
                                                                 "trainer.eval_path=x.jsonl")
    check_run_config(_cfg("trainer.eval_every=5", f"trainer.eval_path={PROMPTS}"), tiny_hf)
    assert "trainer.warmup.path is not set" in _err(tiny_hf, "trainer.warmup.steps=10")
    check_run_config(_cfg("trainer.warmup.steps=10", f"trainer.warmup.path={PROMPTS}"), tiny_hf)


# ---- counts and batch divisibility
@pytest.mark.parametrize("override,message", [
    ("trainer.epochs=0", "trainer.epochs=0 must be >= 1"),
    ("trainer.mini_batches=0", "trainer.mini_batches=0 must be >= 1"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last=0 must be >= 1"),
    ("checkpoint.save_every=-1", "checkpoint.save_every=-1 must be >= 0"),
    ("algorithm.dynamic_sampling.max_tries=0", "algorithm.dynamic_sampling.max_tries=0 must be >= 1"),
    ("algorithm.dynamic_sampling.max_carry_steps=-1", "algorithm.dynamic_sampling.max_carry_steps=-1 must be >= 0"),
])
def test_counts(tiny_hf, override, message):
    assert message in _err(tiny_hf, override)


DIST_OPT = "optim.use_distributed_optimizer=true"


@pytest.mark.parametrize("overrides,message", [
    (("optim.cpu_offload=true",), "optim.cpu_offload=true needs optim.use_distributed_optimizer=true"),
    ((DIST_OPT, "optim.cpu_offload=true", "optim.offload_fraction=0"), "optim.offload_fraction=0.0 must be in (0, 1]"),
    ((DIST_OPT, "optim.overlap_cpu_optimizer_d2h_h2d=true"), "without optim.cpu_offload=true, where they do nothing"),
    ((DIST_OPT, "optim.offload_fraction=0.5"), "without optim.cpu_offload=true"),
    (("optim.precision_aware=true", "optim.cpu_offload=true"), "needs optim.use_distributed_optimizer=true"),
    ((DIST_OPT, "optim.exp_avg_dtype=bfloat16"), "needs optim.precision_aware=true"),
    ((DIST_OPT, "optim.precision_aware=true", "optim.cpu_offload=true", "optim.exp_avg_sq_dtype=bfloat16"),
     "the host optimizer keeps fp32 moments"),
    ((DIST_OPT, "optim.precision_aware=true"), "needs Transformer Engine's FusedAdam"),
    (("critic.optim.cpu_offload=true", "algorithm.advantage.name=gae"), "critic.optim.cpu_offload=true needs"),
])
def test_optimizer_offload_combinations_megatron_does_not_build(tiny_hf, overrides, message):
    """optim.cpu_offload / precision_aware: what megatron-core 0.16.1 refuses (asserts, or a KeyError at the first
    step for offload without the distributed optimizer) is refused in one line naming the keys."""
    msg = _err(tiny_hf, *overrides)
    assert message in msg and "\n" not in msg, msg


def test_optimizer_offload_with_slimes_flags_passes(tiny_hf):
    cfg = _cfg(DIST_OPT, "optim.cpu_offload=true", "optim.precision_aware=true",
               "optim.overlap_cpu_optimizer_d2h_h2d=true", "optim.offload_fraction=0.5")
    assert check_run_config(cfg, tiny_hf) == []


def test_lr_schedule(tiny_hf):
    assert "optim.min_lr=0.1 must be in [0, optim.lr=0.0001]" in _err(tiny_hf, "optim.min_lr=0.1")
    assert "optim.lr_warmup_init=-1.0 must be in" in _err(tiny_hf, "optim.lr_warmup_init=-1.0")
    msg = _err(tiny_hf, "optim.lr_decay_style=cosine", "optim.lr_warmup_steps=10", "train_iters=2",
               "trainer.mini_batches=2")
    assert "optim.lr_warmup_steps=10 leaves no optimizer step to decay over" in msg and "= 4" in msg
    check_run_config(_cfg("optim.lr_decay_style=cosine", "optim.lr_warmup_steps=3", "train_iters=2",
                          "trainer.mini_batches=2"), tiny_hf)


def test_group_advantage_needs_two_samples(tiny_hf):
    for adv in ("grpo", "dr_grpo", "rloo"):
        msg = _err(tiny_hf, "prompts.n_samples=1", f"algorithm.advantage.name={adv}")
        assert "prompts.n_samples=1" in msg and "n_samples >= 2" in msg


def test_batch_divisibility(tiny_hf):
    # default batch: 8 prompts x 4 samples = 32 sequences
    msg = _err(tiny_hf, "trainer.mini_batches=3")
    assert "8*4 = 32 sequences" in msg and "trainer.mini_batches=3" in msg and "divisor of 32" in msg
    msg = _err(tiny_hf, "prompts.prompts_per_step=6", "prompts.n_samples=3", "parallel.expert=4",
               world_size=4)
    assert "does not split over 4 data-parallel ranks" in msg and "world size 4" in msg
    msg = _err(tiny_hf, "parallel.num_micro_batches=3", "parallel.expert=2", "trainer.layout=padded", world_size=2)
    assert "(32/2 = 16)" in msg and "parallel.num_micro_batches=3" in msg
    assert "parallel.num_micro_batches=3" in _err(tiny_hf, "parallel.num_micro_batches=3", "trainer.layout=padded")
    # packed: ranks hold uneven sample counts anyway (the DP split balances tokens); a rank short of samples
    # runs empty micro-batches, so the count need not divide the share
    check_run_config(_cfg("parallel.num_micro_batches=3", "parallel.expert=2"), tiny_hf, world_size=2)
    msg = _err(tiny_hf, "parallel.micro_batch_size=4", "parallel.num_micro_batches=2", world_size=2,
               *("parallel.expert=2",))
    assert "set parallel.micro_batch_size=8" in msg
    check_run_config(_cfg("parallel.micro_batch_size=8", "parallel.num_micro_batches=2", "parallel.expert=2"),
                     tiny_hf, world_size=2)
    check_run_config(_cfg("trainer.mini_batches=4", "parallel.num_micro_batches=2", "parallel.expert=4"),
                     tiny_hf, world_size=4)


def test_bad_layout_is_a_config_error(tiny_hf):
    assert "bad parallel layout" in _err(tiny_hf, "parallel.expert=3", world_size=3)


# ---- cluster recipes
def test_recipes_exist():
    names = {Path(p).name for p in RECIPES}
    assert {f"qwen3_30b_a3b_{a}_r3_{n}nodes.yaml" for a in ("gspo", "sapo") for n in (2, 4)} <= names


def test_qwen3_30b_a3b_config():
    hf = load_hf_config(str(ROOT / "configs" / "models" / "qwen3_30b_a3b.json"))
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
            hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.vocab_size) == \
        (2048, 48, 32, 4, 128, 128, 8, 768, 151936)
    assert not hf.tie_word_embeddings and hf.norm_topk_prob


@pytest.mark.parametrize("path", RECIPES, ids=[Path(p).stem for p in RECIPES])
def test_recipe_passes(path):
    world = 8 * int(re.search(r"_(\d+)nodes?", path)[1])  # learner nodes of 8 GPUs
    # the recipes' data path is a placeholder users replace; the SLURM script adds the servers' URLs (at least one
    # per rollout driver), except where the trainer launches them on its own GPUs (the colocated recipe)
    urls = ",".join(f"http://n3:3000{i}" for i in range(4))
    colocated = load_config(path).rollout.colocate
    cfg = load_config(path, (f"prompts.path={PROMPTS}",) + (() if colocated else (f"rollout.sglang.urls=[{urls}]",)))
    hf = load_hf_config(cfg.model.hf_config)
    assert check_run_config(cfg, hf, world_size=world) == []
    layout = resolve_layout(cfg.parallel, world, hf)
    assert layout.world_size == world and layout.expert == (16 if "glm45" in path else 8) and layout.sequence_parallel
    assert cfg.model.params_dtype == "bfloat16" and cfg.routing.mode == "r3" and cfg.rollout.engine == "sglang"
    assert cfg.optim.use_distributed_optimizer
    loss = cfg.algorithm.loss
    if "gspo" in path:
        assert (loss.name, loss.eps_low, loss.eps_high, loss.aggregation) == ("gspo", 3e-4, 4e-4, "seq-mean-token-mean")
    else:
        assert (loss.name, loss.tau_pos, loss.tau_neg, loss.eps_low) == ("sapo", 1.0, 1.05, None)
    # a layout the recipe was not made for is reported as a config error
    with pytest.raises(ConfigError):
        check_run_config(cfg, hf, world_size=world + 2)


def test_yaml_on_off_words_stay_words_for_string_keys(tmp_path):
    """YAML 1.1 reads `off`/`on` as booleans; string-typed keys get the word back (not "False")."""
    path = tmp_path / "c.yaml"
    path.write_text("routing:\n  mode: off\nprompts:\n  chat_template: on\nlogging:\n  wandb: off\n")
    cfg = load_config(str(path), ("algorithm.mismatch.mode=none",))
    assert (cfg.routing.mode, cfg.prompts.chat_template, cfg.logging.wandb) == ("off", "on", False)
    assert load_config(None, ("routing.mode=off",)).routing.mode == "off"


GAE = ("algorithm.advantage.name=gae", "algorithm.loss.name=ppo_clip")


def test_ppo_demo_config_passes(tiny_hf):
    cfg = load_config(str(ROOT / "configs" / "demo_ppo_cpu.yaml"))
    assert check_run_config(cfg, tiny_hf, world_size=2) == []


def test_lora_demo_config_passes(tiny_hf):
    """`make demo-lora`'s RL config: adapters on the base its first command makes (not there yet: files=False), their
    checkpoints adapter-only."""
    cfg = load_config(str(ROOT / "configs" / "demo_lora_cpu.yaml"))
    assert check_run_config(cfg, tiny_hf, world_size=2, files=False) == []
    assert cfg.model.lora.rank == 16 and cfg.model.adapters_only() and cfg.trainer.warmup.steps == 0


def test_gae_with_a_sequence_level_ratio_is_refused(tiny_hf):
    """GSPO clips one ratio per sequence with one advantage per sequence; GAE gives one per token and we define
    no reduction of it: refused, with the token-level variant named."""
    msg = _err(tiny_hf, "algorithm.advantage.name=gae", "algorithm.loss.name=gspo")
    assert "gspo_token" in msg and "algorithm.advantage.name=gae" in msg
    for loss in ("gspo_token", "ppo_clip", "grpo", "dapo", "sapo"):
        check_run_config(_cfg("algorithm.advantage.name=gae", f"algorithm.loss.name={loss}"), tiny_hf)


@pytest.mark.parametrize("override, message", [
    ("critic.vf_clip=0", "critic.vf_clip=0"),
    ("critic.vf_coef=0", "critic.vf_coef=0"),
    ("critic.warmup_steps=-1", "critic.warmup_steps=-1"),
    ("algorithm.advantage.lam=1.5", "advantage.lam=1.5 must lie in [0, 1]"),
    ("critic.optim.min_lr=1.0", "critic.optim.min_lr=1.0"),
])
def test_critic_settings(tiny_hf, override, message):
    assert message in _err(tiny_hf, *GAE, override)


def test_critic_knobs_without_a_critic_are_refused(tiny_hf):
    assert "algorithm.advantage.name=gae" in _err(tiny_hf, "algorithm.kl.in_reward=true", "algorithm.kl.coef=0.1")
    assert "critic.init_from_hf" in _err(tiny_hf, "critic.init_from_hf=somewhere")


def test_critic_warnings(tiny_hf):
    warns = check_run_config(_cfg(*GAE, "critic.warmup_steps=1", "algorithm.kl.in_reward=true"), tiny_hf,
                             log_warnings=False)
    assert any("critic.warmup_steps=1 >= train_iters=1" in w for w in warns)
    assert any("algorithm.kl.in_reward=true with algorithm.kl.coef=0" in w for w in warns)


def test_colocate_refusals(tiny_hf):
    """rollout.colocate=true: each combination the hand-over cannot serve is one line naming the fix (the SGLang
    engine's own checks, rlpo_mega/rollout/sglang_checks.py; the producer's in config_checks)."""
    sg = ("rollout.colocate=true", "rollout.engine=sglang", "rollout.sglang.launch=true", "model.init_from_hf=/m")
    assert check_run_config(_cfg(*sg), tiny_hf) == []
    assert "set rollout.sync_transport=in_process" in _err(tiny_hf, *sg, "rollout.sync_transport=sglang_distributed")
    assert "set rollout.sync_transport=in_process (or reshard" in _err(tiny_hf, *sg, "rollout.sync_transport=disk")
    # reshard: each server rank's shard packed on its GPU (weight_sync/reshard.py, _local)
    assert check_run_config(_cfg(*sg, "rollout.sync_transport=reshard"), tiny_hf) == []
    assert "rollout.sglang.launch=true, no rollout.sglang.urls" in _err(
        tiny_hf, *sg, "rollout.sglang.urls=[http://127.0.0.1:30000]")
    assert "use rollout.producer=sync" in _err(tiny_hf, "rollout.colocate=true", "rollout.producer=async")
    assert "a node has 8 (cluster.gpus_per_node)" in _err(
        tiny_hf, *sg, "rollout.sglang.num_servers=3", "rollout.sglang.tp_size=4", "cluster.learner_nodes=1",
        "cluster.gpus_per_node=8")


def test_colocated_drivers_must_drive_their_own_nodes_servers(tiny_hf):
    """rollout.colocate on several nodes: a driver sends CUDA IPC handles of its node's GPUs, which open on that node
    only; with fewer drivers than nodes (or drivers that do not split a node's servers evenly) one driver's share
    would hold another node's servers: refused in one line naming the layout that works, from the node count
    torchrun gives the trainer or cluster.learner_nodes (`rlpo-mega check`, `plan`)."""
    sg = ("rollout.colocate=true", "rollout.engine=sglang", "rollout.sglang.launch=true", "model.init_from_hf=/m",
          "rollout.sglang.num_servers=2", "rollout.sglang.tp_size=4")
    for how in ({"nodes": 2}, {"cluster": ("cluster.learner_nodes=2",)}):
        extra, nodes = how.get("cluster", ()), how.get("nodes")
        msg = _err(tiny_hf, *sg, *extra, "rollout.sglang.drivers=1", world_size=16, nodes=nodes)
        assert "CUDA IPC handles to servers on another node" in msg and "set rollout.sglang.drivers=2" in msg, msg
        assert "\n" not in msg
        for fine in (2, 4):  # one driver per node; two per node, one server each
            assert check_run_config(_cfg(*sg, *extra, f"rollout.sglang.drivers={fine}"), tiny_hf, world_size=16,
                                    nodes=nodes) == []
    msg = _err(tiny_hf, *sg[:-2], "rollout.sglang.num_servers=3", "rollout.sglang.tp_size=2",
               "rollout.sglang.drivers=4", world_size=16, nodes=2)
    assert "set rollout.sglang.drivers=2 (one per node; or 6)" in msg, msg  # 2 per node cannot split 3 servers
    # one node: any drivers (every server on the node)
    assert check_run_config(_cfg(*sg, "rollout.sglang.drivers=1"), tiny_hf, world_size=8, nodes=1) == []


def test_context_parallel_refusals_name_the_combination(tiny_hf):
    """parallel.context > 1: what megatron-core's THD CP layout and this trainer run under it, each refusal naming
    its keys; the DP split divides by tensor x pipeline x context."""
    assert check_run_config(_cfg("parallel.context=2"), tiny_hf, world_size=2) == []
    assert check_run_config(_cfg("parallel.context=2", "parallel.expert=2", "parallel.tensor=2"), tiny_hf,
                            world_size=4) == []
    msg = _err(tiny_hf, "parallel.context=2", "trainer.layout=padded")
    assert "trainer.layout=padded is not supported" in msg and "trainer.layout=packed" in msg
    msg = _err(tiny_hf, "parallel.context=2", "trainer.warmup.steps=2", f"trainer.warmup.path={PROMPTS}")
    assert "trainer.warmup.steps=2 with parallel.context=2" in msg
    # the budget is the CP group's, and each sample counts padded to 2 x cp x tp
    msg = _err(tiny_hf, "parallel.context=2", "parallel.tensor=2", "rollout.max_new_tokens=30",
               "trainer.max_tokens_per_micro_batch=31")
    assert "per CP group" in msg and "at least 32" in msg
    dropout = Qwen3MoeConfig(**{**tiny_hf.to_dict(), "attention_dropout": 0.1})
    assert "attention_dropout=0.1" in _err(dropout, "parallel.context=2")
    msg = _err(tiny_hf, "parallel.context=3", world_size=4)
    assert "tensor*pipeline*context" in msg
    msg = _err(tiny_hf, "parallel.context=2", "prompts.prompts_per_step=3", "prompts.n_samples=3", world_size=4)
    assert "parallel.context = 1*1*2" in msg
