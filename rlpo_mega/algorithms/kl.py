"""KL estimators to a reference policy (registry), per token, with x = logp_ref - logp (Schulman's k1/k2/k3).

All are evaluated on tokens sampled from the current policy: k1 = -x (unbiased, high variance),
k2 = x^2 / 2, k3 = exp(x) - x - 1 (unbiased value, >= 0; GRPO's choice). Used as a loss, k3's gradient
is not the KL's: "k3+" keeps k3's value and takes k2's gradient (whose expectation is the true KL
gradient). x is clamped to +-20 against overflow (verl does the same; verl also clamps k3 to +-10, not
done here).
"""
from __future__ import annotations

import torch

from .registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")
X_GUARD = 20.0


def _x(logp, ref_logp):
    return (ref_logp - logp).clamp(-X_GUARD, X_GUARD)


@KL_ESTIMATORS.register("k1")
def k1(logp, ref_logp):
    return -_x(logp, ref_logp)


@KL_ESTIMATORS.register("k2")
def k2(logp, ref_logp):
    return _x(logp, ref_logp) ** 2 / 2


@KL_ESTIMATORS.register("k3")
def k3(logp, ref_logp):
    x = _x(logp, ref_logp)
    return torch.exp(x) - x - 1


@KL_ESTIMATORS.register("k3+")
def k3_plus(logp, ref_logp):
    value, grad_carrier = k3(logp, ref_logp), k2(logp, ref_logp)
    return value.detach() + (grad_carrier - grad_carrier.detach())


def kl_penalty(name: str, logp, ref_logp):
    return KL_ESTIMATORS.get(name)(logp, ref_logp)
