"""GAE, token rewards, whitening and the clipped value loss against float64 transcriptions
(tests/algo_reference.py): Monte-Carlo (lambda = gamma = 1) and TD(0) (lambda = 0) limits, masks and response
lengths of different sizes, a KL penalty folded into the reward, gradients of the value loss. GAE without a loop
over positions against the loop it replaced (tools/bench_gae.gae_loop, float64), at lengths that take every level
of its blocked suffix sum; its number of torch ops does not grow with the length, and it makes no host sync."""
import pytest
import torch

from rlpo_mega.algorithms import gae as G
from tests import algo_reference as ref
from tools.bench_gae import gae_loop


def _batch(seed=0):
    """Rows with prompts and responses of different lengths (one empty response), right padding."""
    g = torch.Generator().manual_seed(seed)
    spans = [(2, 5), (1, 1), (3, 0), (0, 7), (4, 3)]  # (prompt positions, response tokens)
    width = max(p + r for p, r in spans) + 2
    mask = torch.zeros(len(spans), width, dtype=torch.bool)
    for i, (p, r) in enumerate(spans):
        mask[i, p:p + r] = True
    values = torch.randn(len(spans), width, generator=g, dtype=torch.float64)
    rewards = torch.randn(len(spans), width, generator=g, dtype=torch.float64)
    return rewards, values, mask


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.0), (0.99, 0.95), (0.9, 0.5), (1.0, 0.95)])
def test_gae_matches_the_paper(gamma, lam):
    rewards, values, mask = _batch()
    adv, ret = G.gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = ref.gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, want_adv, rtol=0, atol=1e-12) and torch.allclose(ret, want_ret, rtol=0, atol=1e-12)
    assert not adv[~mask].any() and not ret[~mask].any()


def test_gae_limits_monte_carlo_and_td0():
    rewards, values, mask = _batch(1)
    m = mask.double()
    adv, ret = G.gae(rewards, values, mask, 1.0, 1.0)
    # lambda = gamma = 1: the return to go of the row's rewards minus V; the value target is the MC return
    to_go = (rewards * m).flip(1).cumsum(1).flip(1) * m
    assert torch.allclose(adv, to_go - values * m, atol=1e-12) and torch.allclose(ret, to_go, atol=1e-12)
    # lambda = 0: one-step TD error, V after the last response token is 0
    adv0, _ = G.gae(rewards, values, mask, 0.9, 0.0)
    nxt = torch.cat([values[:, 1:] * m[:, 1:], torch.zeros(values.shape[0], 1, dtype=values.dtype)], 1)
    assert torch.allclose(adv0, (rewards + 0.9 * nxt - values) * m, atol=1e-12)


def test_token_rewards_put_the_reward_on_the_last_token_and_fold_in_kl():
    _, _, mask = _batch()
    seq = torch.tensor([1.0, -0.5, 2.0, 0.25, 3.0])
    kl = torch.rand(mask.shape, dtype=torch.float64)
    r = G.token_rewards(seq, mask, kl, kl_coef=0.1)
    for i in range(mask.shape[0]):
        ts = ref.valid_positions(mask, i)
        want = torch.zeros(mask.shape[1], dtype=torch.float64)
        for t in ts:
            want[t] = -0.1 * kl[i, t]
        if ts:
            want[ts[-1]] += seq[i]
        assert torch.allclose(r[i], want, atol=1e-12), i
    # no KL: exactly the sequence reward, once per row with a response
    plain = G.token_rewards(seq, mask)
    assert plain.sum(1).tolist() == [1.0, -0.5, 0.0, 0.25, 3.0] and (plain != 0).sum() == 4


