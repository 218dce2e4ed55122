"""Test-only: read back what an offline W&B run recorded (its `run-<id>.wandb` transaction log).

Tests use this to check that metrics really reached W&B, not just metrics.jsonl. wandb >= 0.20 has no
Python reader any more (the old `wandb.sdk.internal.datastore` was removed when wandb-core, written in
Go, took over writing the log). Two backends:

- "python" (default): decodes the log here. The format is stable since the first datastore: a 7-byte
  header (b":W&B", uint16 LE 0xBEE1, uint8 version 0), then LevelDB-log framing: 32 KiB blocks, each
  record chunk = crc32 (IEEE, over the type byte then the data) uint32 LE, length uint16 LE, type uint8
  (1 full, 2 first, 3 middle, 4 last); fewer than 7 bytes left in a block are zero padding. Every record
  is a serialized `wandb.proto.wandb_internal_pb2.Record`, parsed with wandb's own protobuf classes.
- "leet": `wandb leet inspect --json PATH` (wandb >= 0.25; the CLI W&B documents for browsing a log),
  one JSON record per line. Slower (spawns wandb-core) but independent of the framing code above.
"""
from __future__ import annotations

import glob
import json
import math
import os
import struct
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

_MAGIC = b":W&B" + struct.pack("<H", 0xBEE1)
_BLOCK = 32768
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    """Metrics and config of one W&B run log. W&B's own keys (_step, _runtime, _timestamp, _wandb) are dropped."""

    path: str  # the .wandb file read
    history: dict[str, list] = field(default_factory=dict)  # metric -> values in the order logged
    steps: dict[str, list[int]] = field(default_factory=dict)  # metric -> the step of each value
    config: dict[str, Any] = field(default_factory=dict)  # after every config update / removal
    summary: dict[str, Any] = field(default_factory=dict)
    project: Optional[str] = None
    name: Optional[str] = None  # display name
    run_id: Optional[str] = None


def find_wandb_file(path: str) -> str:
    """The .wandb file for `path`: the file itself, a W&B run directory (offline-run-*), or a directory
    holding `wandb/` (our run directory, W&B's `dir`). Several runs: the newest (a restarted job)."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} does not exist")
    patterns = ["run-*.wandb", "*/run-*.wandb", "wandb/*/run-*.wandb"]
    for pattern in patterns:
        found = [f for f in glob.glob(os.path.join(path, pattern)) if "latest-run" not in f]
        if found:
            return max(found, key=os.path.getmtime)
    raise FileNotFoundError(f"no W&B run log (run-*.wandb) in {path!r} (looked for {', '.join(patterns)})")


def _iter_payloads(data: bytes):
    """Record payloads of a LevelDB-framed log; a truncated tail (a run still writing, or killed) ends it."""
    if len(data) < len(_MAGIC) + 1 or data[:len(_MAGIC)] != _MAGIC:
        raise ValueError("not a W&B run log (bad header)")
    if data[len(_MAGIC)] != 0:
        raise ValueError(f"W&B log format version {data[len(_MAGIC)]} is unknown here; try backend='leet'")
    pos, pending = len(_MAGIC) + 1, None
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:
            pos += left  # block trailer padding
        if pos + _CHUNK_HEADER > len(data):
            return
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:  # zero-filled (pre-allocated) space: nothing more was written
            return
        start = pos + _CHUNK_HEADER
        chunk = data[start:start + length]
        if len(chunk) < length:
            return
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"W&B log corrupt: checksum mismatch in the chunk at byte {pos}")
        pos = start + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = bytearray(chunk)
        elif kind in (_MIDDLE, _LAST) and pending is not None:
            pending += chunk
            if kind == _LAST:
                yield bytes(pending)
                pending = None
        else:
            raise ValueError(f"W&B log corrupt: chunk type {kind} at byte {pos - length - _CHUNK_HEADER}")


def _item_key(item) -> str:
    return item.key or ".".join(item.nested_key)  # W&B flattens nested dicts to "a.b"


def _item_value(item):
    which = item.WhichOneof("value") if item.DESCRIPTOR.oneofs_by_name.get("value") else None
    if which == "none":
        return None
    if which == "json":
        return json.loads(item.json)
    if which is not None:
        return getattr(item, which)
    return json.loads(item.value_json)  # Python's json reads W&B's NaN / Infinity


def _apply_config(config: dict, rec):
    for item in rec.update:
        config[_item_key(item)] = json.loads(item.value_json)
    for item in rec.remove:
        config.pop(_item_key(item), None)


def _add_history(run: OfflineRun, step: int, items: dict):
    for key, value in items.items():
        if key.startswith("_"):
            continue
        run.history.setdefault(key, []).append(value)
        run.steps.setdefault(key, []).append(step)


def _read_python(path: str) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    run = OfflineRun(path=path)
    for payload in _iter_payloads(data):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run.project = rec.run.project or None
            run.name = rec.run.display_name or None
            run.run_id = rec.run.run_id or None
            _apply_config(run.config, rec.run.config)
        elif kind == "config":
            _apply_config(run.config, rec.config)
        elif kind == "history":
            items = {_item_key(i): _item_value(i) for i in rec.history.item}
            step = rec.history.step.num if rec.history.HasField("step") else items.get("_step", 0)
            _add_history(run, int(step), items)
        elif kind == "summary":
            for item in rec.summary.update:
                run.summary[_item_key(item)] = json.loads(item.value_json)
    return run


_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _decode_leet(value):
    # protobuf's JSON form spells non-finite numbers as strings
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


def _read_leet(path: str, timeout: float) -> OfflineRun:
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"wandb leet inspect failed (rc {proc.returncode}; needs wandb >= 0.25): "
                           f"{proc.stderr.strip()[-2000:]}")
    run = OfflineRun(path=path)
    for line in proc.stdout.splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        kind = rec.get("type")
        body = rec.get(kind) or {}
        if kind == "run":
            run.project, run.name, run.run_id = body.get("project"), body.get("display_name"), body.get("run_id")
            run.config.update(body.get("config", {}).get("update", {}))
        elif kind == "config":
            run.config.update(body.get("update", {}))
            for key in body.get("remove", {}) or {}:
                run.config.pop(key, None)
        elif kind == "history":
            items = {k: _decode_leet(v) for k, v in body.get("item", {}).items()}
            _add_history(run, int(body.get("step", {}).get("num", items.get("_step", 0))), items)
        elif kind == "summary":
            run.summary.update({k: _decode_leet(v) for k, v in body.get("update", {}).items()})
    return run


def read_wandb_offline_run(path: str, backend: str = "python", timeout: float = 120.0) -> OfflineRun:
    """Metrics (history), config and summary of the W&B run log at `path` (see find_wandb_file)."""
    wandb_file = find_wandb_file(path)
    if backend == "python":
        run = _read_python(wandb_file)
    elif backend == "leet":
        run = _read_leet(wandb_file, timeout)
    else:
        raise ValueError(f"backend {backend!r}: expected 'python' or 'leet'")
    run.config.pop("_wandb", None)
    run.summary = {k: v for k, v in run.summary.items() if not k.startswith("_")}
    return run
