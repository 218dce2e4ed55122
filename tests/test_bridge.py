"""Weight bridge: HF <-> megatron at several layouts, against transformers' own forward."""
import os

import pytest
import torch

from moe.bridge.mapping import (Dims, full_to_hf, full_to_shard, hf_row_ranges, hf_slices_to_shard,
                                hf_to_full, param_maps, shards_to_full)
from moe.model import load_hf_config
from tests.dist import torchrun
from tests.layout_runs import BRIDGE_LAYOUTS, BRIDGE_MODELS, bridge_run

MODELS = BRIDGE_MODELS


@pytest.mark.parametrize("layout", list(BRIDGE_LAYOUTS))
def test_import_forward_export_roundtrip(layout, tmp_path_factory):
    reports = {k: v for k, v in bridge_run(layout, tmp_path_factory).items() if not k.startswith("critic:")}
    assert set(reports) == {"qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3"}
    for family, r in reports.items():
        assert r["import_logits_rel_err"] <= 1e-4, (layout, family, r)
        assert r["export_names_equal"] and r["export_dtypes_equal"], (layout, family)
        assert r["export_max_abs_diff"] == 0.0, (layout, family, r)
        assert r["trained_moved"] > 1e-3, "the optimizer step must change the logits"
        assert r["trained_logits_rel_err"] <= 1e-4, (layout, family, r)


@pytest.mark.parametrize("cfg", MODELS.split(","))
@pytest.mark.parametrize("tp", [1, 2])  # the tiny configs have 2 KV heads: TP <= 2
def test_shard_math_inverts(cfg, tp):
    """Reading a TP slice straight from HF tensors == slicing the fused full tensor; gathers invert."""
    hf = load_hf_config(cfg)
    dims = Dims.of(hf, 128, tp)
    g = torch.Generator().manual_seed(0)
    from moe.bridge.hf_checkpoint import expected_hf_shapes

    shapes = expected_hf_shapes(hf)
    for m in param_maps(hf):
        hf_t = [torch.randn(shapes[n], generator=g) for n in m.hf]
        full = hf_to_full(m.kind, hf_t, dims)
        for a, b in zip(full_to_hf(m.kind, full, dims), hf_t):
            assert torch.equal(a, b), m.megatron
        shards = [full_to_shard(m.kind, full, r, tp) for r in range(tp)]
        assert torch.equal(shards_to_full(m.kind, shards), full), m.megatron
        for r in range(tp):
            ranges = hf_row_ranges(m.kind, dims, [tuple(t.shape) for t in hf_t], r, tp)
            sl = [t[s:e] if d == 0 else t[:, s:e] for t, (d, s, e) in zip(hf_t, ranges)]
            assert torch.equal(hf_slices_to_shard(m.kind, sl, dims, r, tp), shards[r]), (m.megatron, r)


def test_qkv_layout_matches_megatron_grouping():
    """Megatron's fused QKV is [per KV group: its q heads, then k, then v] (attention.py)."""
    hf = load_hf_config("configs/models/tiny_qwen3_moe.json")
    dims = Dims.of(hf)
    hd, heads, groups, h = dims.head_dim, dims.heads, dims.groups, hf.hidden_size
    q = torch.arange(heads * hd).float().unsqueeze(1).expand(-1, h)
    k = 1000 + torch.arange(groups * hd).float().unsqueeze(1).expand(-1, h)
    v = 2000 + torch.arange(groups * hd).float().unsqueeze(1).expand(-1, h)
    full = hf_to_full("qkv", [q, k, v], dims)[:, 0]
    per = heads // groups
    first_group = full[: (per + 2) * hd]
    assert torch.equal(first_group[: per * hd], torch.arange(per * hd).float())
    assert torch.equal(first_group[per * hd:(per + 1) * hd], 1000 + torch.arange(hd).float())
    assert torch.equal(first_group[(per + 1) * hd:], 2000 + torch.arange(hd).float())


def test_transformer_engine_parameter_names(tmp_path):
    """On a GPU with Transformer Engine, megatron builds the TE spec, whose norms and grouped experts carry
    other parameter names; the bridge maps them to the same HF tensors (EP2, a dense layer included)."""
    import json

    with open("configs/models/tiny_qwen3_moe.json") as f:
        dense = {**json.load(f), "mlp_only_layers": [1]}  # layer 1 is a dense MLP: its norm fuses into fc1
    dense_cfg = tmp_path / "qwen3_moe_dense_layer.json"
    dense_cfg.write_text(json.dumps(dense))
    models = f"{dense_cfg},configs/models/tiny_mixtral.json"
    reports = torchrun("bridge_te_names.py", 2, str(tmp_path), models, "parallel.expert=2")
    for family, r in reports.items():
        assert r["te_style_names"] > 0 and r["local_style_left"] == 0, (family, r)
        assert r["global_names_equal"], (family, r)
        assert r["export_equals_local"] and r["reimport_equals_checkpoint"], (family, r)
