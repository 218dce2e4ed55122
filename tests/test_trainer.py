"""The RL trainer end to end (2 processes, EP2/TP2, embedded engine, offline W&B).

Each test is one torchrun launch running several short trainer runs (tests/workers/train_scenarios.py);
the runs' metrics are read back from their offline W&B logs and metrics.jsonl.
"""
import glob
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlpo_mega.config import load_config

from tests.dist import ROOT, torchrun
from tests.metric_catalogue import missing_metrics
from tests.wandb_reader import read_wandb_offline_run

pytestmark = pytest.mark.timeout(900)


def _wandb(run_dir):
    files = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, f"expected one offline W&B run in {run_dir}, found {files}"
    return read_wandb_offline_run(files[0])


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    return out, torchrun("train_scenarios.py", 2, "matrix", str(out), env={"WANDB_MODE": "offline"}, timeout=900)


# every loss under R3; replay off and R2 once (the routing metrics and the replay do not depend on the loss)
@pytest.mark.parametrize("loss, mode", [(loss, "r3") for loss in ("gspo", "sapo", "grpo", "dapo")]
                         + [("gspo", "off"), ("gspo", "r2")])
def test_every_loss_logs_every_metric_to_wandb(matrix, loss, mode):
    """Two mini-batches per step (gspo: 2 micro-batches, sapo: 2 epochs) at EP2, every metric in W&B."""
    out, report = matrix
    run = f"{loss}_{mode}"
    assert report[run] == {"rc": 0, "steps": [1, 2]}
    wb = _wandb(out / run)
    assert wb.config["algorithm"]["loss"]["name"] == loss and wb.config["routing"]["mode"] == mode
    logged = set(wb.history)
    assert missing_metrics(logged, loss, kl_ref=loss == "grpo", dynamic_sampling=loss == "dapo") == []
    for key in ("reward/mean", "loss/policy", "optim/grad_norm", "routing/agreement/mean", "time/step",
                "perf/tokens_per_s", "experts/load_max/layer_0"):
        assert len(wb.history[key]) == 2 and all(math.isfinite(v) for v in wb.history[key]), key
    assert wb.history["routing/agreement/mean"] == [1.0, 1.0]  # engine and learner hold the same weights
    assert max(wb.history["mismatch/ratio_dev_max"]) < 1e-4  # embedded engine vs learner, fp32
    if loss == "grpo":
        assert all(v >= 0 for v in wb.history["kl/ref"])
        assert wb.history["kl/ref"][0] == 0.0  # the reference is the policy as RL starts
    if loss == "dapo":
        assert wb.history["dynamic_sampling/kept"] == [4.0, 4.0]  # refilled to prompts_per_step groups
    if loss != "grpo":  # the second mini-batch is updated by a policy the first one already moved
        assert all(v > 0 for v in wb.history["kl/policy"]), wb.history["kl/policy"]
    if mode != "off":  # the update replays (r3: the rollout's routes, r2: those its old pass recorded)
        assert all(0.5 < v <= 1.0 for v in wb.history["routing/update/agreement"])


def test_context_parallel_run_replays_the_engines_routes(matrix):
    """GSPO with R3 at CP2 (the two ranks split every packed sample, EP2 over the same ranks): the learner's
    routers agree with the engine's record on every token of every shard, and its log-probs with the engine's."""
    out, report = matrix
    assert report["gspo_r3_cp2"] == {"rc": 0, "steps": [1, 2]}
    wb = _wandb(out / "gspo_r3_cp2")
    assert wb.config["parallel"]["context"] == 2
    assert wb.history["routing/agreement/mean"] == [1.0, 1.0]  # engine and learner hold the same weights
    assert all(0.5 < v <= 1.0 for v in wb.history["routing/update/agreement"])
    assert max(wb.history["mismatch/ratio_dev_max"]) < 1e-4  # embedded engine vs learner, fp32
    assert all(math.isfinite(v) for v in wb.history["loss/policy"])


