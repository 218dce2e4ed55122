"""Critic parity: PPO's value model through the trainer's critic path at a layout vs TP1.

The path is rlpo_mega.training.critic.Critic: old values (forward-only) -> GAE per sample with the batch-wide
whitening -> clipped value loss -> backward -> the critic's optimizer, 3 updates on one rollout batch.

phase=reference (1 process): save the critic's initial weights, report the GAE stats, the 3 value losses and
clip fractions, and the first update's gradients. phase=layout (N processes): load those weights at the
layout given by the overrides, run the same steps on the same global batch (padded rows split over DP ranks
and micro-batches), save the first update's gradients as a dist checkpoint and reload them at TP1.

The old values of the update are offset by a fixed function of the returns (a stale critic), so the value
clip (0.05) binds on some tokens from the first update on.
"""
import json
from dataclasses import replace
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from moe.model import load_hf_config  # noqa: E402
from moe.routing.trace import TraceSpec  # noqa: E402
from rlpo_mega import distributed  # noqa: E402
from rlpo_mega.checkpoint.dist import load_checkpoint, save_checkpoint  # noqa: E402
from rlpo_mega.config import load_config  # noqa: E402
from rlpo_mega.training.critic import Critic  # noqa: E402
from tools.batch_support import assemble_batch  # noqa: E402
from rlpo_mega.training.warmup import shard_and_split  # noqa: E402
from tests.workers.algo_parity import rollout  # noqa: E402
from tests.workers.parity import full_grads_at_tp1, grad_tensors, save_sharded_grads  # noqa: E402

MODEL = "configs/models/tiny_qwen3_moe.json"
STEPS = 3
SETTINGS = ("algorithm.advantage.name=gae", "algorithm.loss.name=ppo_clip", "algorithm.advantage.gamma=0.99",
            "algorithm.advantage.lam=0.9", "critic.optim.lr=1e-3", "critic.vf_clip=0.05", "critic.vf_coef=0.5")


def main():
    run(*sys.argv[1:4], tuple(sys.argv[4:]))
    distributed.destroy()


def run(phase, ref_root, out_dir, overrides: tuple):
    """Also called by tests/workers/parity.py (RLPO_CRITIC_DIRS): one launch per layout for both parities."""
    cfg = load_config(None, overrides + SETTINGS)
    hf = load_hf_config(MODEL)
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    rank = torch.distributed.get_rank()
    critic = Critic(cfg, hf, layout, TraceSpec.from_hf(hf))
    init = os.path.join(ref_root, "init")
    if phase == "reference":
        save_checkpoint(init, critic.chunks)
    else:
        load_checkpoint(init, critic.chunks)
    prompts, responses, rewards, group_ids = rollout(hf.vocab_size)
    batch, _ = assemble_batch(prompts, responses, rewards, group_ids, cfg.algorithm)
    micro = shard_and_split(batch, cfg.parallel.num_micro_batches)
    critic_micro, stats = critic.prepare([micro])
    for mb in critic_micro[0]:
        if mb.old_values is not None:  # last stage
            mb.old_values = mb.old_values + 0.1 * torch.sin(7.0 * mb.returns)
    result = {"stats": stats, "losses": [], "clip": [], "advantages_finite": all(
        bool(torch.isfinite(mb.advantages).all()) for mb in micro if mb.advantages.dim() == 2)}
    for step in range(STEPS):
        out = critic.update(critic_micro[0])
        result["losses"].append(out["value_loss"])
        result["clip"].append(out["vf_clip_frac"])
        if step == 0:
            if phase == "reference":
                torch.save(grad_tensors(critic.chunks[0]), os.path.join(ref_root, "grads.pt"))
            else:
                grads_dir = os.path.join(out_dir, "grads")
                save_sharded_grads(critic.chunks[0], grads_dir)
    critic.close()
    if phase == "reference":
        result["replay"] = replay_check(hf, layout, init, batch, overrides)
    if phase != "reference":
        model_cfg = cfg.model
        del critic
        grads = full_grads_at_tp1(hf, layout.world_size, model_cfg, grads_dir, value_head=True)
        if rank == 0:
            torch.save(grads, os.path.join(out_dir, "grads.pt"))
    if rank == 0:
        with open(os.path.join(out_dir, f"{phase}.json"), "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()


def replay_check(hf, layout, init, batch, overrides):
    """R3 in the critic: routes recorded from the critic, its routers perturbed, the value pass replays the
    recorded experts exactly while its live routers disagree; live routing gives other values."""
    from moe.routing.metrics import same_sets
    from moe.routing.replay import _flat
    from moe.routing.transport import local_routers
    from rlpo_mega.training.critic import values_forward_step
    from rlpo_mega.training.update import forward_only

    cfg = load_config(None, overrides + SETTINGS + ("routing.mode=r3",))
    critic = Critic(cfg, hf, layout, TraceSpec.from_hf(hf))
    load_checkpoint(init, critic.chunks)
    micro = shard_and_split(batch, 1)
    forward_only(critic.chunks, micro, critic.routing.wrap(values_forward_step, "record", "record"))
    routes = micro[0].routes.clone()
    v0 = critic.old_values(micro)[0]
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for name, p in critic.chunks[0].named_parameters():
            if ".router." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    v_replay = critic.old_values(micro)[0]
    routers = local_routers(critic.chunks)
    replayed = all(bool(same_sets(r.router_replay.used_topk, _flat(routes[:, :, col]).long()).all())
                   for col, (_, r) in enumerate(routers))
    live = critic.routing.metrics()["routing/old/agreement"]
    critic.routing.reset()
    v_live = forward_only(critic.chunks, [replace(micro[0], routes=None)],
                          values_forward_step)[0]["values"]
    mask = micro[0].loss_mask.bool()
    critic.close()
    return {"replayed_exactly": replayed, "live_agreement": live, "routers": len(routers),
            "replay_dev": float((v_replay - v0)[mask].abs().max()), "live_dev": float((v_live - v0)[mask].abs().max())}


if __name__ == "__main__":
    main()
