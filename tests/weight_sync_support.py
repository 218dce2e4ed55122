"""The generic engine-rank weight-sync protocol, for tests only: learner rank 0 broadcasts each bucket over a
process group of its own to engine ranks, which load it and send back their digests. No config selects it (the
engines' transports are in_process, disk and sglang_distributed, rlpo_mega/weight_sync/transports.py and
rlpo_mega/rollout/sglang_engine.py); tests/test_weight_sync.py syncs through it to a stand-in engine process
(tests/workers/engine_receiver.py), so the digest check is exercised across a process boundary.
"""
from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from moe.bridge.digest import verify


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
