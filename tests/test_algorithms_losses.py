"""Policy losses, KL, mismatch corrections and aggregation vs independent float64 transcriptions of the
papers (tests/algo_reference.py), on random inputs with padding (NaN in padded slots) and varied lengths."""
import math
import warnings

import pytest
import torch

from rlpo_mega.algorithms import losses as L
from rlpo_mega.algorithms.aggregation import MODES, global_mean
from rlpo_mega.algorithms.objective import AggregationPitfallWarning, policy_objective, resolve_loss
from rlpo_mega.training.batches import MicroBatch
from rlpo_mega.config import AlgorithmConfig
from rlpo_mega.reductions import Stat
from tests import algo_reference as ref

LOSS_NAMES = ["ppo_clip", "grpo", "dapo", "gspo", "gspo_token", "sapo"]
DEFAULT_AGG = {"ppo_clip": "token-mean", "grpo": "seq-mean-token-mean", "dapo": "token-mean",
               "gspo": "seq-mean-token-mean", "gspo_token": "seq-mean-token-mean", "sapo": "seq-mean-token-mean"}
NORM_LEN = 12
STARTS = [0, 2, 4, 1, 0, 6, 3, 0]
LENGTHS = [9, 5, 1, 7, 0, 3, 6, 2]  # one fully masked row (overlong-filtered sample)


