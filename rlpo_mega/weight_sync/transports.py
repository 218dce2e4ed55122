"""Weight-sync transports: how the learner's export stream reaches a rollout engine, then is verified.

Receiver contract (what an engine implements; SGLang's session API has the same shape):
  begin_weight_update() / load_weights([(hf_name, tensor), ...]) / end_weight_update()
                                                  load_weights must copy: the in-process and distributed
                                                  transports reuse a bucket's buffers once it returns
  reload_from_disk(hf_dir)                       (disk transport)
  weight_digests(names, algorithm) -> {name: digest}   digests of what the engine now holds, computed
                                                  with the sender's algorithm (stream.digest_algorithm)

Built once per engine through the registry (`from_config(cfg, engine, hf)`); `close()`, where a transport
has one, runs before its engine shuts down. Every transport ends with `digest.verify(sent, received)`: a mismatch raises before any rollout uses
the new weights. All learner ranks call `sync(stream)` (the export is collective); only the stream's
receiving rank talks to the engine.
"""
from __future__ import annotations

import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from rlpo_mega.algorithms.registry import Registry

from moe.bridge.digest import DigestMismatchError, verify

TRANSPORTS = Registry("weight-sync transport")


@TRANSPORTS.register("in_process")
class InProcessTransport:
    """The engine lives in this process (the embedded engine): buckets are loaded as they arrive."""

    def __init__(self, receiver):
        self.receiver = receiver

    @classmethod
    def from_config(cls, cfg, engine, hf):
        return cls(engine)

    def sync(self, stream) -> dict:
        # A receiver that can digest while it copies (load_weights_verified) takes the sender's digest
        # from the streamed tensor in the same cache-blocked pass; otherwise the stream digests on export
        # and the receiver re-reads what it holds after the update.
        fused = stream.receives and hasattr(self.receiver, "load_weights_verified")
        if fused:
            stream.compute_digests = False
        stream.recycle = True  # the receiver copies each bucket before asking for the next
        if stream.receives:
            self.receiver.begin_weight_update()
        loaded = {}
        for bucket in stream:
            if bucket and stream.receives:
                if fused:
                    sent, got = self.receiver.load_weights_verified(bucket, stream.digest_algorithm)
                    stream.digests.update(sent)
                    loaded.update(got)
                else:
                    self.receiver.load_weights(bucket)
        if not stream.receives:
            return {}
        self.receiver.end_weight_update()
        verify(stream.digests, loaded if fused
               else self.receiver.weight_digests(list(stream.digests), stream.digest_algorithm))
        return {"tensors": len(stream.digests), "bytes": stream.bytes_sent}


@TRANSPORTS.register("disk")
class DiskTransport:
    """Write an HF checkpoint directory (atomically), then the engine reloads it in place."""

    def __init__(self, receiver, directory: str, hf_config, source_dir: str | None = None):
        from moe.bridge.hf_checkpoint import HFCheckpointWriter
        from moe.bridge.outputs import check_target

        # at construction, not at the first sync (whose stream is collective): a directory of other files
        # is refused before anything runs; an earlier run's export there is replaced
        check_target(directory, HFCheckpointWriter.KIND, overwrite=True)
        self.receiver, self.directory, self.hf_config, self.source_dir = receiver, directory, hf_config, source_dir

    @classmethod
    def from_config(cls, cfg, engine, hf):
        return cls(engine, cfg.rollout.sync_dir or "runs/weight_sync", hf, source_dir=cfg.model.init_from_hf)

    def sync(self, stream) -> dict:
        from moe.bridge.hf_checkpoint import HFCheckpointWriter, write_stream

        # overwrite: each sync replaces the previous sync's export (and nothing else: a directory of other
        # files is refused)
        write_stream(stream, HFCheckpointWriter(self.directory, self.hf_config, source_dir=self.source_dir,
                                                overwrite=True)
                     if stream.receives else None)
        if not stream.receives:
            return {}
        self.receiver.reload_from_disk(self.directory)
        verify(stream.digests, self.receiver.weight_digests(list(stream.digests), stream.digest_algorithm))
        return {"tensors": len(stream.digests), "bytes": stream.bytes_sent, "path": self.directory}


