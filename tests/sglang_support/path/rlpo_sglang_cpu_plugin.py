"""Test-support sglang plugin (found through the dist-info beside this file, on PYTHONPATH): sglang loads
`sglang.srt.plugins` entry points in every server process (and before `launch_server` parses its arguments), so
what it sets lands in the scheduler too, without editing site-packages.

1. The bug it mends (sglang 0.5.23): with --enable-return-routed-experts on device=cpu, the routed-experts host
   buffer is allocated through ALLOC_MEMORY_FUNCS["cpu"], whose default is cudaHostRegister
   (mem_cache/pool_host/common.py has entries for npu/musa/xpu only). On CPU a plain tensor is right.
2. What it adds: torch_native among the attention backends that --enable-deterministic-inference accepts
   (sglang's own extension point, arg_groups/choices.add_deterministic_attention_backend_choices). On a GPU the
   flag takes fa3/flashinfer/triton; the CPU build has torch_native alone, and refused the flag. What the flag
   gives the tests is per-request seeded sampling (layers/sampler.multinomial_with_seed, the request's
   sampling_seed), so a sample depends on its seed, its prompt and the weights, not on the server's RNG state or
   on which requests shared its batch. The flag also turns on sglang's batch-invariant matmul kernels
   (batch_invariant_ops, triton: CUDA/XPU only, RuntimeError on CPU at ModelRunner.maybe_enable_batch_invariant_mode):
   on CPU that step is skipped, so batch invariance is not claimed; tests/test_sglang_trainer.py measures the runs
   it compares.
3. What it saves: on a machine without CUDA, the server's schedulers and detokenizer are forked from the launching
   process instead of spawned (engine._set_envs_and_config sets "spawn", which CUDA needs: a forked child cannot
   use its parent's CUDA context). A spawned child imports sglang and torch again, 8-13 s of CPU each (a probe of
   a suite run: 22 detokenizers, 282 CPU-s; 25 schedulers, ~14 s each in their first 40 s); a forked one starts
   with the launcher's imports. Nothing else differs: the same functions run in the same processes.
5. LoRA without pinned memory (see _lora_without_pinning).
"""
import multiprocessing
import sys

import torch


def _alloc_cpu(dims, dtype, device, pin_memory, allocator=None, registration_granularity_bytes=None):
    return torch.empty(dims, dtype=dtype, device="cpu")  # pinning needs CUDA: nothing to pin for


def _fork_instead_of_spawn():
    if getattr(multiprocessing.set_start_method, "rlpo_fork", False):
        return  # plugins load more than once per process (and again in each forked child)
    set_start_method = multiprocessing.set_start_method

    def fork_instead_of_spawn(method, force=False):
        set_start_method("fork" if method == "spawn" else method, force=force)

    fork_instead_of_spawn.rlpo_fork = True
    multiprocessing.set_start_method = fork_instead_of_spawn


def _fp8_without_amx():
    """4. What it stands in for (rollout.weights=fp8 on a CPU without AMX): sglang's block-FP8 layers on CPU
    (layers/quantization/fp8.py) assert AMX at load (:827, :2185), pack their FP8 weights into the AMX kernels'
    layout (amx_utils._amx_process_weight_after_loading) and compute with sgl-kernel's AMX kernels. Here the
    assert's flag is set, the packing leaves the weights as loaded and marks the layer for the CPU kernels
    (use_intel_amx_backend), which the sgl_kernel stand-in supplies in torch (dequantise by block, multiply).
    Everything else is sglang's own: the FP8 parameters it creates, its loaders, the quantisation config and the
    rest of its post-load processing. One mend with it: that CPU branch re-wraps weight_scale_inv as a plain
    Parameter (fp8.py:831), which drops its weight loader, so a second load (every sync after the first) raised
    AttributeError -- the loader-loss bug class of sglang #5424/#7421/#9855; the scale's own parameter is put back,
    as sglang's CUDA branch (Hopper) keeps every parameter as loaded."""
    from sglang.srt.layers import amx_utils
    from sglang.srt.layers.quantization import fp8

    if getattr(fp8, "rlpo_standin", False) or amx_utils.cpu_has_amx_support():
        return

    def as_loaded(module, weight_names, *args, **kwargs):
        module.use_intel_amx_backend = True  # the stand-in kernels read the weights in their loaded layout

    process = fp8.Fp8LinearMethod.process_weights_after_loading

    def process_keeping_scale(self, layer):
        scale = getattr(layer, "weight_scale_inv", None)
        process(self, layer)
        if scale is not None and getattr(layer, "weight_scale_inv", None) is not scale:
            layer.weight_scale_inv = scale  # the same data; its loader kept

    fp8._is_cpu_amx_available = True
    fp8._amx_process_weight_after_loading = as_loaded
    fp8.Fp8LinearMethod.process_weights_after_loading = process_keeping_scale
    fp8.rlpo_standin = True


def _lora_without_pinning():
    """5. The bug it mends (sglang 0.5.23, --enable-lora on device=cpu): its LoRA layers, adapters and backends pin
    host memory unconditionally (lora/layers.py:145,324,479,594,723,814 `torch.tensor(..., pin_memory=True)` and
    `.pin_memory()`, lora/lora.py:533, the backends' batch info), which raises without an accelerator ("pin_memory=True
    requires a CUDA or other accelerator backend"); mem_pool.py alone asks is_pin_memory_available first. Pinning only
    speeds host-to-GPU copies: without a GPU the plain host tensor is the same tensor. In the LoRA modules the
    factories drop the flag, and Tensor.pin_memory returns the tensor."""
    import importlib
    import types

    if getattr(torch.Tensor.pin_memory, "rlpo_no_pin", False):
        return

    def unpinned(self, *args, **kwargs):
        return self

    unpinned.rlpo_no_pin = True
    torch.Tensor.pin_memory = unpinned

    def dropping(factory):
        def call(*args, pin_memory=False, **kwargs):
            return factory(*args, **kwargs)
        return call

    shim = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")})
    for name in ("tensor", "zeros", "empty", "ones", "arange", "full", "as_tensor"):
        setattr(shim, name, dropping(getattr(torch, name)))
    for module in ("sglang.srt.lora.layers", "sglang.srt.lora.lora", "sglang.srt.lora.backend.torch_backend",
                   "sglang.srt.lora.backend.base_backend", "sglang.srt.lora.backend.triton_backend",
                   "sglang.srt.lora.backend.chunked_backend", "sglang.srt.lora.mem_pool",
                   "sglang.srt.lora.lora_manager"):
        try:
            mod = importlib.import_module(module)
        except Exception:  # a backend whose kernels this build cannot import is not used here
            continue
        if getattr(mod, "torch", None) is torch:
            mod.torch = shim


def register():
    from sglang.srt.arg_groups.choices import (
        DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
        add_deterministic_attention_backend_choices,
    )
    from sglang.srt.mem_cache.pool_host import common

    common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_cpu
    if not torch.cuda.is_available():
        import sglang.srt.batch_invariant_ops as batch_invariant

        batch_invariant.enable_batch_invariant_mode = lambda: None  # its kernels are triton's (CUDA/XPU)
        _fork_instead_of_spawn()
        _fp8_without_amx()
        if "--enable-lora" in sys.argv:  # the launcher's flags (its schedulers are forked from it, mended)
            _lora_without_pinning()
    if "torch_native" not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:  # plugins load more than once per process
        add_deterministic_attention_backend_choices(["torch_native"])
