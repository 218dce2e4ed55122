"""Advantages, reward shaping, dynamic sampling, batch assembly and bad inputs (clear errors)."""
import math
import warnings

import pytest
import torch

from rlpo_mega.algorithms import advantages as A
from rlpo_mega.algorithms.dynamic_sampling import filter_groups
from rlpo_mega.algorithms.logprobs import vocab_parallel_logprobs
from rlpo_mega.algorithms.objective import AggregationPitfallWarning, policy_objective, resolve_loss, validate
from tools.batch_support import assemble_batch
from rlpo_mega.algorithms.shaping import overlong_filter, soft_overlong_punishment
from rlpo_mega.config import AdvantageConfig, AlgorithmConfig, load_config
from rlpo_mega.training.batches import MicroBatch
from tests import algo_reference as ref


def rewards_and_groups(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [4, 4, 3, 5, 2, 4]
    groups = torch.cat([torch.full((n,), 10 * k + 3) for k, n in enumerate(sizes)])  # arbitrary labels
    r = torch.randn(len(groups), generator=g, dtype=torch.float64)
    r[groups == 13] = 0.7  # all equal (not exactly representable: rounding must not leak through eps)
    r[groups == 43] = 1.0
    perm = torch.randperm(len(groups), generator=g)  # groups interleaved
    return r[perm], groups[perm]


@pytest.mark.parametrize("std", ["unbiased", "biased"])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_advantages_match_reference(name, std):
    r, groups = rewards_and_groups(0)
    cfg = AdvantageConfig(name=name, eps=1e-6, std=std)
    out = A.compute_advantages(cfg, r.float(), groups)
    want = torch.tensor(ref.advantages(name, r.tolist(), groups.tolist(), eps=1e-6, std=std), dtype=torch.float64)
    err = (out.advantages.double() - want).abs().max().item()
    assert err <= 1e-6 * want.abs().max().item(), err  # float32 output of a float64 computation
    assert out.num_groups == 6 and out.num_zero_groups == 2
    zero = (groups == 13) | (groups == 43)
    assert (out.advantages[zero] == 0).all()  # exactly zero, not rounding noise / eps


def test_advantage_hook_for_per_token_estimators():
    @A.ADVANTAGES.register("test_token_discount")
    def token_discount(r, idx, g, cfg, mask=None, **_):
        base = A.ADVANTAGES.get("dr_grpo")(r, idx, g, cfg)
        return base[:, None] * mask.double().cumsum(1).flip(1) / mask.sum(1, keepdim=True)

    try:
        r, groups = rewards_and_groups(1)
        mask = torch.ones(len(r), 5, dtype=torch.bool)
        out = A.compute_advantages(AdvantageConfig(name="test_token_discount"), r, groups, mask=mask)
        assert out.advantages.shape == (len(r), 5) and out.num_zero_groups == 2
    finally:
        A.ADVANTAGES._entries.pop("test_token_discount")


def test_soft_overlong_punishment_matches_paper():
    lengths = torch.tensor([0, 10, 15, 16, 17, 18, 19, 20, 21, 100])
    got = soft_overlong_punishment(lengths, max_length=20, cache_length=4)
    want = torch.tensor([ref.soft_overlong(int(x), 20, 4) for x in lengths], dtype=torch.float32)
    assert torch.allclose(got, want, atol=0, rtol=1e-7), (got, want)
    assert got[3] == 0 and got[7] == -1 and got[8] == -1
    # paper values: L_max = 20480, L_cache = 4096
    assert float(soft_overlong_punishment(torch.tensor([18432]), 20480, 4096)) == pytest.approx(-0.5)


def test_overlong_filter_masks_truncated_samples():
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = overlong_filter(mask, torch.tensor([False, True, False]))
    assert out.sum(1).tolist() == [4, 0, 4]


def test_dynamic_sampling_filter():
    acc = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1, 1, 0.5, 0.5, 0, 1])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4])
    f = filter_groups(acc, groups)
    assert f.keep.tolist() == [False] * 6 + [True] * 3 + [False, False, True, True]
    assert f.stats() == {"groups": 5, "kept_groups": 2, "dropped_all_zero": 1, "dropped_all_one": 1,
                         "dropped_other_constant": 1}


