"""The sigmoid-router (DeepSeek-V3-style) families, glm4_moe and deepseek_v3 (MLA): routing replay against
transformers' routers, the trainer, what the families refuse.

The bridge (transformers forward == megatron at TP1, TP2+EP2, TP2/EP2/PP2; export exact; after a training
step) is in test_bridge.py, layout parity (TP2+SP, EP2, PP2) in test_parity.py: both list these families.
"""
import json
import math
import os
import subprocess
import sys

import pytest

from tests.dist import ROOT, torchrun

GLM = "configs/models/tiny_glm4_moe.json"
MODELS = {"glm4_moe": GLM, "deepseek_v3": "configs/models/tiny_deepseek_v3.json"}


@pytest.fixture(scope="module")
def routing_runs(tmp_path_factory):
    """One process, both families: glm4_moe (2 groups of 4 experts, top-1 group, top-2) and deepseek_v3 (4
    groups of 2, top-2 groups, top-4), each with a perturbed score-correction bias."""
    return torchrun("routing_single.py", 1, str(tmp_path_factory.mktemp("routing")), ",".join(MODELS.values()))


@pytest.fixture(params=sorted(MODELS))
def sigmoid_routing(request, routing_runs):
    return routing_runs[request.param]


def test_megatron_routes_equal_transformers_group_limited_biased(sigmoid_routing):
    """Same weights (a perturbed score-correction bias, 2 expert groups, top-1 group, top-2 experts): the
    learner's live routes are transformers' exactly, and so are its log-probs."""
    r = sigmoid_routing["identical"]
    assert r["old_routes_vs_trace"] == 1.0 and r["metrics"]["routing/old/agreement"] == 1.0
    assert r["mismatch_r3/ratio_dev_max"] < 1e-5


def test_r3_with_perturbed_routers_restores_the_recorded_routes(sigmoid_routing):
    off, r3 = sigmoid_routing["perturbed_off"], sigmoid_routing["perturbed_r3"]
    assert off["old_routes_vs_trace"] < 0.5  # the perturbed router chooses other experts (or other groups)
    assert r3["old_routes_vs_trace"] == 1.0 and r3["update_routes_vs_trace"] == 1.0
    assert r3["metrics"]["routing/update/agreement"] < 0.5  # the live router still disagrees
    assert all(g > 1e-4 for g in r3["router_grad_norms"])  # gate weights from the live scores: it learns
    assert r3["mismatch_r3/k3_kl"] < off["mismatch_off/k3_kl"]


def test_r2_replays_the_old_pass_routes(sigmoid_routing):
    """R2: the old pass records, the update replays (GSPO ratio exactly 1); after the routers move, the update
    still dispatches the recorded (group-limited, bias-corrected) routes while the live ones disagree."""
    r = sigmoid_routing["r2"]
    assert r["ratio_exactly_one"] and r["update_equals_recorded"] and r["recompute_calls"] > 0
    assert r["after_router_change_equals_recorded"] and r["after_router_change_live_agreement"] < 0.6
    assert all(g > 1e-4 for g in r["router_grad_norms"])


def test_expert_bias_moves_only_when_the_config_says_so(sigmoid_routing):
    """A replayed step leaves the bias as loaded (model.expert_bias_update_rate=0, the default); with a rate,
    megatron's aux-loss-free update moves every expert's bias by exactly +-rate."""
    assert all(c == 0.0 for layer in sigmoid_routing["perturbed_r3"]["bias_change"] for c in layer)
    moved = [c for layer in sigmoid_routing["r3_bias_rate"]["bias_change"] for c in layer]
    assert moved and all(abs(abs(c) - 0.01) < 1e-6 for c in moved), moved


def test_sync_never_splits_what_sglang_loads_together(routing_runs):
    """SGLang fuses MLA's q_a_proj and kv_a_proj_with_mqa on load and only within one load call (one bucket):
    even at a 1-byte bucket size each layer's pair travels together, while every other parameter goes alone (its
    fused HF parts, e.g. an MLP's gate and up, together)."""
    from moe.model import load_hf_config

    layers = load_hf_config(os.path.join(ROOT, MODELS["deepseek_v3"])).num_hidden_layers
    a = "model.layers.{}.self_attn."
    buckets = routing_runs["deepseek_v3"]["export_buckets"]
    assert [b for b in buckets if any("_a_proj" in n for n in b)] == [
        [a.format(i) + "q_a_proj.weight", a.format(i) + "kv_a_proj_with_mqa.weight"] for i in range(layers)]
    assert [a.format(0) + "q_b_proj.weight"] in buckets  # the next map starts a bucket of its own
    glm = routing_runs["glm4_moe"]["export_buckets"]
    assert [a.format(0) + "o_proj.weight"] in glm and all(len(b) <= 3 for b in glm)  # q/k/v, gate/up: one map


