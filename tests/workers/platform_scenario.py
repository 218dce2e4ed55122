"""Platform-layer scenario: build the tiny MoE policy at one layout and run optimizer steps.

Usage: platform_scenario.py MODEL_JSON [--steps=N] [--untag-norm-from=K] [--fake-apex] [key=value ...]

Run by tests/test_platform.py with and without individual CPU patches (RLPO_MEGA_ABLATE_PATCH).
Rank 0 reports the patches applied, the loss and grad norm of each step, and for TP > 1 per step how
far the replicated norm weights' gradients differ between tensor-parallel ranks (0 when they are
all-reduced over TP, as finalize_model_grads does for params tagged `sequence_parallel`).

--untag-norm-from=K clears, before step K, the `sequence_parallel` tag the
torch_norm_sequence_parallel patch puts on the norm parameters: it shows that the tag (not only
lifting the assert) is what keeps the norm grads right.

--fake-apex puts an empty `apex` module in place before megatron is imported, as on a GPU node with
apex but no Transformer Engine: megatron's local spec then picks apex's FusedLayerNorm for the final
norm (megatron_fixes.final_norm_rmsnorm_apex). Every other `from apex... import` falls back as without
apex. The report names the classes of the norms built.
"""
import os
import sys
import types

if "--fake-apex" in sys.argv:  # before anything imports megatron
    sys.modules["apex"] = types.ModuleType("apex")

import torch
import torch.distributed as dist

from moe.model import load_hf_config
from rlpo_mega import distributed, platform
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy, unwrap
from rlpo_mega.training.warmup import data_parallel_shard, split_micro_batches, train_step
from tests.dist import write_report


def norm_params(model_chunk):
    return {n: p for n, p in unwrap(model_chunk).named_parameters() if "layernorm" in n}


def norm_classes(model_chunk) -> list[str]:
    """Classes of the norms built (the *layernorm submodules that are not megatron's IdentityOp)."""
    from megatron.core.transformer.identity_op import IdentityOp

    return sorted({f"{type(m).__module__}.{type(m).__name__}" for n, m in unwrap(model_chunk).named_modules()
                   if n.endswith("layernorm") and not isinstance(m, IdentityOp)})


def tp_spread(tensors: dict) -> float:
    """max |x_rank - x_rank0| over the tensor-parallel group, over all given tensors."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    worst = torch.zeros(1, dtype=torch.float64)
    for t in tensors.values():
        ref = t.detach().clone()
        dist.broadcast(ref, src=parallel_state.get_tensor_model_parallel_src_rank(), group=group)
        worst = torch.maximum(worst, (t.detach() - ref).abs().max().double().reshape(1))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def context_parallel_batch(rows: torch.Tensor, tp: int):
    """This rank's CP shard of the rows as one packed micro-batch (the trainer's own builder): each row a sample of
    a 4-token prompt and its response, the response tokens in the loss."""
    from megatron.core import parallel_state

    from rlpo_mega.rollout import Sample
    from rlpo_mega.training.batches import build_micro_batch

    samples = [Sample(r[:4].tolist(), r[4:].tolist(), torch.zeros(len(r) - 4), "stop", None) for r in rows]
    n = len(samples)
    cp = (parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank())
    return build_micro_batch(samples, samples, list(range(n)), torch.zeros(n), torch.ones(n, dtype=torch.bool),
                             layout="packed", align=tp, pad_id=0, cp=cp).to()


def main():
    model_json = sys.argv[1]
    steps, untag_from, overrides, save_optimizer = 2, None, [], False
    for arg in sys.argv[2:]:
        if arg.startswith("--steps="):
            steps = int(arg.split("=", 1)[1])
        elif arg.startswith("--untag-norm-from="):
            untag_from = int(arg.split("=", 1)[1])
        elif arg == "--fake-apex":
            pass
        elif arg == "--save-optimizer":
            save_optimizer = True
        else:
            overrides.append(arg)
    cfg = load_config(None, tuple(overrides))
    hf = load_hf_config(model_json)
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim)
    norms = norm_params(chunks[0])

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hf.vocab_size, (4, 17), generator=g)
    if layout.context > 1:  # CP splits packed rows only: the rows as samples (4-token prompts), packed
        micro = [context_parallel_batch(data_parallel_shard(tokens), layout.tensor)]
    else:
        micro = split_micro_batches(data_parallel_shard(tokens), cfg.parallel.num_micro_batches)
    losses, grad_norms, norm_grad_spread, tags = [], [], [], []
    for i in range(steps):
        if untag_from is not None and i >= untag_from:
            for p in norms.values():
                p.sequence_parallel = False
        tags.append(sorted({bool(getattr(p, "sequence_parallel", False)) for p in norms.values()}))
        out = train_step(chunks, opt, micro)
        losses.append(out["loss"])
        grad_norms.append(out["grad_norm"])
        if layout.tensor > 1:
            norm_grad_spread.append(tp_spread({n: p.main_grad for n, p in norms.items()}))
    resumed = None
    if save_optimizer:  # a checkpoint with the optimizer after the steps, loaded into a fresh one: the next step equal
        import tempfile

        from rlpo_mega.checkpoint.dist import load_checkpoint, save_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            box = [tmp]
            dist.broadcast_object_list(box, src=0)
            save_checkpoint(os.path.join(box[0], "ckpt"), chunks, opt)
            chunks2, opt2 = build_policy(hf, layout, cfg.model, cfg.optim)
            load_checkpoint(os.path.join(box[0], "ckpt"), chunks2, opt2)
            dist.barrier()
        resumed = [train_step(chunks, opt, micro)["loss"], train_step(chunks2, opt2, micro)["loss"]]
        resumed += [train_step(chunks, opt, micro)["loss"], train_step(chunks2, opt2, micro)["loss"]]
    report = {
        "resumed": resumed,
        "applied": platform.apply(),
        "losses": losses,
        "grad_norms": grad_norms,
        "norm_params": len(norms),
        "norm_tags": tags,
        "norm_grad_tp_spread": norm_grad_spread,
        "norm_classes": norm_classes(chunks[0]),
    }
    if dist.get_rank() == 0:
        write_report(report)
    distributed.destroy()


if __name__ == "__main__":
    main()
