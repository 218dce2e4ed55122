"""Test-only: a CPU run held to a CUDA run's host/device rules (tests/test_device_discipline.py).

On CPU the host and the accelerator are one device, so a batch that never reaches the accelerator, or a
host tensor handed to an NCCL collective, runs fine here and dies on the first GPU step. `DeviceTracker`
separates them again and keeps real arithmetic: inside it the accelerator is `cpu:0` (what
`platform.device()` and `torch.cuda.current_device()` return), the host is plain `cpu`, and a
torch-function mode tags every tensor that a CUDA run would hold on the host:

- host: made by the learner's own code (rlpo_mega/ and moe/, except the _TRUSTED modules below) with
  no device or with device "cpu"; `.cpu()`,
  `.to("cpu")`, `torch.from_numpy` anywhere; anything computed from host tensors only;
- accelerator: everything else: the model, what megatron makes, `device=platform.device()`,
  `.to(platform.device())` (a copy, as on CUDA), anything computed with an accelerator tensor.
  `tensor.device` reads `cpu:0` for those, so `device=x.device` follows x as it does on CUDA.

What a CUDA run would refuse is recorded (not raised: one rank raising would leave the others waiting
in a collective), with where the host tensor was made:
- "mix": a host tensor and an accelerator tensor in one op called from the learner's code (a 0-dim
  host tensor is let through where CUDA's elementwise kernels take it as a scalar);
- "model input": a host tensor among a watched model's inputs (forward pre-hook);
- "router": host routes handed to megatron's RouterReplay;
- "collective": a host tensor handed to a torch.distributed collective on any group but a gloo one
  (megatron's *_GLOO groups, groups made with backend="gloo"); NCCL takes device tensors only.

Host syncs (`with tracker.counting():` ... `tracker.syncs`): what makes a CUDA host wait for the device,
counted per (what, site) on accelerator tensors only: a value read into Python (`item`, `tolist`,
`__bool__`, `__int__`, `__float__`, `__index__`, `numpy`), a copy to the host (`.cpu()`, `.to("cpu")`), an
op whose output size depends on the values (`nonzero`, `masked_select`, `unique`, `repeat_interleave`
without `output_size`, `bincount`, one-argument `where`, indexing with a boolean tensor). A host
tensor's reads cost nothing on CUDA and are not counted.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ACC = torch.device("cpu", 0)
HOST = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TAG = "_rlpo_host_origin"  # on a host tensor: where it was made (file:line function)
_DEVICE_GET = torch._C.TensorBase.device.__get__
_FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange,
              torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye,
              torch.empty_strided, torch.scalar_tensor}
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
# Cross-device by design on CUDA too: copies, and indexing with CPU indices.
_UNCHECKED = {torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__}
# CUDA's elementwise kernels take a 0-dim CPU tensor as a scalar; these take no CPU tensor at all.
_NO_CPU_SCALARS = {torch.stack, torch.cat, torch.concat, torch.concatenate, torch.hstack, torch.vstack,
                   torch.index_select, torch.Tensor.index_select, torch.gather, torch.Tensor.gather,
                   torch.Tensor.index_add_, torch.Tensor.scatter_, torch.matmul, torch.Tensor.__matmul__,
                   torch.mm, torch.bmm}
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "reduce", "all_to_all", "all_to_all_single", "send", "recv", "gather",
                "scatter", "_all_gather_base", "_reduce_scatter_base", "batch_isend_irecv")
_OURS = ("rlpo_mega.", "moe.")
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
          torch.Tensor.__index__, torch.Tensor.numpy, torch.equal, torch.allclose, torch.Tensor.allclose,
          torch.Tensor.equal, torch.is_nonzero}
_SIZED_BY_VALUES = {torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere, torch.masked_select,
                    torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.unique_consecutive,
                    torch.Tensor.unique_consecutive, torch.bincount, torch.Tensor.bincount}
# The CPU-platform shim; the rollout engines (CPU/HF by design); the weight export, whose buffer pool is
# for CPU devices only (it branches on device.type, which cannot tell the emulated accelerator apart).
_TRUSTED = ("rlpo_mega.platform", "rlpo_mega.rollout", "moe.bridge")


def origin(t):
    """Where a host tensor was made, None for an accelerator tensor."""
    return getattr(t, _TAG, None)


def _tensors(*trees):
    return [x for x in tree_flatten(list(trees))[0] if isinstance(x, torch.Tensor)]


def _is_ours(module: str) -> bool:
    return module.startswith(_OURS) and not module.startswith(_TRUSTED)


def _caller():
    """The first frame outside torch and this file."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if not (name == __name__ or name == "torch" or name.startswith("torch.")):
            return f
        f = f.f_back
    return None


