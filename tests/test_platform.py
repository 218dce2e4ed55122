"""The CPU platform layer: every patch is needed, the patched runs are right, and a GPU run gets none of it.

Ablation: for each patch (cpu_megatron.PATCHES, megatron_fixes.FIXES and OFFLOAD_FIXES) the smallest training scenario
that takes the megatron path it answers is run with only that patch left out (RLPO_MEGA_ABLATE_PATCH);
it must fail with the expected error, raised at a megatron-core file:line listed in the patch's
`answers`. The same scenario with every patch must train (2 optimizer steps, loss going down).
The norm tagging of torch_norm_sequence_parallel, whose
absence is silent, is shown by clearing the tag mid-run: the TP ranks' norm grads then disagree.

Platform selection: with CUDA present (simulated) apply() patches nothing CPU-specific and leaves
torch and megatron untouched but for the local-spec fixes (megatron_fixes, applied whenever Transformer
Engine is absent, on any device); a megatron-core version other than the one the patches were written
for is refused on CPU with both versions named.

GPU without Transformer Engine (simulated: CUDA reported present, an empty `apex` module, no TE): the
norms of a TP2 + sequence-parallel local spec (the recipes' layout) are all torch RMSNorms tagged
sequence_parallel, where without the fixes the layers' norms assert and the final norm is apex's
FusedLayerNorm, which rejects RMSNorm. The CPU scenario tp2_ep2 also runs with that stand-in apex.
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
import torch

from rlpo_mega import platform
from rlpo_mega.platform import all_patches, cpu_megatron, megatron_fixes
from tests.dist import ROOT, torchrun

QWEN = "configs/models/tiny_qwen3_moe.json"
MIXTRAL = "configs/models/tiny_mixtral.json"
GLM = "configs/models/tiny_glm4_moe.json"
DEEPSEEK = "configs/models/tiny_deepseek_v3.json"

# name -> (processes, model, overrides). Every scenario trains 2 optimizer steps (clip_grad=1.0 by
# default, alltoall token dispatcher, local layer spec: no Transformer Engine; no apex but in tp2_ep2).
SCENARIOS = {
    "tp1": (1, QWEN, ()),
    # TP2 (hence sequence parallel) and EP2 alltoall on 2 processes; the norm tag is cleared before
    # the second step (--untag-norm-from=1) for the silent half of torch_norm_sequence_parallel.
    # With an empty `apex` module standing in (--fake-apex), as on a GPU node with apex but no TE.
    "tp2_ep2": (2, QWEN, ("parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=1",
                          "--untag-norm-from=1", "--fake-apex")),
    # Expert-TP 2 with experts on 2 ranks: the expert-TP all-gather sizes differ between ranks.
    "tp2_ep2_etp2": (4, QWEN, ("parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=2")),
    # Tied input/output embeddings on two pipeline stages.
    "pp2_tied": (2, MIXTRAL, ("parallel.pipeline=2",)),
    # bf16 parameters: megatron's mixed-precision optimizer (fp32 main params), saved with the optimizer and
    # loaded into a fresh model and optimizer after the steps
    "tp1_bf16": (1, QWEN, ("model.params_dtype=bfloat16", "--save-optimizer")),
    # glm4_moe on two pipeline stages (the first holds only its dense layer) with EP2, bf16 parameters and the
    # distributed optimizer, saved and reloaded: q/k/v biases (bf16) share a param group with fp32 norms, and the
    # first stage's expert optimizer has no params
    "pp2_glm_bf16_distopt": (4, GLM, ("parallel.pipeline=2", "parallel.expert=2", "parallel.num_micro_batches=2",
                                      "model.params_dtype=bfloat16", "optim.use_distributed_optimizer=true",
                                      "--save-optimizer")),
    # multi-latent attention (deepseek_v3) on the local spec
    "mla": (1, DEEPSEEK, ()),
    # ... under context parallelism (its YaRN RoPE table cut per CP rank at construction), packed rows
    "mla_cp2": (2, DEEPSEEK, ("parallel.context=2",)),
    # optimizer CPU offload (megatron's HybridDeviceOptimizer) with slime's one-node flags, bf16 (the local spec's
    # norms stay fp32), saved with the optimizer and loaded into a fresh model and optimizer after the steps
    "tp1_bf16_offload": (1, QWEN, ("model.params_dtype=bfloat16", "optim.use_distributed_optimizer=true",
                                   "optim.cpu_offload=true", "optim.precision_aware=true",
                                   "optim.overlap_cpu_optimizer_d2h_h2d=true", "--save-optimizer")),
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
    # fused_layer_norm.py:67 building the final norm (apex present, gpt_layer_specs.py:644)
    "final_norm_rmsnorm_apex": ("tp2_ep2", "(RMSNorm) is not supported in FusedLayerNorm"),
    # mappings.py:150 token_dispatcher's gather of expert-TP tokens
    "uneven_all_gather": ("tp2_ep2_etp2", "ProcessGroupGloo::allgather: invalid tensor size"),
    # language_module.py:244 weight.data.cuda() before the embedding-group all-reduce
    "tied_embedding_cuda": ("pp2_tied", CUDA_MISSING),
    # optimizer.py:695 Float16OptimizerWithFloat16Params checks for torch.cuda parameter types
    "optimizer_param_types": ("tp1_bf16", "Wrapped parameters must be one of"),
    # dist_checkpointing/optimizer.py:145 in the save after the steps (the local spec's fp32 norms)
    "float16_optimizer_fp32_param_ids": ("tp1_bf16", "does not match any model sharded param"),
    # distrib_optimizer.py:894-908 handing the wrong param's state to the checkpoint (the first save), caught by
    # rlpo_mega.checkpoint.distopt's size check (megatron's own gather failed at :1068 copying it)
    "distributed_optimizer_group_order": ("pp2_glm_bf16_distopt", "param-group index map points at another parameter"),
    # distrib_optimizer.py:642 `assert len(steps) == 1` on the dense stage's expert optimizer (the first save)
    "distributed_optimizer_without_params": ("pp2_glm_bf16_distopt", "AssertionError"),
    # multi_latent_attention.py:185 isinstance(self.linear_proj, TELinear) with a MagicMock as TELinear
    "mla_have_te_flag": ("mla", "isinstance() arg 2 must be a type"),
    # rope_utils.py:62-64 building the first MLA layer's YaRN cache (yarn_rotary_pos_embedding.py:98)
    "cp_pos_emb_cuda": ("mla_cp2", "requires a CUDA or other accelerator backend"),
    # utils.py:348 from optimizer_config.py:383 (TE's version, None, compared with 2.1.0) building the config
    "te_min_version_without_te": ("tp1_bf16_offload", "'>=' not supported between instances of 'NoneType'"),
    # hybrid_optimizer.py:57 (torch.optim.Optimizer.__init__ -> add_param_group) rebuilding the HDO over the shards
    "hybrid_optimizer_fp32_shards_as_leaves": ("tp1_bf16_offload", "can't optimize a non-leaf Tensor"),
    # hybrid_optimizer.py:101: on CPU no param is taken for a device one, and the first step's copy-back lookup fails
    "hybrid_optimizer_host": ("tp1_bf16_offload", "KeyError: tensor("),
    # hybrid_optimizer.py:373 in the load after the steps: an fp32 norm looked up among the 16-bit params' copies
    "hybrid_optimizer_fp32_params_load": ("tp1_bf16_offload", "KeyError: tensor("),
}

# patch -> the megatron-core site whose wrong answer an rlpo_mega check catches first (the message names it)
CAUGHT_BY_RLPO_MEGA = {"distributed_optimizer_group_order": ("optimizer/distrib_optimizer.py", 894)}

PATCHES = {p.name: p for p in all_patches()}


def _run(scenario, ablate=None):
    nproc, model, args = SCENARIOS[scenario]
    env = {"RLPO_MEGA_ABLATE_PATCH": ablate or ""}
    fresh = "--fake-apex" in args  # the stand-in apex must be in place before megatron's first import
    if ablate:
        return torchrun("platform_scenario.py", nproc, model, *args, env=env, expect_fail=True, fresh=fresh)
    return torchrun("platform_scenario.py", nproc, model, *args, env=env, fresh=fresh)


_PASSED: dict[str, dict] = {}
_SINGLE: dict[tuple[str, str | None], object] = {}  # (scenario, ablated patch) -> process or report


def _single_process_runs():
    """Every run of a one-process scenario (with all patches, and each ablation on it), two at a time: one
    process leaves the second core idle (CI time). Run once, before the multi-process ones, which then run alone."""
    if not _SINGLE:
        from concurrent.futures import ThreadPoolExecutor

        jobs = [(sc, None) for sc, (n, _, _) in SCENARIOS.items() if n == 1]
        jobs += [(sc, patch) for patch, (sc, _) in sorted(ABLATIONS.items()) if SCENARIOS[sc][0] == 1]
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {job: pool.submit(_run, *job) for job in jobs}
        _SINGLE.update({job: f.exception() or f.result() for job, f in futures.items()})
    return _SINGLE


def _single(scenario, patch):
    out = _single_process_runs()[(scenario, patch)]
    if isinstance(out, BaseException):  # that run's failure, raised in the test that asks for it
        raise out
    return out


def ablated_run(scenario, patch):
    return _single(scenario, patch) if SCENARIOS[scenario][0] == 1 else _run(scenario, ablate=patch)


def passing_run(scenario) -> dict:
    """The scenario with every patch (run once per test session)."""
    if scenario not in _PASSED:
        _PASSED[scenario] = _single(scenario, None) if SCENARIOS[scenario][0] == 1 else _run(scenario)
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
    proc = ablated_run(scenario, patch)
    tail = proc.stderr[-4000:]
    assert proc.returncode != 0, f"{scenario} trains without {patch}: the patch is not needed there"
    assert message in proc.stderr, f"{scenario} without {patch}: expected {message!r}\n{tail}"
    site = failing_site(proc.stderr, message) or CAUGHT_BY_RLPO_MEGA.get(patch)
    assert site is not None, f"no megatron-core frame above {message!r}\n{tail}"
    assert site in _answer_sites(PATCHES[patch]), (
        f"without {patch}, {scenario} fails at megatron/core/{site[0]}:{site[1]}, "
        f"which is not in the patch's answers {PATCHES[patch].answers}")


@pytest.mark.parametrize("patch", sorted(ABLATIONS))
def test_scenario_trains_with_all_patches(patch):
    scenario = ABLATIONS[patch][0]
    report = passing_run(scenario)
    assert set(report["applied"]) == set(PATCHES) | {p.name for p in megatron_fixes.SPEEDUPS}, report["applied"]
    losses = report["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    # (That the patched layouts reproduce the single-process losses and grads is tests/test_parity.py.)
    if report["resumed"] is not None:  # the loaded model and optimizer continue exactly as the saved ones
        a, b, c, d = report["resumed"]
        assert a == b and c == d, report["resumed"]
    assert losses[1] < losses[0], f"{scenario}: the optimizer step did not lower the loss {losses}"


def test_norm_sequence_parallel_tag_all_reduces_norm_grads():
    """torch_norm_sequence_parallel's tag: without it the norm grads silently differ across TP ranks."""
    report = passing_run("tp2_ep2")
    assert report["norm_params"] > 0
    assert report["norm_tags"] == [[True], [False]]  # step 0 as patched, step 1 with the tag cleared
    tagged, untagged = report["norm_grad_tp_spread"]
    assert tagged == 0.0, f"tagged norm grads differ across TP ranks by {tagged}"
    assert untagged > 1e-4, f"untagged norm grads agree across TP ranks ({untagged}): the tag is moot"


