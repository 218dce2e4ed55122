"""Runs in SGLang's venv (python fp8_reference.py out.pt): our block-FP8 quantiser (moe/bridge/fp8.py) and SGLang
0.5.23's own functions on the same tensors, for tests/test_fp8.py to compare bit for bit.

SGLang's: srt/layers/quantization/fp8_utils.per_block_cast_to_fp8 (UE8M0 scales; fp8_utils.py:2393-2417),
benchmark/deepseek_utils.per_block_cast_to_fp8 (fp32 scales; deepseek_utils.py:19-31) and
fp8_utils.block_quant_dequant (the dequantisation SGLang applies, fp8_utils.py:2044-2066)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from sglang.benchmark.deepseek_utils import per_block_cast_to_fp8 as sglang_fp32  # noqa: E402
from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant  # noqa: E402
from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8 as sglang_ue8m0  # noqa: E402

from moe.bridge.fp8 import dequantize_block, quantize_block  # noqa: E402


def cases():
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ((256, 384), (300, 200), (128, 128), (1, 5), (129, 257)):
            out[f"{dtype}:{shape}"] = (torch.randn(shape, generator=g) * 0.05).to(dtype)
        zeros = (torch.randn(384, 256, generator=g) * 0.02).to(dtype)
        zeros[128:256, :128] = 0  # an all-zero tile
        zeros[:128, 128:] *= 1e4  # a tile far above e4m3's range before scaling
        out[f"{dtype}:zero_and_large"] = zeros
        tiny = torch.full((130, 140), 1e-7).to(dtype)  # every value below the amax floor
        out[f"{dtype}:below_floor"] = tiny
    return out


def main():
    results = {}
    for name, x in cases().items():
        for fmt, theirs in (("fp32", sglang_fp32), ("ue8m0", sglang_ue8m0)):
            q, s = quantize_block(x, fmt)
            tq, ts = theirs(x)
            results[f"{name}:{fmt}"] = {
                "q": q.view(torch.uint8), "s": s, "tq": tq.view(torch.uint8), "ts": ts,
                "dq": dequantize_block(q, s, x.dtype), "tdq": block_quant_dequant(tq, ts, [128, 128], x.dtype)}
    torch.save(results, sys.argv[1])


if __name__ == "__main__":
    main()