@pytest.mark.parametrize("mode", ["r3", "r2", "off"])
def test_ppo_with_a_critic_logs_every_metric(matrix, mode):
    """PPO + GAE (two mini-batches per step, EP2): the critic's metrics in W&B next to the policy's; r3 folds a KL
    penalty into the rewards (logged as kl/ref) and its first step trains the critic alone (critic.warmup_steps=1)."""
    out, report = matrix
    run = f"ppo_gae_{mode}"
    assert report[run] == {"rc": 0, "steps": [1, 2]}
    wb = _wandb(out / run)
    assert wb.config["algorithm"]["advantage"]["name"] == "gae"
    logged = set(wb.history)
    assert missing_metrics(logged, "ppo_clip", kl_ref=mode == "r3", dynamic_sampling=False, critic=True) == []
    h = wb.history
    for key in ("critic/value_loss", "critic/explained_variance", "critic/vf_clip_frac", "critic/returns_mean",
                "critic/values_mean", "critic/grad_norm", "advantages/std"):
        assert len(h[key]) == 2 and all(math.isfinite(v) for v in h[key]), (key, h[key])
    assert all(v > 0 for v in h["advantages/std"])  # GAE's advantages before whitening
    if mode != "off":  # the critic's update replays (r3: the rollout's routes; r2: its own old pass's)
        assert all(0.5 < v <= 1.0 for v in h["critic/routing/update/agreement"])
    if mode == "r3":
        assert len(h["loss/policy"]) == 1  # step 1: the critic alone
        assert h["kl/ref"][0] == 0.0  # the reference is the policy as RL starts; step 1 did not move it
    else:
        assert len(h["loss/policy"]) == 2


def lr_reference(n, init, peak, low, warmup, decay, style="cosine"):
    """Linear warm-up then cosine or linear decay (Loshchilov & Hutter), transcribed in float64."""
    if warmup and n <= warmup:
        return init + (peak - init) * n / warmup
    if n > decay:
        return low
    ratio = (n - warmup) / (decay - warmup)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if style == "cosine" else 1.0 - ratio
    return low + coeff * (peak - low)


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_lr_schedule_matches_the_formula(style):
    import torch

    from rlpo_mega.config import OptimConfig
    from rlpo_mega.model_setup import build_lr_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    cfg = OptimConfig(lr=1e-3, min_lr=1e-5, lr_warmup_steps=5, lr_warmup_init=1e-4, lr_decay_style=style,
                      lr_decay_steps=30)
    sched = build_lr_scheduler(opt, cfg, total_steps=999)
    got = []
    for n in range(40):
        got.append(opt.param_groups[0]["lr"])
        sched.step(1)
    want = [lr_reference(n, 1e-4, 1e-3, 1e-5, 5, 30, style) for n in range(40)]
    assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18) for a, b in zip(got, want)), (got, want)
    constant = build_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0), OptimConfig(lr=3e-4), 10)
    assert constant.optimizer.param_groups[0]["lr"] == 3e-4  # the default keeps optim.lr throughout


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return torchrun("train_scenarios.py", 2, "resume", str(tmp_path_factory.mktemp("resume")),
                    env={"WANDB_MODE": "disabled"}, timeout=900)


def test_resume_equals_uninterrupted_run(resumed):
    full = {h["step"]: h for h in resumed["full"]}
    second = {h["step"]: h for h in resumed["second"]}
    assert [h["step"] for h in resumed["first"]] == [1, 2] and sorted(second) == [3, 4]
    for step in (1, 2):  # the first run is the uninterrupted one, so far
        assert resumed["first"][step - 1]["loss/policy"] == full[step]["loss/policy"]
    for step in (3, 4):
        for key in ("loss/policy", "reward/mean", "optim/grad_norm", "kl/policy", "ratio/seq_max", "optim/lr",
                    "kl/ref"):  # the KL reference was saved with the checkpoint, not rebuilt from step 2's policy
            assert second[step][key] == full[step][key], (step, key, second[step][key], full[step][key])
    # the schedule (cosine, 2 warm-up steps from 1e-4, 8 decay steps to 2e-4, lr 2e-3) after 2 optimizer
    # steps per RL step, against the formula
    lr = {s: lr_reference(2 * s, init=1e-4, peak=2e-3, low=2e-4, warmup=2, decay=8) for s in (1, 2, 3, 4)}
    for step in (1, 2, 3, 4):
        assert math.isclose(full[step]["optim/lr"], lr[step], rel_tol=1e-12), (step, full[step]["optim/lr"], lr)
    assert resumed["ckpt_dirs"] == ["latest", "step_00000004"]  # keep_last=1 pruned step 2