def test_norms_are_torch_rmsnorm_with_apex_present():
    """final_norm_rmsnorm_apex: with apex (stood in) and no TE every norm of the model is torch's RMSNorm."""
    report = passing_run("tp2_ep2")
    assert report["norm_classes"] == ["torch.nn.modules.normalization.RMSNorm"], report["norm_classes"]


def test_unknown_ablation_name_is_refused():
    code = ("import os; os.environ['RLPO_MEGA_ABLATE_PATCH'] = 'no_such_patch'\n"
            "from rlpo_mega import platform\n"
            "try:\n    platform.apply()\nexcept platform.PlatformError as e:\n    print('REFUSED', e)\n")
    out = _python(code)
    assert "REFUSED" in out and "no_such_patch" in out, out


# ------------------------------------------------------------------------------------------------
# Platform selection, in fresh interpreters (apply() changes process-global state).

def _python(code: str, env: dict | None = None) -> str:
    extra, env = env or {}, {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    env.pop("RLPO_MEGA_ABLATE_PATCH", None)
    env.update(extra)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_thd_rope_vectorized_equals_megatron_loop():
    """The speed-up's one gather gives megatron's per-sequence result bit for bit, for both frequency layouts
    (max-length freqs, and freqs over every packed position), with grads."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils

    megatron_fixes._thd_rope_vectorized()
    fast = rope_utils._apply_rotary_pos_emb_thd
    slow = fast._rlpo_original
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 3, 4, 11, 16], dtype=torch.int32)
    one = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    for freqs in (torch.rand(7, 1, 1, 8, generator=g), torch.rand(16, 1, 1, 8, generator=g)):
        t = torch.randn(16, 2, 8, generator=g, requires_grad=True)
        a, b = fast(t, cu, freqs, cp_group=one), slow(t, cu, freqs, cp_group=one)
        assert torch.equal(a, b)
        ga, = torch.autograd.grad(a.square().sum(), t)
        gb, = torch.autograd.grad(b.square().sum(), t)
        assert torch.equal(ga, gb)


def test_grad_norm_on_device_equals_megatron_local_norm():
    """Without TE and apex, the gradient norm's speed-up gives megatron's local stand-in's value bit for bit
    (fp32 main grads and bf16 ones, many shapes) as a 1-element float32 tensor on the grads' device, and it is
    the one clip_grads calls."""
    from megatron.core import utils as core_utils
    from megatron.core.optimizer import clip_grads

    platform.apply()  # the CPU patches point megatron's device='cuda' at this CPU; the speed-up is among them
    megatron_fixes._grad_norm_on_device()  # a second time changes nothing
    fast = clip_grads.l2_norm_impl
    assert fast._rlpo_original is core_utils.local_multi_tensor_l2_norm
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        grads = [torch.randn(*shape, generator=g).to(dtype) * scale
                 for shape, scale in (((64, 32), 1e-3), ((7,), 3.0), ((4, 16, 8), 1e2), ((1,), 0.0))]
        a, _ = fast(2048 * 32, None, [grads], False)
        b, _ = core_utils.local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape == (1,) and torch.equal(a, b), (a, b)
        assert a.device == grads[0].device


def test_selection():
    """Local-spec fixes whenever TE is absent (CPU or GPU); CPU patches whenever CUDA is absent; the speed-ups
    (megatron code both specs reach: the unfused packed RoPE runs with TE too) always."""
    from rlpo_mega.platform import select

    fast = megatron_fixes.SPEEDUPS
    offload = megatron_fixes.OFFLOAD_FIXES  # defects of megatron's optimizer CPU offload that TE runs reach too
    local = megatron_fixes.FIXES + offload + fast
    assert select(have_transformer_engine=False, have_cuda=False) == local + cpu_megatron.PATCHES
    assert select(have_transformer_engine=False, have_cuda=True) == local
    assert select(have_transformer_engine=True, have_cuda=True) == offload + fast
    assert select(have_transformer_engine=True, have_cuda=False) == offload + fast + cpu_megatron.PATCHES
    assert set(all_patches()) == set(megatron_fixes.FIXES + offload + cpu_megatron.PATCHES)
    # The two norm fixes act on the local spec, which a GPU without TE builds too: not CPU patches.
    fixes = {p.name for p in megatron_fixes.FIXES}
    assert {"torch_norm_sequence_parallel", "final_norm_rmsnorm_apex"} <= fixes
    assert not fixes & {p.name for p in cpu_megatron.PATCHES}


# A GPU node with apex and without Transformer Engine, as far as the platform layer and megatron can
# tell (this machine has neither TE nor apex; `apex` is an empty module, imported before megatron).
_CUDA_PRESENT = r"""
import json, sys, types, torch
torch.cuda.is_available = lambda: True
sys.modules["apex"] = types.ModuleType("apex")

import megatron.core
from megatron.core import utils as core_utils
from megatron.core.models.common.language_module import language_module
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.optimizer import clip_grads, optimizer
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import mappings, random as mrandom
from megatron.core.transformer import torch_norm, utils as transformer_utils
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.spec_utils import build_module

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
        "clip": [id(clip_grads.clip_grad_by_total_norm_fp32), id(optimizer.clip_grad_by_total_norm_fp32)],
        "tied": id(language_module.LanguageModule.setup_embeddings_and_output_layer),
    }

