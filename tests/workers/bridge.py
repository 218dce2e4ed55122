"""Weight-bridge worker: HF checkpoint -> megatron at a layout -> forward vs transformers -> export.

argv: out_dir model_config [overrides...]. Rank 0 writes a random HF checkpoint (every tensor, norms
included, perturbed so a mis-mapped norm shows), all ranks import it, and rank 0 reports errors.
"""
import os
import sys

import torch
import torch.distributed as dist

from moe.bridge.hf_checkpoint import HFCheckpointWriter
from moe.bridge.megatron_io import export_hf_state
from moe.model import load_hf_config
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy
from rlpo_mega.training.batches import MicroBatch
from rlpo_mega.training.update import run_schedule
from rlpo_mega.training.warmup import split_micro_batches, train_step
from tests.dist import write_report


def make_hf_checkpoint(hf, path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(hf)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():  # a sigmoid router's score-correction bias: mapped, so perturbed
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.05)
    model.save_pretrained(path)


def hf_logits(path, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.double()


def megatron_logits(chunks, tokens, vocab):
    """Full-vocabulary logits on the last stage (None elsewhere), through the forward-only schedule."""
    from megatron.core import parallel_state, tensor_parallel

    captured = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        toks = batch.tokens
        pos = torch.arange(toks.shape[1]).unsqueeze(0).expand_as(toks)
        out = model(input_ids=toks, position_ids=pos, attention_mask=None)

        def loss_func(logits):
            full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :vocab]
            captured.append(full.detach().double())
            return logits.sum() * 0, torch.tensor(1, dtype=torch.int), {}

        return out, loss_func

    for c in chunks:
        c.eval()
    with torch.no_grad():
        run_schedule(chunks, [MicroBatch(tokens=tokens, labels=tokens, loss_mask=torch.ones_like(tokens))],
                     forward_only=True, forward_step=forward_step)
    for c in chunks:
        c.train()
    return captured[0] if parallel_state.is_pipeline_last_stage() else None


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def per_family_main(run_family):
    """argv: out_dir model_configs(comma-separated) [overrides...]; rank 0 reports {model_type: report}."""
    out_dir, model_cfgs, *overrides = sys.argv[1:]
    reports = {}
    for model_cfg in model_cfgs.split(","):
        hf = load_hf_config(model_cfg)
        reports[hf.model_type] = run_family(out_dir, hf, overrides)
    if os.environ.get("RLPO_CRITIC_MODELS"):  # the value model's bridge at this layout too (tests/layout_runs.py)
        from tests.workers.critic_bridge import run_family as critic_family

        for model_cfg in os.environ["RLPO_CRITIC_MODELS"].split(","):
            hf = load_hf_config(model_cfg)
            reports["critic:" + hf.model_type] = critic_family(out_dir, hf, overrides)
    if dist.get_rank() == 0:
        write_report(reports)
    distributed.destroy()


def main():
    per_family_main(run_family)


def run_family(out_dir, hf, overrides):
    src = os.path.join(out_dir, f"hf_src_{hf.model_type}")
    cfg = load_config(None, tuple(overrides) + (f"model.init_from_hf={src}", "optim.lr=1e-3"))
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    rank = dist.get_rank()
    if rank == 0 and not os.path.isdir(src):
        make_hf_checkpoint(hf, src)
    dist.barrier()
    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim)
    tokens = torch.randint(0, hf.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    report = {}

    # 1. Import: megatron forward == transformers forward.
    got = megatron_logits(chunks, tokens, hf.vocab_size)
    if got is not None:
        report["import_logits_rel_err"] = rel_err(got, hf_logits(src, tokens))

    # 2. Export: tensor-for-tensor equal to the original checkpoint.
    exported = export_hf_state(chunks, dst=0)
    if rank == 0:
        from safetensors.torch import load_file

        original = {}
        for f in os.listdir(src):
            if f.endswith(".safetensors"):
                original.update(load_file(os.path.join(src, f)))
        report["export_names_equal"] = sorted(original) == sorted(exported)
        report["export_max_abs_diff"] = max(float((original[k] - exported[k]).abs().max()) for k in original)
        report["export_dtypes_equal"] = all(original[k].dtype == exported[k].dtype for k in original)

    # 3. Round trip through training: one optimizer step, export, transformers forward == megatron.
    tokens_train = torch.randint(0, hf.vocab_size, (4, 17), generator=torch.Generator().manual_seed(5))
    from rlpo_mega.training.warmup import data_parallel_shard

    train_step(chunks, opt, split_micro_batches(data_parallel_shard(tokens_train), cfg.parallel.num_micro_batches))
    after = megatron_logits(chunks, tokens, hf.vocab_size)
    exported = export_hf_state(chunks, dst=0)
    trained_dir = os.path.join(out_dir, f"trained_{hf.model_type}")
    if rank == 0:
        writer = HFCheckpointWriter(trained_dir, hf, source_dir=src)
        for k, v in exported.items():
            writer.add(k, v)
        writer.close()
    dist.barrier()
    if after is not None:
        ref = hf_logits(trained_dir, tokens)
        report["trained_logits_rel_err"] = rel_err(after, ref)
        report["trained_moved"] = rel_err(after, hf_logits(src, tokens))
    # Rank 0 collects the last stage's numbers (every rank contributes what it measured).
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, report)
    for r in every:
        for k, v in r.items():
            report.setdefault(k, v)
    dist.barrier()
    return report


def parallel_state_last_rank():
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_last_rank()


if __name__ == "__main__":
    main()