def test_lora_run_syncs_merged_weights_keeps_the_base_as_reference_and_resumes_exactly(resumed):
    """model.lora (rank 4, EP2 learners, the embedded engine): every step the engine samples with the merged weights
    (its log-probs are the learner's: the merged sync took effect), the KL reference is the base (adapters off: the
    policy moves away from it), and 2 steps + resume gives the uninterrupted run's step 3 (the factors and their
    optimizer state were saved and loaded)."""
    full = {h["step"]: h for h in resumed["full_lora"]}
    second = {h["step"]: h for h in resumed["second_lora"]}
    assert sorted(full) == [1, 2, 3] and sorted(second) == [3]
    for h in full.values():
        assert h["mismatch/ratio_dev_max"] < 1e-4 and h["mismatch/k3_kl"] < 1e-8, h
    assert full[3]["kl/ref"] > 0 and full[3]["kl/ref"] > full[1]["kl/ref"], full
    for key in ("loss/policy", "reward/mean", "optim/grad_norm", "kl/ref", "kl/policy"):
        assert second[3][key] == full[3][key], (key, second[3][key], full[3][key])


def test_a_lora_checkpoint_exports_its_merged_weights_and_refuses_another_models_resume(resumed, tmp_path):
    """A LoRA run on an HF base (model.init_from_hf) saves its adapters only: the checkpoint's model entries are the
    factors (and the optimizer's theirs), its meta names the base and its fingerprint. `rlpo-mega export` of it
    rebuilds the base from there, loads the factors and writes the merged weights: tensor for tensor the trainer's own
    HF export of that step; `--peft-out` in the same command writes the PEFT adapter, which peft puts on that base to
    give the merged model's logits. A resume whose model.lora differs (none, another rank) is refused before anything
    loads, naming both, and so is one on no base or on another base (same shapes, other weights)."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from moe.lora import is_lora_param
    from rlpo_mega.checkpoint.dist import CheckpointError, read_meta
    from rlpo_mega.config import LoRAConfig, ModelConfig
    from rlpo_mega.training.trainer import check_lora_resume

    step2, base = os.path.join(resumed["ckpt_lora"], "step_00000002"), resumed["lora_base"]
    meta = read_meta(step2)
    assert meta["adapters_only"] and meta["base"]["path"] == base and len(meta["base"]["fingerprint"]) == 64, meta
    keys = [k for k in FileSystemReader(step2).read_metadata().state_dict_metadata if not k.startswith("optimizer.")]
    assert keys and all(is_lora_param(k) for k in keys if k.startswith(("decoder.", "embedding.", "output_layer."))), keys
    out, adapter = tmp_path / "hf", tmp_path / "adapter"
    proc = subprocess.run([sys.executable, "-m", "rlpo_mega.cli", "export", "--ckpt", step2, "--hf-out", str(out),
                           "--peft-out", str(adapter)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]

    def tensors(d):
        return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(d, f)).items()}

    mine, trainers = tensors(out), tensors(os.path.join(step2, "hf_model"))
    assert sorted(mine) == sorted(trainers) and all(torch.equal(mine[k], trainers[k]) for k in mine)
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(tokens).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(adapter))
        got = peft(tokens).logits
    assert float((got - merged).abs().max() / merged.abs().max()) < 1e-5

    lora = LoRAConfig(rank=4, alpha=16.0)
    check_lora_resume(step2, ModelConfig(lora=lora, init_from_hf=base))
    for other, named in ((LoRAConfig(), "this run has off"), (LoRAConfig(rank=8, alpha=16.0), "'rank': 8")):
        with pytest.raises(CheckpointError, match=named):
            check_lora_resume(step2, ModelConfig(lora=other, init_from_hf=base))
    with pytest.raises(CheckpointError, match="saved with model.lora off"):
        check_lora_resume(os.path.join(resumed["ckpt"], "step_00000004"), ModelConfig(lora=lora))
    with pytest.raises(CheckpointError, match="adapters only, trained on the base .*: set model.init_from_hf"):
        check_lora_resume(step2, ModelConfig(lora=lora))
    other = tmp_path / "other_base"  # the same model, other weights (one tensor moved: all in the samples here)
    shutil.copytree(base, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.weight"] += 1e-3
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="holds other weights"):
        check_lora_resume(step2, ModelConfig(lora=lora, init_from_hf=str(other)))


def test_resume_keeps_the_groups_carried_to_the_next_step(resumed):
    """Dynamic sampling with surplus groups carried one step: each rank's carried groups (and prompts drawn but
    not sent) are saved with the checkpoint, so the resumed run trains at steps 2-4 exactly what the
    uninterrupted run does, carried groups included."""
    full = {h["step"]: h for h in resumed["full_ds"]}
    second = {h["step"]: h for h in resumed["second_ds"]}
    assert sorted(second) == [2, 3, 4] and resumed["rank_state"] == ["rank_00000.pt", "rank_00001.pt"]
    assert full[2]["dynamic_sampling/carried_in"] > 0  # step 2 trains groups that step 1 carried (saved, loaded)
    for step in (2, 3, 4):
        for key in ("loss/policy", "reward/mean", "optim/grad_norm", "dynamic_sampling/carried_in",
                    "dynamic_sampling/kept", "dynamic_sampling/prompts_drawn"):
            assert second[step][key] == full[step][key], (step, key, second[step][key], full[step][key])
    # the async producer (max_staleness 0): its drawn chunks and carried groups saved and loaded, the carry
    # counted stale at the bound
    full = {h["step"]: h for h in resumed["full_ads"]}
    second = {h["step"]: h for h in resumed["second_ads"]}
    assert sorted(second) == [2, 3] and full[1]["dynamic_sampling/carried_out"] > 0
    for step in (2, 3):
        for key in ("loss/policy", "reward/mean", "optim/grad_norm", "dynamic_sampling/carry_stale",
                    "dynamic_sampling/kept", "dynamic_sampling/prompts_drawn"):
            assert second[step][key] == full[step][key], (step, key, second[step][key], full[step][key])


def test_resume_with_a_critic_equals_uninterrupted_run(tmp_path):
    r = torchrun("train_scenarios.py", 2, "resume_ppo", str(tmp_path), env={"WANDB_MODE": "disabled"}, timeout=900)
    full = {h["step"]: h for h in r["full"]}
    second = {h["step"]: h for h in r["second"]}
    assert [h["step"] for h in r["first"]] == [1, 2] and sorted(second) == [3, 4]
    for step in (3, 4):  # the critic's weights, optimizer and schedule came back with the checkpoint
        for key in ("loss/policy", "reward/mean", "optim/grad_norm", "optim/lr", "critic/value_loss",
                    "critic/grad_norm", "critic/lr", "critic/explained_variance", "critic/values_mean",
                    "advantages/max"):
            assert second[step][key] == full[step][key], (step, key, second[step][key], full[step][key])
    assert "loss/policy" not in full[1] and "loss/policy" in full[2]  # critic.warmup_steps=1
    full16, second16 = {h["step"]: h for h in r["full_bf16"]}, {h["step"]: h for h in r["second_bf16"]}
    assert sorted(second16) == [3]  # bf16, distributed optimizers (policy and critic): step 3 resumed exactly
    for key in ("loss/policy", "optim/grad_norm", "critic/value_loss", "critic/grad_norm", "critic/values_mean"):
        assert second16[3][key] == full16[3][key], (key, second16[3][key], full16[3][key])
    assert r["resharded_equal"] is True
    # adapters on the policy (on an HF base) and the critic: both checkpoints hold their adapters alone -- the critic
    # its factors and scalar head, its trunk the LoRA policy's base, copied again at the resume -- and step 3 resumed
    # is step 3 uninterrupted, the critic's figures included
    full_l, second_l = {h["step"]: h for h in r["full_lora"]}, {h["step"]: h for h in r["second_lora"]}
    assert sorted(second_l) == [3]
    for key in ("loss/policy", "reward/mean", "optim/grad_norm", "critic/value_loss", "critic/grad_norm",
                "critic/explained_variance", "critic/values_mean", "advantages/max"):
        assert second_l[3][key] == full_l[3][key], (key, second_l[3][key], full_l[3][key])
    _critic_adapters_only(os.path.join(r["ckpt_lora"], "step_00000002"), r["lora_base"])


def _critic_adapters_only(step: str, base: str):
    from torch.distributed.checkpoint import FileSystemReader

    from moe.lora import is_lora_param
    from rlpo_mega.checkpoint.dist import CheckpointError, read_meta
    from rlpo_mega.config import CriticConfig, LoRAConfig, ModelConfig
    from rlpo_mega.training.trainer import check_lora_resume

    meta = read_meta(step)
    assert meta["adapters_only"] and meta["critic_adapters_only"] and meta["critic_base"] == {"from": "policy"}, meta
    keys = [k for k in FileSystemReader(step).read_metadata().state_dict_metadata if k.startswith("critic.")]
    assert any(k.startswith("critic.output_layer.") for k in keys) and any(is_lora_param(k) for k in keys), keys
    assert all(is_lora_param(k) or k.startswith("critic.output_layer.") for k in keys), keys
    model = ModelConfig(init_from_hf=base, lora=LoRAConfig(rank=4))
    check_lora_resume(step, model, CriticConfig(lora=LoRAConfig(rank=4, alpha=8)))
    with pytest.raises(CheckpointError, match="whose trunk is the LoRA policy's base, and critic.init_from_hf=.* would "
                                              "give it another: unset critic.init_from_hf"):
        check_lora_resume(step, model, CriticConfig(init_from_hf=base, lora=LoRAConfig(rank=4, alpha=8)))


def test_reference_is_the_policy_after_warmup(tmp_path):
    r = torchrun("train_scenarios.py", 2, "warmup_reference", str(tmp_path), env={"WANDB_MODE": "disabled"},
                 timeout=600)
    assert r["warmup_moved"] and r["ref_equals_policy"], r


def test_a_rollout_producer_plugs_in_without_touching_the_trainer(tmp_path):
    """A producer the package does not know (tests/workers/train_hooks.ReplayProducer: step 2 trains step 1's
    groups again) runs through rollout.producer: the second step sees the same samples, now off-policy."""
    r = torchrun("train_scenarios.py", 2, "producer", str(tmp_path), env={"WANDB_MODE": "disabled"}, timeout=600)
    first, second = r["history"]
    assert r["rc"] == 0 and (first["step"], second["step"]) == (1, 2)
    assert "producer/replayed" not in first and second["producer/replayed"] == 1
    assert second["reward/mean"] == first["reward/mean"] and second["reward/samples"] == first["reward/samples"]
    # the engine sampled them with step 1's weights; step 2's old log-probs are of the policy step 1 moved
    assert first["mismatch/ratio_dev_max"] < 1e-4 < second["mismatch/ratio_dev_max"]


def test_export_at_save_equals_cli_export(resumed, tmp_path):
    """checkpoint.export_hf writes step_<N>/hf_model during the run; `rlpo-mega export` of the same
    checkpoint (another process, single rank) gives the same tensors, and transformers loads it."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    step = os.path.join(resumed["ckpt"], "step_00000004")
    out = tmp_path / "cli_export"
    proc = subprocess.run([sys.executable, "-m", "rlpo_mega.cli", "export", "--ckpt", step, "--hf-out", str(out)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def tensors(d):
        out = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            out.update(load_file(f))
        return out

    a, b = tensors(os.path.join(step, "hf_model")), tensors(str(out))
    assert sorted(a) == sorted(b) and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(step, "hf_model"))
    assert model.config.model_type == "qwen3_moe"
    assert os.path.isfile(os.path.join(step, "hf_model", "tokenizer.json"))


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path):
    """A crash mid-save leaves step_<N>.tmp (no trainer state) and `latest` on the previous step."""
    from rlpo_mega.checkpoint import run as state

    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "step_00000004" / state.STATE_FILE).write_bytes(b"x")
    (tmp_path / "step_00000006.tmp").mkdir()  # the interrupted save
    (tmp_path / "latest").write_text("step_00000004")
    assert state.complete_steps(str(tmp_path)) == [4]
    assert state.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_00000004")
    assert state.resolve_load_dir(str(tmp_path)) == str(tmp_path / "step_00000004")
    (tmp_path / "latest").unlink()  # even without the pointer: the newest complete step
    assert state.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_00000004")
    with pytest.raises(Exception, match="holds no trainer checkpoint"):
        state.resolve_load_dir(str(tmp_path / "step_00000006.tmp"))


