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


# --- the one real kernel: sglang's seeded sampling (layers/sampler.multinomial_with_seed, under
# --enable-deterministic-inference) hashes (seed, position, vocabulary index) with murmur_hash32_cpu on CPU.
# This is kernels/ops/sampling/murmur_hash.py's triton kernel transcribed to int64 torch ops (each product
# masked to its low 32 bits, which wrapping int64 arithmetic keeps exact).
import torch  # noqa: E402

_M = 0xFFFFFFFF


def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & _M


def _mix(h, k):
    k = _rotl((k * 0xCC9E2D51) & _M, 15)
    h = h ^ ((k * 0x1B873593) & _M)
    return (_rotl(h, 13) * 5 + 0xE6546B64) & _M


def _fmix(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M
    return h ^ (h >> 16)


@torch.library.custom_op("sgl_kernel::murmur_hash32_cpu", mutates_args=())
def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    s = seed.to(torch.int64).view(-1, 1)
    h = torch.zeros((seed.shape[0], 1), dtype=torch.int64)
    h = _mix(h, s & _M)
    h = _mix(h, (s >> 32) & _M)
    h = _mix(h, positions.to(torch.int64).view(-1, 1) & _M)
    h = _mix(h, col_indices.to(torch.int64).view(1, -1) & _M)
    return _fmix(h ^ 16).to(torch.uint32)


@murmur_hash32_cpu.register_fake
def _(seed, positions, col_indices):
    return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)
