"""Every file of a save hashed as it is written: the checksums of the meta file cost no second read.

A save writes, per rank:
- megatron-core's shards (`__<rank>_<i>.distcp`): torch.distributed.checkpoint's write items, written by writer
  processes megatron forks, one per file (dist_checkpointing/strategies/filesystem_async.py,
  write_preloaded_data). Each item goes through the writer's stream transforms (torch's _StorageWriterTransforms,
  torch/distributed/checkpoint/filesystem.py _write_item): HashingTransforms puts a hash between the items and the
  file, so the digest is of the bytes on their way to the file, in file order. The writer process publishes
  [bytes hashed, digest so far] after every write into memory it shares with the saving process (an anonymous
  shared mapping, inherited by the fork), which reads the last one when the save is done;
- on rank 0, torch's `.metadata` (FileSystemWriter.finish, through the writer's FileSystem: HashingFileSystem);
- rlpo_mega's own files (trainer state, HF files, a rank's state), written from bytes in memory: their hash.

Two small files are written by megatron-core from a path with no stream to hook (rank 0, bytes to kilobytes:
the non-tensor state and the format): READ_BACK, read once right after their write (from the page cache).
A file whose bytes hashed are not its size on disk (a write that went around the hooks: another megatron or torch
version) is read back and hashed, with a warning naming it -- the meta file never records a digest of bytes it
did not see.
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
from contextlib import contextmanager

import xxhash
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageWriterTransforms

from rlpo_mega.checkpoint.files import file_digest

log = logging.getLogger("rlpo_mega")

# megatron-core's serialization.save on rank 0: torch.save(state, path) in TorchCommonSaveStrategy.save_common
# (strategies/common.py:48) and json.dump in save_config (dist_checkpointing/core.py:92-93)
READ_BACK = ("common.pt", "metadata.json")
METADATA = ".metadata"  # torch.distributed.checkpoint's global metadata, written by the coordinator (rank 0)

_CELL = struct.Struct("<QQ")  # bytes hashed, xxh3-64 so far


class RunningDigest:
    """xxh3-64 and size of the bytes written to one file so far."""

    def __init__(self):
        self.hash = xxhash.xxh3_64()
        self.size = 0

    def update(self, view: memoryview):
        self.hash.update(view)
        self.size += len(view)


class HashedStream:
    """A binary stream open for writing that passes every byte written through `digest`, in order (then `after`).
    Only write goes through: nothing else writes (a write that went around it shows as a size mismatch)."""

    def __init__(self, raw, digest: RunningDigest, after=None):
        self.raw, self.digest, self.after = raw, digest, after

    def write(self, b) -> int:
        n = self.raw.write(b)
        view = memoryview(b)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = len(view) if n is None else n  # a raw stream may write part of it: the caller writes the rest
        self.digest.update(view[:n])
        if self.after is not None:
            self.after()
        return n

    def writable(self) -> bool:
        return True

    def flush(self):
        self.raw.flush()

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:  # FileSystemWriter.finish fsyncs `.metadata` through it (else a global os.sync)
        return self.raw.fileno()


class SharedDigests:
    """[bytes hashed, xxh3-64] of files written by processes forked after it was made: each writes its cell after
    every write, the maker reads them once the writers are done."""

    def __init__(self, paths: list[str]):
        self.slots = {os.fspath(p): i for i, p in enumerate(paths)}
        self.cells = mmap.mmap(-1, _CELL.size * max(1, len(paths)))  # MAP_SHARED: the fork shares it
        self._running = {}  # in a writer process: its file's running digest

    def stream(self, raw):
        """`raw` (a file just opened by a writer process) with a hash in front, or as it is for a file not planned."""
        slot = self.slots.get(os.fspath(getattr(raw, "name", "")))
        if slot is None:
            return raw
        digest = self._running.setdefault(slot, RunningDigest())
        offset = _CELL.size * slot
        return HashedStream(raw, digest, lambda: _CELL.pack_into(self.cells, offset, digest.size,
                                                                 digest.hash.intdigest()))

    def get(self, path: str) -> tuple[int, str] | None:
        slot = self.slots.get(os.fspath(path))
        if slot is None:
            return None
        size, value = _CELL.unpack_from(self.cells, _CELL.size * slot)
        if size == 0:
            return None  # nothing came through the hook (an empty file is not written by megatron)
        return size, f"{value:016x}"  # xxh3_64().hexdigest() of the same bytes


class HashingTransforms(_StorageWriterTransforms):
    """The writer's stream transforms with a hash between them and the file: the bytes hashed are the file's."""

    def __init__(self, extensions, shared: SharedDigests):
        super().__init__(extensions)
        self.shared = shared

    def transform_save_stream(self, write_item, raw_stream):
        return super().transform_save_stream(write_item, self.shared.stream(raw_stream))


class HashingFileSystem(FileSystem):
    """torch's FileSystem whose streams opened for writing hash what goes through them (`.metadata`, in the saving
    process); a rename carries the digest to the new name."""

    def __init__(self):
        super().__init__()
        self.written: dict[str, RunningDigest] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            digest = self.written[os.fspath(path)] = RunningDigest()
            yield HashedStream(stream, digest)

    def rename(self, path, new_path):
        super().rename(path, new_path)
        if os.fspath(path) in self.written:
            self.written[os.fspath(new_path)] = self.written.pop(os.fspath(path))


class HashingSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's default save strategy (torch_dist, version 1: the same files and metadata.json), its writer
    given the hashing transforms and file system once it has planned its files. One per save: it holds the save's
    digests (written())."""

    def __init__(self):
        super().__init__("torch_dist", 1)
        self.shared: SharedDigests | None = None
        self.fs: HashingFileSystem | None = None

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
        # called by async_save (strategies/torch.py:735) with the writer it made, after prepare_write_data planned
        # this rank's files and before the writing function and its transforms are taken from the writer
        self.shared = SharedDigests([path for path, _, _ in writer.write_buckets or []])
        writer.transforms = HashingTransforms(writer.transforms.extensions, self.shared)
        writer.fs = self.fs = HashingFileSystem()
        return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)


def written(strategy: HashingSaveStrategy, root: str, rank: int) -> dict[str, list]:
    """{relative name: [size, xxh3-64]} of what this rank's megatron save wrote under root: its shards, on rank 0
    also `.metadata` and READ_BACK (read). Each size is checked against the file system's (a stat, no read)."""
    got: dict[str, tuple[int, str] | None] = {}
    shared = strategy.shared
    for path in (shared.slots if shared is not None else ()):
        got[os.path.relpath(path, root)] = shared.get(path)
    if strategy.fs is not None:
        for path, digest in strategy.fs.written.items():
            if os.path.basename(path) == METADATA:
                got[os.path.relpath(path, root)] = (digest.size, digest.hash.hexdigest())
    if rank == 0:
        for name in READ_BACK:
            if os.path.isfile(os.path.join(root, name)):
                got[name] = file_digest(os.path.join(root, name))
    return {name: checked(root, name, value) for name, value in got.items()}


def checked(root: str, name: str, value: tuple[int, str] | None) -> list:
    """[size, digest] of a file hashed while written, or -- no digest, or not every byte of it hashed -- read back
    and hashed, with a warning (a write around the hooks)."""
    path = os.path.join(root, name)
    on_disk = os.path.getsize(path)
    if value is not None and value[0] == on_disk:
        return [value[0], value[1]]
    log.warning("checkpoint file %s was not hashed as it was written (%s of its %d bytes): read back for its "
                "checksum", path, "none" if value is None else value[0], on_disk)
    return list(file_digest(path))
