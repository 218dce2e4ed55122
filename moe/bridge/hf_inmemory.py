"""Load HF checkpoint-named tensors into a live transformers model (the embedded engine's side).

transformers 5 holds a MoE layer's experts fused in memory while checkpoints (and our weight stream) name
them per expert. The family says both layouts (`hf_names`, `hf_inmemory_names`); this module maps each
streamed name onto its slice of the in-memory parameter, loads it, and reads the same slice back for the
digest check.
"""
from __future__ import annotations

import torch

from moe.bridge.digest import copy_with_digests, tensor_digests
from moe.families import get_family


def _checkpoint_slots(model: torch.nn.Module, params: dict) -> dict[str, tuple[str, tuple]]:
    """{checkpoint name: (in-memory parameter name, index)} for every name that differs between the two."""
    hf = model.config
    family = get_family(hf.model_type)
    ckpt, mem = family.hf_names(hf), family.hf_inmemory_names(hf)
    slots = {}
    for i, sparse in enumerate(family.moe_layer_pattern(hf)):
        if not sparse:
            continue
        gate_up, down = mem["experts_gate_up"].format(i=i), mem["experts_down"].format(i=i)
        for pname in (gate_up, down):
            if pname not in params:
                raise KeyError(f"{type(model).__name__} has no parameter {pname!r}: the family's in-memory "
                               "layout (hf_inmemory_names) does not match this transformers version")
        rows = params[gate_up].shape[1] // 2
        for e in range(params[gate_up].shape[0]):
            slots[ckpt["expert_gate"].format(i=i, e=e)] = (gate_up, (e, slice(0, rows)))
            slots[ckpt["expert_up"].format(i=i, e=e)] = (gate_up, (e, slice(rows, 2 * rows)))
            slots[ckpt["expert_down"].format(i=i, e=e)] = (down, (e,))
        slots[ckpt["router"].format(i=i)] = (mem["router"].format(i=i), ())
    return slots


class HFModelWeights:
    """Name-addressed view of a transformers causal LM's parameters in checkpoint naming."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        # persistent buffers are weights too (the sigmoid router's e_score_correction_bias)
        self.params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        self._pname = {id(p): n for n, p in self.params.items()}
        self.tied = getattr(model.config, "tie_word_embeddings", False)
        self._map = _checkpoint_slots(model, self.params)
        self._tied_head = None
        if self.tied:  # the head shares the embedding's parameter; a streamed head lands there
            names = get_family(model.config.model_type).hf_names(model.config)
            self._tied_head = names["output"]
            self._map[names["output"]] = (names["embedding"], ())
        # name -> (view, parameter name, index key, the key's prefixes); the parameters are fixed
        self._slots: dict[str, tuple] = {}

    def _target(self, name: str):
        """(parameter, view index) for a checkpoint-named tensor."""
        pname, index = self._map.get(name, (name, ()))
        if pname not in self.params:
            raise KeyError(f"streamed tensor {name!r} has no parameter in {type(self.model).__name__}")
        return self.params[pname], index

    def begin(self):
        """Start an update: from now on, two streamed tensors landing on overlapping memory are an error."""
        self._written: set = set()  # (parameter name, index key) loaded in this update
        self._covered: set = set()  # and every prefix of those keys

    def _claim(self, name: str, pname: str, key: tuple, prefixes: tuple):
        """A mapping collision (two names onto one slice) would let the later tensor silently overwrite the
        earlier one after its digest was taken; refuse it instead. Keys are index prefixes: () is the whole
        parameter, (e,) expert e, (e, (a, b)) rows a:b of it; two keys overlap when one is a prefix of the
        other."""
        if getattr(self, "_written", None) is None:
            return
        if (pname, key) in self._covered or any(p in self._written for p in prefixes):
            same = (pname, key) in self._written
            raise RuntimeError(f"weight sync: streamed tensor {name!r} lands on {pname}{list(key)}, which "
                               f"{'is' if same else 'overlaps'} a slice already loaded in this update "
                               "(a name-mapping collision)")
        self._written.add((pname, key))
        self._covered.update(prefixes)

    def _view(self, name: str, tensor: torch.Tensor):
        slot = self._slots.get(name)
        if slot is None:
            param, index = self._target(name)
            key = tuple((s.start, s.stop) if isinstance(s, slice) else s for s in index)
            pname = self._pname[id(param)]
            prefixes = tuple((pname, key[:i]) for i in range(len(key) + 1))
            slot = self._slots[name] = ((param[index] if index else param).detach(), pname, key, prefixes)
        view, pname, key, prefixes = slot
        if view.shape != tensor.shape:
            raise ValueError(f"streamed tensor {name!r} has shape {list(tensor.shape)}; the engine's "
                             f"parameter slice has {list(view.shape)}")
        self._claim(name, pname, key, prefixes)
        return view

    @torch.no_grad()
    def load(self, named_tensors):
        for name, tensor in named_tensors:
            view = self._view(name, tensor)
            view.copy_(tensor.to(view.dtype))

    @torch.no_grad()
    def load_verified(self, named_tensors, algorithm: str) -> tuple[dict[str, str], dict[str, str]]:
        """Load and digest in one pass: ({name: digest of the streamed bytes}, {name: digest of the
        engine's memory after the copy}); see moe.bridge.digest.copy_with_digests."""
        named_tensors = list(named_tensors)
        if algorithm == "sums" and not all(t.is_cpu for _, t in named_tensors):
            # accelerator tensors: copy all, then digest each side with one host copy for the whole bucket
            names = [n for n, _ in named_tensors]
            views = [self._view(n, t) for n, t in named_tensors]
            for view, (_, t) in zip(views, named_tensors):
                view.copy_(t.to(view.dtype))
            return (dict(zip(names, tensor_digests([t for _, t in named_tensors], algorithm))),
                    dict(zip(names, tensor_digests(views, algorithm))))
        sent, loaded = {}, {}
        for name, tensor in named_tensors:
            sent[name], loaded[name] = copy_with_digests(self._view(name, tensor), tensor, algorithm)
        return sent, loaded

    def end(self):
        self._written = None

    @torch.no_grad()
    def read(self, name: str) -> torch.Tensor:
        param, index = self._target(name)
        return (param[index] if index else param).detach()

    def names(self) -> list[str]:
        """All checkpoint names this model holds (experts unfused; a tied head counted once, as the
        embedding)."""
        mapped = {n: pname for n, (pname, _) in self._map.items() if n != self._tied_head}
        targets = set(mapped.values())
        return [n for n in self.params if n not in targets] + list(mapped)