def test_resume_at_another_layout(resumed):
    steps = [h["step"] for h in resumed["tp2"]]
    assert steps == [5]  # continued from the EP2 run's step 4 at TP2 (EP1)
    h = resumed["tp2"][0]
    assert math.isfinite(h["loss/policy"]) and h["routing/agreement/mean"] == 1.0
    assert [h["step"] for h in resumed["cp2"]] == [5]  # the same checkpoint at EP2 x CP2
    c = resumed["cp2"][0]
    assert math.isfinite(c["loss/policy"]) and c["routing/agreement/mean"] == 1.0
    assert c["optim/lr"] == h["optim/lr"]  # the schedule restored where the checkpoint left it


def test_colocated_embedded_engine_hands_the_memory_over_and_changes_no_number(tmp_path):
    """rollout.colocate=true (2 processes, EP2, bf16, distributed optimizer with optimizer CPU offload, KL reference,
    an evaluation and a save after each step) against the same run apart: the same metrics at every step and the
    same final weights. Per rank and phase, the bytes on the accelerator (the storages' sizes, counted from the
    tensors) are what rlpo-mega plan's memory model gives for the tiny model: in generation the engine's weights
    and nothing of the learner; in the update the learner's parameters, gradients and accelerator optimizer state
    (none: precision-aware offload) and the reference, nothing of the engine; after the step (sync, save) both."""
    from rlpo_mega.planning.plan import make_plan

    r = torchrun("train_scenarios.py", 2, "colocate", str(tmp_path), env={"WANDB_MODE": "disabled"}, timeout=900)
    apart, colocated = r["apart"], r["colocated"]
    assert [h["step"] for h in apart] == [h["step"] for h in colocated] and {h["step"] for h in apart} == {0, 1, 2, 3}
    keys = ("loss/policy", "reward/mean", "optim/grad_norm", "kl/ref", "eval/reward_mean", "ratio/seq_max")
    for a, c in zip(apart, colocated):
        for k in keys:
            assert a.get(k) == c.get(k), (a["step"], k, a.get(k), c.get(k))
    assert any("loss/policy" in h for h in colocated) and any("eval/reward_mean" in h for h in colocated)
    assert r["weights_equal"]
    assert all(h.get("colocate/learner_offloaded_bytes", 1) > 0 for h in colocated if "loss/policy" in h)

    # what rlpo-mega plan predicts for the same configuration, colocated, at world size 2
    from tests.workers.scenario_config import BASE, COLOCATE

    # (the run's reward, test_parity, is registered in its workers: the plan does not depend on it)
    cfg = load_config("configs/demo_cpu.yaml", BASE + COLOCATE + ("rollout.colocate=true", "reward.function=toy_arith"))
    plan = make_plan(cfg, "colocate", world_size=2).to_json()
    row = {r["name"].split(", ")[1]: r for r in plan["learner_gpus"]}
    assert set(row) == {"training", "generation", "sync"}
    state = ("params", "grads", "optimizer", "reference")
    for rank, phases in enumerate(r["phases"]):
        assert [p["phase"] for p in phases] == ["generation", "update", "after step"] * 3
        for p in phases:
            got = (p["param_bytes"], p["grad_bytes"], p["optimizer_bytes"], p["reference_bytes"], p["engine_bytes"])
            planned = {"generation": row["generation"], "update": row["training"], "after step": row["sync"]}[p["phase"]]
            want = tuple(planned.get(k, 0) for k in state) + (planned.get("engine weights", 0),)
            assert got == want, (rank, p["phase"], p["step"], got, want)
    assert row["generation"]["engine KV cache"] > 0
    # the host: the offloaded optimizer state of the node's two ranks after the first step
    after = [next(p for p in phases if p["phase"] == "after step") for phases in r["phases"]]
    assert plan["hosts"][0]["optimizer offload"] == sum(p["host_optimizer_bytes"] for p in after)
    assert plan["checkpoint"]["handover"]["bytes_per_gpu"] > 0


