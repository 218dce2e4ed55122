"""Per-tensor digests: cheap, position-sensitive checksums over a tensor's bytes.

Definition (the same on every device): the bytes, viewed as 32-bit words laid out in rows of `_COLS`
words, are reduced to every row's sum and every column's sum mod 2**32 (exact integer arithmetic: the
same result in any summation order); those sums, the leftover bytes, the dtype and the shape are then
hashed. Any changed word changes its row sum; two words swapped within a row change two column sums,
across rows two row sums; a truncated or reshaped tensor changes the length or the shape. Only a change
that leaves every row and column sum intact (at least four words in a rectangle) goes unseen.

Speed: on an accelerator the sums are two torch reductions (only they move to the CPU). On the CPU both
sums of a block of `_BLOCK_ROWS` rows are taken while the block is in cache (numpy's reductions: torch's
column sum over a strided dimension is several times slower), so a digest costs one read of the tensor.
`copy_with_digests` goes further for the in-process sync: per block it digests the source, copies it and
digests the copy while both are in cache, so a verified copy moves the bytes of one plain copy.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

_COLS = 1024  # words per row
_BLOCK_ROWS = 256  # rows per CPU block (1 MiB)


class DigestMismatchError(RuntimeError):
    pass


def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 4:  # a slice starting mid-word cannot be viewed as words
        raw = raw.clone()
    return raw


class _Sums:
    """Row and column sums of a [rows, _COLS] int32 word matrix, filled block by block."""

    def __init__(self, t: torch.Tensor, raw: torch.Tensor):
        self.t, self.raw = t, raw
        self.n = raw.numel()
        self.rows = self.n // (4 * _COLS)
        self.row = np.empty(self.rows, np.int32)
        self.col = np.zeros(_COLS, np.int32)

    def words(self) -> np.ndarray:
        return self.raw[: self.rows * 4 * _COLS].view(torch.int32).view(self.rows, _COLS).numpy()

    def add(self, start: int, block: np.ndarray):
        np.add.reduce(block, axis=1, dtype=np.int32, out=self.row[start:start + len(block)])
        self.col += np.add.reduce(block, axis=0, dtype=np.int32)  # wraps mod 2**32, like torch's int32 sum

    def hexdigest(self) -> str:
        return _finish(self.t, self.n, self.row if self.rows else None, self.col if self.rows else None,
                       self.raw[self.rows * 4 * _COLS:])


def _finish(t, n, row, col, tail) -> str:
    h = hashlib.blake2b(n.to_bytes(8, "little"), digest_size=16)
    if row is not None:
        h.update(np.ascontiguousarray(row, dtype=np.int32))
        h.update(np.ascontiguousarray(col, dtype=np.int32))
    if tail.numel():
        h.update(tail.cpu().numpy())
    return f"{t.dtype}:{tuple(t.shape)}:{h.hexdigest()}"


def tensor_digest(t: torch.Tensor) -> str:
    raw = _raw(t)
    if raw.device.type != "cpu":
        n = raw.numel()
        rows = n // (4 * _COLS)
        row = col = None
        if rows:
            words = raw[: rows * 4 * _COLS].view(torch.int32).view(rows, _COLS)
            row = words.sum(1, dtype=torch.int32).cpu().numpy()
            col = words.sum(0, dtype=torch.int32).cpu().numpy()
        return _finish(t, n, row, col, raw[rows * 4 * _COLS:])
    sums = _Sums(t, raw)
    if sums.rows:
        words = sums.words()
        for start in range(0, sums.rows, _BLOCK_ROWS):
            sums.add(start, words[start:start + _BLOCK_ROWS])
    return sums.hexdigest()


def _copy_block(dst: np.ndarray, src: np.ndarray):
    """The copy step of copy_with_digests (a seam tests use to corrupt bytes in transit). torch's copy,
    not np.copyto: glibc's memmove (which numpy calls) ran 7x slower on this machine's AMD CPUs."""
    torch.from_numpy(dst).copy_(torch.from_numpy(src))


def copy_with_digests(dst: torch.Tensor, src: torch.Tensor) -> tuple[str, str]:
    """dst.copy_(src), returning (digest of src, digest of dst after the copy), each computed from its
    own memory. On the CPU, for same-dtype contiguous tensors, one pass in cache-sized blocks."""
    fused = (dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype and dst.shape == src.shape
             and dst.is_contiguous() and src.is_contiguous()
             and (dst.storage_offset() * dst.element_size()) % 4 == 0
             and (src.storage_offset() * src.element_size()) % 4 == 0)
    if not fused:
        sent = tensor_digest(src)
        dst.copy_(src.to(dst.dtype))
        return sent, tensor_digest(dst)
    s_raw, d_raw = src.detach().reshape(-1).view(torch.uint8), dst.detach().reshape(-1).view(torch.uint8)
    s_sums, d_sums = _Sums(src, s_raw), _Sums(dst, d_raw)
    if s_sums.rows:
        s_words, d_words = s_sums.words(), d_sums.words()
        for start in range(0, s_sums.rows, _BLOCK_ROWS):
            s_block, d_block = s_words[start:start + _BLOCK_ROWS], d_words[start:start + _BLOCK_ROWS]
            s_sums.add(start, s_block)
            _copy_block(d_block, s_block)
            d_sums.add(start, d_block)
    tail = s_sums.rows * 4 * _COLS
    if tail < s_raw.numel():
        with torch.no_grad():
            d_raw[tail:].copy_(s_raw[tail:])
    return s_sums.hexdigest(), d_sums.hexdigest()


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
