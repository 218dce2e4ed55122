"""Per-tensor digests of a weight sync: what was sent is digested from the sender's memory, what was
loaded from the receiver's, and `verify` compares them name by name.

Two algorithms, one per device kind, named inside every digest string (`<algorithm>:<dtype>:<shape>:<hex>`):

  xxh3  XXH3-128 of the tensor's bytes in memory order (xxhash). A real hash: any change of bytes,
        order, length, dtype or shape changes it. On this CPU it reads ~30 GB/s from memory, faster
        than the ~19 GB/s copy it verifies (tools/bench_weight_sync.py).
  sums  The bytes, viewed as 32-bit words in rows of `_COLS` words, reduced to every row's and every
        column's sum mod 2**32 (exact integer arithmetic: the same result in any order, on any device),
        then hashed with the length, dtype and shape. On an accelerator these are two torch reductions
        and only the sums move to the host; xxh3 would first copy every tensor to the host. It misses
        only a change that leaves every row and column sum intact (four words in a rectangle).

The sender picks the algorithm for its device (`algorithm_for`) and every receiver computes the one it
is given, on whatever device it holds the weights: both algorithms are defined on bytes, not on devices,
so a GPU learner and a CPU read-back agree. A digest of another algorithm is reported as such by `verify`.
"""
from __future__ import annotations

import ctypes
import hashlib

import numpy as np
import torch
import xxhash

ALGORITHMS = ("xxh3", "sums")
_COLS = 1024  # sums: words per row
_BLOCK_ROWS = 256  # sums: rows per CPU block (1 MiB)
_BLOCK_BYTES = 1 << 20  # fused xxh3 copy: per block, hash, copy, hash while it is in cache (1 MiB: fastest here)
_HOST_CHUNK = 64 << 20  # xxh3 of an accelerator tensor: bytes copied to the host at a time
_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool}  # .numpy() works (bfloat16 and float8 need a byte view)


_TO_NUMPY = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
             torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_}


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy array of a tensor's bytes. A CPU tensor (contiguous) is viewed in place without torch's numpy bridge:
    Tensor.numpy() marks the storage non-resizable for good, and a colocated run (rlpo_mega.residency) shrinks the
    learner's and the embedded engine's storages after syncs have digested them. The caller keeps `t` alive while
    it uses the array. An accelerator tensor is copied to the host first."""
    host = t.cpu()  # an accelerator tensor's copy (a host sync, as counted by tests/test_host_syncs.py); else itself
    if host is not t:
        return host.numpy()  # a fresh copy: the array keeps it alive
    if not t.is_contiguous():
        raise ValueError("digest: a strided CPU tensor has no in-place numpy view")
    n = t.numel() * t.element_size()
    if n == 0:
        return np.empty(tuple(t.shape), _TO_NUMPY[t.dtype])
    return np.frombuffer((ctypes.c_char * n).from_address(t.data_ptr()), dtype=_TO_NUMPY[t.dtype]).reshape(
        tuple(t.shape))


class DigestMismatchError(RuntimeError):
    pass


def algorithm_for(device) -> str:
    """The sender's choice for tensors on `device`: the one that is cheap there."""
    return "xxh3" if torch.device(device).type == "cpu" else "sums"


def _check(algorithm: str):
    if algorithm not in ALGORITHMS:
        raise ValueError(f"digest algorithm {algorithm!r} is unknown: choose one of {', '.join(ALGORITHMS)}")


def algorithm_of(digest: str) -> str:
    return digest.split(":", 1)[0]


def _label(algorithm: str, t: torch.Tensor) -> str:
    """What precedes the hash in a digest string."""
    return f"{algorithm}:{t.dtype}:{tuple(t.shape)}:"


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def sha256(t: torch.Tensor) -> str:
    """The plain sha256 hex of a tensor's bytes in memory order: what SGLang 0.5.23 checks a LoRA adapter's
    tensors against as it loads them (managers/tp_worker.py load_lora_adapter_from_tensors, expected_checksums)."""
    return hashlib.sha256(_np(_flat_bytes(t.cpu()))).hexdigest()


# ---- xxh3 -----------------------------------------------------------------------------------------
def _xxh3(raw: torch.Tensor) -> str:
    h = xxhash.xxh3_128()
    if raw.device.type == "cpu":
        h.update(_np(raw))
    else:
        for start in range(0, raw.numel(), _HOST_CHUNK):
            h.update(_np(raw[start:start + _HOST_CHUNK]))
    return h.hexdigest()


