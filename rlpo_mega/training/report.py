"""Phase 7 of an RL step: its report. The update's keys -> logged metric names, rollout stats, means over updates."""
from __future__ import annotations

import torch

POLICY_KEYS = {  # policy_step report -> logged metric
    "policy_loss": "loss/policy", "clip_frac_low": "loss/clip_frac_low", "clip_frac_high": "loss/clip_frac_high",
    "gate_mean": "loss/gate_mean", "gate_weight_mean": "loss/gate_weight_mean",
    "gate_weight_below_half_frac": "loss/gate_weight_below_half_frac", "ratio_mean": "ratio/token_mean",
    "seq_ratio_mean": "ratio/seq_mean", "seq_ratio_min": "ratio/seq_min", "seq_ratio_max": "ratio/seq_max",
    "kl": "kl/ref", "kl_old_k3": "kl/policy", "entropy": "entropy/mean", "grad_norm": "optim/grad_norm",
}


def mean_dicts(dicts: list[dict]) -> dict:
    keys = {k for d in dicts for k in d}
    out = {}
    for k in keys:
        vals = [d[k] for d in dicts if k in d and isinstance(d[k], (int, float))]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


def policy_metrics(out: dict, agreement_phase: str = "old") -> dict:
    """agreement_phase: the pass whose live router is compared with the rollout's choice (the old pass, or
    the update's forward when it gives the old log-probs)."""
    m = {}
    for k, v in out.items():
        if k in POLICY_KEYS:
            m[POLICY_KEYS[k]] = v
        elif k.startswith(f"routing/{agreement_phase}/agreement/layer"):  # live router vs the rollout's choice
            m["routing/agreement/layer_" + k.rsplit("layer", 1)[1]] = v
            if agreement_phase == "update":  # the update's own key stays too (as when an old pass runs)
                m[k] = v
        elif k == f"routing/{agreement_phase}/agreement":
            m["routing/agreement/mean"] = v
            if agreement_phase == "update":
                m[k] = v
        elif k.startswith("routing/update/load_max_over_mean/layer"):
            m["experts/load_max/layer_" + k.rsplit("layer", 1)[1]] = v
        elif k.startswith("routing/update/load_min_over_mean/layer"):
            m["experts/load_min/layer_" + k.rsplit("layer", 1)[1]] = v
        elif k.startswith(("routing/", "mismatch/")):
            m[k] = v
    return m


def rollout_metrics(scored) -> dict:
    if not scored:
        return {}
    r = torch.tensor([s.reward for s in scored], dtype=torch.float64)
    lengths = torch.tensor([s.response_len for s in scored], dtype=torch.float64)
    return {"reward/mean": float(r.mean()), "reward/std": float(r.std(unbiased=False)),
            "reward/accuracy": sum(s.correct for s in scored) / len(scored),
            "reward/failed": sum(s.failed for s in scored), "reward/samples": len(scored),
            "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/truncated_frac": sum(s.finish_reason == "length" for s in scored) / len(scored),
            **episode_metrics(scored)}


def episode_metrics(scored) -> dict:
    """Multi-turn episodes (rollout/episode.py): turns, tool calls and failures per episode, the model's share of
    the response tokens, environment failures."""
    eps = [s for s in scored if s.episode]
    if not eps:
        return {}
    turns, calls, errors, useful = (sum(s.episode[k] for s in eps) for k in range(4))
    return {"episode/turns_mean": turns / len(eps), "episode/tool_calls_mean": calls / len(eps),
            "episode/useful_tool_calls_mean": useful / len(eps),
            "episode/tool_errors": errors, "episode/tool_error_frac": errors / calls if calls else 0.0,
            "episode/model_tokens_mean": sum(s.model_tokens for s in eps) / len(eps),
            "episode/env_failures": sum(s.failed for s in eps)}


def advantage_metrics(stats: dict, advantages: torch.Tensor, with_critic: bool) -> dict:
    """The plan's and the advantages' stats; without a critic the advantages' moments (with a critic these are
    the sequence rewards: GAE's stats come with the values)."""
    m = {("advantages/" + k if k in ("groups", "zero_advantage_groups") else k): v for k, v in stats.items()}
    if not with_critic:
        adv = advantages.float()
        m.update({"advantages/mean": float(adv.mean()), "advantages/std": float(adv.std(unbiased=False)),
                  "advantages/min": float(adv.min()), "advantages/max": float(adv.max())})
    return m


def update_metrics(outs: list[dict], critic_metrics: dict, skipped: int, bad_steps: int, old_from_update: bool,
                   lr: float) -> dict:
    """The step's update: the policy's metrics as means over its updates (mini-batches x epochs), the critic's,
    the skipped updates (non-finite loss or gradients) and the learning rate."""
    m = dict(critic_metrics)
    m["train/skipped_updates"] = skipped
    m["train/bad_steps_in_a_row"] = bad_steps
    m.update(policy_metrics(mean_dicts(outs), "update" if old_from_update else "old"))
    m["optim/lr"] = lr
    return m


def throughput_metrics(samples, epochs: int, seconds: float, timer) -> dict:
    """Per-phase wall times, the step's time and its tokens per second (each epoch counts its tokens again)."""
    tokens = sum(s.prompt_len + s.response_len for s in samples)
    return {**timer.metrics(), "time/step": seconds, "perf/tokens_per_s": tokens * epochs / seconds}
