"""Load HF checkpoint-named tensors into a live transformers model (the embedded engine's side).

transformers 5 holds experts fused in memory (`mlp.experts.gate_up_proj` [E, 2F, H] = gate rows then
up rows; `mlp.experts.down_proj` [E, H, F]) while checkpoints (and our weight stream) name them per
expert. This module maps each streamed name onto its slice of the in-memory parameter, loads it, and
reads the same slice back for the digest check.
"""
from __future__ import annotations

import re

import torch

# checkpoint projection name -> (fused in-memory parameter, which half of gate_up; None = whole)
_EXPERT_PROJ = {
    "gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None), "w2": ("down_proj", None),
}
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")


class HFModelWeights:
    """Name-addressed view of a transformers causal LM's parameters in checkpoint naming."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params = dict(model.named_parameters())
        self._pname = {id(p): n for n, p in self.params.items()}
        tied = getattr(model.config, "tie_word_embeddings", False)
        self.tied = tied
        # name -> (view, parameter name, index key, the key's prefixes); the parameters are fixed
        self._slots: dict[str, tuple] = {}

    def _target(self, name: str):
        """(parameter, view index) for a checkpoint-named tensor."""
        m = _EXPERT.match(name)
        if m:
            layer, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            if proj not in _EXPERT_PROJ:
                raise KeyError(f"unknown expert projection in {name!r}")
            fused, half = _EXPERT_PROJ[proj]
            param = self.params[f"{layer}.mlp.experts.{fused}"]
            if half is None:
                return param, (expert,)
            rows = param.shape[1] // 2
            return param, (expert, slice(half * rows, (half + 1) * rows))
        m = _ROUTER.match(name)
        if m:
            name = f"{m.group(1)}.mlp.gate.weight"
        if name == "lm_head.weight" and self.tied:
            name = "model.embed_tokens.weight"
        if name not in self.params:
            raise KeyError(f"streamed tensor {name!r} has no parameter in {type(self.model).__name__}")
        return self.params[name], ()

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
        from moe.bridge.digest import copy_with_digests

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
        """All checkpoint names this model holds (experts unfused)."""
        out = []
        for pname, p in self.params.items():
            m = re.match(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", pname)
            if not m:
                out.append(pname)
                continue
            style = "block_sparse_moe" if self.model.config.model_type == "mixtral" else "mlp"
            gate, up, down = (("w1", "w3", "w2") if style == "block_sparse_moe"
                              else ("gate_proj", "up_proj", "down_proj"))
            for e in range(p.shape[0]):
                base = f"{m.group(1)}.{style}.experts.{e}."
                out += [base + gate + ".weight", base + up + ".weight"] if m.group(2) == "gate_up_proj" \
                    else [base + down + ".weight"]
        return out