class WeightUpdateGroup:
    """A process group between the learner's sending rank (rank 0) and engine ranks, outside the
    learner's own world: the contract of SGLang's init_weights_update_group (address, port,
    rank_offset, world_size, group_name, backend). gloo on CPU, NCCL on GPU."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 backend: str | None = None, timeout_s: float = 300.0):
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                                   timeout=timedelta(seconds=timeout_s))
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timedelta(seconds=timeout_s))
        elif backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size)
        else:
            raise ValueError(f"weight update group backend {backend!r}: choose gloo or nccl")
        self.device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        self.pg.broadcast(tensor, src).wait()

    def send_object(self, obj, src: int):
        """Broadcast a picklable object from `src` (length, then bytes)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank == src else None
        length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
        self.broadcast(length, src)
        if payload is None:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.broadcast(payload, src)
        return pickle.loads(payload.numpy().tobytes())


@TRANSPORTS.register("distributed")
class DistributedTransport:
    """Learner rank 0 of the group broadcasts each bucket: first (names, dtypes, shapes), then the
    tensors; engine ranks load them and send back their digests at the end."""

    def __init__(self, group: WeightUpdateGroup):
        self.group = group

    def sync(self, stream) -> dict:
        g = self.group
        stream.recycle = True  # each bucket is broadcast before the next is asked for
        for bucket in stream:
            if not stream.receives or not bucket:
                continue
            g.send_object({"op": "bucket", "meta": [(n, t.dtype, tuple(t.shape)) for n, t in bucket]}, src=0)
            for _, t in bucket:
                g.broadcast(t.contiguous().to(g.device), src=0)
        if not stream.receives:
            return {}
        g.send_object({"op": "end", "names": list(stream.digests), "algorithm": stream.digest_algorithm}, src=0)
        received = {}
        for engine_rank in range(1, g.world_size):
            received[engine_rank] = g.send_object(None, src=engine_rank)
        for engine_rank, digests in received.items():
            verify(stream.digests, digests, where=f"engine rank {engine_rank}")
        return {"tensors": len(stream.digests), "bytes": stream.bytes_sent}


def serve_distributed(group: WeightUpdateGroup, receiver, corrupt=None):
    """Engine side of DistributedTransport: receive one full update, load it, report digests.

    `corrupt(name, tensor)` is a test hook that alters a tensor in transit (after the sender's digest).
    """
    receiver.begin_weight_update()
    while True:
        msg = group.send_object(None, src=0)
        if msg["op"] == "end":
            break
        bucket = []
        for name, dtype, shape in msg["meta"]:
            t = torch.empty(shape, dtype=dtype, device=group.device)
            group.broadcast(t, src=0)
            if corrupt is not None:
                t = corrupt(name, t)
            bucket.append((name, t))
        receiver.load_weights(bucket)
    receiver.end_weight_update()
    digests = receiver.weight_digests(msg["names"], msg["algorithm"])
    for engine_rank in range(1, group.world_size):
        group.send_object(digests if engine_rank == group.rank else None, src=engine_rank)
    return digests


class HFModelReceiver:
    """A transformers model as a weight receiver (the embedded engine's weights; also used in tests)."""

    def __init__(self, model):
        from moe.bridge.hf_inmemory import HFModelWeights

        self.weights = HFModelWeights(model)
        self.updating = False

    def begin_weight_update(self):
        self.updating = True
        self.weights.begin()

    def load_weights(self, named_tensors):
        self._check_updating()
        self.weights.load(named_tensors)

    def load_weights_verified(self, named_tensors, algorithm: str):
        """Load and return (sent, loaded) digests from one pass over the bytes (InProcessTransport)."""
        self._check_updating()
        return self.weights.load_verified(named_tensors, algorithm)

    def _check_updating(self):
        if not self.updating:
            raise RuntimeError("load_weights outside begin_weight_update()/end_weight_update()")

    def end_weight_update(self):
        self.updating = False
        self.weights.end()

    def reload_from_disk(self, path: str):
        from safetensors import safe_open

        self.begin_weight_update()
        for file in sorted(os.listdir(path)):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(path, file), "pt") as f:
                    self.load_weights([(k, f.get_tensor(k)) for k in f.keys()])
        self.end_weight_update()

    def weight_digests(self, names, algorithm: str) -> dict[str, str]:
        from moe.bridge.digest import tensor_digest

        return {n: tensor_digest(self.weights.read(n), algorithm) for n in names}


__all__ = ["TRANSPORTS", "DigestMismatchError", "DiskTransport", "DistributedTransport", "HFModelReceiver",
           "InProcessTransport", "WeightUpdateGroup", "serve_distributed"]
