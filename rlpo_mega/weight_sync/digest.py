"""Per-tensor digests: cheap, order-sensitive checksums over a tensor's bytes.

Two sums over the bytes viewed as int32 words, one plain and one position-weighted (Fletcher-style),
computed blockwise in int64 so any changed, swapped or truncated word changes the digest. It runs at
memory bandwidth with torch ops, unlike a byte-at-a-time CRC.
"""
from __future__ import annotations

import torch

_BLOCK = 1 << 22  # words per block: bounds the int64 temporaries


class DigestMismatchError(RuntimeError):
    pass


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    raw = t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    n = raw.numel()
    pad = (-n) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int32)
    s1 = torch.zeros((), dtype=torch.int64)
    s2 = torch.zeros((), dtype=torch.int64)
    for start in range(0, words.numel(), _BLOCK):
        block = words[start:start + _BLOCK].to(torch.int64)
        s1 += block.sum()
        s2 += (block * torch.arange(start + 1, start + 1 + block.numel(), dtype=torch.int64)).sum()
    return f"{t.dtype}:{tuple(t.shape)}:{int(s1) & 0xFFFFFFFFFFFF:012x}{int(s2) & 0xFFFFFFFFFFFFFFFF:016x}"


def verify(sent: dict[str, str], received: dict[str, str], where: str = "engine"):
    """Stop the run (raise) if what the engine holds is not exactly what was sent."""
    missing = sorted(set(sent) - set(received))
    if missing:
        raise DigestMismatchError(f"weight sync: {len(missing)} tensors sent but not loaded by the {where}, "
                                  f"e.g. {missing[0]!r}")
    bad = [n for n in sent if sent[n] != received[n]]
    if bad:
        raise DigestMismatchError(
            f"weight sync: digest mismatch for {len(bad)} tensors on the {where}, e.g. {bad[0]!r} "
            f"(sent {sent[bad[0]]}, loaded {received[bad[0]]}); refusing to roll out with corrupted weights")
