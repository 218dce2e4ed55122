"""Runs inside an SGLang server: the weight receiver in O(1) per tensor (issue 60 item 3).

SGLang 0.5.23's MoE `load_weights` costs ~90-370 us per tensor on every sync (models/qwen3_moe.py: the
parameter dict rebuilt on each call, every tensor's name matched against the whole expert mapping, then the
parameter's own weight loader). Its work for a given name never changes between syncs: the same views of the
same parameters receive the same views of a tensor of the same shape. So the receiver lets SGLang load each
name once, the way it always does, and watches what that load writes (a TorchFunctionMode over the call): when
every write into the model is a `copy_` from a view of the incoming tensor, it keeps the geometry of each copy
(the parameter's storage, sizes, strides, offset; the tensor's the same), and every later sync of that name
replays them -- `as_strided(parameter).copy_(as_strided(tensor))`, nothing else. A name whose load does anything
more (arithmetic on the tensor, an in-place op other than a copy into a parameter, a write the watch cannot
attribute) stays SGLang's, loaded by its own `load_weights` in one call per sync with the others like it; so do
the names a family declares (`MoEFamily.sglang_loader_keys`: MLA's kv_b, which SGLang post-processes into
w_kc/w_vc; the q_a/kv_a pair it loads together). The weights are SGLang's either way; every sync stays
digest-checked inside the server (rlpo_sglang_hooks.report_digests).

Installed per TP rank by the learner's `{"what": "receiver"}` request through rlpo_sglang_hooks.report_digests:
`model.load_weights` becomes the receiver's on that rank, so every path into it gains it
(update_weights_from_tensor, _distributed, flattened buckets). A replay checks that the parameter still has the
storage it learned (SGLang may replace a parameter's data after loading) and the tensor the shape, strides
and dtype it learned; where either changed the name is loaded by SGLang and learned again.
Imports torch, SGLang's model and moe.families (the family's declared names): nothing else.
"""
import re
import time

import torch
from torch.overrides import TorchFunctionMode


_NEW = object()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Copy:
    """One write of a learned load: the parameter's view <- the incoming tensor's view (or a constant). The
    parameter is named by its module and attribute, read again at each replay: a parameter SGLang replaced
    has another storage, and the replay refuses it (a held reference would write into the discarded one)."""
    __slots__ = ("module", "attr", "ptr", "key", "view", "src", "fill")

    def __init__(self, owner, dst, src, source, fill=None):
        (self.module, self.attr), self.ptr, self.fill = owner, _storage(dst), fill
        self.key = (id(self.module), self.attr, self.ptr)  # one check per parameter and load call (_held)
        # the parameter's view, made once (it keeps the storage the replay checks against)
        self.view = torch.as_strided(dst.detach(), tuple(dst.shape), dst.stride(), dst.storage_offset())
        # the tensor's view: None where it is the whole tensor (the usual case: no view to make per sync)
        self.src = None
        if src is not None:
            geometry = (tuple(src.shape), src.stride(), src.storage_offset() - source.storage_offset())
            if geometry != (tuple(source.shape), source.stride(), 0):
                self.src = geometry


def _held(copies, checked: dict) -> bool:
    """Every copy's parameter still has the storage it was learned with (re-read from its module: SGLang may have
    replaced it), checked once per parameter in a load call (`checked`: that call's answers)."""
    for c in copies:
        ok = checked.get(c.key)
        if ok is None:
            base = getattr(c.module, c.attr, None)
            ok = checked[c.key] = base is not None and _storage(base) == c.ptr
        if not ok:
            return False
    return True


class _Batch:
    """The copies of one load call, made together (torch._foreach_copy_: one dispatch for the call instead of one
    `copy_` per tensor; in list order, so the writes land as they would one by one). A fill, or a load by SGLang,
    flushes it first: nothing is reordered around them."""
    __slots__ = ("dst", "src")
    LIMIT = 1024  # copies held at most: a load from disk streams its tensors, which the batch would otherwise hold

    def __init__(self):
        self.dst, self.src = [], []

    def add(self, dst: torch.Tensor, src: torch.Tensor):
        self.dst.append(dst)
        self.src.append(src)
        if len(self.dst) >= self.LIMIT:
            self.flush()

    def flush(self):
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)
            self.dst, self.src = [], []


class _Learned:
    """A name's replay: the incoming tensor's geometry it was learned from and its copies (none: SGLang skips it)."""
    __slots__ = ("shape", "stride", "dtype", "copies")

    def __init__(self, source, copies):
        self.shape, self.stride, self.dtype, self.copies = tuple(source.shape), source.stride(), source.dtype, copies

    def replay(self, t: torch.Tensor, checked: dict, batch: _Batch) -> bool:
        if t.shape != self.shape or t.stride() != self.stride or t.dtype != self.dtype or not _held(self.copies, checked):
            return False
        for c in self.copies:
            if c.fill is not None:
                batch.flush()
                c.view.fill_(c.fill)
            elif c.src is None:
                batch.add(c.view, t)
            else:
                size, stride, offset = c.src
                batch.add(c.view, torch.as_strided(t, size, stride, t.storage_offset() + offset))
        return True