def test_nan_step_skipped_then_stop_after_max_bad_steps(tmp_path):
    rep = torchrun("train_scenarios.py", 2, "nan", str(tmp_path), env={"WANDB_MODE": "disabled"})
    once = {h["step"]: h for h in rep["nan_once"]}
    assert once[2]["train/skipped_updates"] == 2 and math.isnan(once[2]["optim/grad_norm"])  # both mini-batches
    assert once[1]["train/skipped_updates"] == 0 and once[3]["train/skipped_updates"] == 0
    assert once[3]["train/bad_steps_in_a_row"] == 0 and math.isfinite(once[3]["loss/policy"])
    assert "2 steps in a row had a non-finite loss or gradient" in rep["error"]
    assert [h["step"] for h in rep["nan_always"]] == [1, 2]
    grad = {h["step"]: h for h in rep["nan_grad"]}  # a finite loss, a NaN gradient: the gradient check skips it
    assert math.isfinite(grad[2]["loss/policy"]) and grad[2]["train/skipped_updates"] == 2
    assert grad[1]["train/skipped_updates"] == 0  # and step 3 trains on weights the NaN never reached:
    assert grad[3]["train/skipped_updates"] == 0 and math.isfinite(grad[3]["loss/policy"])


def test_dead_engine_restarted_or_run_stops_with_checkpoint(tmp_path):
    rep = torchrun("train_scenarios.py", 2, "engine", str(tmp_path), env={"WANDB_MODE": "disabled"})
    assert rep["restart_rc"] == 0 and [h["step"] for h in rep["restart"]] == [1, 2, 3]
    assert rep["restart"][-1]["engine/restarts"] == 1
    assert "no restarts are left" in rep["dead_error"] and "simulated crash" in rep["dead_error"]
    assert rep["dead_steps"] == [1] and rep["dead_latest"].endswith("step_00000001")
    # dynamic sampling: the crashed attempt's prompts went to the retry, so the run equals one without the crash
    assert [h["engine/restarts"] for h in rep["ds_restart"]] == [0, 1, 1]
    for clean, restarted in zip(rep["ds_clean"], rep["ds_restart"]):
        for key in ("loss/policy", "reward/mean", "dynamic_sampling/prompts_drawn", "dynamic_sampling/kept"):
            assert restarted[key] == clean[key], (restarted["step"], key, restarted[key], clean[key])
    for rank in rep["ds_prompts"]:  # the same prompts, step by step, on every rank
        assert rank["restart"] == rank["clean"] and len(rank["clean"]) == 3


