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
"""
import torch


def _alloc_cpu(dims, dtype, device, pin_memory, allocator=None, registration_granularity_bytes=None):
    return torch.empty(dims, dtype=dtype, device="cpu")  # pinning needs CUDA: nothing to pin for


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
    if "torch_native" not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:  # plugins load more than once per process
        add_deterministic_attention_backend_choices(["torch_native"])
