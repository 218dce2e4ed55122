"""Test-only: the metrics every RL step must log (names and meanings), and the check that a run logged them
(tests/test_trainer.py, tests/test_logging.py read the run back)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Metric:
    name: str  # exact key, or with prefix=True the start of one or more keys (per-layer metrics)
    doc: str
    # always | clip (clipping losses) | gate (SAPO) | kl_ref (kl.coef > 0) | dynamic_sampling | critic (gae)
    when: str = "always"
    prefix: bool = False


REQUIRED_METRICS: tuple[Metric, ...] = (
    Metric("reward/mean", "mean reward of the step's responses (after shaping)"),
    Metric("reward/std", "std of those rewards"),
    Metric("reward/accuracy", "fraction of responses the reward function scores correct"),
    Metric("response/length_mean", "response tokens per sample"),
    Metric("response/length_max", "longest response"),
    Metric("response/truncated_frac", "fraction stopped by max_new_tokens instead of a stop token"),
    Metric("advantages/mean", "mean advantage over responses"),
    Metric("advantages/std", "std of the advantages"),
    Metric("advantages/min", "smallest advantage"),
    Metric("advantages/max", "largest advantage"),
    Metric("loss/policy", "the aggregated policy loss (policy_step 'policy_loss')"),
    Metric("loss/clip_frac_low", "tokens (GSPO: sequences) with A < 0 clipped at 1 - eps_low", when="clip"),
    Metric("loss/clip_frac_high", "tokens (GSPO: sequences) with A > 0 clipped at 1 + eps_high", when="clip"),
    Metric("loss/gate_mean", "SAPO: mean soft gate f(r; tau)", when="gate"),
    Metric("loss/gate_weight_mean", "SAPO: mean gradient weight of the gate", when="gate"),
    Metric("loss/gate_weight_below_half_frac", "SAPO: tokens whose gate weight is < 0.5", when="gate"),
    Metric("ratio/token_mean", "mean token ratio pi_new / pi_old (policy_step 'ratio_mean')"),
    Metric("ratio/seq_mean", "mean sequence ratio exp(mean_t log r_t)"),
    Metric("ratio/seq_min", "smallest sequence ratio"),
    Metric("ratio/seq_max", "largest sequence ratio"),
    Metric("kl/policy", "k3 KL(pi_old || pi_new) over the update tokens"),
    Metric("kl/ref", "the KL penalty term vs the reference model (policy_step 'kl')", when="kl_ref"),
    Metric("entropy/mean", "mean token entropy of the policy"),
    Metric("optim/grad_norm", "gradient norm before clipping"),
    Metric("optim/lr", "learning rate"),
    Metric("dynamic_sampling/kept", "groups kept (scores not all equal)", when="dynamic_sampling"),
    Metric("dynamic_sampling/dropped", "groups dropped", when="dynamic_sampling"),
    Metric("dynamic_sampling/aborted", "groups submitted but not complete when the step's were (aborted)",
           when="dynamic_sampling"),
    Metric("dynamic_sampling/carried_in", "groups of earlier steps trained on now", when="dynamic_sampling"),
    Metric("dynamic_sampling/carried_out", "surplus groups kept for the next steps", when="dynamic_sampling"),
    Metric("dynamic_sampling/carry_stale", "carried groups dropped past max_carry_steps", when="dynamic_sampling"),
    Metric("routing/agreement/layer_", "per MoE layer: fraction of top-k choices the training router shares "
           "with the rollout's", prefix=True),
    Metric("routing/agreement/mean", "mean over layers"),
    Metric("mismatch/k3_kl", "train/rollout log-prob mismatch: k3 KL(pi_rollout || pi_old_train)"),
    Metric("mismatch/ratio_dev_mean", "mean |pi_old_train / pi_rollout - 1|"),
    Metric("mismatch/ratio_dev_max", "max |pi_old_train / pi_rollout - 1|"),
    Metric("experts/load_max/layer_", "per MoE layer: busiest expert's tokens / mean tokens per expert",
           prefix=True),
    Metric("experts/load_min/layer_", "per MoE layer: idlest expert's tokens / mean tokens per expert",
           prefix=True),
    Metric("time/rollout", "seconds generating"),
    Metric("time/reward", "seconds scoring"),
    Metric("time/old_logprob", "seconds in the old (and reference) log-prob passes"),
    Metric("time/update", "seconds in the optimizer steps"),
    Metric("time/sync", "seconds pushing weights to the rollout engine"),
    Metric("time/step", "seconds for the whole step"),
    Metric("time/gc", "seconds in the garbage collection after the step (trainer.gc per_step; 0 when automatic)"),
    Metric("perf/tokens_per_s", "prompt + response tokens trained per second of the step"),
    Metric("critic/value_loss", "token-mean of the (clipped) value loss 0.5 (V - R)^2, before vf_coef", when="critic"),
    Metric("critic/vf_clip_frac", "tokens whose clipped value loss is the larger (critic.vf_clip)", when="critic"),
    Metric("critic/explained_variance", "1 - Var(R - V_old) / Var(R) over the batch's response tokens",
           when="critic"),
    Metric("critic/returns_mean", "mean GAE return R = A + V_old (the value target)", when="critic"),
    Metric("critic/values_mean", "mean old value V_old", when="critic"),
    Metric("critic/grad_norm", "critic gradient norm before clipping", when="critic"),
    Metric("critic/lr", "critic learning rate", when="critic"),
    Metric("time/values", "seconds in the critic's value pass and GAE", when="critic"),
)


def required_metrics(loss_name: str, *, kl_ref: bool = False, dynamic_sampling: bool = True,
                     critic: bool = False) -> list[Metric]:
    """The metrics a step must log for this loss (SAPO: gate stats instead of clip fractions; a critic's)."""
    from rlpo_mega.algorithms.losses import LOSSES

    gated = LOSSES.get(loss_name).eps_low is None  # unknown name: error listing the known ones
    active = {"always", "gate" if gated else "clip"}
    if kl_ref:
        active.add("kl_ref")
    if dynamic_sampling:
        active.add("dynamic_sampling")
    if critic:
        active.add("critic")
    return [m for m in REQUIRED_METRICS if m.when in active]


def missing_metrics(logged_keys: Iterable[str], loss_name: str, *, kl_ref: bool = False,
                    dynamic_sampling: bool = True, critic: bool = False) -> list[str]:
    """Required names absent from `logged_keys` (prefix metrics shown as 'name*'); [] when complete."""
    keys = set(logged_keys)
    missing = []
    for m in required_metrics(loss_name, kl_ref=kl_ref, dynamic_sampling=dynamic_sampling, critic=critic):
        if m.prefix:
            if not any(k.startswith(m.name) for k in keys):
                missing.append(m.name + "*")
        elif m.name not in keys:
            missing.append(m.name)
    return missing