def make_batch(seed, spread, dtype=torch.float64, token_adv=False):
    """spread: 'near' (log-ratios ~1e-4, inside/around GSPO's 3e-4/4e-4) or 'far' (~0.3, PPO clip range)."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(STARTS), 9
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i, (st, n) in enumerate(zip(STARTS, LENGTHS)):
        mask[i, st:st + n] = True
    logp = -3 * torch.rand(b, s, generator=g, dtype=torch.float64)
    if spread == "near":
        noise = 1e-3 * torch.randn(b, s, generator=g, dtype=torch.float64)
        noise = torch.where(mask, noise - (noise * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1), 0)
        offset = torch.tensor([0.0, 1e-4, -5e-4, 6e-4, -2e-4, 2e-3, -1e-3, 3.5e-4], dtype=torch.float64)
        old = logp - offset[:, None] - noise
    else:
        old = logp + 0.3 * torch.randn(b, s, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    adv[3] = 0.0
    adv = adv[:, None].expand(b, s).clone()
    if token_adv:
        adv = adv + 0.5 * torch.randn(b, s, generator=g, dtype=torch.float64)
    for t in (logp, old, adv):
        t[~mask] = float("nan")  # padding garbage must not leak
    return {"logp": logp.to(dtype), "old_logp": old.to(dtype), "advantages": adv.to(dtype), "loss_mask": mask}


def algo_cfg(name, aggregation=None, **loss_kw):
    cfg = AlgorithmConfig()
    cfg.loss.name = name
    cfg.loss.aggregation = aggregation
    cfg.loss.norm_length = NORM_LEN
    for k, v in loss_kw.items():
        setattr(cfg.loss, k, v)
    return cfg


def paper_params(cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AggregationPitfallWarning)
        r = resolve_loss(cfg.loss).params
    return {"eps_low": r.eps_low, "eps_high": r.eps_high, "dual_clip": r.dual_clip, "tau_pos": r.tau_pos,
            "tau_neg": r.tau_neg, "clamp": r.log_ratio_clamp}


def run_impl(batch, cfg, rows=None):
    """Global loss and its gradient w.r.t. the new log-probs, optionally split into micro-batches."""
    lp = batch["logp"].clone().requires_grad_()
    parts = []
    for sl in rows or [slice(None)]:
        mb = MicroBatch(**{k: v[sl] for k, v in batch.items() if k != "logp"})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AggregationPitfallWarning)
            num, cnt, report = policy_objective(lp[sl], mb, cfg)
        parts.append((num, cnt))
    loss = global_mean(parts)
    loss.backward()
    return loss.detach(), torch.nan_to_num(lp.grad), report


def run_ref(batch, name, mode, P, kl=None):
    lp = batch["logp"].double().clone().requires_grad_()
    old, adv, mask = batch["old_logp"].double(), batch["advantages"].double(), batch["loss_mask"]
    terms = ref.token_terms(name, lp, old, adv, mask, P)
    if kl is not None:
        est, coef, ref_lp = kl
        kts = ref.kl_terms(est, lp, ref_lp, mask)
        terms = [[a + coef * k for a, k in zip(ts, ks)] for ts, ks in zip(terms, kts)]
    loss = ref.aggregate(terms, mode, NORM_LEN)
    loss.backward()
    return loss.detach(), torch.nan_to_num(lp.grad)


def assert_close(got, want, rtol, what):
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= rtol * max(scale, 1e-30), f"{what}: max abs err {err:.3e} (scale {scale:.3e})"


@pytest.mark.parametrize("spread", ["near", "far"])
@pytest.mark.parametrize("mode", [None, *MODES])
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_loss_matches_paper(name, mode, spread):
    cfg = algo_cfg(name, mode)
    P = paper_params(cfg)
    mode = mode or DEFAULT_AGG[name]
    for seed in (0, 1):
        batch = make_batch(seed, spread, token_adv=name in ("ppo_clip", "grpo", "dapo", "sapo", "gspo_token"))
        want, want_g = run_ref(batch, name, mode, P)
        got, got_g, _ = run_impl(batch, cfg)
        assert_close(got, want, 1e-12, f"{name}/{mode} value")
        assert_close(got_g, want_g, 1e-10, f"{name}/{mode} grad")
        got32, got32_g, _ = run_impl({k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}, cfg)
        assert_close(got32, want, 1e-5, f"{name}/{mode} float32 value")
        assert_close(got32_g, want_g, 1e-4, f"{name}/{mode} float32 grad")


def test_resolve_paper_defaults():
    for name, agg in DEFAULT_AGG.items():
        assert resolve_loss(algo_cfg(name).loss).aggregation == agg
    assert paper_params(algo_cfg("gspo"))["eps_low"] == 3e-4 and paper_params(algo_cfg("gspo"))["eps_high"] == 4e-4
    assert paper_params(algo_cfg("dapo"))["eps_low"] == 0.2 and paper_params(algo_cfg("dapo"))["eps_high"] == 0.28
    p = paper_params(algo_cfg("sapo"))
    assert (p["tau_pos"], p["tau_neg"]) == (1.0, 1.05)
    assert AlgorithmConfig().kl.coef == 0.0 and AlgorithmConfig().mismatch.mode == "none"
    assert all(paper_params(algo_cfg(n))["dual_clip"] is None for n in LOSS_NAMES)  # no hidden dual clip


def test_dual_clip_matches_reference():
    cfg = algo_cfg("grpo", dual_clip=1.2)
    batch = make_batch(3, "far")
    want, want_g = run_ref(batch, "grpo", "seq-mean-token-mean", paper_params(cfg))
    got, got_g, report = run_impl(batch, cfg)
    assert_close(got, want, 1e-12, "dual clip value")
    assert_close(got_g, want_g, 1e-10, "dual clip grad")
    assert report["dual_clip_frac"][0] > 0, "test data must exercise the dual clip"


@pytest.mark.parametrize("tau", [0.05, 0.5, 1.0, 1.05, 3.0, 20.0])
def test_sapo_gradient_weight_is_one_at_ratio_one(tau):
    batch = make_batch(4, "far")
    batch["old_logp"] = batch["logp"].clone()  # r = 1 everywhere
    cfg = algo_cfg("sapo", "token-mean", tau_pos=tau, tau_neg=tau)
    loss, grad, report = run_impl(batch, cfg)
    mask, adv = batch["loss_mask"], batch["advantages"]
    n = int(mask.sum())
    # d loss / d logp_it = -A_i * weight_it / n  =>  weight = -grad * n / A
    nz = mask & (adv != 0)
    weight = -grad[nz] * n / adv[nz]
    # exactly 1 mathematically; the autograd chain (x 4/tau, x p(1-p), x tau, / n) rounds at ~1 ulp
    assert (weight - 1).abs().max() <= 1e-15, weight
    assert report["gate_weight_mean"][0] == report["gate_weight_mean"][1]  # 4 p (1-p) r == 1 exactly


@pytest.mark.parametrize("spread", ["near", "far"])
def test_gspo_token_equals_gspo_with_sequence_advantages(spread):
    batch = make_batch(5, spread)
    a, ga, _ = run_impl(batch, algo_cfg("gspo"))
    b, gb, _ = run_impl(batch, algo_cfg("gspo_token"))
    assert_close(b, a, 1e-14, "gspo_token value")
    assert_close(gb, ga, 1e-12, "gspo_token grad")
    assert ga.abs().sum() > 0


def test_dapo_symmetric_equals_grpo_token_mean():
    batch = make_batch(6, "far", token_adv=True)
    a, ga, _ = run_impl(batch, algo_cfg("dapo", eps_low=0.2, eps_high=0.2))
    b, gb, _ = run_impl(batch, algo_cfg("grpo", "token-mean"))
    assert torch.equal(a, b) and torch.equal(ga, gb)


@pytest.mark.parametrize("name", ["ppo_clip", "dapo", "gspo", "gspo_token"])
def test_clipped_tokens_get_exactly_zero_gradient(name):
    cfg = algo_cfg(name)
    P = paper_params(cfg)
    batch = make_batch(7, "near" if name.startswith("gspo") else "far")
    _, grad, report = run_impl(batch, cfg)
    mask, adv = batch["loss_mask"], batch["advantages"]
    lr = torch.where(mask, batch["logp"] - batch["old_logp"], 0)
    if name.startswith("gspo"):
        lr = (lr.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(lr)
    r = lr.exp()
    clipped = mask & (((adv > 0) & (r > 1 + P["eps_high"])) | ((adv < 0) & (r < 1 - P["eps_low"])))
    free = mask & ~clipped & (adv != 0)
    assert clipped.any() and free.any(), "test data must have clipped and unclipped tokens"
    assert (grad[clipped] == 0).all()
    assert (grad[free] != 0).all()
    n = int(mask.sum())
    got = float(report["clip_frac_high"][0] + report["clip_frac_low"][0]) / n
    assert got == pytest.approx(int(clipped.sum()) / n)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3+"])
def test_kl_term_matches_reference(estimator):
    batch = make_batch(8, "far")
    g = torch.Generator().manual_seed(9)
    batch["ref_logp"] = torch.where(batch["loss_mask"], batch["logp"] + 0.4 * torch.randn(batch["logp"].shape, generator=g,
                                                                                            dtype=torch.float64), float("nan"))
    cfg = algo_cfg("grpo")
    cfg.kl.coef, cfg.kl.estimator = 0.04, estimator
    got, got_g, report = run_impl(batch, cfg)
    value_est = "k3" if estimator == "k3+" else estimator
    want, _ = run_ref(batch, "grpo", "seq-mean-token-mean", paper_params(cfg), kl=(value_est, 0.04, batch["ref_logp"]))
    grad_est = "k2" if estimator == "k3+" else estimator  # k3+: k3's value, k2's gradient
    _, want_g = run_ref(batch, "grpo", "seq-mean-token-mean", paper_params(cfg), kl=(grad_est, 0.04, batch["ref_logp"]))
    assert_close(got, want, 1e-12, f"{estimator} value")
    assert_close(got_g, want_g, 1e-10, f"{estimator} grad")
    assert report["kl"][0] != 0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_mismatch_correction_matches_reference(mode, level):
    batch = make_batch(10, "far", token_adv=True)
    mask = batch["loss_mask"]
    g = torch.Generator().manual_seed(11)
    noise = 0.6 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    batch["rollout_logp"] = torch.where(mask, batch["old_logp"] + noise, float("nan"))
    cfg = algo_cfg("dapo")
    cfg.mismatch.mode, cfg.mismatch.level = mode, level
    cfg.mismatch.mis_low, cfg.mismatch.mis_high = {"token": (0.6, 1.6), "sequence": (0.3, 3.0), "geometric": (0.85, 1.15)}[level]
    got, got_g, report = run_impl(batch, cfg)
    lp = batch["logp"].double().clone().requires_grad_()
    terms = ref.token_terms("dapo", lp, batch["old_logp"], batch["advantages"], mask, paper_params(cfg))
    ws = ref.mismatch_weight_terms(batch["old_logp"], batch["rollout_logp"], mask, level)
    if mode == "tis":
        terms = [[l * min(w, cfg.mismatch.tis_cap) for l, w in zip(ts, wt)] for ts, wt in zip(terms, ws)]
    else:
        terms = [[l for l, w in zip(ts, wt) if cfg.mismatch.mis_low <= w <= cfg.mismatch.mis_high]
                 for ts, wt in zip(terms, ws)]
        dropped = sum(len(t) for t in ws) - sum(len(t) for t in terms)
        assert 0 < dropped < sum(len(t) for t in ws), "test data must mask some tokens, not all"
    want = ref.aggregate(terms, "token-mean")
    want.backward()
    assert_close(got, want.detach(), 1e-12, f"{mode}/{level} value")
    assert_close(got_g, torch.nan_to_num(lp.grad), 1e-10, f"{mode}/{level} grad")
    # metrics: k3 KL(rollout || train) = w - 1 - log w, |w - 1| (token level)
    tok = [w for wt in ref.mismatch_weight_terms(batch["old_logp"], batch["rollout_logp"], mask, "token") for w in wt]
    k3 = sum(w - 1 - math.log(w) for w in tok) / len(tok)
    assert float(report["mismatch/k3_kl"][0] / report["mismatch/k3_kl"][1]) == pytest.approx(k3, rel=1e-12)
    assert float(report[Stat("mismatch/ratio_dev_max", "max")][0]) == pytest.approx(max(abs(w - 1) for w in tok), rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_gradient_invariant_under_micro_batches(name, mode):
    """Loss gradient of the batch == sum over 4 (uneven) micro-batches, normalised by global counts."""
    batch = make_batch(12, "near" if name.startswith("gspo") else "far")
    cfg = algo_cfg(name, mode)
    whole, g_whole, _ = run_impl(batch, cfg)
    split, g_split, _ = run_impl(batch, cfg, rows=[slice(0, 1), slice(1, 4), slice(4, 5), slice(5, 8)])
    assert_close(split, whole, 1e-13, "value")
    assert_close(g_split, g_whole, 1e-13, "grad")
    assert g_whole.abs().sum() > 0


def test_tis_reweights_the_policy_term_not_the_kl_term():
    batch = make_batch(13, "far", token_adv=True)
    mask = batch["loss_mask"]
    g = torch.Generator().manual_seed(14)
    batch["rollout_logp"] = torch.where(mask, batch["old_logp"] + 0.6 * torch.randn(mask.shape, generator=g,
                                                                                    dtype=torch.float64), float("nan"))
    batch["ref_logp"] = torch.where(mask, batch["logp"] + 0.3 * torch.randn(mask.shape, generator=g,
                                                                           dtype=torch.float64), float("nan"))
    cfg = algo_cfg("grpo")
    cfg.mismatch.mode, cfg.kl.coef = "tis", 0.04
    got, got_g, _ = run_impl(batch, cfg)
    lp = batch["logp"].double().clone().requires_grad_()
    pg = ref.token_terms("grpo", lp, batch["old_logp"], batch["advantages"], mask, paper_params(cfg))
    kl = ref.kl_terms("k3", lp, batch["ref_logp"], mask)
    ws = ref.mismatch_weight_terms(batch["old_logp"], batch["rollout_logp"], mask, "token")
    terms = [[p * min(w, 2.0) + 0.04 * k for p, k, w in zip(*t)] for t in zip(pg, kl, ws)]
    want = ref.aggregate(terms, "seq-mean-token-mean")
    want.backward()
    assert_close(got, want.detach(), 1e-12, "value")
    assert_close(got_g, torch.nan_to_num(lp.grad), 1e-10, "grad")
