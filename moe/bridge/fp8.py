"""Block FP8 for the rollout engine (rollout.weights=fp8): the learner's HF tensors quantised on their way out.

Format (what SGLang loads for a block-FP8 checkpoint, `quantization_config.weight_block_size = [128, 128]`): a
linear layer's weight [N, K] becomes `<name>` in float8_e4m3fn, same shape, and `<name minus .weight>.weight_scale_inv`
in fp32, [ceil(N/128), ceil(K/128)], one scale per 128 x 128 tile, the multiplier that dequantises: w ~ q * s.

Arithmetic, per tile (SGLang 0.5.23's own functions, compared bit for bit by tests/test_fp8.py):
  scale="fp32"  a = max(amax(|x|), 1e-4); q = e4m3fn(x * (448 / a)); s = a / 448
                (sglang/benchmark/deepseek_utils.py:19-31, per_block_cast_to_fp8: the fp32 scales Hopper serves)
  scale="ue8m0" s = 2^ceil(log2(a / 448)) (the exponent rounded up); q = e4m3fn(x * (1 / s))
                (sglang/srt/layers/quantization/fp8_utils.py:2393-2417, DeepGEMM's UE8M0 scales on Blackwell)
A shape that is not a multiple of 128 is zero-padded to whole tiles (its last tiles' amax is over the real values
only) and cropped back. The 1e-4 floor gives an all-zero tile a finite scale and zero codes (an unfloored amax of 0
gives NaN: slime's tests/test_block_fp8_zero_block.py). The product is computed in fp32 whatever the input dtype,
as SGLang's is (a bf16 tensor times an fp32 one promotes).

Which tensors: the family's `fp8_weights` keys (moe/families/base.py) -- attention and expert/dense MLP projections;
the embedding, the output layer, every norm and the router stay in the model's dtype (R3 replays the learner's
own routes, so the router must score as the learner's does). Imports torch only: it also runs in SGLang's venv
(tests).
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Literal

import torch

BLOCK = 128
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4
FP8_DTYPE = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # <...>.weight -> <...>.weight_scale_inv (SGLang's and the FP8 checkpoints' name)
ScaleFormat = Literal["fp32", "ue8m0"]


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0, fp32): the exponent rounded up, clamped to a normal fp32."""
    bits = x.abs().float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def quantize_block(x: torch.Tensor, scale: ScaleFormat = "fp32",
                   block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight [N, K] -> (e4m3fn codes [N, K], fp32 scales [ceil(N/block), ceil(K/block)]), per the module's
    arithmetic. On the tensor's own device; the codes and scales are new tensors."""
    if x.dim() != 2:
        raise ValueError(f"block FP8 quantises 2-D weights; got shape {tuple(x.shape)}")
    n, k = x.shape
    rows, cols = math.ceil(n / block), math.ceil(k / block)
    if n % block or k % block:
        padded = x.new_zeros((rows * block, cols * block))
        padded[:n, :k] = x
    else:
        padded = x.contiguous()
    tiles = padded.view(rows, block, cols, block)
    amax = tiles.abs().float().amax(dim=(1, 3), keepdim=True).clamp(AMAX_FLOOR)
    if scale == "ue8m0":
        s = ceil_to_ue8m0(amax / FP8_MAX)
        q = (tiles * (1.0 / s)).to(FP8_DTYPE)
    elif scale == "fp32":
        q = (tiles * (FP8_MAX / amax)).to(FP8_DTYPE)
        # divided by a tensor, not a Python number: CUDA divides by a host scalar as a multiply by its reciprocal
        # (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), 1 ulp off the CPU's division in ~60% of the scales
        # (measured on an H200: tools/gpu_checklist.py's fp8 row); a device tensor divisor is IEEE division on both
        s = amax / amax.new_tensor(FP8_MAX)
    else:
        raise ValueError(f"block FP8 scale format {scale!r}: fp32 or ue8m0")
    q = q.view(rows * block, cols * block)
    if q.shape != (n, k):
        q = q[:n, :k]
    return q.contiguous(), s.view(rows, cols)


def dequantize_block(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32,
                     block: int = BLOCK) -> torch.Tensor:
    """Codes [..., N, K] and scales [..., ceil(N/block), ceil(K/block)] -> the weight they stand for, in `dtype`
    (fp32 product, then the cast: what SGLang's block_quant_dequant computes)."""
    n, k = q.shape[-2:]
    full = s.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :n, :k]
    return (q.float() * full).to(dtype)


