"""LoRA (model.lora, moe/lora.py) at a layout against the single process, in the layout launches of
tests/layout_runs.py (parity.py calls `run` when RLPO_LORA_DIRS is set): one launch per layout for every parity.

phase=reference (1 process): the adapted policy on an HF base made here (base_<family>), with every B drawn non-zero (B
starts at zero, where A's gradient is zero too: the comparison would not see A), saved as the initial checkpoint (the
factors' own sharded entries: a layout that loads it reshards them; its model.lora and config.json as a trainer's
checkpoint records them, so `rlpo-mega export --peft-out` takes it) with the adapted learner's logits of a token batch
(logits_<family>.pt: what peft's adapter on the base must give); 3 steps' losses and the first step's gradients of
every factor.
phase=layout: load it at the layout; its merged export (W + alpha/r B A per shard, gathered by the bridge as the
weight sync sends it) written as an HF checkpoint gives transformers' logits equal to the adapted learner's; the
adapter sync's gather (megatron_io.AdapterStream, rollout.lora_sync=adapter) of every factor whole onto rank 0
(adapter_<family>.pt); the same 3 steps on the same batch, the first step's factor gradients saved as a dist checkpoint and reloaded whole at
TP1. Also, at every layout: every base parameter frozen (no gradient, not in the optimizer) and no router adapted.

Families: qwen3_moe (attention and experts, shared_outer) and glm4_moe (its dense first layer and shared experts
too, experts per_expert).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from moe.bridge.hf_checkpoint import HFCheckpointWriter  # noqa: E402
from moe.bridge.megatron_io import AdapterStream, export_hf_state, stacked_factors  # noqa: E402
from moe.lora import adapters, adapters_off, is_lora_param  # noqa: E402
from moe.model import load_hf_config  # noqa: E402
from rlpo_mega import distributed  # noqa: E402
from rlpo_mega.checkpoint.dist import load_checkpoint, save_checkpoint  # noqa: E402
from rlpo_mega.checkpoint.files import HF_FILES  # noqa: E402
from rlpo_mega.config import load_config  # noqa: E402
from rlpo_mega.model_setup import build_policy, lora_setting, unwrap  # noqa: E402
from rlpo_mega.processes import in_process_checkpoint_queue  # noqa: E402
from rlpo_mega.training.update import forward_backward, reduce_report  # noqa: E402
from rlpo_mega.training.warmup import data_parallel_shard, split_micro_batches, train_step  # noqa: E402
from tests.workers.bridge import hf_logits, make_hf_checkpoint, megatron_logits, rel_err  # noqa: E402
from tests.workers.parity import global_batch  # noqa: E402

STEPS = 3
FAMILIES = {"qwen3_moe": ("configs/models/tiny_qwen3_moe.json", "shared_outer"),
            "glm4_moe": ("configs/models/tiny_glm4_moe.json", "per_expert")}


def settings(layout: str) -> tuple:
    return ("model.lora.rank=4", "model.lora.alpha=8", f"model.lora.expert_layout={layout}", "optim.lr=1e-2")


def factor_grads(chunk) -> dict:
    return {n: p.main_grad.detach().clone() for n, p in unwrap(chunk).named_parameters() if p.requires_grad}


def frozen_report(chunk, optimizer) -> dict:
    """What must hold at every layout: the base frozen and outside the optimizer, the routers never adapted."""
    inner = unwrap(chunk)
    params = dict(inner.named_parameters())
    trainable = sorted(n for n, p in params.items() if p.requires_grad)
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    model_params = {id(p): n for n, p in params.items()}
    return {"trainable_not_lora": [n for n in trainable if not is_lora_param(n)],
            "base_with_grad": [n for n, p in params.items() if not p.requires_grad
                               and (p.grad is not None or getattr(p, "main_grad", None) is not None)],
            "router_adapted": [n for n, _ in adapters(inner) if "router" in n],
            "optimizer_not_lora": sorted(model_params[i] for i in in_optimizer
                                         if i in model_params and not is_lora_param(model_params[i])),
            "adapted": len(list(adapters(inner))), "trainable": len(trainable)}


def perturb_b(chunk, seed: int = 11):
    """Every B non-zero, drawn whole per name (the reference runs at TP1: its tensors are whole)."""
    g = torch.Generator().manual_seed(seed)
    for n, p in sorted(unwrap(chunk).named_parameters()):
        if is_lora_param(n) and (n.endswith(".lora.b") or n.endswith("_b")):
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)


def save_factor_grads(chunk, grads_dir):
    """The factors' gradients, sharded as the factors are (their checkpoint entries, moe/lora.py)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    inner = unwrap(chunk)
    by_id = {id(p): p.main_grad.detach().clone() for p in inner.parameters() if p.requires_grad}
    sd = {k: v for k, v in inner.sharded_state_dict().items() if is_lora_param(k)}
    for v in sd.values():
        assert isinstance(v, (ShardedTensor, ShardedTensorFactory)) and id(v.data) in by_id, v
        v.data = by_id[id(v.data)].to(v.data.dtype).view_as(v.data)
    if torch.distributed.get_rank() == 0:
        os.makedirs(grads_dir, exist_ok=True)
    torch.distributed.barrier()
    in_process_checkpoint_queue()
    dist_checkpointing.save(sd, grads_dir)


