"""Checkpoints across megatron's layer specs: local (this machine, `rlpo-mega convert`) <-> Transformer Engine (GPUs).

Per family: a local-spec policy from a random HF checkpoint takes one training step (Adam moments non-zero) and is
saved; a TE-spec policy (megatron's TE spec, stand-in leaves: tests/workers/te_spec.py) resumes it, model and
optimizer, and saves again; a fresh local-spec policy resumes that TE checkpoint. Weights (through the bridge's HF
export) and Adam moments are compared exactly at every hop, and both resumed models then train one more step.
Rank 0 reports. argv: out_dir model_configs(comma-separated) [overrides...]; the checkpoints (local_<family>,
te_<family>) and the HF tensors they hold (expected_<family>.safetensors) stay in out_dir for the test's CLI export.
RLPO_OTHER_TE_CKPT: a TE checkpoint of another model, loaded last (its one-line refusal reported).
"""
import dataclasses
import json
import os
import shutil

import torch
import torch.distributed as dist

from moe.bridge.megatron_io import _inner, export_hf_state, local_params
from rlpo_mega import distributed
from rlpo_mega.checkpoint.dist import META, CheckpointError, load_checkpoint, read_meta, save_checkpoint
from rlpo_mega.checkpoint.files import HF_FILES
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy, unwrap
from rlpo_mega.training.warmup import data_parallel_shard, split_micro_batches, train_step
from tests.workers.bridge import make_hf_checkpoint, per_family_main
from tests.workers.te_spec import te_spec


def moments(chunks, optimizer) -> dict[str, torch.Tensor]:
    """{global local-spec name (the bridge's, either spec): exp_avg and exp_avg_sq side by side} on this rank."""
    by_param = {}
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for p, state in sub.optimizer.state.items():
            by_param[p] = torch.stack([state["exp_avg"], state["exp_avg_sq"]])
    out = {}
    for lp in local_params(chunks[0]):
        main = lp.param.main_param if getattr(lp.param, "main_param", None) is not None else lp.param
        if main in by_param:
            out[lp.map.megatron] = by_param[main].clone()
    return out


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def on_rank0(fn, *args):
    """fn(*args) where the exports were gathered (rank 0); every rank has run the collectives in args."""
    return fn(*args) if dist.get_rank() == 0 else None


def sharded_keys(chunks) -> set[str]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return {v.key for v in nested_values(unwrap(chunks[0]).sharded_state_dict()) if isinstance(v, ShardedBase)}


def hf_files(src) -> dict[str, bytes]:
    with open(os.path.join(src, "config.json"), "rb") as f:
        return {f"{HF_FILES}/config.json": f.read()}


def step(chunks, opt, hf, cfg, seed):
    tokens = torch.randint(0, hf.vocab_size, (4, 17), generator=torch.Generator().manual_seed(seed))
    return train_step(chunks, opt, split_micro_batches(data_parallel_shard(tokens), cfg.parallel.num_micro_batches))


def run_family(out_dir, hf, overrides):
    src = os.path.join(out_dir, f"hf_src_{hf.model_type}")
    c_local, c_te = (os.path.join(out_dir, f"{kind}_{hf.model_type}") for kind in ("local", "te"))
    cfg = load_config(None, tuple(overrides) + (f"model.init_from_hf={src}", "optim.lr=1e-3"))
    fresh = dataclasses.replace(cfg.model, init_from_hf=None)
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    if dist.get_rank() == 0 and not os.path.isdir(src):
        make_hf_checkpoint(hf, src)
    dist.barrier()
    report = {}

    # 1. local spec: one step, saved
    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim)
    step(chunks, opt, hf, cfg, 5)
    weights, adam = export_hf_state(chunks, dst=0), moments(chunks, opt)
    save_checkpoint(c_local, chunks, opt, files=hf_files(src))
    if dist.get_rank() == 0:  # what `rlpo-mega export` of either checkpoint must give (the test runs it)
        from safetensors.torch import save_file

        save_file(weights, os.path.join(out_dir, f"expected_{hf.model_type}.safetensors"))
    local_keys = sharded_keys(chunks)

    # 2. TE spec, drawn fresh: resumes the local checkpoint, saves its own
    with te_spec():
        te_chunks, te_opt = build_policy(hf, layout, fresh, cfg.optim)
    te_keys = sharded_keys(te_chunks)
    report["te_only_keys"] = sorted(te_keys - local_keys)
    report["local_only_keys"] = sorted(local_keys - te_keys)
    report["te_layer_spec"] = getattr(unwrap(te_chunks[0]), "layer_spec", None)
    load_checkpoint(c_local, te_chunks, te_opt)
    te_weights = export_hf_state(te_chunks, dst=0)
    report["te_weights_equal"] = on_rank0(same, te_weights, weights)
    report["te_moments_equal"] = same(moments(te_chunks, te_opt), adam)
    save_checkpoint(c_te, te_chunks, te_opt, files=hf_files(src))
    report["meta_specs"] = [read_meta(c_local).get("layer_spec"), read_meta(c_te).get("layer_spec")]

    # 3. local spec, drawn fresh: resumes the TE checkpoint
    back, back_opt = build_policy(hf, layout, fresh, cfg.optim)
    load_checkpoint(c_te, back, back_opt)
    report["back_weights_equal"] = on_rank0(same, export_hf_state(back, dst=0), weights)
    report["back_moments_equal"] = same(moments(back, back_opt), adam)

    # 3b. checkpoints from before the spec was recorded: the spec is read from the keys they hold
    for path, into in ((c_te, back), (c_local, te_chunks)):
        unrecorded = path + "_unrecorded"
        if dist.get_rank() == 0:
            shutil.copytree(path, unrecorded)
            with open(os.path.join(unrecorded, META)) as f:
                meta = json.load(f)
            del meta["layer_spec"]
            with open(os.path.join(unrecorded, META), "w") as f:
                json.dump(meta, f)
        dist.barrier()
        with torch.no_grad():
            for p in _inner(into[0]).parameters():
                p.zero_()
        load_checkpoint(unrecorded, into)
        key = f"unrecorded_{'te' if path == c_te else 'local'}_weights_equal"
        report[key] = on_rank0(same, export_hf_state(into, dst=0), weights)

    # 4. the resumed local model trains on exactly as the one that saved
    report["next_loss"] = [float(step(model, optimizer, hf, cfg, 6)["loss"])
                           for model, optimizer in ((chunks, opt), (back, back_opt))]
    report["next_weights_equal"] = on_rank0(same, export_hf_state(back, dst=0), export_hf_state(chunks, dst=0))

    # 5. a TE checkpoint of another model: one line naming the specs
    other = os.environ.get("RLPO_OTHER_TE_CKPT")
    if other and os.path.isdir(other):
        try:
            load_checkpoint(other, back)
            report["other_model_error"] = None
        except CheckpointError as e:
            report["other_model_error"] = str(e)
    return merged(report)


def merged(report: dict) -> dict:
    """Every rank's report in one (pipeline stages hold different layers): key lists joined, checks all true."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, report)
    out = dict(every[0])
    for key, value in out.items():
        values = [r[key] for r in every if r.get(key) is not None]
        if isinstance(value, list) and key.endswith("_keys"):
            out[key] = sorted({k for v in values for k in v})
        elif isinstance(value, bool) or value is None:
            out[key] = all(values) if values and all(isinstance(v, bool) for v in values) else value
    return out


if __name__ == "__main__":
    per_family_main(run_family)