# ---- sums -----------------------------------------------------------------------------------------
class _Sums:
    """Row and column sums of a [rows, _COLS] int32 word matrix, filled block by block (CPU)."""

    def __init__(self, raw: torch.Tensor):
        self.raw = raw
        self.n = raw.numel()
        self.rows = self.n // (4 * _COLS)
        self.row = np.empty(self.rows, np.int32)
        self.col = np.zeros(_COLS, np.int32)

    def words(self) -> np.ndarray:
        return _np(self.raw[: self.rows * 4 * _COLS].view(torch.int32).view(self.rows, _COLS))

    def add(self, start: int, block: np.ndarray):
        # numpy, not torch: torch's column sum over a strided dimension is several times slower on the CPU
        np.add.reduce(block, axis=1, dtype=np.int32, out=self.row[start:start + len(block)])
        self.col += np.add.reduce(block, axis=0, dtype=np.int32)  # wraps mod 2**32, like torch's int32 sum

    def hexdigest(self) -> str:
        return _sums_hex(self.n, self.row if self.rows else None, self.col if self.rows else None,
                         self.raw[self.rows * 4 * _COLS:])


def _sums_hex(n, row, col, tail) -> str:
    h = hashlib.blake2b(n.to_bytes(8, "little"), digest_size=16)
    if row is not None:
        h.update(np.ascontiguousarray(row, dtype=np.int32))
        h.update(np.ascontiguousarray(col, dtype=np.int32))
    if tail.numel():
        h.update(_np(tail))
    return h.hexdigest()


def _sums(raw: torch.Tensor) -> str:
    if raw.storage_offset() % 4:  # a slice starting mid-word cannot be viewed as words
        raw = raw.clone()
    if raw.device.type != "cpu":
        n = raw.numel()
        rows = n // (4 * _COLS)
        row = col = None
        if rows:
            words = raw[: rows * 4 * _COLS].view(torch.int32).view(rows, _COLS)
            row = words.sum(1, dtype=torch.int32).cpu().numpy()
            col = words.sum(0, dtype=torch.int32).cpu().numpy()
        return _sums_hex(n, row, col, raw[rows * 4 * _COLS:])
    sums = _Sums(raw)
    if sums.rows:
        words = sums.words()
        for start in range(0, sums.rows, _BLOCK_ROWS):
            sums.add(start, words[start:start + _BLOCK_ROWS])
    return sums.hexdigest()


def _sums_many(raws: list) -> list[str]:
    """_sums of accelerator tensors with one copy to the host for all of them (a copy per tensor stops the
    host twice per tensor, tens of thousands of times per sync at scale): every tensor's row and column
    sums and its tail bytes are laid end to end in one uint8 tensor on the device."""
    parts, layout = [], []
    for raw in raws:
        if raw.storage_offset() % 4:
            raw = raw.clone()
        n = raw.numel()
        rows = n // (4 * _COLS)
        if rows:
            words = raw[: rows * 4 * _COLS].view(torch.int32).view(rows, _COLS)
            parts += [words.sum(1, dtype=torch.int32).view(torch.uint8), words.sum(0, dtype=torch.int32).view(torch.uint8)]
        tail = raw[rows * 4 * _COLS:]
        parts.append(tail)
        layout.append((n, rows, tail.numel()))
    host = torch.cat(parts).cpu() if parts else torch.empty(0, dtype=torch.uint8)
    out, at = [], 0
    for n, rows, tail in layout:
        row = col = None
        if rows:
            row = host[at:at + 4 * rows].view(torch.int32).numpy()
            col = host[at + 4 * rows:at + 4 * (rows + _COLS)].view(torch.int32).numpy()
            at += 4 * (rows + _COLS)
        out.append(_sums_hex(n, row, col, host[at:at + tail]))
        at += tail
    return out


# ---- public ---------------------------------------------------------------------------------------
def tensor_digest(t: torch.Tensor, algorithm: str) -> str:
    _check(algorithm)
    raw = _flat_bytes(t)
    return _label(algorithm, t) + (_xxh3(raw) if algorithm == "xxh3" else _sums(raw))


def tensor_digests(tensors: list, algorithm: str) -> list[str]:
    """tensor_digest of each tensor; the "sums" (an accelerator's algorithm) of all of them reach the host in
    one copy (a bucket of a weight sync: one host sync per bucket, not two per tensor)."""
    _check(algorithm)
    if algorithm != "sums" or not tensors:
        return [tensor_digest(t, algorithm) for t in tensors]
    raws = [_flat_bytes(t) for t in tensors]
    return [_label(algorithm, t) + h for t, h in zip(tensors, _sums_many(raws))]


def _copy_block(dst: torch.Tensor, src: torch.Tensor):
    """The copy step of copy_with_digests (a seam tests use to corrupt bytes in transit). torch's copy,
    not np.copyto: glibc's memmove (which numpy calls) ran 7x slower on this machine's AMD CPUs."""
    dst.copy_(src)