def fixed_sites():  # what megatron_fixes' norm fixes replace
    return {"norm_new": id(torch_norm.WrappedTorchNorm.__dict__["__new__"]),
            "block_spec": id(gpt_layer_specs.get_gpt_decoder_block_spec)}

before, fixed_before = snapshot(), fixed_sites()
from rlpo_mega import platform
applied = platform.apply()
after, fixed_after = snapshot(), fixed_sites()

# The recipes' layout (TP2 + sequence parallel) through moe.model's spec call; every norm built.
from moe.model import FAST_PATH_FIELDS, ParallelSizes, have_transformer_engine, load_hf_config, transformer_config
from rlpo_mega.model_setup import ddp_config
hf = load_hf_config("configs/models/tiny_qwen3_moe.json")
config = transformer_config(hf, ParallelSizes(tensor=2, sequence_parallel=True))
spec = gpt_layer_specs.get_gpt_decoder_block_spec(
    config, use_transformer_engine=have_transformer_engine(), normalization="RMSNorm", pp_rank=0)
layer = spec.layer_specs[0].submodules
attn = layer.self_attention.submodules
head = config.kv_channels
norms = {}
for name, s, size in (("input", layer.input_layernorm, config.hidden_size),
                      ("pre_mlp", layer.pre_mlp_layernorm, config.hidden_size),
                      ("q", attn.q_layernorm, head), ("k", attn.k_layernorm, head),
                      ("final", spec.layer_norm, config.hidden_size)):
    if s is IdentityOp:
        continue
    try:
        m = build_module(s, config=config, hidden_size=size, eps=config.layernorm_epsilon)
        norms[name] = [f"{type(m).__module__}.{type(m).__name__}",
                       sorted({getattr(p, "sequence_parallel", None) for p in m.parameters()})]
    except AssertionError as e:
        norms[name] = ["AssertionError", str(e)]
