"""A megatron-core 0.16.1 bug that is not about CPUs: applied whenever Transformer Engine is absent.

moe_utils.py imports `te_general_gemm` only inside its `try: import transformer_engine` block, then
tests `te_general_gemm is not None` (moe_utils.py:1192, 1225): without TE that is a NameError on
any device. Defining the name as None selects megatron's own torch.mm path, as the code intends.
"""
from __future__ import annotations

from .cpu_megatron import Patch


def _define_te_general_gemm():
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


FIXES: tuple[Patch, ...] = (
    Patch(
        "te_general_gemm_undefined",
        ("transformer/moe/moe_utils.py:1192,1225",),
        "te_general_gemm is undefined when Transformer Engine is not installed (NameError)",
        _define_te_general_gemm,
    ),
)
