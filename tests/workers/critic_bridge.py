"""Value-model bridge worker: a transformers *ForTokenClassification (num_labels=1) checkpoint -> the critic
at a layout -> values vs transformers' own forward -> export; and a critic started from a causal-LM (policy)
checkpoint: its trunk is the policy's, its head the value head's own initialisation.

argv: out_dir model_configs(comma-separated) [overrides...]; rank 0 reports {model_type: report}.
"""
import copy
import os

import torch
import torch.distributed as dist

from moe.bridge.megatron_io import export_hf_state
from moe.value_head import VALUE_HEAD_HF
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy
from rlpo_mega.training.batches import MicroBatch
from rlpo_mega.training.update import run_schedule
from tests.workers.bridge import make_hf_checkpoint, per_family_main, rel_err


def make_value_checkpoint(hf, path):
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(13)
    c = copy.deepcopy(hf)
    c.num_labels = 1
    model = AutoModelForTokenClassification.from_config(c)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)


def hf_values(path, tokens):
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits[..., 0].double()


def megatron_values(chunks, tokens):
    from megatron.core import parallel_state

    captured = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        toks = batch.tokens
        pos = torch.arange(toks.shape[1]).unsqueeze(0).expand_as(toks)
        out = model(input_ids=toks, position_ids=pos, attention_mask=None)

        def loss_func(values):
            captured.append(values[..., 0].detach().double())
            return values.sum() * 0, torch.tensor(1, dtype=torch.int), {}

        return out, loss_func

    for c in chunks:
        c.eval()
    with torch.no_grad():
        run_schedule(chunks, [MicroBatch(tokens=tokens, labels=tokens, loss_mask=torch.ones_like(tokens))],
                     forward_only=True, forward_step=forward_step)
    for c in chunks:
        c.train()
    return captured[0] if parallel_state.is_pipeline_last_stage() else None


def _safetensors(path):
    from safetensors.torch import load_file

    out = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def run_family(out_dir, hf, overrides):
    src = os.path.join(out_dir, f"value_src_{hf.model_type}")
    policy_src = os.path.join(out_dir, f"policy_src_{hf.model_type}")
    cfg = load_config(None, tuple(overrides))
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    rank = dist.get_rank()
    if rank == 0:
        if not os.path.isdir(src):
            make_value_checkpoint(hf, src)
        if not os.path.isdir(policy_src):
            make_hf_checkpoint(hf, policy_src)
    dist.barrier()
    report = {}
    chunks, _ = build_policy(hf, layout, cfg.model, cfg.critic.optim, value_head=True, init_from_hf=src)
    tokens = torch.randint(0, hf.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    got = megatron_values(chunks, tokens)
    if got is not None:
        ref = hf_values(src, tokens)
        report["values_rel_err"] = rel_err(got, ref)
        report["values_scale"] = float(ref.abs().max())
    exported = export_hf_state(chunks, dst=0)
    if rank == 0:
        original = _safetensors(src)
        report["export_names_equal"] = sorted(original) == sorted(exported)
        report["export_max_abs_diff"] = max(float((original[k] - exported[k]).abs().max()) for k in original)
    # from the policy's (causal-LM) checkpoint: the trunk loads, the LM head is not read, the head is fresh
    chunks, _ = build_policy(hf, layout, cfg.model, cfg.critic.optim, value_head=True, init_from_hf=policy_src,
                             head_seed=cfg.seed)
    exported = export_hf_state(chunks, dst=0)
    if rank == 0:
        policy = _safetensors(policy_src)
        head = {k: v for k, v in policy.items() if k.startswith("lm_head.")}
        trunk = {k: v for k, v in policy.items() if k not in head}
        report["trunk_names_equal"] = sorted(trunk) == sorted(k for k in exported if k not in VALUE_HEAD_HF)
        report["trunk_max_abs_diff"] = max(float((trunk[k] - exported[k]).abs().max()) for k in trunk)
        g = torch.Generator().manual_seed(cfg.seed)
        want = torch.randn(1, hf.hidden_size, generator=g) * hf.initializer_range
        report["fresh_head_is_the_seeded_draw"] = bool(torch.equal(exported[VALUE_HEAD_HF[0]], want))
        report["fresh_bias_zero"] = bool((exported[VALUE_HEAD_HF[1]] == 0).all())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, report)
    for r in every:
        for k, v in r.items():
            report.setdefault(k, v)
    dist.barrier()
    return report


if __name__ == "__main__":
    per_family_main(run_family)