print(json.dumps({"applied": applied, "same": before == after, "before": before, "after": after,
                  "fixed_changed": {k: fixed_before[k] != fixed_after[k] for k in fixed_before},
                  "backend": platform.backend(), "te": have_transformer_engine(),
                  "te_general_gemm": repr(getattr(moe_utils, "te_general_gemm", "undefined")),
                  "norms": norms, "fast": {f: getattr(config, f) for f in FAST_PATH_FIELDS},
                  "overlap_grad_reduce": ddp_config(True).overlap_grad_reduce}))
"""

RMSNORM = "torch.nn.modules.normalization.RMSNorm"


def _cuda_present(ablate: str = "") -> dict:
    return json.loads(_python(_CUDA_PRESENT, {"RLPO_MEGA_ABLATE_PATCH": ablate}).strip().splitlines()[-1])


def test_nothing_cpu_specific_runs_when_cuda_is_present():
    result = _cuda_present()
    fixes = [p.name for p in ([] if result["te"] else megatron_fixes.FIXES) + megatron_fixes.OFFLOAD_FIXES
             + megatron_fixes.SPEEDUPS]
    # Only the device-independent megatron fixes (without Transformer Engine) and speed-ups; no version check.
    assert result["applied"] == fixes
    assert not set(result["applied"]) & {p.name for p in cpu_megatron.PATCHES}
    assert result["same"], {k: (result["before"][k], result["after"][k])
                            for k in result["before"] if result["before"][k] != result["after"][k]}
    assert all(result["after"]["module_torch"])
    assert result["backend"] == "nccl"
    assert result["fixed_changed"] == {"norm_new": not result["te"], "block_spec": not result["te"]}
    # The GPU fast path as megatron finds its kernels (no TE, apex without its CUDA extensions here):
    # bias-dropout-add only (torch's jit); the gradient reduction overlaps the backward.
    if not result["te"]:
        assert result["fast"] == {"gradient_accumulation_fusion": False, "bias_dropout_fusion": True,
                                  "apply_rope_fusion": False, "masked_softmax_fusion": False,
                                  "moe_permute_fusion": False}, result["fast"]
    assert result["overlap_grad_reduce"] is True
    if not result["te"]:
        assert result["te_general_gemm"] == "None"
        # GPU, apex, no TE, TP2 + sequence parallel: every norm is torch's RMSNorm, its params tagged
        # sequence_parallel (grads all-reduced over TP by finalize_model_grads).
        assert result["norms"], result
        assert {"input", "pre_mlp", "final"} <= set(result["norms"]), result["norms"]
        assert all(v == [RMSNORM, [True]] for v in result["norms"].values()), result["norms"]


def test_gpu_without_te_norms_fail_without_the_fixes():
    """The same GPU-without-TE spec as above with both norm fixes left out: each norm fails to build."""
    left_out = {"torch_norm_sequence_parallel", "final_norm_rmsnorm_apex"}
    result = _cuda_present(ablate=",".join(sorted(left_out)))
    if result["te"]:
        pytest.skip("Transformer Engine is installed: the local spec and its fixes are not used")
    assert result["applied"] == [p.name for p in megatron_fixes.FIXES + megatron_fixes.OFFLOAD_FIXES
                                 + megatron_fixes.SPEEDUPS if p.name not in left_out]
    norms = result["norms"]
    assert {"input", "pre_mlp", "final"} <= set(norms), norms
    for name, (kind, message) in norms.items():
        assert kind == "AssertionError", (name, norms)
        if name == "final":  # apex's FusedLayerNorm chosen for the final norm
            assert "(RMSNorm) is not supported in FusedLayerNorm" in message, norms
        else:
            assert "sequence parallel not supported by torch LayerNorm" in message, norms


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


def test_fast_path_follows_the_kernels_found():
    """Each fusion on under CUDA exactly where its kernel exists; nothing on a CPU; MLA keeps the unfused
    RoPE (megatron-core 0.16.1's fused MLA RoPE is YaRN-only and experimental)."""
    from moe.model import FAST_PATH_FIELDS, fast_kernels, fast_path

    every = dict.fromkeys(("rope", "permute", "wgrad_accumulation", "masked_softmax"), True)
    none = dict.fromkeys(every, False)
    assert fast_path(False, every) == dict.fromkeys(FAST_PATH_FIELDS, False)
    assert fast_path(True, every) == dict.fromkeys(FAST_PATH_FIELDS, True)
    assert fast_path(True, every, mla=True)["apply_rope_fusion"] is False
    assert fast_path(True, none) == {**dict.fromkeys(FAST_PATH_FIELDS, False), "bias_dropout_fusion": True}
    for kernel, field in (("rope", "apply_rope_fusion"), ("permute", "moe_permute_fusion"),
                          ("wgrad_accumulation", "gradient_accumulation_fusion"),
                          ("masked_softmax", "masked_softmax_fusion")):
        on = fast_path(True, {**none, kernel: True})
        assert [f for f in FAST_PATH_FIELDS if on[f]] == sorted({field, "bias_dropout_fusion"},
                                                                key=FAST_PATH_FIELDS.index)
    # this machine: no TE, no apex extensions
    assert fast_kernels() == none
