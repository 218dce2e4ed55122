"""Test-support stand-in for sgl_kernel (sglang's CUDA/AMX kernel wheel), which has no build for this CPU.

With SGLANG_USE_CPU_ENGINE=1, sglang imports a few CPU kernels from sgl_kernel at module level. None of them
is called with attention_backend="torch_native", page size 1 and no speculative decoding; each name here
raises if it ever is, naming itself (any other name too), so a recipe change that needs a real kernel fails loudly.
"""

_NAMES = (
    "copy_all_layer_kv_cache_cpu", "assign_req_to_token_pool_cpu", "assign_extend_cache_locs_cpu",
    "get_last_loc_cpu", "alloc_extend_cpu", "alloc_decode_cpu", "create_flashinfer_kv_indices_cpu",
    "build_draft_decode_metadata_cpu",
)


def _missing(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is a test stub (tests/sglang_support/path/sgl_kernel): "
                                  "this sglang code path needs the real CPU kernel; keep the recipe of "
                                  "shared/notes/sglang.md (torch_native attention, page size 1)")
    kernel.__name__ = name
    return kernel


for _n in _NAMES:
    globals()[_n] = _missing(_n)


def __getattr__(name):  # other module-level `from sgl_kernel import X` (e.g. speculative-decoding kernels)
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
