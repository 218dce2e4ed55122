"""Megatron layouts vs the single-process run: loss and every gradient (gathered to full tensors).

The reference is one process at TP1; each layout loads the reference's initial weights through a
megatron dist checkpoint, trains 3 optimizer steps on the same global batch (split over data-parallel
ranks and micro-batches) and reports its first-step gradients resharded back to TP1.
"""
import json
import os

import pytest
import torch

from tests.layout_runs import LAYOUTS, layout_run, reference_run

REL_TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory)


def _load(root, name):
    with open(os.path.join(root, name)) as f:
        return json.load(f)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference, tmp_path_factory):
    families = LAYOUTS[layout][2]
    tmp_path = layout_run(layout, tmp_path_factory)
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
