"""The CPU platform layer: every patch is needed, the patched runs are right, and a GPU run gets none of it.

Ablation: for each patch (cpu_megatron.PATCHES and megatron_fixes.FIXES) the smallest training scenario
that takes the megatron path it answers is run with only that patch left out (RLPO_MEGA_ABLATE_PATCH);
it must fail with the expected error, raised at a megatron-core file:line listed in the patch's
`answers`. The same scenario with every patch must train (2 optimizer steps, loss going down).
The norm tagging of torch_norm_sequence_parallel, whose
absence is silent, is shown by clearing the tag mid-run: the TP ranks' norm grads then disagree.

Platform selection: with CUDA present (simulated) apply() patches nothing CPU-specific and leaves
torch and megatron untouched; a megatron-core version other than the one the patches were written
for is refused on CPU with both versions named.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest

from rlpo_mega.platform import all_patches, cpu_megatron, megatron_fixes
from tests.dist import ROOT, torchrun

QWEN = "configs/models/tiny_qwen3_moe.json"
MIXTRAL = "configs/models/tiny_mixtral.json"

# name -> (processes, model, overrides). Every scenario trains 2 optimizer steps (clip_grad=1.0 by
# default, alltoall token dispatcher, local layer spec: no Transformer Engine, no apex).
SCENARIOS = {
    "tp1": (1, QWEN, ()),
    # TP2 (hence sequence parallel) and EP2 alltoall on 2 processes; the norm tag is cleared before
    # the second step (--untag-norm-from=1) for the silent half of torch_norm_sequence_parallel.
    "tp2_ep2": (2, QWEN, ("parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=1",
                          "--untag-norm-from=1")),
    # Expert-TP 2 with experts on 2 ranks: the expert-TP all-gather sizes differ between ranks.
    "tp2_ep2_etp2": (4, QWEN, ("parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=2")),
    # Tied input/output embeddings on two pipeline stages.
    "pp2_tied": (2, MIXTRAL, ("parallel.pipeline=2",)),
}

CUDA_MISSING = "Torch not compiled with CUDA enabled"

# patch -> (scenario, text the failure must show). Measured without the patch, megatron-core 0.16.1,
# torch 2.13 (gloo):
ABLATIONS = {
    # moe_utils.py:1192 RouterGatingLinearFunction.forward
    "te_general_gemm_undefined": ("tp1", "NameError: name 'te_general_gemm' is not defined"),
    # param_and_grad_buffer.py:806 (DDP grad buffer), the first of many current_device() sites
    "current_device": ("tp1", CUDA_MISSING),
    # token_dispatcher.py:445 MoEAlltoAllTokenDispatcher.__init__
    "streams": ("tp1", "torch.cuda.Stream requires CUDA support"),
    # random.py:235 CudaRNGStatesTracker.add via model_parallel_cuda_manual_seed
    "rng_tracker": ("tp1", CUDA_MISSING),
    # optimizer.py:907 FP32Optimizer._scale
    "cuda_literals": ("tp1", CUDA_MISSING),
    # clip_grads.py:167 in the optimizer step (grad norm 1.85 > clip_grad 1.0)
    "clip_grads": ("tp1", "torch.cuda.FloatTensor"),
    # mappings.py:444, split sizes are tensors: TypeError from the gloo binding
    "all_to_all_splits": ("tp2_ep2", "all_to_all_single(): incompatible function arguments"),
    # torch_norm.py:32 while building the first layer
    "torch_norm_sequence_parallel": ("tp2_ep2", "sequence parallel not supported by torch LayerNorm"),
    # mappings.py:150 token_dispatcher's gather of expert-TP tokens
    "uneven_all_gather": ("tp2_ep2_etp2", "ProcessGroupGloo::allgather: invalid tensor size"),
    # language_module.py:244 weight.data.cuda() before the embedding-group all-reduce
    "tied_embedding_cuda": ("pp2_tied", CUDA_MISSING),
}

PATCHES = {p.name: p for p in all_patches()}


def _run(scenario, ablate=None):
    nproc, model, args = SCENARIOS[scenario]
    env = {"RLPO_MEGA_ABLATE_PATCH": ablate or ""}
    if ablate:
        return torchrun("platform_scenario.py", nproc, model, *args, env=env, expect_fail=True)
    return torchrun("platform_scenario.py", nproc, model, *args, env=env)


_PASSED: dict[str, dict] = {}


def passing_run(scenario) -> dict:
    """The scenario with every patch (run once per test session)."""
    if scenario not in _PASSED:
        _PASSED[scenario] = _run(scenario)
    return _PASSED[scenario]


def _answer_ranges(patch) -> list[tuple[str, int, int]]:
    """`answers` entries are 'path/in/megatron/core.py:12,30-34' -> (path, first, last) each."""
    ranges = []
    for entry in patch.answers:
        m = re.fullmatch(r"([\w/]+\.py):([\d,\-]+)", entry)
        assert m, f"{patch.name}: answers entry {entry!r} is not 'path.py:lines'"
        for part in m[2].split(","):
            lo, _, hi = part.partition("-")
            ranges.append((m[1], int(lo), int(hi or lo)))
    return ranges


def _answer_sites(patch) -> set[tuple[str, int]]:
    return {(path, n) for path, lo, hi in _answer_ranges(patch) for n in range(lo, hi + 1)}


_FRAME = re.compile(r'File ".*?/megatron/core/([^"]+)", line (\d+)')
_PREFIX = re.compile(r"^\[rank(\d+)\]:(.*)$")


def failing_site(stderr: str, message: str):
    """(file, line) of the innermost megatron-core frame above `message` in some rank's traceback."""
    by_rank = defaultdict(list)
    for line in stderr.splitlines():
        m = _PREFIX.match(line)
        by_rank[m[1] if m else None].append(m[2] if m else line)
    for lines in by_rank.values():
        for i, line in enumerate(lines):
            if message in line:
                frames = [f for f in map(_FRAME.search, lines[:i]) if f]
                if frames:
                    return frames[-1][1], int(frames[-1][2])
    return None


