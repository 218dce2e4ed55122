"""Parity worker: train the tiny MoE policy at one layout and dump losses and full-size gradients.

phase=reference (1 process): save the initial weights (dist checkpoint, TP1), losses of 3 steps and the
first step's gradients. phase=layout (N processes): load those weights at the layout given by the
overrides, run the same 3 steps on the same global batch (split over DP ranks and micro-batches),
save the first step's gradients as a dist checkpoint and reload them at TP1 to get full tensors.
"""
import json
import os
import sys

import torch

from moe.model import load_hf_config
from rlpo_mega import distributed
from rlpo_mega.checkpoint.dist import load_checkpoint, save_checkpoint
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy, unwrap
from rlpo_mega.processes import in_process_checkpoint_queue
from rlpo_mega.training.warmup import data_parallel_shard, split_micro_batches, train_step
from rlpo_mega.training.update import forward_backward, reduce_report

STEPS = 3


def global_batch(vocab):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (8, 17), generator=g)


def grad_tensors(model_chunk):
    """name -> main_grad (the DDP buffer after finalize_model_grads)."""
    return {n: p.main_grad.detach().clone() for n, p in unwrap(model_chunk).named_parameters()}


def sharded_grads(model_chunk):
    """The model's sharded state dict with every parameter replaced by its gradient.

    Saving this through dist_checkpointing lets megatron's own resharding (fused QKV/fc1 layouts,
    expert numbering, pipeline layer offsets) produce full tensors at TP1.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    inner = unwrap(model_chunk)
    by_id = {id(p): p.main_grad.detach().clone() for p in inner.parameters()}
    sd = inner.sharded_state_dict()

    def swap(obj):
        if isinstance(obj, dict):
            return {k: swap(v) for k, v in obj.items()}
        if isinstance(obj, (ShardedTensor, ShardedTensorFactory)) and id(obj.data) in by_id:
            obj.data = by_id[id(obj.data)].to(obj.data.dtype).view_as(obj.data)
        return obj

    return swap(sd)


def save_sharded_grads(model_chunk, grads_dir):
    from megatron.core import dist_checkpointing

    if torch.distributed.get_rank() == 0:
        os.makedirs(grads_dir, exist_ok=True)
    torch.distributed.barrier()
    # as save_checkpoint does: without it megatron starts a spawn-context Manager per rank (a fresh interpreter
    # importing torch, ~0.4 GB, left running), 8 of them in the tp2_ep2_pp2 launch
    in_process_checkpoint_queue()
    dist_checkpointing.save(sharded_grads(model_chunk), grads_dir)


def full_grads_at_tp1(hf, world_size, model_cfg, grads_dir, value_head: bool = False):
    """Re-initialise megatron at TP1 (every rank holds the full model) and load the saved gradients."""
    from megatron.core import dist_checkpointing

    distributed.init_model_parallel(distributed.Layout(world_size, 1, 1, 1, 1, False))
    tp1, _ = build_policy(hf, distributed.Layout(world_size, 1, 1, 1, 1, False), model_cfg, None, with_ddp=False,
                          value_head=value_head)
    sd = dist_checkpointing.load(tp1[0].sharded_state_dict(), grads_dir)
    tp1[0].load_state_dict(sd, strict=True)
    return {n: p.detach().clone() for n, p in tp1[0].named_parameters()}


def main():
    phase, ref_root, out_dir, model_cfgs = sys.argv[1:5]
    overrides = tuple(sys.argv[5:]) + ("optim.lr=1e-3",)
    for model_cfg in model_cfgs.split(","):
        run_family(phase, ref_root, out_dir, model_cfg, overrides)
    if os.environ.get("RLPO_CRITIC_DIRS"):  # the critic's parity at this layout too (tests/layout_runs.py)
        from tests.workers.critic_parity import run as critic_parity

        critic_ref, critic_out = os.environ["RLPO_CRITIC_DIRS"].split(",")
        critic_parity(phase, critic_ref, critic_out, tuple(sys.argv[5:]))
    if os.environ.get("RLPO_LORA_DIRS"):  # LoRA's parity at this layout too (tests/layout_runs.py)
        from tests.workers.lora_parity import run as lora_parity

        lora_ref, lora_out = os.environ["RLPO_LORA_DIRS"].split(",")
        lora_parity(phase, lora_ref, lora_out, tuple(sys.argv[5:]))
    if os.environ.get("RLPO_PLAN_MEMORY_DIR"):  # tests/test_plan.py's allocations at this layout (layout_runs.py)
        from tests.workers.plan_memory import run as plan_memory

        plan_memory(os.environ["RLPO_PLAN_MEMORY_DIR"], tuple(sys.argv[5:]))
    distributed.destroy()


def run_family(phase, ref_root, out_dir, model_cfg, overrides):
    cfg = load_config(None, overrides)
    hf = load_hf_config(model_cfg)
    tag = hf.model_type
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    rank = torch.distributed.get_rank()
    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim)
    ref_dir = os.path.join(ref_root, f"reference_{tag}")
    if phase == "reference":
        g = torch.Generator().manual_seed(17)
        for name, b in unwrap(chunks[0]).named_buffers():  # a sigmoid router's score-correction bias starts at
            if name.endswith("router.expert_bias"):        # zero: perturbed, so the biased selection is tested
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
        save_checkpoint(os.path.join(ref_dir, "init"), chunks)
    else:
        load_checkpoint(os.path.join(ref_dir, "init"), chunks)

    tokens = global_batch(hf.vocab_size)
    micro = split_micro_batches(data_parallel_shard(tokens), cfg.parallel.num_micro_batches)
    reports = forward_backward(chunks, opt, micro)
    losses = [reduce_report(reports)["lm_loss"]]
    if phase == "reference":
        torch.save(grad_tensors(chunks[0]), os.path.join(ref_dir, "grads.pt"))
    else:
        grads_dir = os.path.join(out_dir, f"grads_{tag}")
        save_sharded_grads(chunks[0], grads_dir)
    ok, _, _ = opt.step()
    assert ok
    for _ in range(STEPS - 1):
        losses.append(train_step(chunks, opt, micro)["loss"])

    result = {"losses": losses}
    if phase != "reference":
        # Reload the gradients at TP1 (every rank holds the full model) to get full tensors.
        del chunks, opt
        grads = full_grads_at_tp1(hf, layout.world_size, cfg.model, grads_dir)
        if rank == 0:
            torch.save(grads, os.path.join(out_dir, f"grads_{tag}.pt"))
    if rank == 0:
        with open(os.path.join(out_dir, f"{phase}_{tag}.json"), "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
