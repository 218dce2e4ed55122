"""Bad HF checkpoints: one clear error naming the tensor or field, and no partial output left."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from moe.bridge.hf_checkpoint import CheckpointFormatError, HFCheckpoint
from moe.model import load_hf_config
from tests.dist import ROOT

CFG = "configs/models/tiny_qwen3_moe.json"


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    from tests.workers.bridge import make_hf_checkpoint

    path = tmp_path_factory.mktemp("hf") / "good"
    make_hf_checkpoint(load_hf_config(CFG), str(path))
    return str(path)


def _mutate(good, tmp_path, fn, config_fn=None):
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    file = os.path.join(bad, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file)
    if config_fn:
        with open(os.path.join(bad, "config.json")) as f:
            cfg = json.load(f)
        config_fn(cfg)
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump(cfg, f)
    return bad


def test_good_checkpoint_validates(good_ckpt):
    HFCheckpoint(good_ckpt).validate(load_hf_config(os.path.join(good_ckpt, "config.json")))


def test_missing_tensor_is_named(good_ckpt, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = _mutate(good_ckpt, tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointFormatError, match=f"tensor '{name}' is missing"):
        HFCheckpoint(bad).validate(load_hf_config(os.path.join(bad, "config.json")))


def test_wrong_shape_is_named(good_ckpt, tmp_path):
    name = "model.layers.0.mlp.experts.2.down_proj.weight"
    bad = _mutate(good_ckpt, tmp_path, lambda t: t.__setitem__(name, t[name][:, :16].contiguous()))
    with pytest.raises(CheckpointFormatError, match=rf"'{name}' has shape \[64, 16\] but the config implies \[64, 32\]"):
        HFCheckpoint(bad).validate(load_hf_config(os.path.join(bad, "config.json")))


def test_expert_count_mismatch_names_the_field(good_ckpt, tmp_path):
    bad = _mutate(good_ckpt, tmp_path, lambda t: None, config_fn=lambda c: c.update(
        {k: 2 for k in ("num_experts", "num_local_experts") if k in c}))
    with pytest.raises(CheckpointFormatError, match="4 experts.*num_experts is 2"):
        HFCheckpoint(bad).validate(load_hf_config(os.path.join(bad, "config.json")))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rlpo_mega.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"})


def test_convert_rejects_bad_checkpoint_and_writes_nothing(good_ckpt, tmp_path):
    bad = _mutate(good_ckpt, tmp_path, lambda t: t.pop("model.norm.weight"))
    out = tmp_path / "out"
    proc = _cli("convert", "--hf", bad, "--out", str(out))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tensor 'model.norm.weight' is missing" in proc.stderr
    assert not out.exists() and not (tmp_path / "out.tmp").exists()


def test_convert_rejects_unknown_family(good_ckpt, tmp_path):
    bad = _mutate(good_ckpt, tmp_path, lambda t: None, config_fn=lambda c: c.update(model_type="llama"))
    proc = _cli("convert", "--hf", bad, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    from moe.families import FAMILIES

    assert f"model_type 'llama' is not supported; supported model types: {', '.join(sorted(FAMILIES))}" in proc.stderr
    assert "deepseek_v3, glm4_moe, mixtral, qwen3_moe" in proc.stderr
    assert not (tmp_path / "out").exists()


# `convert` then `export` round trip: tests/test_families_sigmoid.py::test_convert_then_export_is_exact (glm4_moe
# and deepseek_v3: the mapping kinds of every family here plus q/k/v biases, MLA, shared experts, the bias buffer)