def copy_with_digests(dst: torch.Tensor, src: torch.Tensor, algorithm: str) -> tuple[str, str]:
    """dst.copy_(src), returning (digest of src, digest of dst after the copy), each computed from its
    own memory. On the CPU, for same-dtype contiguous tensors, one pass in cache-sized blocks: each
    block is digested, copied and its copy digested while both are in cache."""
    _check(algorithm)
    fusable = (src.is_cpu and dst.is_cpu and dst.dtype == src.dtype and dst.shape == src.shape
               and dst.is_contiguous() and src.is_contiguous())
    if fusable and algorithm == "xxh3":
        return _copy_with_xxh3(dst, src)
    word_aligned = all(t.storage_offset() * t.element_size() % 4 == 0 for t in (dst, src))
    if fusable and word_aligned:  # the sums view the bytes as 32-bit words
        return _copy_with_sums(dst, src)
    sent = tensor_digest(src, algorithm)
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))
    return sent, tensor_digest(dst, algorithm)


def _copy_with_sums(dst: torch.Tensor, src: torch.Tensor) -> tuple[str, str]:
    s_raw, d_raw = src.detach().reshape(-1).view(torch.uint8), dst.detach().reshape(-1).view(torch.uint8)
    s_sums, d_sums = _Sums(s_raw), _Sums(d_raw)
    if s_sums.rows:
        s_words, d_words = s_sums.words(), d_sums.words()
        s_torch, d_torch = torch.from_numpy(s_words), torch.from_numpy(d_words)
        for start in range(0, s_sums.rows, _BLOCK_ROWS):
            stop = start + _BLOCK_ROWS
            s_sums.add(start, s_words[start:stop])
            _copy_block(d_torch[start:stop], s_torch[start:stop])
            d_sums.add(start, d_words[start:stop])
    tail = s_sums.rows * 4 * _COLS
    if tail < s_raw.numel():
        with torch.no_grad():
            d_raw[tail:].copy_(s_raw[tail:])
    label = _label("sums", src)
    return label + s_sums.hexdigest(), label + d_sums.hexdigest()


def _copy_with_xxh3(dst: torch.Tensor, src: torch.Tensor) -> tuple[str, str]:
    """The fused xxh3 path (contiguous, same dtype and shape, CPU): per block, hash the source, copy it
    and hash the copy while it is in cache. Kept lean: a sync calls it once per HF tensor, and at a few
    hundred tensors per sync the per-call Python cost shows in the throughput."""
    label = _label("xxh3", src)
    nbytes = src.numel() * src.element_size()
    if nbytes <= _BLOCK_BYTES and src.dtype in _NUMPY_DTYPES:
        # one block: the one-shot hash (same value as streaming) straight on the arrays' buffers
        src, dst = src.detach(), dst.detach()
        sent = xxhash.xxh3_128_hexdigest(_np(src))
        _copy_block(dst, src)
        return label + sent, label + xxhash.xxh3_128_hexdigest(_np(dst))
    s_t, d_t = src.detach().view(-1).view(torch.uint8), dst.detach().view(-1).view(torch.uint8)
    s_np, d_np = _np(s_t), _np(d_t)
    hs, hd = xxhash.xxh3_128(), xxhash.xxh3_128()
    for start in range(0, s_np.size, _BLOCK_BYTES):
        stop = start + _BLOCK_BYTES
        hs.update(s_np[start:stop])
        _copy_block(d_t[start:stop], s_t[start:stop])
        hd.update(d_np[start:stop])
    return label + hs.hexdigest(), label + hd.hexdigest()


def verify(sent: dict[str, str], received: dict[str, str], where: str = "engine"):
    """Stop the run (raise) if what the engine holds is not exactly what was sent."""
    missing = sorted(set(sent) - set(received))
    if missing:
        raise DigestMismatchError(f"weight sync: {len(missing)} tensors sent but not loaded by the {where}, "
                                  f"e.g. {missing[0]!r}")
    bad = [n for n in sent if sent[n] != received[n]]
    if not bad:
        return
    first = bad[0]
    a, b = algorithm_of(sent[first]), algorithm_of(received[first])
    if a != b:
        raise DigestMismatchError(
            f"weight sync: the {where} digested {first!r} with {b!r}, the sender with {a!r}; the receiver must "
            "compute the stream's digest_algorithm (nothing was compared)")
    raise DigestMismatchError(
        f"weight sync: digest mismatch for {len(bad)} tensors on the {where}, e.g. {first!r} "
        f"(sent {sent[first]}, loaded {received[first]}); refusing to roll out with corrupted weights")
