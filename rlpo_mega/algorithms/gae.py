"""PPO with a critic: token rewards, generalized advantage estimation, whitening and the clipped value loss.

Tensor math only (the critic model and its trainer wiring live elsewhere). Shapes are the loss side's
[n, s] view: `mask` marks each sequence's response tokens, values and rewards are aligned with them. A
multi-turn episode's mask has gaps (the observations between the model's turns): the recursion runs over the
model's tokens only, as if the gaps were cut out.

- token_rewards: the RLHF-PPO reward (Ziegler et al. 2019, InstructGPT): the sequence reward on the last
  response token, minus kl_coef * KL_t on every token when a per-token KL penalty is folded in.
- gae (Schulman et al. 2016): delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambda A_{t+1}, with
  V and A zero after the last response token (the episode ends there); returns R_t = A_t + V_t, the value
  target. lambda = 1, gamma = 1 gives the Monte-Carlo return minus V; lambda = 0 gives TD(0).
- whiten: A -> (A - mean) / (std + eps) over the valid tokens (PPO's advantage normalisation).
- value_loss: 0.5 max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clip(V - V_old, -c, c) (PPO2's vf_clip);
  no clipping when c is None.
Computed in float64 (the recursion accumulates over the sequence); results in the inputs' dtype.
"""
from __future__ import annotations

from typing import Optional

import torch


def _check_mask(mask: torch.Tensor) -> torch.Tensor:
    mask = mask.bool()
    if mask.dim() != 2:
        raise ValueError(f"mask must be [sequences, positions], got {tuple(mask.shape)}")
    return mask