def test_every_patch_has_an_ablation_scenario():
    names = [p.name for p in all_patches()]
    assert len(names) == len(set(names)), "patch names must be unique"
    assert set(ABLATIONS) == set(names), (
        f"patches without an ablation scenario: {sorted(set(names) - set(ABLATIONS))}; "
        f"scenarios for no patch: {sorted(set(ABLATIONS) - set(names))}")
    assert {s for s, _ in ABLATIONS.values()} == set(SCENARIOS)


def test_answers_point_into_megatron_core():
    root = importlib.util.find_spec("megatron.core").submodule_search_locations[0]
    for patch in all_patches():
        assert patch.answers, patch.name
        for path, lo, hi in _answer_ranges(patch):
            file = os.path.join(root, path)
            assert os.path.isfile(file), f"{patch.name}: {path} is not in megatron-core"
            with open(file) as f:
                lines = f.read().splitlines()
            for line in (lo, hi):
                assert lo <= hi <= len(lines) and lines[line - 1].strip(), f"{patch.name}: {path}:{line}"


@pytest.mark.parametrize("patch", sorted(ABLATIONS))
def test_scenario_fails_without_patch(patch):
    scenario, message = ABLATIONS[patch]
    proc = _run(scenario, ablate=patch)
    tail = proc.stderr[-4000:]
    assert proc.returncode != 0, f"{scenario} trains without {patch}: the patch is not needed there"
    assert message in proc.stderr, f"{scenario} without {patch}: expected {message!r}\n{tail}"
    site = failing_site(proc.stderr, message)
    assert site is not None, f"no megatron-core frame above {message!r}\n{tail}"
    assert site in _answer_sites(PATCHES[patch]), (
        f"without {patch}, {scenario} fails at megatron/core/{site[0]}:{site[1]}, "
        f"which is not in the patch's answers {PATCHES[patch].answers}")


