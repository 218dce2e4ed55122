"""Colocated SGLang servers (rollout.colocate): each server TP rank's weights made on its own GPU, by the learner rank
on that GPU, in SGLang's `flattened_bucket` format, and relayed to the server's driver, which posts them.

SGLang's own pattern (sglang 0.5.23, under site-packages/sglang/):
- each GPU's producer serializes its own copy (srt/weight_sync/utils.py:16-105, `update_weights`), after
  `monkey_patch_torch_reductions()`, so a CUDA tensor names its GPU by UUID rather than by an index that depends
  on CUDA_VISIBLE_DEVICES (srt/utils/patch_torch.py:41-99);
- the copies are gathered into one list per server, one entry per TP rank (a flattened_bucket caller passes the
  per-rank payloads itself: srt/entrypoints/engine.py:1743-1759); each TP rank deserializes only entry
  [tp_rank] (srt/managers/tp_worker.py:194-201), so each opens only the handle of memory on its own GPU, and each
  handle counts its own reference (one pickle per entry);
- `load_format="flattened_bucket"`: one tensor per bucket, {"flattened_tensor": uint8 tensor, "metadata": [...]},
  rebuilt as views of that tensor (srt/model_executor/model_runner_components/weight_updater.py:354-358,383-413;
  srt/weight_sync/tensor_bucket.py:118-135): one handle per bucket, not one per tensor.

The learner's environment has no sglang, so this module has its own small equivalents. The metadata is
types.SimpleNamespace, which SGLang's SafeUnpickler admits (srt/utils/common.py:3176), and it carries the fields
that the loader reads (weight_updater.py:394-401). The UUID reduction belongs to the payload's pickler alone: no
patch applies to the whole process. The server calls `monkey_patch_torch_reductions()` before it deserializes
(tp_worker.py:198), so its `rebuild_cuda_tensor` maps the UUID back to its own device index.

Who produces what (`placements`): torchrun puts local rank r on GPU r, and launched colocated servers go on the
learner's GPUs from GPU 0 (rollout/sglang_launch.server_gpus with no learner GPUs before them). So TP rank k of a
node's server i is on GPU i*tp_size + k, and that node's learner rank with that local rank produces its entry.
Where a node has fewer learner ranks than server GPUs, the node's first rank produces the entries that have no rank
of their own. On a GPU, the server rank then opens memory of another GPU: that works, at the cost this layout
avoids everywhere else (a CUDA context on the other GPU, its links). Each server's driver (SGLangEngine.ranks,
share_of) gathers its servers' entries.

Per bucket (`PayloadRelay`): the export stream broadcasts it to every rank (training/sync.py). Each producer
flattens it into one uint8 tensor on its own device (a GPU, or the host, where pickling moves the tensor into
shared memory by file name: the same path with another device) and pickles that tensor once for each of its entries.
It sends them to the driver over the gloo control group, point to point, and keeps the tensor until the driver
acknowledges. The driver posts each server's list and acknowledges once the servers have answered, so a producer's
memory outlives the servers' loads. A producer that fails to make its payload (out of memory) sends the error. The
driver's load then fails with that error (EngineError: the guard rebuilds and re-syncs), and the exchange still
completes for every bucket (a failed driver drains the stream), so no rank is left waiting.
"""
from __future__ import annotations

import base64
import io
import json
import types
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from rlpo_mega.shares import share_of

FLATTENED = "flattened_bucket"  # SGLang's load_format (weight_updater.py:354)
_ALIGN = 16  # each tensor's byte offset in the bucket: a view as its dtype needs an aligned offset
# rebuild_cuda_tensor's storage_device argument (torch/multiprocessing/reductions.py: reduce_tensor's CUDA branch;
# sglang srt/utils/patch_torch.py:64, _REDUCE_TENSOR_ARG_DEVICE_INDEX = 6)
_DEVICE_ARG = 6
_SIZE, _DATA, _ACK = 71, 72, 73  # tags of the relay's messages on the control group