def _made_by_torch_optim() -> bool:
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "") == __name__:
        f = f.f_back
    return f is not None and f.f_globals.get("__name__", "").startswith("torch.optim")


def _site(f) -> str:
    if f is None:
        return "?"
    path = f.f_code.co_filename
    path = path.split("site-packages" + os.sep, 1)[-1] if "site-packages" in path else os.path.relpath(path, ROOT)
    return f"{path}:{f.f_lineno} {f.f_code.co_name}"


def _on_host(device) -> bool:
    d = torch.device(device)
    return d.type == "cpu" and d.index is None


def _mark(outputs, host_origin, inputs=()):
    keep = {id(t) for t in inputs}
    for t in _tensors(outputs):
        if id(t) in keep:  # in-place or identity: the tensor keeps what it was
            continue
        if host_origin is not None:
            setattr(t, _TAG, host_origin)
        elif origin(t) is not None:
            delattr(t, _TAG)


class _Mode(TorchFunctionMode):
    def __init__(self, tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GET:
            return HOST if origin(args[0]) is not None else ACC
        if func in _FACTORIES:
            return self._factory(func, args, kwargs)
        if func in _MOVES:
            return self._move(func, args, kwargs)
        inputs = _tensors(args, kwargs)
        if self.tracker.counting_syncs:
            self._count_sync(func, args, kwargs)
        out = func(*args, **kwargs)
        hosts = [t for t in inputs if origin(t) is not None]
        accs = [t for t in inputs if origin(t) is None]
        if func in _UNCHECKED:
            if func is torch.Tensor.__getitem__:
                _mark(out, origin(args[0]), inputs)
            return out
        scalars_ok = func not in _NO_CPU_SCALARS
        if hosts and accs and any(h.dim() > 0 or not scalars_ok for h in hosts):
            f = _caller()
            if f is not None and _is_ours(f.f_globals.get("__name__", "")):
                h = next(h for h in hosts if h.dim() > 0 or not scalars_ok)
                self.tracker.record("mix", getattr(func, "__name__", str(func)), _site(f), origin(h))
        device = kwargs.get("device")
        if device is not None:  # zeros_like(x, device=...), x.new_zeros(..., device=...)
            host = _on_host(device) and self._ours_caller()
            _mark(out, _site(_caller()) if host else None, inputs)
        else:
            _mark(out, None if accs or not hosts else origin(hosts[0]), inputs)
        return out

    def _count_sync(self, func, args, kwargs):
        def acc(t):
            return isinstance(t, torch.Tensor) and origin(t) is None

        what = None
        name = getattr(func, "__name__", str(func))
        if func in _READS and any(acc(t) for t in _tensors(args)):
            what = name
        elif func in _SIZED_BY_VALUES and acc(args[0] if args else None):
            what = name
        elif func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if kwargs.get("output_size") is None and (acc(repeats) or (repeats is None and acc(args[0]))):
                what = name
        elif func is torch.where and len(args) + len(kwargs) == 1 and acc(args[0] if args else kwargs.get("condition")):
            what = "where(condition)"
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = args[1] if len(args) > 1 else None
            items = index if isinstance(index, (tuple, list)) else (index,)
            if any(acc(i) and i.dtype in (torch.bool, torch.uint8) for i in items):
                what = name + "[bool mask]"
        if what is not None:
            self.tracker.syncs[(what, _site(_caller()))] += 1

    def _ours_caller(self) -> bool:
        f = _caller()
        return f is not None and _is_ours(f.f_globals.get("__name__", ""))

    def _factory(self, func, args, kwargs):
        out = func(*args, **kwargs)
        device = kwargs.get("device")
        data = _tensors(args)
        if device is None and data:  # torch.tensor(t) / as_tensor(t): where t is
            _mark(out, origin(data[0]))
            return out
        f = _caller()
        ours = f is not None and _is_ours(f.f_globals.get("__name__", ""))
        # megatron's own factories (its "cuda" literals, current_device()) are on the device on CUDA; torch's
        # optimizers keep their step counters on the host unless capturable or fused (torch/optim/adam.py)
        host = (ours or _made_by_torch_optim()) and (device is None or _on_host(device))
        _mark(out, _site(f) if host else None)
        return out

    def _move(self, func, args, kwargs):
        src = args[0]
        target = None  # None: dtype-only .to(), the tensor stays where it is
        if func is torch.Tensor.cpu:
            target = HOST
        elif func is torch.Tensor.cuda:
            target = ACC
        else:
            for a in list(args[1:]) + [kwargs.get("device")]:
                if isinstance(a, (torch.device, str)):
                    target = torch.device(a)
                    break
                if isinstance(a, torch.Tensor):  # .to(other): other's device
                    target = HOST if origin(a) is not None else ACC
                    break
        out = func(*args, **kwargs)
        if target is None:
            if out is not src:
                _mark(out, origin(src))
            return out
        host = _on_host(target)
        if host and origin(src) is None and self.tracker.counting_syncs:
            self.tracker.syncs[(getattr(func, "__name__", "to") + "(host)", _site(_caller()))] += 1
        if host != (origin(src) is not None) and out is src:
            out = out.clone()  # a move across devices is a copy on CUDA: the source keeps its place
        _mark(out, (origin(src) or _site(_caller())) if host else None)
        return out


class DeviceTracker:
    """`with DeviceTracker() as tr:` ... `tr.watch(model_chunks)` ... `tr.violations()` (see the module doc)."""

    def __init__(self):
        self.found = Counter()
        self.syncs = Counter()
        self.counting_syncs = False
        self.gloo_groups = []
        self._saved = []
        self._hooks = []

    # --- recording -----------------------------------------------------------------------------------
    def record(self, kind, what, site, made_at):
        self.found[(kind, what, site, made_at or "?")] += 1

    @contextlib.contextmanager
    def counting(self):
        """Count host syncs inside (into self.syncs)."""
        self.counting_syncs = True
        try:
            yield self.syncs
        finally:
            self.counting_syncs = False

    def violations(self) -> list[dict]:
        return [{"kind": k, "what": w, "site": s, "host_tensor_made_at": m, "count": n}
                for (k, w, s, m), n in sorted(self.found.items())]

    def watch(self, model_chunks):
        """Every tensor a watched model receives must be on the accelerator."""
        def check(module, args, kwargs):
            for name, t in [(f"arg{i}", t) for i, t in enumerate(_tensors(args))] + [
                    (k, t) for k, v in kwargs.items() for t in _tensors(v)]:
                if origin(t) is not None:
                    self.record("model input", name, _site(_caller()), origin(t))

        for chunk in model_chunks:
            inner = chunk.module if hasattr(chunk, "module") else chunk
            self._hooks.append(inner.register_forward_pre_hook(check, with_kwargs=True))

    # --- patches -------------------------------------------------------------------------------------
    def _patch(self, owner, name, value):
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _is_gloo(self, group) -> bool:
        from megatron.core import parallel_state

        gloo = list(self.gloo_groups)
        for name, value in vars(parallel_state).items():
            if "GLOO" in name and value is not None:
                gloo += value if isinstance(value, (list, tuple)) else [value]
        return group is not None and any(group is g for g in gloo)

    def _collective(self, name, fn):
        sig = inspect.signature(fn)

        def wrapped(*args, **kwargs):
            if name == "batch_isend_irecv":
                ops = args[0] if args else kwargs["p2p_op_list"]
                group, tensors = (ops[0].group if ops else None), [op.tensor for op in ops]
            else:
                bound = sig.bind(*args, **kwargs)
                group, tensors = bound.arguments.get("group"), _tensors(bound.args, bound.kwargs)
            if not self._is_gloo(group):
                for t in tensors:
                    if origin(t) is not None:
                        self.record("collective", f"dist.{name}", _site(_caller()), origin(t))
            return fn(*args, **kwargs)

        return wrapped

    def __enter__(self):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        from rlpo_mega import platform

        platform.apply()  # first, so that its own torch.cuda.current_device patch is the one replaced
        self._patch(platform, "device", lambda: ACC)
        self._patch(torch.cuda, "current_device", lambda: ACC)
        for name in _COLLECTIVES:
            self._patch(dist, name, self._collective(name, getattr(dist, name)))
        new_group = dist.new_group

        def new_group_noting_gloo(*args, **kwargs):
            group = new_group(*args, **kwargs)
            if kwargs.get("backend") == "gloo":
                self.gloo_groups.append(group)
            return group

        self._patch(dist, "new_group", new_group_noting_gloo)
        from_numpy = torch.from_numpy

        def host_from_numpy(array):
            out = from_numpy(array)
            setattr(out, _TAG, _site(_caller()))
            return out

        self._patch(torch, "from_numpy", host_from_numpy)
        set_target = RouterReplay.set_target_indices

        def checked_set_target(replay, topk_indices):
            if origin(topk_indices) is not None:
                self.record("router", "RouterReplay.set_target_indices", _site(_caller()), origin(topk_indices))
            return set_target(replay, topk_indices)

        self._patch(RouterReplay, "set_target_indices", checked_set_target)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved, self._hooks = [], []
        return False
