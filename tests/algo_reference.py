"""Independent float64 transcriptions of the papers' formulas (shared/notes/algorithms.md, beside the
repository), written as plain per-sample loops over Python scalars / 0-d tensors, never calling rlpo_mega.algorithms.

Gradients of the references come from autograd through these loops.
"""
from __future__ import annotations

import math

import torch


def clip(x, lo, hi):
    """clip(x, lo, hi): a constant (no gradient) when clipped."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def sigmoid(x):
    return 1 / (1 + torch.exp(-x))


def valid_positions(mask, i):
    return [t for t in range(mask.shape[1]) if bool(mask[i, t])]


def token_terms(name, lp, old, adv, mask, P):
    """Per sequence, the list of per-token loss terms of loss `name` (GSPO: its l_i once per token)."""
    out = []
    for i in range(lp.shape[0]):
        ts = valid_positions(mask, i)
        terms = []
        if name in ("ppo_clip", "grpo", "dapo"):
            for t in ts:
                r = torch.exp(lp[i, t] - old[i, t])
                a = float(adv[i, t])
                l = -min(r * a, clip(r, 1 - P["eps_low"], 1 + P["eps_high"]) * a)
                if P.get("dual_clip") is not None and a < 0:
                    l = min(l, -P["dual_clip"] * a)
                terms.append(l)
        elif name == "gspo":
            if ts:
                mean_log_ratio = sum(lp[i, t] - old[i, t] for t in ts) / len(ts)
                s = torch.exp(torch.clamp(mean_log_ratio, -P["clamp"], P["clamp"]))
                a = float(adv[i, ts[0]])
                l_i = -min(s * a, clip(s, 1 - P["eps_low"], 1 + P["eps_high"]) * a)
                terms = [l_i] * len(ts)
        elif name == "gspo_token":
            if ts:
                mean_log_ratio = sum(lp[i, t] - old[i, t] for t in ts) / len(ts)
                s_i = torch.exp(torch.clamp(mean_log_ratio, -P["clamp"], P["clamp"])).detach()
                for t in ts:
                    s = s_i * torch.exp(lp[i, t] - lp[i, t].detach())
                    a = float(adv[i, t])
                    terms.append(-min(s * a, clip(s, 1 - P["eps_low"], 1 + P["eps_high"]) * a))
        elif name == "sapo":
            for t in ts:
                r = torch.exp(lp[i, t] - old[i, t])
                a = float(adv[i, t])
                tau = P["tau_pos"] if a > 0 else P["tau_neg"]
                terms.append(-(sigmoid(tau * (r - 1)) * 4 / tau) * a)
        else:
            raise KeyError(name)
        out.append(terms)
    return out


def kl_terms(estimator, lp, ref, mask):
    out = []
    for i in range(lp.shape[0]):
        terms = []
        for t in valid_positions(mask, i):
            x = ref[i, t] - lp[i, t]
            if estimator == "k1":
                terms.append(-x)
            elif estimator == "k2":
                terms.append(x * x / 2)
            elif estimator == "k3":
                terms.append(torch.exp(x) - x - 1)
        out.append(terms)
    return out


def aggregate(terms, mode, norm_length=None):
    """terms: per sequence, a list of per-token terms."""
    if mode == "token-mean":
        n = sum(len(ts) for ts in terms)
        return sum(sum(ts) for ts in terms) / n
    if mode == "seq-mean-token-mean":
        seqs = [sum(ts) / len(ts) for ts in terms if ts]
        return sum(seqs) / len(seqs)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(ts) for ts in terms if ts) / (len(terms) * norm_length)
    raise KeyError(mode)


def advantages(name, rewards, groups, eps=1e-6, std="unbiased"):
    out = []
    for i, r in enumerate(rewards):
        group = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        g = len(group)
        mean = sum(group) / g
        if name == "grpo":
            ddof = 1 if std == "unbiased" else 0
            sd = math.sqrt(sum((x - mean) ** 2 for x in group) / (g - ddof)) if g > ddof else 0.0
            a = (r - mean) / (sd + eps)
        elif name == "dr_grpo":
            a = r - mean
        elif name == "rloo":
            a = r - (sum(group) - r) / (g - 1)
        if all(x == group[0] for x in group):
            a = 0.0
        out.append(a)
    return out


def soft_overlong(length, l_max, l_cache):
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def mismatch_weight_terms(old, rollout, mask, level):
    """Per sequence, per valid token: w (token), prod w (sequence) or geometric mean (geometric)."""
    out = []
    for i in range(old.shape[0]):
        ts = valid_positions(mask, i)
        ws = [math.exp(float(old[i, t] - rollout[i, t])) for t in ts]
        if level == "token":
            out.append(ws)
        elif level == "sequence":
            out.append([math.prod(ws)] * len(ws))
        else:
            out.append([math.prod(ws) ** (1 / len(ws))] * len(ws) if ws else [])
    return out


# --- PPO with a critic (Schulman et al. 2016 GAE; PPO2's clipped value loss) --------------------------

def gae(rewards, values, mask, gamma, lam):
    """A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t (V = 0 after the last
    response token); R_t = A_t + V_t. Per row, per token, as the paper writes it."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        ts = valid_positions(mask, i)
        v = [float(values[i, t]) for t in ts] + [0.0]
        delta = [float(rewards[i, t]) + gamma * v[j + 1] - v[j] for j, t in enumerate(ts)]
        for j, t in enumerate(ts):
            a = sum((gamma * lam) ** k * delta[j + k] for k in range(len(ts) - j))
            adv[i, t] = a
            ret[i, t] = a + v[j]
    return adv, ret


def value_loss(values, old_values, returns, mask, clip_range):
    """Per valid token: 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) (or 0.5 (V - R)^2)."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    out = out + 0 * values.double().sum()  # keeps autograd's graph when every token is masked
    for i in range(mask.shape[0]):
        for t in valid_positions(mask, i):
            v, r = values[i, t].double(), float(returns[i, t])
            loss = 0.5 * (v - r) ** 2
            if clip_range is not None:
                old = float(old_values[i, t])
                vc = old + torch.clamp(v - old, -clip_range, clip_range)
                loss = torch.maximum(loss, 0.5 * (vc - r) ** 2)
            out = out.index_put((torch.tensor([i]), torch.tensor([t])), loss.reshape(1))
    return out