@pytest.mark.parametrize("family", sorted(MODELS))
def test_sglang_layout_unfuses_to_hf_names(family):
    """The digest hook's SGLang -> HF unfusing (moe/families/sglang_names.py) on SGLang 0.5.23's layout as its
    model code builds it (deepseek_v2.py: fused_qkv_a_proj_with_mqa = [q_a_proj; kv_a_proj_with_mqa];
    gate_up_proj = [gate; up]; experts.w13_weight [E, 2I, H], w2_weight [E, H, I]): every HF tensor back,
    exactly. deepseek_v3 does not run on SGLang's CPU path (README), so this is its SGLang coverage here."""
    import torch

    from moe.families.sglang_names import sglang_to_hf
    from tests.sglang_layout import sglang_layout

    hf, ref, sgl = sglang_layout(MODELS[family])
    back = sglang_to_hf(sgl, hf)
    assert sorted(back) == sorted(ref)
    assert all(torch.equal(back[k], ref[k]) for k in ref)


def test_trainer_gspo_r3_few_steps(tmp_path):
    """deepseek_v3: the shipped demo's GSPO + R3 at EP2 (embedded engine, weights synced every step). glm4_moe
    trains through its recipe (tests/test_recipes.py: GLM-4.5-Air shrunk, GSPO + R3 with SGLang, TP2/PP2/EP2,
    bf16 and the distributed optimizer, checkpoint and resume)."""
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "rlpo_mega.cli", "train", "configs/demo_cpu.yaml", "--nproc-per-node", "2",
           f"model.hf_config={MODELS['deepseek_v3']}", "train_iters=3", "trainer.warmup.steps=0", "trainer.eval_every=0",
           "checkpoint.save_dir=null", "logging.mode=disabled", f"logging.dir={logs}", "logging.progress_bar=false",
           "prompts.prompts_per_step=16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in open(logs / "metrics.jsonl") if line.strip()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["routing/update/agreement"] >= 0.99  # the live routers choose what R3 replays
        assert r["mismatch/ratio_dev_max"] < 1e-5  # the engine (transformers) and the learner agree after syncs
        assert math.isfinite(r["optim/grad_norm"]) and math.isfinite(r["loss/policy"])
    # a random tiny model mostly scores 0 on the toy task: some step had a group with a learning signal
    assert any(r["optim/grad_norm"] > 0 for r in rows), [r["advantages/zero_advantage_groups"] for r in rows]


def _glm(**changes):
    from moe.model import load_hf_config

    hf = load_hf_config(os.path.join(ROOT, GLM))
    for k, v in changes.items():
        setattr(hf, k, v)
    return hf


@pytest.mark.parametrize("changes, needle", [
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"n_group": 4, "topk_group": 2}, "num_experts_per_tok == 2 * topk_group"),
    ({"n_group": 3}, "not a multiple of n_group"),
])
def test_routers_megatron_cannot_express_are_refused(changes, needle):
    from moe.families import UnsupportedModelError, get_family

    with pytest.raises(UnsupportedModelError, match=needle.replace("*", r"\*")):
        get_family("glm4_moe").transformer_fields(_glm(**changes))


def test_multi_token_prediction_layers_are_not_an_error(tmp_path):
    """Released GLM-4.5 / DeepSeek-V3 checkpoints carry MTP layers after the decoder (model.layers.{L});
    they validate (and are not read), while a stray tensor inside the decoder still fails."""
    import torch
    from safetensors.torch import save_file

    from moe.bridge.hf_checkpoint import CheckpointFormatError, HFCheckpoint, expected_hf_shapes

    hf = _glm()
    tensors = {n: torch.zeros(s) for n, s in expected_hf_shapes(hf).items()}
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].shape == (8,)
    assert tensors["model.layers.1.self_attn.q_proj.bias"].shape == (64,)
    assert tensors["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (32, 64)
    mtp = {"model.layers.2.mlp.experts.0.up_proj.weight": torch.zeros(32, 64), "model.layers.2.eh_proj.weight":
           torch.zeros(64, 128)}
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"))
    HFCheckpoint(str(tmp_path)).validate(hf)
    save_file({**tensors, "model.layers.1.mlp.stray.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match="stray"):
        HFCheckpoint(str(tmp_path)).validate(hf)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_convert_then_export_is_exact(family, tmp_path):
    """`rlpo-mega convert` (HF -> megatron dist checkpoint at TP2/EP2) then `export` give every tensor back
    exactly, the score-correction bias (a buffer, perturbed away from zero) included, and transformers loads
    the result."""
    import torch
    from safetensors.torch import load_file

    from moe.model import load_hf_config
    from tests.workers.bridge import make_hf_checkpoint

    src, ckpt, out = tmp_path / "hf", tmp_path / "dist", tmp_path / "hf_out"
    make_hf_checkpoint(load_hf_config(os.path.join(ROOT, MODELS[family])), str(src))
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    for args in (("convert", "--hf", str(src), "--out", str(ckpt), "--tp", "2", "--ep", "2"),
                 ("export", "--ckpt", str(ckpt), "--hf-out", str(out))):
        proc = subprocess.run([sys.executable, "-m", "rlpo_mega.cli", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    original = load_file(str(src / "model.safetensors"))
    exported = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            exported.update(load_file(str(out / f)))
    assert sorted(original) == sorted(exported)
    bias = [k for k in original if k.endswith("e_score_correction_bias")]
    assert bias and all(original[k].abs().max() > 0 for k in bias)
    for k in original:
        assert original[k].dtype == exported[k].dtype and torch.equal(original[k], exported[k]), k
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out))