def token_rewards(seq_rewards: torch.Tensor, mask: torch.Tensor, kl: Optional[torch.Tensor] = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """[n] sequence rewards -> [n, s] token rewards: R_i on the last response token, - kl_coef * kl on each
    response token (kl: per-token KL estimate to the reference, [n, s]); zero elsewhere."""
    mask = _check_mask(mask)
    if seq_rewards.shape != mask.shape[:1]:
        raise ValueError(f"sequence rewards {tuple(seq_rewards.shape)} for a mask of {mask.shape[0]} rows")
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if kl is not None and kl_coef:
        out = torch.where(mask, -kl_coef * kl.double(), out)
    has = mask.any(1)
    last = (mask.shape[1] - 1 - mask.flip(1).long().argmax(1))[has]  # each row's last response position
    out[has.nonzero()[:, 0], last] += seq_rewards.double()[has]
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [n, s], zero outside the mask. rewards, values: [n, s] aligned with mask.

    A position outside the mask is not an action: V and A pass through it unchanged. After the last response
    token that is the zero of the episode's end; across a multi-turn episode's observation tokens it links a
    turn's last token to the next turn's first (the environment's step is no decision). So each row's model
    tokens are moved to the left (in order, gaps cut out), the recursion runs there with zeros after the row's
    last token, and the results go back to their positions. No Python loop over positions and no host sync (a
    scatter, a gather, matrix products: tools/bench_gae.py compares it with the loop it replaced): the next
    value is a shift, and A_k = sum_j (gamma lambda)^(j-k) delta_j is `_discounted_suffix_sum`. Inputs outside
    the mask are never read."""
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma={gamma} and lambda={lam} must lie in [0, 1]")
    mask = _check_mask(mask)
    if rewards.shape != mask.shape or values.shape != mask.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must match the mask "
                         f"{tuple(mask.shape)}")
    n, s = mask.shape
    if s == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    k = mask.long().cumsum(1) - 1  # a model token's place among its row's model tokens
    spare = s + torch.arange(s, device=mask.device)  # every other position: a column of its own, dropped
    at = torch.where(mask, k, spare.expand(n, s))

    def left(x):  # [n, s] -> each row's model tokens at 0, 1, ...; zero after the row's last
        out = torch.zeros(n, 2 * s, dtype=torch.float64, device=mask.device)
        return out.scatter_(1, at, x.double())[:, :s]

    r, v = left(rewards), left(values.detach())
    next_v = torch.nn.functional.pad(v[:, 1:], (0, 1))  # V after a row's last model token is 0 (the padding)
    a = _discounted_suffix_sum(r + gamma * next_v - v, gamma * lam)  # delta is 0 after the last: adds nothing
    back = k.clamp(min=0)
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    adv = torch.where(mask, a.gather(1, back), zero)
    returns = torch.where(mask, (a + v).gather(1, back), zero)
    return adv.to(values.dtype), returns.to(values.dtype)


_BLOCK = 64  # positions per matrix of powers: [block, block] float64, n * width * block multiply-adds a level


def _powers(size: int, c: float, like: torch.Tensor) -> torch.Tensor:
    """[size, size]: P[i, j] = c^(j - i) for j >= i, else 0 (c = 0: the identity, 0^0 = 1)."""
    i = torch.arange(size, device=like.device)
    e = i[None, :] - i[:, None]
    p = torch.pow(torch.tensor(c, dtype=torch.float64, device=like.device), e.clamp(min=0).double())
    return torch.where(e >= 0, p, torch.zeros_like(p))


def _discounted_suffix_sum(x: torch.Tensor, c: float, block: int = _BLOCK) -> torch.Tensor:
    """y[:, k] = sum_{j >= k} c^(j - k) x[:, j] for x [n, L] float64 (y_k = x_k + c y_{k+1}, y_L = 0), without a
    loop over positions: the sum within each block of `block` positions is one product with the matrix of
    powers; the sum from each block's start on is the same suffix sum over the blocks' sums (factor c^block),
    done recursively (ceil(log_block L) levels); each position adds c^(block - i) times the next block's."""
    n, length = x.shape
    if length <= block:
        return x @ _powers(length, c, x).T
    blocks = -(-length // block)
    xb = torch.nn.functional.pad(x, (0, blocks * block - length)).view(n, blocks, block)
    within = xb @ _powers(block, c, x).T  # [n, blocks, block]: the sum up to the block's end
    starts = _discounted_suffix_sum(within[:, :, 0], c ** block, block)  # [n, blocks]: the sum from each start
    after = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # from the next block's start (0 after the last)
    tail = _powers(block + 1, c, x)[:, block]  # c^(block - i) for i in 0..block
    y = within + after[:, :, None] * tail[None, None, :block]
    return y.reshape(n, blocks * block)[:, :length]


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / (std + eps) over the valid tokens (population std); zero outside the mask.
    shift_mean=False keeps the mean (scales only)."""
    mask = mask.bool()
    xd = x.double()
    n = mask.sum().clamp(min=1)
    mean = torch.where(mask, xd, torch.zeros_like(xd)).sum() / n
    var = torch.where(mask, (xd - mean) ** 2, torch.zeros_like(xd)).sum() / n
    out = (xd - mean) / (var.sqrt() + eps) + (0.0 if shift_mean else mean)
    return torch.where(mask, out, torch.zeros_like(out)).to(x.dtype)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss [n, s], clipped [n, s] bool): 0.5 (V - R)^2, or with `clip` the pessimistic max over the
    clipped value V_old + clip(V - V_old, -clip, clip); zero outside the mask. The gradient flows to `values`."""
    if clip is not None and not clip > 0:
        raise ValueError(f"value clip={clip} must be > 0 (or None: no clipping)")
    mask = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    target, old = returns.detach(), old_values.detach()
    loss = 0.5 * (values - target) ** 2
    clipped = torch.zeros_like(mask)
    if clip is not None:
        v_clip = old + (values - old).clamp(-clip, clip)
        loss_clip = 0.5 * (v_clip - target) ** 2
        clipped = (loss_clip > loss) & mask
        loss = torch.maximum(loss, loss_clip)
    return torch.where(mask, loss, zero), clipped
