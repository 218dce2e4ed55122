"""Policy-step parity: the full RL step (rollout samples -> assemble_batch -> old log-prob pass ->
policy loss -> backward -> optimizer) at a layout vs TP1, for gspo and sapo in one launch.

phase=reference (1 process): save the initial weights, then per loss: first-step gradients, metrics and
the losses of 2 steps. phase=layout (N processes): load the same weights at the layout given by the
overrides, run the same steps on the same global batch, save the first-step gradients as a dist
checkpoint and reload them at TP1 (full tensors), as tests/workers/parity.py does.

The old log-probs from the forward-only pass are perturbed by a fixed [n, s] offset (a stale rollout
policy), so that GSPO clips some sequences (and not others) and SAPO's gates are away from 1.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from moe.model import load_hf_config  # noqa: E402
from rlpo_mega import distributed  # noqa: E402
from rlpo_mega.training.batches import MicroBatch  # noqa: E402
from rlpo_mega.training.update import policy_step  # noqa: E402
from rlpo_mega.training.warmup import shard_and_split  # noqa: E402
from tools.batch_support import assemble_batch, prepare_micro_batches  # noqa: E402
from rlpo_mega.checkpoint.dist import load_checkpoint, save_checkpoint  # noqa: E402
from rlpo_mega.config import load_config  # noqa: E402
from rlpo_mega.model_setup import build_policy  # noqa: E402
from tests.workers.parity import full_grads_at_tp1, grad_tensors, save_sharded_grads  # noqa: E402

LOSSES = ("gspo", "sapo")
MODEL = "configs/models/tiny_qwen3_moe.json"


def rollout(vocab):
    """8 samples in 2 groups of 4: prompts and responses of varied lengths, rewards."""
    g = torch.Generator().manual_seed(5)
    plen = [3, 5, 2, 4, 6, 3, 2, 5]
    rlen = [10, 4, 12, 7, 3, 9, 13, 6]
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p in plen]
    responses = [torch.randint(3, vocab, (r,), generator=g).tolist() for r in rlen]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.2])
    return prompts, responses, rewards, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def staleness(loss, shape):
    g = torch.Generator().manual_seed(9)
    if loss == "gspo":  # per-sequence mean log-ratio around GSPO's clip range 3e-4 / 4e-4
        seq = torch.tensor([0.0, 2e-4, -2e-4, 1e-3, -1e-3, 6e-4, -6e-4, 3e-3])
        return seq[:, None] + 1e-4 * torch.randn(shape, generator=g)
    return 0.3 * torch.randn(shape, generator=g)


def main():
    phase, ref_root, out_dir = sys.argv[1:4]
    overrides = tuple(sys.argv[4:]) + ("optim.lr=1e-3",)
    hf = load_hf_config(MODEL)
    result = {}
    for loss in LOSSES:
        cfg = load_config(None, overrides + (f"algorithm.loss.name={loss}",))
        layout = distributed.init(cfg.parallel, hf, cfg.seed)
        rank = torch.distributed.get_rank()
        chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim)
        init = os.path.join(ref_root, "init")
        if phase == "reference" and loss == LOSSES[0]:
            save_checkpoint(init, chunks)
        else:
            load_checkpoint(init, chunks)
        prompts, responses, rewards, groups = rollout(hf.vocab_size)
        batch, stats = assemble_batch(prompts, responses, rewards, groups, cfg.algorithm, seq_length=18)
        micro = prepare_micro_batches(chunks, batch, cfg.algorithm, cfg.parallel.num_micro_batches)
        offsets = shard_and_split(MicroBatch(old_logp=staleness(loss, batch.labels.shape)),
                                  cfg.parallel.num_micro_batches)
        for mb, off in zip(micro, offsets):
            if mb.old_logp is not None:  # last pipeline stage only
                mb.old_logp = mb.old_logp - off.old_logp
        first = policy_step(chunks, opt, micro, cfg.algorithm, step_optimizer=False)
        if phase == "reference":
            torch.save(grad_tensors(chunks[0]), os.path.join(out_dir, f"grads_{loss}.pt"))
        else:
            grads_dir = os.path.join(out_dir, f"grads_{loss}")
            save_sharded_grads(chunks[0], grads_dir)
        ok, grad_norm, _ = opt.step()
        assert ok
        second = policy_step(chunks, opt, micro, cfg.algorithm)
        result[loss] = {"first": first, "second": second, "grad_norm": float(grad_norm), "stats": stats}
        if phase != "reference":
            del chunks, opt
            grads = full_grads_at_tp1(hf, layout.world_size, cfg.model, grads_dir)
            if rank == 0:
                torch.save(grads, os.path.join(out_dir, f"grads_{loss}.pt"))
        torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out_dir, f"{phase}.json"), "w") as f:
            json.dump(result, f)
    distributed.destroy()


if __name__ == "__main__":
    main()