def test_assemble_batch_shapes_masks_and_shaping():
    cfg = AlgorithmConfig()
    cfg.shaping.soft_overlong, cfg.shaping.max_response_length, cfg.shaping.overlong_cache = True, 4, 2
    cfg.shaping.overlong_filter = True
    prompts = [[5, 6], [7], [5, 6], [7]]
    responses = [[1, 2, 3], [4], [9, 9, 9, 9], [8, 8]]
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    batch, stats = assemble_batch(prompts, responses, rewards, torch.tensor([0, 1, 0, 1]), cfg, seq_length=6,
                                  truncated=torch.tensor([False, False, True, False]),
                                  rollout_logps=[[-.1, -.2, -.3], [-.4], [-1] * 4, [-.5, -.6]])
    assert batch.tokens.shape == (4, 6) and batch.labels[0, :4].tolist() == [6, 1, 2, 3]
    assert batch.loss_mask[0].tolist() == [False, True, True, True, False, False]
    assert batch.loss_mask[2].sum() == 0  # truncated: filtered
    assert batch.rollout_logp[0, 1:4].tolist() == pytest.approx([-.1, -.2, -.3])
    assert batch.rollout_logp[1, 0].item() == pytest.approx(-.4)
    # lengths 3 and 4 with L_max 4, L_cache 2: penalties -0.5 and -1 before the advantages
    assert stats["overlong_penalty_mean"] == pytest.approx((-0.5 - 1.0 + 0 + 0) / 4)
    assert stats["groups"] == 2 and stats["overlong_filtered"] == 1


# ---------------------------------------------------------------- bad inputs: clear errors

def cfg_with(**loss):
    cfg = AlgorithmConfig()
    for k, v in loss.items():
        setattr(cfg.loss, k, v)
    return cfg


@pytest.mark.parametrize("kw, match", [
    (dict(name="ppo"), r"unknown policy loss 'ppo'; known: dapo, grpo, gspo, gspo_token, ppo_clip, sapo"),
    (dict(name="dapo", eps_low=-0.1), r"eps_low=-0.1 must be a finite number >= 0"),
    (dict(name="gspo", eps_high=-1e-4), r"eps_high=-0.0001 must be a finite number >= 0"),
    (dict(name="dapo", eps_low=1.2), r"eps_low=1.2 must be < 1.*inverted"),
    (dict(name="grpo", eps_low=0.2, eps_high=0.3), r"grpo clips symmetrically.*use loss.name=dapo"),
    (dict(name="sapo", tau_pos=0.0), r"tau_pos=0.0 must be > 0"),
    (dict(name="sapo", tau_neg=-1.0), r"tau_neg=-1.0 must be > 0"),
    (dict(name="sapo", eps_low=0.2), r"sapo has no clip range"),
    (dict(name="grpo", dual_clip=0.9), r"dual clip needs c > 1"),
    (dict(name="grpo", aggregation="mean"), r"unknown loss aggregation 'mean'; known: token-mean"),
    (dict(name="grpo", aggregation="seq-mean-token-sum-norm"), r"needs a constant length"),
    (dict(name="gspo", aggregation="token-mean", strict=True), r"gspo with token-mean aggregation makes.*length-weighted"),
])
def test_bad_loss_config(kw, match):
    with pytest.raises((ValueError, KeyError), match=match):
        resolve_loss(cfg_with(**kw).loss)


