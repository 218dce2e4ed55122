"""Per-tensor digests: cheap, position-sensitive checksums over a tensor's bytes.

The bytes, viewed as 32-bit words laid out in rows of `_COLS` words, are reduced to every row's sum and
every column's sum mod 2**32 (exact integer arithmetic: the same result on any device and in any
summation order); those sums, the leftover bytes, the dtype and the shape are then hashed. Any changed
word changes its row sum; two words swapped within a row change two column sums, across rows two row
sums; a truncated or reshaped tensor changes the length or the shape. Only a change that leaves every
row and column sum intact (at least four words in a rectangle) goes unseen.

The sums are computed where the tensor lives (only they are moved to the CPU), and on the CPU in blocks
of `_ROWS` rows, so the column sums find each block in cache: one read of the tensor, at about memory
bandwidth, and no temporary larger than the sums.
"""
from __future__ import annotations

import hashlib

import torch

_COLS = 1024  # words per row
_ROWS = 256  # rows per CPU block (1 MiB)


class DigestMismatchError(RuntimeError):
    pass


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 4:  # a slice starting mid-word cannot be viewed as words
        raw = raw.clone()
    n = raw.numel()
    rows = n // (4 * _COLS)
    h = hashlib.blake2b(n.to_bytes(8, "little"), digest_size=16)
    if rows:
        words = raw[: rows * 4 * _COLS].view(torch.int32).view(rows, _COLS)
        if rows <= _ROWS or t.device.type != "cpu":
            row_sums, col_sums = words.sum(1, dtype=torch.int32), words.sum(0, dtype=torch.int32)
        else:
            row_sums = torch.empty(rows, dtype=torch.int32)
            col_sums = torch.zeros(_COLS, dtype=torch.int32)
            for start in range(0, rows, _ROWS):
                block = words[start:start + _ROWS]
                torch.sum(block, 1, dtype=torch.int32, out=row_sums[start:start + _ROWS])
                col_sums += block.sum(0, dtype=torch.int32)
        h.update(row_sums.cpu().numpy())
        h.update(col_sums.cpu().numpy())
    if rows * 4 * _COLS < n:
        h.update(raw[rows * 4 * _COLS:].cpu().numpy())
    return f"{t.dtype}:{tuple(t.shape)}:{h.hexdigest()}"


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
