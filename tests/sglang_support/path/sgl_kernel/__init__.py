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


# --- block-FP8 kernels (rollout.weights=fp8 on a CPU server): sglang 0.5.23's FP8 layers on CPU call these AMX
# kernels (layers/quantization/fp8.py:1400-1410 and :3109-3137), which this CPU lacks. Their arithmetic in torch:
# dequantise by 128-block with sglang's own block_quant_dequant (quantization/fp8_utils.py:2044-2066), then the
# product -- the linear as x @ W^T (+ bias), the experts as sglang's own reference MoE (test/cpu_test_utils.py
# native_fp8_fused_moe, the reference sgl-kernel's tests hold fused_experts_cpu to). The weights are read in the
# layout they were loaded in: the plugin's FP8 stand-in (rlpo_sglang_cpu_plugin.py) leaves them unpacked.
from typing import Optional  # noqa: E402

_FP8_W8A16 = 2  # sglang.srt.layers.amx_utils.CPUQuantMethod.FP8_W8A16


def _dequant(w, s, block_size, dtype=torch.float32):
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    return block_quant_dequant(w, s, list(block_size), dtype)


@torch.library.custom_op("sgl_kernel::fp8_scaled_mm_cpu", mutates_args=())
def fp8_scaled_mm_cpu(mat1: torch.Tensor, mat2: torch.Tensor, scales2: torch.Tensor, block_size: list[int],
                      bias: Optional[torch.Tensor], out_dtype: torch.dtype, is_vnni: bool) -> torch.Tensor:
    out = mat1.float() @ _dequant(mat2, scales2, block_size).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@torch.library.custom_op("sgl_kernel::fused_experts_cpu", mutates_args=())
def fused_experts_cpu(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, inplace: bool, moe_comp_method: int, w1_scale: Optional[torch.Tensor],
                      w2_scale: Optional[torch.Tensor], w1_zp: Optional[torch.Tensor], w2_zp: Optional[torch.Tensor],
                      block_size: Optional[list[int]], w1_bias: Optional[torch.Tensor], w3_bias: Optional[torch.Tensor],
                      alpha: Optional[float], limit: Optional[float], is_vnni: bool, activation: str) -> torch.Tensor:
    if moe_comp_method != _FP8_W8A16 or w1_bias is not None or w3_bias is not None or alpha is not None:
        raise NotImplementedError(f"sgl_kernel.fused_experts_cpu stand-in (tests/sglang_support/path/sgl_kernel): "
                                  f"only block FP8 (method {_FP8_W8A16}) without biases; got method {moe_comp_method}")
    from sglang.test.cpu_test_utils import native_fp8_fused_moe

    out = native_fp8_fused_moe(hidden_states.float(), _dequant(w1, w1_scale, block_size),
                               _dequant(w2, w2_scale, block_size), topk_weights.float(), topk_ids,
                               topk_ids.shape[-1], activation)
    return out.to(hidden_states.dtype)