class Fp8Selection:
    """Which HF tensor names of a model go in block FP8: the family's `fp8_weights` templates over every layer
    and expert, compiled once."""

    def __init__(self, hf):
        from moe.families import get_family

        family = get_family(hf.model_type)
        names = family.hf_names(hf)
        keys = family.fp8_weights(hf)  # raises for a family without an FP8 path
        patterns = []
        for key in sorted(keys):
            template = re.escape(names[key]).replace(re.escape("{i}"), r"\d+").replace(re.escape("{e}"), r"\d+")
            patterns.append(template)
        self._re = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None

    def __call__(self, name: str) -> bool:
        return self._re is not None and self._re.fullmatch(name) is not None


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], selected, scale: ScaleFormat = "fp32"):
    """(name, tensor) pairs -> the same with every selected weight replaced by its codes followed by its
    `weight_scale_inv` (SGLang's loader fills a fused parameter's scale rows beside its weight rows)."""
    out = []
    for name, t in named:
        if selected(name):
            q, s = quantize_block(t, scale)
            out += [(name, q), (scale_name(name), s)]
        else:
            out.append((name, t))
    return out


def sglang_quantization_config(hf) -> dict:
    """What an SGLang server started from the bf16 checkpoint needs to hold block-FP8 weights: passed as
    --quantization fp8 --json-model-override-args '{"quantization_config": ...}' (SGLang sets it on the model's
    config, sglang/srt/configs/model_config.py:612; Fp8Config.from_config reads it, quantization/fp8.py:346-387).
    quant_method "fp8" makes SGLang build the quantised layers' parameters as e4m3 codes and weight_scale_inv
    (a serialized-FP8 checkpoint's), which every sync fills; activations are quantised dynamically per token."""
    from moe.families import get_family

    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "ignored_layers": get_family(hf.model_type).fp8_ignored_layers(hf)}


