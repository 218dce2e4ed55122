"""Accelerator memory that leaves the device and returns: the learner's, handed to a colocated engine (rollout.colocate).

A storage leaves by having its bytes copied to host memory (pinned on CUDA, so the copies run at the link's speed)
and shrinking to 0 bytes; it returns by growing back and copying them in. Every tensor viewing it (the parameters
and `main_grad`s inside megatron's DDP buffers, the distributed optimizer's shards) stays the same Python object and
sees its bytes again: nothing is rebuilt, so megatron's hooks, the optimizer's maps and the routers' replay keep
working. Storages whose contents are not needed back are dropped without a copy (the gradient buffers: the update
zeroes them before the backward that fills them, update.py).

On CUDA the freed blocks go back to the driver (`torch.cuda.empty_cache`), where the colocated server's memory saver
can map them. On a CPU both sides are host memory; what a GPU would hold is the same storages' sizes, which is what the
tests count (a shrunk storage has 0 bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from rlpo_mega.model_setup import unwrap


def distinct_storages(tensors) -> list:
    """The distinct allocated storages under `tensors` (None and empty ones skipped), in first-seen order."""
    seen, out = set(), []
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out.append(s)
    return out


def _bytes_view(storage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Moved:
    storage: object  # torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # None: dropped (its contents are not needed back)


@dataclass
class Residency:
    """Storages that leave the accelerator (`offload`, which returns the bytes it frees) and return (`onload`).
    keep: tensors whose bytes come back; drop: tensors whose storage comes back uninitialised (gradients)."""
    keep: Callable[[], Iterable]  # tensors, asked at each offload (optimizer state appears at the first step)
    drop: Callable[[], Iterable] = lambda: ()
    moved: list = field(default_factory=list)
    # the host copies, kept from one offload to the next: pinning host memory costs far more than copying into it
    hosts: list = field(default_factory=list)

    @property
    def offloaded(self) -> bool:
        return bool(self.moved)

    def offload(self) -> int:
        """Move out; returns the bytes freed on the accelerator. Idempotent."""
        if self.moved:
            return 0
        pin = torch.cuda.is_available()
        drop = distinct_storages(self.drop())
        dropped = {s.data_ptr() for s in drop}
        keep = [s for s in distinct_storages(self.keep()) if s.data_ptr() not in dropped]
        for i, s in enumerate(keep):
            if i == len(self.hosts):
                self.hosts.append(None)
            if self.hosts[i] is None or self.hosts[i].numel() != s.nbytes():
                self.hosts[i] = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host = self.hosts[i]
            host.copy_(_bytes_view(s), non_blocking=pin)
            self.moved.append(_Moved(s, s.nbytes(), host))
        self.moved += [_Moved(s, s.nbytes(), None) for s in drop]
        if pin:
            torch.cuda.synchronize()  # the copies are done before the storages are freed
        for m in self.moved:
            m.storage.resize_(0)
        if pin:
            torch.cuda.empty_cache()
        return sum(m.nbytes for m in self.moved)

    def onload(self) -> int:
        """Move back; returns the bytes allocated on the accelerator again. Idempotent."""
        moved, self.moved = self.moved, []
        for m in moved:
            m.storage.resize_(m.nbytes)
            if m.host is not None:
                _bytes_view(m.storage).copy_(m.host, non_blocking=m.host.is_pinned())
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies back are done before the host buffers are written again
        return sum(m.nbytes for m in moved)


def _ddp_buffers(chunk) -> list:
    """megatron DDP's param-and-grad buffers of a chunk (none for a model without DDP: the KL reference)."""
    if not hasattr(chunk, "expert_parallel_buffers"):
        return []
    return list(chunk.buffers) + list(chunk.expert_parallel_buffers)


def model_tensors(chunks) -> list:
    """A model's accelerator tensors: under megatron's DDP its param buffers (the distributed optimizer's) or its
    parameters, and the modules' buffers (a sigmoid router's bias)."""
    out = []
    for chunk in chunks:
        out += [buf.param_data for buf in _ddp_buffers(chunk)]
        inner = unwrap(chunk)
        out += list(inner.parameters()) + list(inner.buffers())
    return out


def grad_tensors(chunks) -> list:
    return [buf.grad_data for chunk in chunks for buf in _ddp_buffers(chunk)]


def _adam(inner) -> list:
    return [p for g in inner.param_groups for p in g["params"]] + [
        v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def optimizer_tensors(optimizer) -> list:
    """An optimizer's accelerator state: fp32 main copies and Adam moments. Under optimizer CPU offload the host
    AdamWs' state is host memory already: only the distributed optimizer's main shards and the device AdamW's."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    out = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        out += [p for g in getattr(sub, "shard_fp32_from_float16_groups", None) or [] for p in g]
        out += [p for g in getattr(sub, "fp32_from_float16_groups", None) or [] for p in g]
        if isinstance(inner, HybridDeviceOptimizer):
            out += _adam(inner.gpu_optimizer) if inner.gpu_optimizer is not None else []
        else:
            out += _adam(inner)
    return out


def learner_residency(policy, critic=None) -> Residency:
    """The learner's whole accelerator state: the policy (and KL reference) and the critic, their optimizers;
    gradients dropped."""
    def keep():
        out = model_tensors(policy.chunks) + optimizer_tensors(policy.optimizer)
        if policy.ref_chunks is not None:
            out += model_tensors(policy.ref_chunks)
        if critic is not None:
            out += model_tensors(critic.chunks) + optimizer_tensors(critic.optimizer)
        return out

    def drop():
        return grad_tensors(policy.chunks) + (grad_tensors(critic.chunks) if critic is not None else [])

    return Residency(keep, drop)