def test_whiten_over_valid_tokens():
    rewards, _, mask = _batch(2)
    w = G.whiten(rewards, mask)
    x = rewards[mask]
    assert torch.allclose(w[mask], (x - x.mean()) / (x.std(unbiased=False) + 1e-8), atol=1e-12)
    assert not w[~mask].any()
    kept = G.whiten(rewards, mask, shift_mean=False)  # scaled to unit std, the mean kept
    assert torch.allclose(kept[mask].mean(), x.mean(), atol=1e-12)
    assert torch.allclose(kept[mask].std(unbiased=False), torch.tensor(1.0, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("clip", [None, 0.2, 0.05])
def test_value_loss_and_its_gradient_match_ppo2(clip):
    _, old, mask = _batch(3)
    g = torch.Generator().manual_seed(4)
    returns = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    v = (old + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    loss, clipped = G.value_loss(v, old, returns, mask, clip)
    v2 = v.detach().clone().requires_grad_(True)
    want = ref.value_loss(v2, old, returns, mask, clip)
    assert torch.allclose(loss, want, atol=1e-12)
    grad, = torch.autograd.grad(loss.sum(), v)
    want_grad, = torch.autograd.grad(want.sum(), v2)
    assert torch.allclose(grad, want_grad, atol=1e-12)
    if clip is None:
        assert not clipped.any()
    else:  # the clip is exercised and a clipped token passes no gradient through V
        assert 0 < int(clipped.sum()) < int(mask.sum())
        assert not grad[clipped].any()


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_over_a_multi_turn_mask_is_gae_over_the_model_tokens(gamma, lam):
    """A multi-turn episode's mask has gaps (observation tokens): GAE there equals the paper's recursion run on
    the model tokens alone (cut out of the row, float64 reference), scattered back; zero at the gaps."""
    g = torch.Generator().manual_seed(3)
    turns = [[(2, 3), (2, 4), (3, 2)], [(1, 1), (4, 2)], [(0, 5)]]  # per row: (gap before, model tokens) per turn
    width = max(sum(a + b for a, b in row) for row in turns) + 2
    mask = torch.zeros(len(turns), width, dtype=torch.bool)
    for i, row in enumerate(turns):
        at = 0
        for gap, n in row:
            mask[i, at + gap:at + gap + n] = True
            at += gap + n
    values = torch.randn(len(turns), width, generator=g, dtype=torch.float64)
    seq = torch.randn(len(turns), generator=g, dtype=torch.float64)
    kl = torch.rand(len(turns), width, generator=g, dtype=torch.float64)
    rewards = G.token_rewards(seq, mask, kl, 0.1)
    adv, ret = G.gae(rewards, values, mask, gamma, lam)
    for i in range(len(turns)):
        pos = mask[i].nonzero()[:, 0]
        one = torch.ones(1, len(pos), dtype=torch.bool)
        want_r = G.token_rewards(seq[i:i + 1], one, kl[i:i + 1, pos], 0.1)
        want_adv, want_ret = ref.gae(want_r, values[i:i + 1, pos], one, gamma, lam)
        assert torch.allclose(rewards[i, pos], want_r[0], rtol=0, atol=1e-15)
        assert torch.allclose(adv[i, pos], want_adv[0], rtol=0, atol=1e-12)
        assert torch.allclose(ret[i, pos], want_ret[0], rtol=0, atol=1e-12)
    assert not adv[~mask].any() and not ret[~mask].any()


def test_bad_inputs():
    rewards, values, mask = _batch()
    with pytest.raises(ValueError, match="lambda"):
        G.gae(rewards, values, mask, 1.0, 1.5)
    with pytest.raises(ValueError, match="clip"):
        G.value_loss(values, values, rewards, mask, 0.0)


def _gapped_mask(rows, width, seed, p=0.7):
    """Random multi-turn masks (gaps anywhere), plus a row without model tokens and a row of model tokens only."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=g) < p
    mask[0] = False
    if rows > 1:
        mask[1] = True
    return mask


# widths: one position; one block (64) exactly; one more (two levels); 3 levels (> 64 * 64)
@pytest.mark.parametrize("width", [1, 64, 65, 300, 4200])
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.0), (0.99, 0.95), (0.9, 0.5), (0.0, 1.0), (1.0, 0.95)])
def test_gae_matches_the_loop_it_replaced(width, gamma, lam):
    """Exact to float64 rounding: every row (none, all, gapped model tokens), the zero after a row's last
    token, the pass-through at observation gaps; float32 inputs give the loop's float32 outputs."""
    g = torch.Generator().manual_seed(width)
    mask = _gapped_mask(4, width, width)
    rewards = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    adv, ret = G.gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = gae_loop(rewards, values, mask, gamma, lam)
    tol = 1e-13 * max(1.0, float(want_adv.abs().max()), float(want_ret.abs().max())) * max(1.0, width / 64)
    assert (adv - want_adv).abs().max() <= tol and (ret - want_ret).abs().max() <= tol
    assert not adv[~mask].any() and not ret[~mask].any()
    adv32, ret32 = G.gae(rewards.float(), values.float(), mask, gamma, lam)
    loop32 = gae_loop(rewards.float(), values.float(), mask, gamma, lam)
    assert adv32.dtype == ret32.dtype == torch.float32
    assert torch.allclose(adv32, loop32[0], rtol=1e-6, atol=1e-6) and torch.allclose(ret32, loop32[1], rtol=1e-6,
                                                                                       atol=1e-6)


def test_gae_edge_shapes():
    """No positions, no rows, no model token anywhere: zeros of the inputs' shape and dtype."""
    for shape in ((3, 0), (0, 5), (2, 7)):
        z = torch.zeros(shape, dtype=torch.float32)
        adv, ret = G.gae(torch.ones(shape), torch.ones(shape), torch.zeros(shape, dtype=torch.bool), 0.99, 0.95)
        assert adv.shape == ret.shape == shape and adv.dtype == torch.float32
        assert torch.equal(adv, z) and torch.equal(ret, z)


def test_gae_never_reads_outside_the_mask():
    """NaN / inf at prompt, observation or padding positions change nothing (the loop's `* mask` made them NaN
    there); the model tokens' results are those of zeros there."""
    rewards, values, mask = _batch(5)
    bad_r, bad_v = rewards.clone(), values.clone()
    bad_r[~mask], bad_v[~mask] = float("nan"), float("inf")
    adv, ret = G.gae(bad_r, bad_v, mask, 0.99, 0.95)
    want_adv, want_ret = gae_loop(rewards, values, mask, 0.99, 0.95)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.allclose(adv, want_adv, rtol=0, atol=1e-12) and torch.allclose(ret, want_ret, rtol=0, atol=1e-12)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that run (and the ones that read a value on the host)."""

    def __init__(self):
        super().__init__()
        self.ops, self.host = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.__name__.split(".")[0] in ("_local_scalar_dense", "nonzero", "masked_select", "item"):
            self.host.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_gae_has_no_loop_over_positions_and_no_host_sync():
    """The loop ran a handful of ops per position; the vectorised GAE runs the same ops at any length, plus one
    level of the blocked suffix sum per factor of 64 (100 positions: 2 levels; 20000: 3), and reads nothing on the
    host (a CUDA run would wait there)."""
    counts = {}
    for width in (100, 20000):
        mask = _gapped_mask(3, width, 0)
        rewards, values = torch.randn(mask.shape), torch.randn(mask.shape)
        with _Ops() as ops:
            G.gae(rewards, values, mask, 0.99, 0.95)
        counts[width] = ops.ops
        assert ops.host == [], (width, ops.host)
    assert counts[20000] <= 2 * counts[100], counts  # the loop: 200x