def server_alignment_problem(hf, tp: int, ep: int = 1) -> str | None:
    """Why an SGLang server at tensor parallel `tp` (its MoE layers at expert parallel `ep`, MoE-TP tp/ep) cannot
    hold block-FP8 weights, or None: SGLang refuses at start any quantised layer whose per-rank part is not whole
    128-tiles (sglang/srt/layers/quantization/fp8.py:595-610 linear, :1589-1597 MoE): column-split outputs
    (q, k, v, gate/up) and row-split inputs (o, down) per rank."""
    from moe.families import get_family

    family = get_family(hf.model_type)
    family.fp8_weights(hf)  # a family without an FP8 path refuses here
    heads, kv, head_dim = int(hf.num_attention_heads), int(hf.num_key_value_heads), family.head_dim(hf)
    moe_tp = max(1, tp // max(1, ep))
    checks = [("the attention's query heads", heads * head_dim, tp),
              ("the attention's key/value heads", kv * head_dim, min(tp, kv)),
              ("the experts' intermediate size", int(getattr(hf, "moe_intermediate_size", None)
                                                      or hf.intermediate_size), moe_tp)]
    if any(family.moe_layer_pattern(hf)[i] == 0 for i in range(hf.num_hidden_layers)):
        checks.append(("the dense layers' intermediate size", int(hf.intermediate_size), tp))
    for what, size, parts in checks:
        if size % parts or (size // parts) % BLOCK:
            if parts == 1:
                return (f"rollout.weights=fp8: {what} ({size}) is not a multiple of the {BLOCK}-wide FP8 block SGLang "
                        "needs, at any server layout: this model cannot be served in block FP8; use "
                        "rollout.weights=bf16")
            fix = ("use expert parallelism on the servers (rollout.sglang.server_args.ep_size = tp_size: whole "
                   "experts per rank)" if "experts" in what and ep < tp else "use a smaller rollout.sglang.tp_size")
            return (f"rollout.weights=fp8: {what} ({size}) over {parts} server rank(s) is {size / parts:g} per rank, "
                    f"not a multiple of the {BLOCK}-wide FP8 block SGLang needs: {fix}, or rollout.weights=bf16")
    return None


class QuantizedStream:
    """An export stream (moe.bridge.megatron_io.ExportStream's contract) whose selected weights leave in block FP8:
    each bucket is quantised as it comes (after the bridge made its HF tensors, on the receiving rank's device),
    each selected weight followed by its weight_scale_inv. `digests` are of what leaves -- the codes and the scales
    -- which is what an SGLang server holds once loaded (on a GPU its post-load processing keeps both as loaded:
    quantization/fp8.py's CUDA branch, UE8M0 requantisation being off on Hopper); `bytes_sent` counts them too.
    The inner stream's own (bf16) digests are not computed."""

    def __init__(self, stream, selected, scale: ScaleFormat = "fp32", quantization_config: dict | None = None):
        stream.compute_digests = False
        object.__setattr__(self, "_stream", stream)
        object.__setattr__(self, "_selected", selected)
        object.__setattr__(self, "_scale", scale)
        object.__setattr__(self, "compute_digests", True)  # a transport that digests while loading turns it off
        object.__setattr__(self, "digests", {})
        object.__setattr__(self, "bytes_sent", 0)
        # what a checkpoint of these tensors declares (sglang_quantization_config): the disk transport writes it
        object.__setattr__(self, "quantization_config", quantization_config)

    def __getattr__(self, name):  # receives, digest_algorithm, ...: the inner stream's
        return getattr(self._stream, name)

    def __setattr__(self, name, value):
        if name in ("compute_digests", "bytes_sent"):
            object.__setattr__(self, name, value)
        else:  # recycle: the inner stream's buffers (the quantised tensors are new each bucket)
            setattr(self._stream, name, value)

    def __iter__(self):
        from moe.bridge.digest import tensor_digests

        for bucket in self._stream:
            out = quantize_named(bucket, self._selected, self._scale)
            bucket = None
            if out and self.compute_digests:
                names, tensors = zip(*out)
                self.digests.update(zip(names, tensor_digests(list(tensors), self.digest_algorithm)))
            object.__setattr__(self, "bytes_sent", self.bytes_sent + sum(t.numel() * t.element_size() for _, t in out))
            yield out


def served_bytes(hf) -> tuple[int, int]:
    """(bytes of the model as FP8 servers hold it -- the selected weights' codes and scales, the rest in bf16 --, the
    same in bf16): the export's tensors (moe/bridge/hf_checkpoint.expected_hf_shapes), for `rlpo-mega plan`."""
    from moe.bridge.hf_checkpoint import expected_hf_shapes

    selected = Fp8Selection(hf)
    fp8 = bf16 = 0
    for name, shape in expected_hf_shapes(hf).items():
        numel = math.prod(shape)
        bf16 += 2 * numel
        fp8 += fp8_nbytes(shape) if selected(name) else 2 * numel
    return fp8, bf16


def fp8_nbytes(shape) -> int:
    """Bytes of one quantised weight of `shape` [N, K]: the codes and the fp32 scales."""
    n, k = shape
    return n * k + 4 * math.ceil(n / BLOCK) * math.ceil(k / BLOCK)


__all__ = ["BLOCK", "FP8_DTYPE", "FP8_MAX", "Fp8Selection", "QuantizedStream", "ScaleFormat", "ceil_to_ue8m0",
           "SCALE_SUFFIX", "dequantize_block", "fp8_nbytes", "quantize_block", "quantize_named", "scale_name", "served_bytes",
           "server_alignment_problem", "sglang_quantization_config"]
