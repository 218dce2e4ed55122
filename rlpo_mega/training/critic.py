"""Phase 4 of an RL step with a critic (values and GAE), and the critic's update: PPO's value model on Megatron.

On when algorithm.advantage.name=gae. The value model is the policy's family at the policy's layout with
moe.value_head in place of the output layer (built through rlpo_mega/model_setup.build_policy), with its own
optimizer and LR schedule (critic.optim) and its own routing replay driver: r3 replays the rollout's routes
in its passes too, r2 records its own old pass's routes and replays them in its update.

Per RL step (the trainer calls it after the policy's old/reference passes):
1. `prepare`: the old values V_old of every micro-batch (a forward-only pass, before any update), then on
   the last pipeline stage GAE per sample row: token rewards (the shaped sequence reward on the last response
   token, minus kl.coef * (log pi_old - log pi_ref) per token when algorithm.kl.in_reward), advantages and
   returns (algorithms/gae.py); advantages whitened over the whole rollout batch (sums over all micro-batches
   and DP ranks). The policy's micro-batches get the [n, s] advantages in place of the sequence rewards that
   travelled in that slot; the critic's own micro-batches (shallow copies) get returns and V_old.
2. `update` per mini-batch: vf_coef * token-mean of PPO2's clipped value loss, normalised globally like the
   policy loss (per-token loss in megatron: numerator and token count over micro-batches and DP ranks).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from megatron.core import parallel_state

from moe.bridge.megatron_io import weight_tensors
from moe.routing.replay import RoutingReplay
from rlpo_mega.algorithms.gae import gae, token_rewards, value_loss
from rlpo_mega.model_setup import build_lr_scheduler, build_policy, optimizer_steps, unwrap
from rlpo_mega.reductions import Stat
from rlpo_mega.training.batches import MicroBatch
from rlpo_mega.training.report import mean_dicts
from rlpo_mega.training.update import forward_only, forward_step_of, reduce_report, unpack, update


def _values(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """GPTModel's output [rows, positions, 1] -> the loss view [samples, positions] in float32."""
    return unpack(values[..., 0].float(), batch)


def _pair(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum over the mask, count]: a mean for reduce_report."""
    m = mask.double()
    return torch.stack([(x.detach().double() * m).sum(), m.sum()])


def values_loss(batch, values):
    """A forward-only pass's values (V_old) in the report."""
    v = _values(values, batch).detach()
    return v.new_zeros(()), v.new_zeros((), dtype=torch.int), {"values": v}


values_forward_step = forward_step_of(values_loss)


def critic_loss(batch, values, *, clip, coef):
    """The value loss of one micro-batch: (vf_coef * summed token losses, token count, report)."""
    v = _values(values, batch)
    mask = batch.loss_mask.bool()
    loss, clipped = value_loss(v, batch.old_values, batch.returns, mask, clip)
    count = mask.sum().to(torch.int)
    return coef * loss.sum(), count, {"value_loss": _pair(loss, mask), "vf_clip_frac": _pair(clipped.float(), mask),
                                      "values_update": _pair(v, mask)}