def factor_grads_at_tp1(hf, world_size, model_cfg, grads_dir) -> dict:
    from megatron.core import dist_checkpointing

    distributed.init_model_parallel(distributed.Layout(world_size, 1, 1, 1, 1, False))
    tp1, _ = build_policy(hf, distributed.Layout(world_size, 1, 1, 1, 1, False), model_cfg, None, with_ddp=False)
    wanted = {k: v for k, v in tp1[0].sharded_state_dict().items() if is_lora_param(k)}
    loaded = dist_checkpointing.load(wanted, grads_dir)
    missing, _ = tp1[0].load_state_dict(loaded, strict=False)
    assert not [m for m in missing if is_lora_param(m)], missing
    return {n: p.detach().clone() for n, p in tp1[0].named_parameters() if is_lora_param(n)}


def merged_export(chunks, hf, path) -> dict:
    """The learner's merged export at this layout into transformers: its logits against the adapted learner's, and
    how far the adapters move them (the base's logits: adapters off)."""
    tokens = torch.randint(0, hf.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    adapted = megatron_logits(chunks, tokens, hf.vocab_size)
    with adapters_off(chunks):
        base = megatron_logits(chunks, tokens, hf.vocab_size)
    exported = export_hf_state(chunks, dst=0)
    if torch.distributed.get_rank() == 0:
        writer = HFCheckpointWriter(path, hf)
        for k, v in exported.items():
            writer.add(k, v)
        writer.close()
    torch.distributed.barrier()
    report = {}
    if adapted is not None:
        report = {"merged_logits_rel_err": rel_err(hf_logits(path, tokens), adapted),
                  "adapters_move_logits": rel_err(base, adapted)}
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, report)
    return {k: v for r in every for k, v in r.items()}


def run(phase, ref_root, out_dir, overrides: tuple):
    rank = None
    for family, (model, expert_layout) in FAMILIES.items():
        cfg = load_config(None, overrides + settings(expert_layout))
        hf = load_hf_config(model)
        layout = distributed.init(cfg.parallel, hf, cfg.seed)
        rank = torch.distributed.get_rank()
        init = os.path.join(ref_root, f"init_{family}")
        if phase == "reference":  # its base an HF checkpoint (made here), which peft's adapter goes on in the test
            base = os.path.join(ref_root, f"base_{family}")
            make_hf_checkpoint(hf, base)
            chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim, seed=cfg.seed, init_from_hf=base)
        else:
            chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim, seed=cfg.seed)
        if phase == "reference":
            perturb_b(chunks[0])
            with open(os.path.join(base, "config.json"), "rb") as f:
                config = f.read()
            save_checkpoint(init, chunks, meta={"settings": {"model.lora": lora_setting(cfg.model.lora)}},
                            files={f"{HF_FILES}/config.json": config})
            tokens = torch.randint(0, hf.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
            torch.save({"tokens": tokens, "logits": megatron_logits(chunks, tokens, hf.vocab_size)},
                       os.path.join(ref_root, f"logits_{family}.pt"))
        else:
            load_checkpoint(init, chunks)
        result = {}
        if phase != "reference":
            result.update(merged_export(chunks, hf, os.path.join(out_dir, f"merged_{family}")))
            # rollout.lora_sync=adapter's gather: every factor whole on rank 0, keyed as the checkpoint keys it
            named = [item for bucket in AdapterStream(chunks, bucket_bytes=1 << 12, dst=0) for item in bucket]
            if rank == 0:
                torch.save(stacked_factors(named), os.path.join(out_dir, f"adapter_{family}.pt"))
        micro = split_micro_batches(data_parallel_shard(global_batch(hf.vocab_size)), cfg.parallel.num_micro_batches)
        losses = [reduce_report(forward_backward(chunks, opt, micro))["lm_loss"]]
        result["frozen"] = frozen_report(chunks[0], opt)
        grads_dir = os.path.join(out_dir, f"grads_{family}")
        if phase == "reference":
            torch.save(factor_grads(chunks[0]), os.path.join(ref_root, f"grads_{family}.pt"))
        else:
            save_factor_grads(chunks[0], grads_dir)
        ok, _, _ = opt.step()
        assert ok
        for _ in range(STEPS - 1):
            losses.append(train_step(chunks, opt, micro)["loss"])
        result["losses"] = losses
        if phase != "reference":
            del chunks, opt
            grads = factor_grads_at_tp1(hf, layout.world_size, cfg.model, grads_dir)
            if rank == 0:
                torch.save(grads, os.path.join(out_dir, f"grads_{family}.pt"))
        if rank == 0:
            with open(os.path.join(out_dir, f"{phase}_{family}.json"), "w") as f:
                json.dump(result, f)
        torch.distributed.barrier()


if __name__ == "__main__":  # alone: phase ref_root out_dir [overrides...] (tests run it from parity.py's launches)
    run(sys.argv[1], sys.argv[2], sys.argv[3], tuple(sys.argv[4:]))
    distributed.destroy()
