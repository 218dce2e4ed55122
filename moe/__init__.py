"""MoE models under megatron-core (below rlpo_mega, importing nothing from it).

Without CUDA, megatron-core's fusions run eagerly: its `jit_fuser` is `torch.compile`
(megatron/core/jit.py:21, megatron-core 0.16.1), so importing megatron builds inductor's backend for every
decorated fusion (3.6 s of CPU per process, measured: 8.9 s -> 5.8 s for `import megatron.core`), and the one
fusion the CPU path calls, the routers' expert-bias count (transformer/moe/router.py:531), is compiled to C++ by
the machine's compiler at its first call in every process, a compiler a laptop may not have. Eager is the same
arithmetic (an integer count added in place). This package is imported before megatron-core by every module of ours
that imports megatron-core (the rlpo_mega packages that import it directly import `moe` in their __init__; checked
by tests/test_layering.py), so this is set before the first `@jit_fuser` runs. On a GPU nothing changes; a
TORCHDYNAMO_DISABLE already set wins.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