def _contiguous_strides(shape) -> list[int]:
    out, step = [], 1
    for n in reversed(tuple(shape)):
        out.append(step)
        step *= n
    return out[::-1]


def _into_region(size, stride, offset, shape, region):
    """A view (size, stride, offset) of a contiguous tensor of `shape` -> the view of the same elements in the
    contiguous tensor that holds only `region` ((start, stop) per dim) of it, or None where the view reaches
    outside the region or does not step along one dim per view dim. Each view dim k steps m_k along one tensor dim
    d_k (its stride m_k times d_k's); the view's first element sits at multi-index `start`; if every dim's reach
    start_d + sum over k of (size_k - 1) * m_k stays inside the region, each element's multi-index is that sum
    (unique: it stays within the shape) and its place in the region tensor follows by the region's strides."""
    full, part = _contiguous_strides(shape), _contiguous_strides([b - a for a, b in region])
    start, rest = [], offset
    for step in full:
        start.append(rest // step)
        rest %= step
    reach, steps = list(start), []
    for n, s in zip(size, stride):
        if n == 0:
            return tuple(size), tuple(0 for _ in size), 0  # nothing to copy
        if n == 1 or s == 0:
            steps.append((None, 0))
            continue
        d = next((d for d, f in enumerate(full) if f <= s and s % f == 0), None)
        if d is None:
            return None
        m = s // full[d]
        reach[d] += (n - 1) * m
        steps.append((d, m))
    if any(not (a <= lo and hi < b) for lo, hi, (a, b) in zip(start, reach, region)) \
            or any(hi >= n for hi, n in zip(reach, shape)):
        return None
    new_stride = tuple(0 if d is None else m * part[d] for d, m in steps)
    return tuple(size), new_stride, sum((lo - a) * p for lo, (a, _), p in zip(start, region, part))


_WHOLE = "whole"  # a region copy that reads the whole region tensor (no view of it to make)


class _Region:
    """A name's replay from its server rank's region alone (the shard-to-shard transport): the copies of the
    learned load, each source view moved into the region tensor's coordinates; None from `of` where a copy reads
    outside the region (the plan and SGLang's loader disagree: that name stays SGLang's, loaded whole)."""
    __slots__ = ("shape", "dtype", "copies", "writes")

    @classmethod
    def of(cls, learned, full, region):
        out = cls()
        out.shape, out.dtype, out.writes = tuple(b - a for a, b in region), full.dtype, []
        whole = (out.shape, tuple(_contiguous_strides(out.shape)), 0)
        for c in learned.copies:
            geometry = None
            if c.fill is None:
                size, stride, offset = c.src or (tuple(full.shape), full.stride(), 0)
                geometry = _into_region(size, stride, offset, tuple(full.shape), region)
                if geometry is None:
                    return None
                if (tuple(geometry[0]), tuple(geometry[1]), geometry[2]) == whole:
                    geometry = _WHOLE
            out.writes.append((c, geometry))
        out.copies = [c for c, _ in out.writes]
        return out

    def replay(self, t: torch.Tensor, checked: dict, batch: _Batch) -> bool:
        if t.shape != self.shape or t.dtype != self.dtype or not t.is_contiguous() or not _held(self.copies, checked):
            return False
        for c, geometry in self.writes:
            if geometry is None:
                batch.flush()
                c.view.fill_(c.fill)
            elif geometry is _WHOLE:
                batch.add(c.view, t)
            else:
                batch.add(c.view, torch.as_strided(t, geometry[0], geometry[1], t.storage_offset() + geometry[2]))
        return True

    def read_back(self, out: torch.Tensor) -> torch.Tensor:
        """The region as the model holds it now: each copy read back from the parameter into `out`."""
        for c, geometry in self.writes:
            if geometry is _WHOLE:
                out.copy_(c.view)
            elif geometry is not None:
                torch.as_strided(out, geometry[0], geometry[1], out.storage_offset() + geometry[2]).copy_(c.view)
        return out


def _extent(t: torch.Tensor) -> int:
    """Elements of storage a view spans, from its first to its last."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


class _Watch(TorchFunctionMode):
    """The writes one load call makes into the model, each attributed to the incoming tensor it reads: a `copy_`
    into a parameter (or buffer) from a view lying within one incoming tensor's bytes is kept as that tensor's; a
    constant `fill_` (a padded vocabulary's rows, written right after its copy) as the tensor copied last; any other
    in-place write into one, or a copy from anything else, makes the call opaque."""

    def __init__(self, bases: dict, sources: list):
        super().__init__()
        self.bases, self.sources = bases, sources
        self.spans: dict = {}  # storage -> [(first byte, end byte, index)] (a flattened bucket: many per storage)
        for i, t in enumerate(sources):
            first = t.storage_offset() * t.element_size()
            self.spans.setdefault(_storage(t), []).append((first, first + _extent(t) * t.element_size(), i))
        self.copies = [[] for _ in sources]
        self.last = None  # the source copied from last
        self.opaque = None  # opaque: what made the call one the receiver cannot replay

    def _source(self, src: torch.Tensor):
        spans = self.spans.get(_storage(src))
        if not spans or src.requires_grad:
            return None
        first = src.storage_offset() * src.element_size()
        end = first + _extent(src) * src.element_size()
        for a, b, i in spans:
            if a <= first and end <= b:
                return i if self.sources[i].dtype == src.dtype else None  # (a reinterpreted view: not the tensor)
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        name = getattr(func, "__name__", "")
        in_place = name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))  # (not __get__)
        if target is not None and in_place:
            owner = self.bases.get(_storage(target))
            if owner is not None:
                src = args[1] if len(args) > 1 else kwargs.get("src")
                i = self._source(src) if name == "copy_" and isinstance(src, torch.Tensor) else None
                if i is not None:
                    self.copies[i].append(_Copy(owner, target, src, self.sources[i]))
                    self.last = i
                elif name == "fill_" and isinstance(src, (int, float, bool)) and self.last is not None:
                    self.copies[self.last].append(_Copy(owner, target, None, self.sources[self.last], fill=src))
                else:
                    self.opaque = self.opaque or (name if name != "copy_" else "copy_ from another tensor")
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor) and _storage(out) in self.bases:
            self.opaque = self.opaque or f"{name}(out=)"
        return func(*args, **kwargs)


_ALONE = object()  # learned in a call whose writes were not all replayable: learned alone at its next sync


class Receiver:
    """`model.load_weights` replaced on one TP rank: learned names replayed, the rest SGLang's."""

    def __init__(self, model, loader_only=()):
        self.model, self.original = model, model.load_weights
        self.loader_only = [re.compile(p) for p in loader_only]
        self.learned: dict = {}  # name -> _Learned, None (SGLang's loader every time) or _ALONE
        self.regions: dict = {}  # name -> _Region, None or _ALONE: the same for the shard-to-shard transport
        self.bases: dict = {}
        self.replay = True  # False: SGLang loads every name (the figure the receiver is measured against)
        self.stats = {"replayed": 0, "loaded": 0, "learned": 0, "calls": 0, "seconds": 0.0, "not_replayed": {},
                      "region_replayed": 0, "region_seconds": 0.0}  # (load_regions' share of replayed and seconds)

    def _refresh_bases(self):
        """{storage: (module, attribute)} of every parameter and buffer of the model."""
        self.bases = {}
        for prefix, module in self.model.named_modules():
            for attr, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if t is not None:
                    self.bases.setdefault(_storage(t), (module, attr))

    def _not_replayed(self, why: str):
        self.stats["not_replayed"][why] = self.stats["not_replayed"].get(why, 0) + 1

    def _learn(self, batch: list) -> dict:
        """SGLang loads `batch` [(name, tensor)] in one call, as it always does, watched -> {name: its replay, None
        (never replayable: SGLang's at every sync, counted by reason) or _ALONE}. Where the call's writes are not
        all replayable the culprit is not known: each name of a batch is learned alone at its next sync (one
        SGLang call per name, the slow path), a name alone gets None."""
        if not self.bases:
            self._refresh_bases()
        watch = _Watch(self.bases, [t for _, t in batch])
        with watch:
            self.original(batch)
        self.stats["learned"] += len(batch)
        if watch.opaque and len(batch) > 1:
            return {name: _ALONE for name, _ in batch}
        out = {}
        for (name, t), copies in zip(batch, watch.copies):
            dtypes = {getattr(c.module, c.attr).dtype for c in copies if c.fill is None}
            why = watch.opaque or next((f"copy_ {t.dtype} -> {d}" for d in dtypes  # (none seen on 0.5.23)
                                        if d.is_floating_point != t.dtype.is_floating_point), None)
            if why:  # SGLang's at every sync; counted by reason (the learner's report)
                self._not_replayed(why)
                out[name] = None
            else:
                out[name] = _Learned(t, copies)
        return out

    def load_weights(self, weights, *args, **kwargs):
        if args or kwargs:  # a variant this receiver does not know (e.g. is_nextn): SGLang's
            return self.original(weights, *args, **kwargs)
        t0 = time.perf_counter()
        if not self.replay:  # SGLang's loader for everything, timed by the same clock (tools/bench_refit.py)
            weights = list(weights)
            self.original(weights)
            self.stats["loaded"] += len(weights)
            self.stats["calls"] += 1
            self.stats["seconds"] += time.perf_counter() - t0
            return
        rest, new, checked, replayed, batch = [], [], {}, 0, _Batch()
        for name, t in weights:
            entry = self.learned.get(name, _NEW)
            if entry is _NEW:
                if any(p.search(name) for p in self.loader_only):
                    self.learned[name] = None
                    rest.append((name, t))
                else:  # loaded below, by SGLang, watched
                    new.append((name, t))
            elif entry is _ALONE:
                batch.flush()
                self.learned.update(self._learn([(name, t)]))
            elif entry is None:
                rest.append((name, t))
            elif entry.replay(t, checked, batch):
                replayed += 1
            else:  # the parameter or the tensor changed since it was learned: SGLang's now, learned again next time
                del self.learned[name]
                self.bases = {}
                rest.append((name, t))
        batch.flush()
        self.stats["replayed"] += replayed
        if new:
            self.learned.update(self._learn(new))
        if rest:
            self.original(rest)
            self.stats["loaded"] += len(rest)
        self.stats["calls"] += 1
        self.stats["seconds"] += time.perf_counter() - t0

    def load_regions(self, items):
        """The shard-to-shard transport's load: items [(name, full HF shape, region, tensor of the region)]. Names
        seen for the first time are loaded by SGLang from whole-shaped tensors holding only their regions (its
        loader reads only its own slice: moe/bridge/reshard.server_region), watched, and their copies moved into
        the regions' coordinates; later syncs replay them from the region alone. Names SGLang must load itself, or
        whose copies reach outside the region, go to SGLang that way every sync, in one call."""
        t0 = time.perf_counter()
        rest, new, alone, checked, batch = [], [], [], {}, _Batch()

        def whole(shape, region, t):
            full = torch.zeros(shape, dtype=t.dtype, device=t.device)
            full[tuple(slice(a, b) for a, b in region)].copy_(t)
            return full

        for name, shape, region, t in items:
            entry = self.regions.get(name, _NEW)
            if entry is not _NEW and entry is not None and entry is not _ALONE and entry.replay(t, checked, batch):
                self.stats["replayed"] += 1
                self.stats["region_replayed"] += 1
                continue
            if entry is _NEW and any(p.search(name) for p in self.loader_only):
                self.regions[name] = entry = None
            if entry is _NEW or entry is _ALONE:  # loaded below, by SGLang, watched
                (new if entry is _NEW else alone).append((name, whole(shape, region, t), region))
                continue
            if entry is not None:  # the parameter or the tensor changed: SGLang's now, learned again next time
                del self.regions[name]
                self.bases = {}
            rest.append((name, whole(shape, region, t)))
        batch.flush()
        for call in ([new] if new else []) + [[x] for x in alone]:
            learned = self._learn([(name, full) for name, full, _ in call])
            for name, full, region in call:
                entry = learned[name]
                if entry is not None and entry is not _ALONE:
                    entry = _Region.of(entry, full, region)
                    if entry is None:
                        self._not_replayed("reads outside its region")
                self.regions[name] = entry
        if rest:
            self.original(rest)
            self.stats["loaded"] += len(rest)
        self.stats["calls"] += 1
        self.stats["seconds"] += time.perf_counter() - t0
        self.stats["region_seconds"] += time.perf_counter() - t0

    def read_region(self, name: str, region, t: torch.Tensor):
        """`t` (the region's shape) filled with what the model holds of `name`'s region, or None where this
        receiver does not replay the name (SGLang loads it; its layout is SGLang's own)."""
        entry = self.regions.get(name)
        return None if entry is None or entry is _ALONE else entry.read_back(t)


def _loader_only_patterns(config) -> list[str]:
    """Regexes of the HF names the family says SGLang must load itself (MoEFamily.sglang_loader_keys)."""
    from moe.families import get_family

    family = get_family(config.model_type)
    names = family.hf_names(config)
    out = []
    for key in family.sglang_loader_keys(config):
        template = names.get(key)
        if template:
            out.append("^" + re.escape(template).replace(r"\{i\}", r"\d+").replace(r"\{e\}", r"\d+") + "$")
    return out


def install(model, replay=None) -> Receiver:
    """The receiver on this rank's model (once; later calls return it). replay: switch replaying on or off."""
    receiver = getattr(model, "_rlpo_receiver", None)
    if receiver is None:
        receiver = Receiver(model, _loader_only_patterns(model.config))
        object.__setattr__(model, "_rlpo_receiver", receiver)
        object.__setattr__(model, "load_weights", receiver.load_weights)
    if replay is not None:
        receiver.replay = bool(replay)
    return receiver
