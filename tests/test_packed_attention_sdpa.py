"""Packed (THD) attention without Transformer Engine: moe/packed_attention.py's packed branch runs torch's
scaled_dot_product_attention, and equals the attention it replaced (megatron's local DotProductAttention math
on the padded layout), outputs and gradients, at TP1 and at TP2 + sequence parallel, with no host sync.

The module is built in a torchrun worker (tests/workers/packed_attention_tp.py), as the other megatron tests
do: megatron's parallel state and the CPU platform patches stay out of this process.
End to end (the trainer's packed path vs its padded path, TP2+SP among the layouts): tests/test_packing.py.
"""
import pytest

from tests.dist import torchrun

# max abs error allowed, as a fraction of the largest reference value (at least 1)
TOL = {"float32": 1e-6, "float64": 1e-13, "bfloat16": 2e-2}
WHAT = ("output", "grad q", "grad k", "grad v")


def _within(errors, magnitudes, dtype, where):
    for what, err, mag in zip(WHAT, errors, magnitudes):
        assert err <= TOL[dtype] * max(1.0, mag), f"{where} {what}: max abs error {err:.3e} (|ref| up to {mag:.3g})"


@pytest.fixture(scope="module")
def tp1():
    return torchrun("packed_attention_tp.py", 1, timeout=300)


def test_equals_local_attention_at_tp1(tp1):
    cases = {k.split(":")[0] for k in tp1["errors"]}
    assert cases == {"several", "gqa", "gqa_native", "single", "mla", "qk_layer_scaling", "max_seqlen_above"}
    assert {k.split(":")[1] for k in tp1["errors"]} == {"float32", "float64", "bfloat16"}
    for key, errors in tp1["errors"].items():
        _within(errors, tp1["magnitudes"][key], key.split(":")[1], key)


def test_no_host_sync_in_packed_branch(tp1):
    assert tp1["syncs"] == []
    # the spy sees the old branch's int(lens.max()) and boolean-mask gather: it would see ours
    assert "__int__" in tp1["old_syncs"] and "__getitem__[bool]" in tp1["old_syncs"]


def test_refusals_and_dropout(tp1):
    r = tp1["refusals"]
    for name in ("no_max_seqlen", "tensor_max_seqlen"):
        assert r[name].startswith("ValueError") and "must set PackedSeqParams.max_seqlen_q" in r[name], r[name]
    # cu_seqlens that do not cover the row, or a sequence longer than max_seqlen_q: an index out of range
    for name in ("max_seqlen_below", "cu_short", "cu_long", "cu_start"):
        assert r[name] is not None and r[name].startswith("IndexError"), (name, r[name])
    d = tp1["dropout"]
    assert d["eval_vs_ref"] <= 1e-5 and d["train_finite"] and d["train_vs_eval"] > 0.1, d


def test_equals_single_process_at_tp2_sp():
    report = torchrun("packed_attention_tp.py", 2, timeout=300)
    for dtype in ("float32", "float64"):
        # the same kernels on each rank's heads (bitwise equal on this CPU; within rounding is what is asked)
        _within(report[f"tp2_vs_tp1:{dtype}"], report[f"magnitudes:{dtype}"], dtype, f"tp2 vs tp1 {dtype}")
        _within(report[f"tp2_vs_old:{dtype}"], report[f"magnitudes:{dtype}"], dtype, f"tp2 {dtype}")