def test_gspo_token_mean_is_a_warning_naming_the_pitfall():
    with pytest.warns(AggregationPitfallWarning, match="length-weighted"):
        resolve_loss(cfg_with(name="gspo", aggregation="token-mean").loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_loss(cfg_with(name="gspo").loss)  # paper default: silent


@pytest.mark.parametrize("section, key, value, match", [
    ("advantage", "name", "ppo", r"unknown advantage estimator 'ppo'; known: dr_grpo, gae, grpo, rloo"),
    ("advantage", "std", "sample", r"advantage.std='sample'"),
    ("kl", "estimator", "k4", r"unknown KL estimator 'k4'; known: k1, k2, k3, k3\+"),
    ("kl", "coef", -0.1, r"kl.coef=-0.1 must be >= 0"),
    ("mismatch", "mode", "icepop", r"unknown mismatch correction 'icepop'; known: none, tis, mis"),
    ("mismatch", "mis_low", 3.0, r"0 <= mis_low <= mis_high"),
    ("mismatch", "tis_cap", 0.0, r"tis_cap=0.0 must be > 0"),
])
def test_bad_algorithm_config(section, key, value, match):
    cfg = AlgorithmConfig()
    setattr(getattr(cfg, section), key, value)
    with pytest.raises((ValueError, KeyError), match=match):
        validate(cfg)


def test_config_loads_from_dotted_overrides():
    cfg = load_config(None, ("algorithm.loss.name=sapo", "algorithm.loss.tau_neg=1.2", "algorithm.kl.coef=0.01"))
    assert cfg.algorithm.loss.name == "sapo" and cfg.algorithm.loss.tau_neg == 1.2
    validate(cfg.algorithm)


def small_batch():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    return MicroBatch(loss_mask=mask, old_logp=torch.full((2, 3), -1.0), advantages=torch.tensor([1.0, -1.0]))


def test_bad_tensors():
    cfg = AlgorithmConfig()
    lp = torch.full((2, 3), -1.0)
    with pytest.raises(ValueError, match=r"log-probs \(2, 4\) and loss_mask \(2, 3\) differ in shape"):
        policy_objective(torch.zeros(2, 4), small_batch(), cfg)
    b = small_batch()
    b.old_logp = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"old_logp \(2, 2\) and the new log-probs \(2, 3\) differ in shape"):
        policy_objective(lp, b, cfg)
    b = small_batch()
    b.old_logp[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"old_logp has 1 NaN/inf values at valid \(unmasked\) tokens$"):
        policy_objective(lp, b, cfg)
    bad = lp.clone()
    bad[0, 1] = float("nan")  # the model's own output: a non-finite loss the trainer skips, not an input error
    numerator, _, _ = policy_objective(bad, small_batch(), cfg)
    assert torch.isnan(numerator)
    ok = lp.clone()
    ok[0, 2] = float("nan")  # padding: fine
    policy_objective(ok, small_batch(), cfg)
    b = small_batch()
    b.advantages = torch.zeros(3)
    with pytest.raises(ValueError, match=r"advantages \(3,\) must be \[batch\] or \[batch, seq\]"):
        policy_objective(lp, b, cfg)
    b = small_batch()
    b.advantages = torch.tensor([[1.0, 2.0, 0.0], [1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"gspo needs one advantage per sequence.*gspo_token"):
        policy_objective(lp, b, cfg_with(name="gspo"))
    b = small_batch()
    b.old_logp = None
    with pytest.raises(ValueError, match=r"the batch has no 'old_logp'"):
        policy_objective(lp, b, cfg)
    cfg.kl.coef = 0.1
    with pytest.raises(ValueError, match=r"needs ref_logp"):
        policy_objective(lp, small_batch(), cfg)
    with pytest.raises(ValueError, match=r"rewards contain NaN"):
        A.compute_advantages(AdvantageConfig(), torch.tensor([1.0, math.nan]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"rloo needs at least 2 responses"):
        A.compute_advantages(AdvantageConfig(name="rloo"), torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match=r"0 < L_cache <= L_max"):
        soft_overlong_punishment(torch.tensor([3]), 4, 8)


def test_bad_logprob_inputs():
    logits = torch.randn(2, 3, 10)
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, 8\).*\[0, 9\]"):
        vocab_parallel_logprobs(logits, torch.tensor([[0, 1, 9], [0, 0, 0]]), real_vocab=8, group=None)
    with pytest.raises(ValueError, match=r"logits \(2, 3, 10\) and labels \(2, 2\) disagree"):
        vocab_parallel_logprobs(logits, torch.zeros(2, 2, dtype=torch.long), group=None)
    with pytest.raises(ValueError, match=r"temperature=0.0 must be a positive"):
        vocab_parallel_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0.0, group=None)
    with pytest.raises(ValueError, match=r"real_vocab=11 must be in \(0, 10\]"):
        vocab_parallel_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), real_vocab=11, group=None)