def test_step_collector_collects_once_per_step():
    """trainer.gc per_step: no automatic collection while the run lasts (a rollout's millions of containers
    trigger none), the young generations after each step and everything every gc_full_every steps; the
    collector is left as it was found (on, or off when the user had turned it off); automatic: untouched."""
    import gc

    from rlpo_mega.training.garbage import StepCollector

    gens = []

    def seen(phase, info):
        if phase == "start":
            gens.append(info["generation"])

    was = gc.isenabled()
    gc.callbacks.append(seen)
    try:
        gc.enable()
        with StepCollector("per_step", full_every=3) as collector:
            assert not gc.isenabled()
            gens.clear()
            junk = [[i] for i in range(100_000)]  # ~140 automatic collections' worth of containers
            assert gens == []
            del junk
            assert [collector.step(s) >= 0 for s in (1, 2, 3, 4)] == [True] * 4 and gens == [1, 1, 2, 1]
        assert gc.isenabled()
        gc.disable()
        with StepCollector("per_step"):
            pass
        assert not gc.isenabled()  # the user's choice stands
        gc.enable()
        with StepCollector("automatic") as collector:
            assert gc.isenabled() and collector.step(10) == 0.0
        assert gc.isenabled()
        with pytest.raises(ValueError, match="gc_full_every=0"):
            StepCollector("per_step", full_every=0)
    finally:
        gc.callbacks.remove(seen)
        (gc.enable if was else gc.disable)()


