"""Megatron layouts vs the single-process run: loss and every gradient (gathered to full tensors).

The reference is one process at TP1; each layout loads the reference's initial weights through a
megatron dist checkpoint, trains 3 optimizer steps on the same global batch (split over data-parallel
ranks and micro-batches) and reports its first-step gradients resharded back to TP1.
"""
import json
import os

import pytest
import torch

from tests.dist import torchrun

CONFIGS = {"qwen3_moe": "configs/models/tiny_qwen3_moe.json", "mixtral": "configs/models/tiny_mixtral.json",
           "glm4_moe": "configs/models/tiny_glm4_moe.json", "deepseek_v3": "configs/models/tiny_deepseek_v3.json"}
BASE = ("qwen3_moe", "mixtral")
ALL = tuple(CONFIGS)  # the sigmoid-router families at the layouts their issue names (TP2+SP, EP2, PP2)
REL_TOL = 1e-5

LAYOUTS = {  # name: (processes, overrides, families)
    "tp2_sp": (2, ["parallel.tensor=2"], ALL),
    "ep2": (2, ["parallel.expert=2"], ALL),
    "pp2_mb2": (2, ["parallel.pipeline=2", "parallel.num_micro_batches=2"], ALL),
    "tp2_ep2_etp1": (2, ["parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=1"], BASE),
    "tp2_ep2_etp2": (4, ["parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=2"], BASE),
    "tp2_ep2_pp2": (8, ["parallel.tensor=2", "parallel.expert=2", "parallel.pipeline=2",
                        "parallel.num_micro_batches=2"], BASE),
}


def _models(families) -> str:
    return ",".join(CONFIGS[f] for f in families)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity_reference")
    torchrun("parity.py", 1, "reference", str(root), str(root), _models(ALL), json_report=False)
    return root


def _load(root, name):
    with open(os.path.join(root, name)) as f:
        return json.load(f)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference, tmp_path):
    nproc, overrides, families = LAYOUTS[layout]
    torchrun("parity.py", nproc, "layout", str(reference), str(tmp_path), _models(families), *overrides,
             json_report=False)
    for family in families:
        ref = _load(reference, f"reference_{family}.json")["losses"]
        got = _load(tmp_path, f"layout_{family}.json")["losses"]
        assert len(ref) == len(got) == 3
        assert ref[2] < ref[0], "the 3 steps must move the loss, or the comparison proves little"
        for step, (a, b) in enumerate(zip(ref, got)):
            assert abs(a - b) <= REL_TOL * abs(a), f"{layout} {family} step {step}: loss {b} vs {a}"
        ref_grads = torch.load(os.path.join(reference, f"reference_{family}", "grads.pt"))
        grads = torch.load(os.path.join(tmp_path, f"grads_{family}.pt"))
        assert set(grads) == set(ref_grads)
        for name, g_ref in ref_grads.items():
            scale = g_ref.norm()
            assert scale > 0, f"{family} {name}: zero reference gradient"
            rel = float((grads[name] - g_ref).norm() / scale)
            assert rel <= REL_TOL, f"{layout} {family} {name}: gradient rel error {rel:.2e}"