# ---------------------------------------------------------------- the payload
def flatten(named: Sequence, aliases: Optional[dict] = None) -> dict:
    """A bucket [(name, tensor), ...] as SGLang's flattened_bucket payload (weight_updater.py:383-413): each tensor's
    bytes in one uint8 tensor on their device, at 16-byte aligned offsets (tensor_bucket.py:126-131 views each
    range as its dtype), and one metadata entry per name. aliases {name: source}: when `source` is in the bucket and
    `name` is not, `name` also reads `source`'s bytes (a tied head: named twice, stored once)."""
    named = list(named)
    if not named:
        raise ValueError("an empty bucket has no flattened_bucket payload")
    spans, metadata, offset = {}, [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        spans[name] = (offset, offset + nbytes, t)
        offset += -(-nbytes // _ALIGN) * _ALIGN
    flat = torch.empty(offset, dtype=torch.uint8, device=named[0][1].device)
    for start, end, t in spans.values():
        flat[start:end].view(t.dtype).view(t.shape).copy_(t)
    for name, source in (aliases or {}).items():
        if source in spans and name not in spans:
            spans[name] = spans[source]
    for name, (start, end, t) in spans.items():
        # the fields of sglang's FlattenedTensorMetadata (tensor_bucket.py:7-16); numel counts bytes, as there
        metadata.append(types.SimpleNamespace(name=name, shape=torch.Size(t.shape), dtype=t.dtype, start_idx=start,
                                              end_idx=end, numel=end - start))
    return {"flattened_tensor": flat, "metadata": metadata}


def serialize(obj) -> str:
    """base64(ForkingPickler(obj)), what sglang's MultiprocessingSerializer.deserialize reads (srt/utils/common.py:
    3060-3099). Host tensors travel through shared memory by file name (the default file-descriptor passing cannot
    cross HTTP); CUDA tensors as IPC handles naming their GPU by UUID (_reduce_tensor)."""
    import multiprocessing.reduction

    import torch.multiprocessing as tmp  # registers torch's reductions with ForkingPickler

    tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    pickler = multiprocessing.reduction.ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor  # this pickler's own table: no process-wide patch
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def _reduce_tensor(t: torch.Tensor):
    """torch's reduction, with a CUDA tensor's device index replaced by its GPU's UUID, as sglang's
    _reduce_tensor_modified does (srt/utils/patch_torch.py:72-77,85-86). The rebuild function stays torch's
    `rebuild_cuda_tensor`, which the server has replaced with its UUID-aware one before it deserializes
    (tp_worker.py:198, patch_torch.py:41-52)."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        device = args[_DEVICE_ARG]
        if not isinstance(device, int):
            raise RuntimeError(f"torch's CUDA tensor reduction changed: argument {_DEVICE_ARG} is {device!r}, not "
                               "the device index (rlpo_mega/weight_sync/sglang_payloads.py)")
        args = (*args[:_DEVICE_ARG], str(torch.cuda.get_device_properties(device).uuid), *args[_DEVICE_ARG + 1:])
    return rebuild, args


def tied_aliases(hf) -> dict:
    """{head name: embedding name} for a model with tied embeddings (flatten's aliases): sglang's Mixtral (0.5.23)
    ignores tie_word_embeddings and keeps its own lm_head, so the head goes too, read from the embedding's bytes."""
    if hf is None or not getattr(hf, "tie_word_embeddings", False):
        return {}
    from moe.families import get_family

    names = get_family(hf.model_type).hf_names(hf)
    return {names["output"]: names["embedding"]}


# ---------------------------------------------------------------- who produces what
@dataclass(frozen=True)
class ServerPlacement:
    index: int  # the server's place in the URL list (node order, rollout/engines.EngineSlot._launch_per_node)
    driver: int  # the learner rank that drives it
    producers: tuple  # per TP rank: the learner rank that makes its entry


def placements(world_size: int, local_world_size: int, num_servers: int, tp_size: int,
               driver_ranks: Sequence[int]) -> list[ServerPlacement]:
    """Every colocated server of the run: the learner rank on the GPU of each of its TP ranks (server i of a node on
    GPUs i*tp_size .. i*tp_size+tp_size-1; the node's first rank where no rank has that GPU) and its driver (driver
    d drives share d of the servers in node order, as SGLangEngine does with the URLs)."""
    local = max(1, min(local_world_size, world_size))
    total = max(1, world_size // local) * num_servers
    owner = {j: r for d, r in enumerate(driver_ranks) for j in share_of(range(total), d, len(driver_ranks))}
    out = []
    for j in range(total):
        node, i = divmod(j, num_servers)
        base = node * local
        gpus = [i * tp_size + k for k in range(tp_size)]
        out.append(ServerPlacement(j, owner[j], tuple(base + g if g < local else base for g in gpus)))
    return out


# ---------------------------------------------------------------- the relay
class RelayedBucket(list):
    """A bucket as the export stream yields it, with the entries gathered for it: payloads {server index: [entry of
    TP rank 0, 1, ...]} of the servers this driver drives; errors: producers that could not make theirs."""

    def __init__(self, named, payloads: dict, errors: list):
        super().__init__(named)
        self.payloads, self.errors = payloads, errors


class _Step:
    def __init__(self, keep, payloads, errors, waits):
        self.keep, self.payloads, self.errors, self.waits = keep, payloads, errors, waits


class PayloadRelay:
    """One sync's exchange of per-GPU payloads, on every rank (collective: every rank of the export runs it for
    every bucket). group: a gloo group over the world (distributed.control_group). aliases: flatten's."""

    def __init__(self, servers: Sequence[ServerPlacement], rank: int, group, aliases: Optional[dict] = None):
        self.servers, self.rank, self.group, self.aliases = list(servers), rank, group, dict(aliases or {})
        self.drives = [s for s in self.servers if s.driver == rank]
        # this rank's entries: (server index, TP rank, its driver)
        self.entries = [(s.index, k, s.driver) for s in self.servers for k, p in enumerate(s.producers) if p == rank]
        self.to_drivers = sorted({d for _, _, d in self.entries if d != rank})
        self.from_producers = sorted({p for s in self.drives for p in s.producers if p != rank})

    @property
    def producer_ranks(self) -> list[int]:
        return sorted({p for s in self.servers for p in s.producers})

    def produce(self, stream) -> None:
        """A rank that drives no server: its entries of every bucket to their drivers (none: it only iterates)."""
        stream.recycle = True  # each bucket is flattened (copied) before the next is asked for
        stream.compute_digests = False  # the drivers digest and verify
        for bucket in stream:
            if bucket:
                self.finish(self._start(bucket))

    def gathering(self, stream):
        """A driver's export stream: each bucket comes as a RelayedBucket; the entries' producers are acknowledged
        when the next bucket is asked for (or the stream is drained after a failure)."""
        return _Gathering(stream, self)

    def _start(self, bucket) -> _Step:
        keep, mine = None, {}
        if self.entries:
            try:
                keep = flatten(bucket, self.aliases)
                for j, k, d in self.entries:  # one pickle per entry: each TP rank opens its own reference
                    mine.setdefault(d, []).append([j, k, serialize(keep)])
            except Exception as e:  # (out of memory on this GPU): the driver's load fails with it, the exchange goes on
                keep, mine = None, self.failed(e)
        return self.exchange(mine, keep)

    def failed(self, e: Exception) -> dict:
        """This rank's entries replaced by its error, for each of their drivers (exchange's `mine`)."""
        return {d: f"rank {self.rank}: {type(e).__name__}: {e}" for _, _, d in self.entries}

    def exchange(self, mine: dict, keep) -> _Step:
        """This rank's entries {driver: [[server index, TP rank, payload], ...] or its error} to their drivers; a
        driver gathers its servers' entries (the returned step's payloads). `keep`: what the payloads refer to, held
        until finish (the servers have loaded). Collective over the relay's ranks, once per bucket."""
        errors = []
        g = self.group
        waits = [dist.irecv(torch.zeros(1, dtype=torch.int64), src=d, group=g, tag=_ACK) for d in self.to_drivers]
        sends = []
        for d in self.to_drivers:
            data = torch.frombuffer(bytearray(json.dumps(mine[d]).encode()), dtype=torch.uint8)
            sends += [dist.isend(torch.tensor([data.numel()], dtype=torch.int64), dst=d, group=g, tag=_SIZE),
                      dist.isend(data, dst=d, group=g, tag=_DATA)]
        payloads = {s.index: [None] * len(s.producers) for s in self.drives}
        if self.drives:
            got = {self.rank: mine.get(self.rank, [])}
            sizes = {p: torch.zeros(1, dtype=torch.int64) for p in self.from_producers}
            for w in [dist.irecv(t, src=p, group=g, tag=_SIZE) for p, t in sizes.items()]:
                w.wait()
            data = {p: torch.empty(int(t[0]), dtype=torch.uint8) for p, t in sizes.items()}
            for w in [dist.irecv(t, src=p, group=g, tag=_DATA) for p, t in data.items()]:
                w.wait()
            got.update((p, json.loads(bytes(t.numpy()).decode())) for p, t in data.items())
            for p, entries in got.items():
                if isinstance(entries, str):
                    errors.append(entries)
                    continue
                for j, k, payload in entries:
                    if j in payloads:
                        payloads[j][k] = payload
            if not errors:
                missing = [(j, k) for j, row in payloads.items() for k, e in enumerate(row) if e is None]
                if missing:
                    errors.append(f"rank {self.rank}: no payload for (server, TP rank) {missing}")
        for w in sends:
            w.wait()
        return _Step(keep, payloads, errors, waits)

    def finish(self, step: _Step) -> None:
        """Acknowledges this driver's producers (the servers have loaded), waits for this rank's own drivers, then
        lets its bucket go (on a GPU, torch frees IPC-shared memory once every server rank has released it)."""
        acks = [dist.isend(torch.ones(1, dtype=torch.int64), dst=p, group=self.group, tag=_ACK)
                for p in self.from_producers]
        for w in acks + step.waits:
            w.wait()
        # keep: a flattened bucket (its payload dict) or a list of tensors (the colocated refit's per-rank buckets)
        held = [step.keep["flattened_tensor"]] if isinstance(step.keep, dict) else list(step.keep or ())
        on_gpu = any(t.is_cuda for t in held)
        step.keep = step.payloads = None
        if on_gpu:
            torch.cuda.ipc_collect()


class _Gathering:
    """An export stream whose buckets carry their gathered entries (PayloadRelay.gathering); the transport's
    settings (recycle, compute_digests) and its reads (digests, receives, ...) are the stream's."""

    def __init__(self, stream, relay: PayloadRelay):
        object.__setattr__(self, "_stream", stream)
        object.__setattr__(self, "_relay", relay)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __setattr__(self, name, value):
        setattr(self._stream, name, value)

    def __iter__(self):
        for bucket in self._stream:
            if not bucket:
                yield bucket
                continue
            step = self._relay._start(bucket)
            try:
                yield RelayedBucket(bucket, step.payloads, step.errors)
            finally:
                self._relay.finish(step)


__all__ = ["FLATTENED", "PayloadRelay", "RelayedBucket", "ServerPlacement", "flatten", "placements", "serialize",
           "tied_aliases"]
