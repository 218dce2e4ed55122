"""Test-support sglang plugin (found through the dist-info beside this file, on PYTHONPATH): sglang loads
`sglang.srt.plugins` entry points in every server process, so the fix lands in the scheduler too, without
editing site-packages.

The bug it mends (sglang 0.5.23): with --enable-return-routed-experts on device=cpu, the routed-experts host
buffer is allocated through ALLOC_MEMORY_FUNCS["cpu"], whose default is cudaHostRegister
(mem_cache/pool_host/common.py has entries for npu/musa/xpu only). On CPU a plain tensor is right.
"""
import torch


def _alloc_cpu(dims, dtype, device, pin_memory, allocator=None, registration_granularity_bytes=None):
    return torch.empty(dims, dtype=dtype, device="cpu")  # pinning needs CUDA: nothing to pin for


def register():
    from sglang.srt.mem_cache.pool_host import common

    common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_cpu