@pytest.mark.parametrize("patch", sorted(ABLATIONS))
def test_scenario_trains_with_all_patches(patch):
    scenario = ABLATIONS[patch][0]
    report = passing_run(scenario)
    assert set(report["applied"]) == set(PATCHES), report["applied"]
    losses = report["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    # (That the patched layouts reproduce the single-process losses and grads is tests/test_parity.py.)
    assert losses[1] < losses[0], f"{scenario}: the optimizer step did not lower the loss {losses}"


def test_norm_sequence_parallel_tag_all_reduces_norm_grads():
    """torch_norm_sequence_parallel's tag: without it the norm grads silently differ across TP ranks."""
    report = passing_run("tp2_ep2")
    assert report["norm_params"] > 0
    assert report["norm_tags"] == [[True], [False]]  # step 0 as patched, step 1 with the tag cleared
    tagged, untagged = report["norm_grad_tp_spread"]
    assert tagged == 0.0, f"tagged norm grads differ across TP ranks by {tagged}"
    assert untagged > 1e-4, f"untagged norm grads agree across TP ranks ({untagged}): the tag is moot"


def test_unknown_ablation_name_is_refused():
    code = ("import os; os.environ['RLPO_MEGA_ABLATE_PATCH'] = 'no_such_patch'\n"
            "from rlpo_mega import platform\n"
            "try:\n    platform.apply()\nexcept platform.PlatformError as e:\n    print('REFUSED', e)\n")
    out = _python(code)
    assert "REFUSED" in out and "no_such_patch" in out, out


# ------------------------------------------------------------------------------------------------
# Platform selection, in fresh interpreters (apply() changes process-global state).

def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    env.pop("RLPO_MEGA_ABLATE_PATCH", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


_CUDA_PRESENT = r'''
import json, torch
torch.cuda.is_available = lambda: True   # a GPU machine, as far as the platform layer can tell

import megatron.core
from megatron.core import utils as core_utils
from megatron.core.models.common.language_module import language_module
from megatron.core.optimizer import clip_grads, optimizer
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import mappings, random as mrandom
from megatron.core.transformer import torch_norm, utils as transformer_utils
from megatron.core.transformer.moe import moe_utils

megatron.core.__version__ = "0.0.0-not-the-version-the-cpu-patches-were-written-for"
modules = [core_utils, clip_grads, optimizer, schedules, mappings, mrandom, transformer_utils]

def snapshot():
    return {
        "cuda": {n: id(getattr(torch.cuda, n)) for n in
                 ("current_device", "Stream", "Event", "stream", "current_stream", "default_stream",
                  "synchronize", "empty_cache", "manual_seed")},
        "record_stream": id(torch.Tensor.record_stream),
        "tensor_cuda": id(torch.Tensor.cuda),
        "module_torch": [m.torch is torch for m in modules],
        "tracker": id(mrandom.CudaRNGStatesTracker),
        "norm_new": id(torch_norm.WrappedTorchNorm.__dict__["__new__"]),
        "clip": [id(clip_grads.clip_grad_by_total_norm_fp32), id(optimizer.clip_grad_by_total_norm_fp32)],
        "tied": id(language_module.LanguageModule.setup_embeddings_and_output_layer),
    }

before = snapshot()
from rlpo_mega import platform
applied = platform.apply()
after = snapshot()
print(json.dumps({"applied": applied, "same": before == after, "before": before, "after": after,
                  "backend": platform.backend(), "te": platform._have_transformer_engine(),
                  "te_general_gemm": repr(getattr(moe_utils, "te_general_gemm", "undefined"))}))
'''


def test_nothing_cpu_specific_runs_when_cuda_is_present():
    result = json.loads(_python(_CUDA_PRESENT).strip().splitlines()[-1])
    fixes = [] if result["te"] else [p.name for p in megatron_fixes.FIXES]
    # Only the device-independent megatron fix (and only without Transformer Engine); no version check.
    assert result["applied"] == fixes
    assert not set(result["applied"]) & {p.name for p in cpu_megatron.PATCHES}
    assert result["same"], {k: (result["before"][k], result["after"][k])
                            for k in result["before"] if result["before"][k] != result["after"][k]}
    assert all(result["after"]["module_torch"])
    assert result["backend"] == "nccl"
    if not result["te"]:
        assert result["te_general_gemm"] == "None"


_WRONG_VERSION = r'''
import torch
import megatron.core
megatron.core.__version__ = "0.15.3"
saved = torch.cuda.current_device
from rlpo_mega import platform
try:
    platform.apply()
except platform.PlatformError as e:
    print("REFUSED", e)
print("UNTOUCHED", torch.cuda.current_device is saved and platform._APPLIED is None)
'''


def test_other_megatron_version_is_refused_on_cpu():
    out = _python(_WRONG_VERSION)
    assert "REFUSED" in out, out
    message = out.split("REFUSED", 1)[1]
    assert "0.15.3" in message and cpu_megatron.WRITTEN_FOR in message, message
    assert "UNTOUCHED True" in out, out