class Critic:
    def __init__(self, cfg, hf, layout, spec):
        self.cfg = cfg
        c = cfg.critic
        self.chunks, self.optimizer = build_policy(hf, layout, cfg.model, c.optim, routing_replay=True,
                                                   value_head=True, init_from_hf=c.init_from_hf, head_seed=cfg.seed,
                                                   lora=c.lora, seed=cfg.seed)
        self.lr_schedule = build_lr_scheduler(self.optimizer, c.optim, optimizer_steps(cfg))
        self.routing = RoutingReplay(self.chunks, spec, mode=cfg.routing.mode)

    @torch.no_grad()
    def copy_trunk_from(self, policy_chunks, reload_optimizer: bool = True):
        """Initialise the critic from the policy: every parameter but the output layer (the value head keeps
        its own initialisation) and LoRA's factors; the optimizer's main copies follow (mixed precision).
        reload_optimizer=False: a frozen trunk (critic.lora) under a loaded optimizer, whose main copies are the
        checkpoint's and hold no trunk parameter."""
        mine = dict(weight_tensors(unwrap(self.chunks[0])))
        for name, p in weight_tensors(unwrap(policy_chunks[0])):
            if not name.startswith("output_layer."):
                mine[name].copy_(p)
        if reload_optimizer:
            self.optimizer.reload_model_params()

    @torch.no_grad()
    def old_values(self, micro: list[MicroBatch]):
        """V_old per micro-batch [n, s] on the last pipeline stage (None elsewhere), before any update."""
        reports = forward_only(self.chunks, micro, forward_step=self.routing.wrap_old(values_forward_step))
        return [r["values"] for r in reports] if parallel_state.is_pipeline_last_stage() else None

    def prepare(self, prepared: list[list[MicroBatch]]) -> tuple[list[list[MicroBatch]], dict]:
        """The policy's micro-batches per mini-batch (routes, old/ref log-probs attached; the shaped sequence
        rewards in "advantages") -> the critic's micro-batches, and stats. Sets the policy's advantages to
        GAE's, whitened. Collective (DP, and PP for the stats)."""
        alg = self.cfg.algorithm
        adv_cfg = alg.advantage
        critic = [[replace(mb) for mb in micro] for micro in prepared]
        rows = []  # (policy micro-batch, critic micro-batch, advantages, returns, old values) on the last stage
        for policy_micro, critic_micro in zip(prepared, critic):
            values = self.old_values(critic_micro)
            if values is None:
                continue
            for p, c, v in zip(policy_micro, critic_micro, values):
                mask = p.loss_mask.bool()
                kl = None
                if alg.kl.in_reward and alg.kl.coef > 0:
                    kl = p.old_logp - p.ref_logp  # k1 per token: the RLHF-PPO penalty
                r = token_rewards(p.advantages, mask, kl, alg.kl.coef)
                adv, ret = gae(r, v.double(), mask, adv_cfg.gamma, adv_cfg.lam)
                rows.append((p, c, adv, ret, v, mask, kl))
        reports = []
        for _, _, adv, ret, v, mask, kl in rows:
            rep = {"adv": _pair(adv, mask), "adv_sq": _pair(adv ** 2, mask), "ret": _pair(ret, mask),
                   "ret_sq": _pair(ret ** 2, mask), "val": _pair(v, mask), "res": _pair(ret - v, mask),
                   "res_sq": _pair((ret - v) ** 2, mask)}
            if kl is not None:
                rep["kl"] = _pair(kl, mask)
            # every report has every key (the DP ranks reduce one vector); masked positions are -inf / +inf (an
            # empty mask: NaN)
            inf = torch.full_like(adv, math.inf)
            rep.update({Stat("adv_max", "max"): torch.where(mask, adv, -inf),
                        Stat("adv_min", "min"): torch.where(mask, adv, inf),
                        Stat("ret_max", "max"): torch.where(mask, ret, -inf),
                        Stat("ret_min", "min"): torch.where(mask, ret, inf)})
            reports.append(rep)
        s = reduce_report(reports)
        var = lambda a, b: max(s[b] - s[a] ** 2, 0.0)  # noqa: E731  E[x^2] - E[x]^2 over the batch's tokens
        mean, std = s["adv"], math.sqrt(var("adv", "adv_sq"))
        for p, c, adv, ret, v, mask, _ in rows:
            if adv_cfg.whiten:  # over the whole rollout batch, as one batch would be (rlpo_mega.algorithms.gae.whiten)
                adv = (adv - mean) / (std + 1e-8)
            p.advantages = torch.where(mask, adv, torch.zeros_like(adv)).float()
            c.returns, c.old_values = ret.float(), v
        var_ret = var("ret", "ret_sq")
        stats = {"advantages/mean": mean, "advantages/std": std, "advantages/min": s.get("adv_min", math.nan),
                 "advantages/max": s.get("adv_max", math.nan), "critic/returns_mean": s["ret"],
                 "critic/returns_min": s.get("ret_min", math.nan), "critic/returns_max": s.get("ret_max", math.nan),
                 "critic/values_mean": s["val"],
                 "critic/explained_variance": 1.0 - var("res", "res_sq") / var_ret if var_ret > 0 else math.nan}
        if "kl" in s:  # the penalty folded into the rewards: mean log pi_old - log pi_ref (k1)
            stats["kl/ref"] = s["kl"]
        return critic, stats

    def update(self, micro: list[MicroBatch]) -> dict:
        """One critic optimizer step over a mini-batch's micro-batches -> its metrics (global)."""
        c = self.cfg.critic
        step = forward_step_of(critic_loss, clip=c.vf_clip, coef=c.vf_coef)
        return update(self.chunks, self.optimizer, micro, self.routing.wrap_update(step), "value_loss",
                      self.lr_schedule)

    def metrics(self, outs: list[MicroBatch]) -> dict:
        """The step's critic metrics from its updates (means over mini-batches and epochs) and routing."""
        means = mean_dicts(outs)
        m = {name: means[key] for key, name in (("value_loss", "critic/value_loss"), ("vf_clip_frac", "critic/vf_clip_frac"),
                                                 ("grad_norm", "critic/grad_norm"),
                                                 ("values_update", "critic/values_update_mean")) if key in means}
        m["critic/skipped_updates"] = sum(o.get("skipped", 0.0) for o in outs)
        m["critic/lr"] = float(self.optimizer.param_groups[0]["lr"])
        for k, v in self.routing.metrics().items():
            if isinstance(v, (int, float)) and (k.endswith("/agreement") or k.startswith("routing/update/agreement")):
                m["critic/" + k] = v
        return m

    def close(self):
        self.routing.close()