def test_demo_learns_on_a_short_schedule(tmp_path):
    """`make demo`'s config through the real CLI (--nproc-per-node 2), 20 RL steps instead of 80: the
    warm-up's wrong rule gives ~0 greedy accuracy, RL alone lifts reward and accuracy by a clear margin.
    Seed 3: the demo was tuned on seeds 1234, 1 and 2 (here: greedy accuracy 0 -> 0.67 at step 20)."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlpo_mega.cli", "train", "configs/demo_cpu.yaml", "train_iters=20", "seed=3",
         f"logging.dir={run}", "logging.mode=disabled", "logging.progress_bar=false", "checkpoint.save_dir=null",
         "--nproc-per-node", "2"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    reward = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sorted(evals) == [0, 10, 20] and len(reward) == 20
    # the warm-up taught a+b+1: greedy accuracy near 0 (3/64 on earlier CI machines, 6/64 on this session's AMD
    # EPYC at the same commit and pins: the CPU's float kernels differ); RL's lift below is the claim
    assert evals[0] <= 0.1
    assert evals[20] >= evals[0] + 0.3, evals
    # step 1's samples are the warm-up policy's alone (steps 2-3 already follow RL updates: 0.19, 0.31 here)
    start, end = reward[0], sum(reward[-3:]) / 3
    assert start <= 0.15 and end >= start + 0.25, (start, end)
    assert "reward (mean of the first/last 5 steps)" in proc.stdout and (run / "curves.png").is_file()


def test_demo_with_dynamic_sampling_learns(tmp_path):
    """The demo with DAPO dynamic sampling streamed on both engine ranks (chunks, groups filtered as they are
    scored, surplus carried one step): it still learns. Measured over seeds 3, 4, 5 at 20 steps: greedy accuracy
    0 -> 0.84 / 0.73 / 0.89 (without dynamic sampling 0.70 / 0.86 / 0.80)."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlpo_mega.cli", "train", "configs/demo_cpu.yaml", "train_iters=20", "seed=3",
         f"logging.dir={run}", "logging.mode=disabled", "logging.progress_bar=false", "checkpoint.save_dir=null",
         "algorithm.dynamic_sampling.enabled=true", "logging.plot=false", "--nproc-per-node", "2"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    steps = [r for r in rows if "dynamic_sampling/kept" in r]
    assert len(steps) == 20 and evals[0] <= 0.1 and evals[20] >= evals[0] + 0.3, evals  # 0.1: as above
    # every step trains on mixed groups only, most steps on the full 64; surplus groups were carried and used
    assert all(r["dynamic_sampling/kept"] <= 64 for r in steps)
    assert sum(r["dynamic_sampling/complete"] for r in steps) >= 10
    carried_in = sum(r["dynamic_sampling/carried_in"] for r in steps)
    assert carried_in > 0 and sum(r["dynamic_sampling/carry_stale"] for r in steps) + carried_in <= \
        sum(r["dynamic_sampling/carried_out"] for r in steps)
