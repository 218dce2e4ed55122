"""Chunked vocab-parallel log-probs and entropy vs float64 log_softmax (single process; TP2 in
test_algorithms_dist.py)."""
import pytest
import torch

from rlpo_mega.algorithms.logprobs import vocab_parallel_logprobs


def reference(logits, labels, temperature, real_vocab, g_lp, g_h):
    x = logits.detach().double()[..., :real_vocab].requires_grad_()
    lsm = torch.log_softmax(x / temperature, dim=-1)
    lp = lsm.gather(-1, labels[..., None])[..., 0]
    h = -(lsm.exp() * lsm).sum(-1)
    ((lp * g_lp.double()).sum() + (h * g_h.double()).sum()).backward()
    grad = torch.zeros(logits.shape, dtype=torch.float64)
    grad[..., :real_vocab] = x.grad
    return lp.detach(), h.detach(), grad


def rel(a, b):
    return float((a.detach().double() - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("dtype, tol_grad", [(torch.float32, 2e-6), (torch.float64, 2e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk", [None, 1, 4, 1000])
def test_matches_float64_log_softmax(dtype, tol_grad, temperature, chunk):
    g = torch.Generator().manual_seed(0)
    b, s, v, real = 3, 11, 70, 64  # 6 padded vocabulary columns
    logits = (torch.randn(b, s, v, generator=g) * 5).to(dtype).requires_grad_()
    labels = torch.randint(0, real, (b, s), generator=g)
    g_lp, g_h = torch.randn(b, s, generator=g), torch.randn(b, s, generator=g)
    lp, h = vocab_parallel_logprobs(logits, labels, temperature=temperature, real_vocab=real, group=None,
                                    chunk_size=chunk)
    ((lp * g_lp).sum() + (h * g_h).sum()).backward()
    lp_ref, h_ref, g_ref = reference(logits, labels, temperature, real, g_lp, g_h)
    assert lp.dtype == torch.float32 and logits.grad.dtype == dtype
    assert rel(lp, lp_ref) < 1e-6 and rel(h, h_ref) < 1e-6
    assert rel(logits.grad, g_ref) < tol_grad
    assert (logits.grad[..., real:] == 0).all()


def test_logp_only_gradient_and_no_entropy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 33, generator=g).requires_grad_()
    labels = torch.randint(0, 33, (5,), generator=g)
    lp, h = vocab_parallel_logprobs(logits, labels, with_entropy=False, group=None, chunk_size=2)
    assert (h == 0).all() and not h.requires_grad
    lp.sum().backward()
    lp_ref, _, g_ref = reference(logits, labels, 1.0, 33, torch.ones(5), torch.zeros(5))
    assert rel(lp, lp_ref) < 1e-6 and rel(logits.grad, g_ref) < 2e-6


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0, 3.0], [-50.0, -50.0, -50.0, -50.0]], requires_grad=True)
    lp, h = vocab_parallel_logprobs(logits, torch.tensor([1, 2]), group=None)
    (lp.sum() + h.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(h).all() and torch.isfinite(logits.grad).all()
    assert lp[1].item() == pytest.approx(-torch.log(torch.tensor(4.0)).item(), abs=1e-6)
    assert h[1].item() == pytest.approx(torch.log(torch.tensor(4.0)).item(), abs=1e-6)
