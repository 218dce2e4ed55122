"""Megatron <-> HF parameter mapping: names, fused layouts and tensor-parallel shard math.

A `ParamMap` ties one megatron parameter (global name, as at TP1/PP1/EP1) to the HF tensors it is made
of, with a `kind` saying how it is fused and sharded:

  replicated  norms, q/k norms, router: identical on every TP rank
  vocab       embedding / output layer: rows split over TP, vocabulary padded with zero rows
  qkv         linear_qkv: rows grouped per KV group [q heads of the group, k, v], groups split over TP
  glu         linear_fc1 of a SwiGLU MLP: [gate; up], each of gate and up split over TP
  column      a column-parallel linear kept whole in HF (MLA's projections): rows split over TP; where
              megatron keeps it whole on every rank (Transformer Engine's duplicated down-projections)
              it is replicated (megatron_io reads that from the parameter)
  row         linear_proj / linear_fc2: columns split over TP

Everything here is pure tensor code (no process groups), so it is tested directly against
transformers' own modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe.families import VALUE_HEAD_HF, get_family
from moe.model import padded_vocab_size


@dataclass(frozen=True)
class ParamMap:
    megatron: str  # global megatron name (layer and expert indices global)
    hf: tuple[str, ...]  # HF names, in the order the kind fuses them
    kind: str
    layer: Optional[int] = None  # global decoder layer (None: embedding / final norm / output)
    expert: Optional[int] = None  # global expert index (None: not an expert parameter)
    shapes: Optional[tuple] = None  # the HF tensors' shapes where the family states them (attention)
    fp32: bool = False  # kept in fp32 whatever the model dtype, by megatron, transformers and SGLang alike
    with_previous: bool = False  # synced in the previous map's bucket (an engine fuses the two on load)


@dataclass(frozen=True)
class Dims:
    """Sizes the shard math needs."""

    heads: int
    groups: int
    head_dim: int
    vocab: int
    padded_vocab: int

    @classmethod
    def of(cls, hf, vocab_divisible_by: int = 128, tensor_parallel: int = 1):
        family = get_family(hf.model_type)
        return cls(hf.num_attention_heads, hf.num_key_value_heads, family.head_dim(hf), hf.vocab_size,
                   padded_vocab_size(hf.vocab_size, vocab_divisible_by, tensor_parallel))


def param_maps(hf, value_head: bool = False) -> list[ParamMap]:
    """Every parameter of the model in a fixed order (the export and sync order). value_head: the critic
    (moe.value_head): its head is HF's token-classification `score` in place of the LM head."""
    family = get_family(hf.model_type)
    n = family.hf_names(hf)
    pattern = family.moe_layer_pattern(hf)
    experts = family.num_experts(hf)
    together = family.loaded_with_previous(hf)
    maps = [ParamMap("embedding.word_embeddings.weight", (n["embedding"],), "vocab")]
    for i in range(hf.num_hidden_layers):
        d = f"decoder.layers.{i}."
        f = lambda key, e=None: n[key].format(i=i, e=e)  # noqa: E731
        maps.append(ParamMap(d + "input_layernorm.weight", (f("input_norm"),), "replicated", i))
        maps += [ParamMap(d + "self_attention." + name, tuple(f(k) for k in keys), kind, i, shapes=shapes,
                          with_previous=bool(set(keys) & together))
                 for name, keys, kind, shapes in family.attention_maps(hf)]
        maps.append(ParamMap(d + "pre_mlp_layernorm.weight", (f("post_attn_norm"),), "replicated", i))
        if pattern[i]:
            maps.append(ParamMap(d + "mlp.router.weight", (f("router"),), "replicated", i))
            if family.expert_bias(hf):  # a buffer, not a parameter: loaded, exported and synced all the same
                maps.append(ParamMap(d + "mlp.router.expert_bias", (f("router_bias"),), "replicated", i,
                                     fp32=family.fp32_hf_tensor(hf, f("router_bias"))))
            if family.shared_expert_size(hf):  # split over TP like a dense MLP (not an expert parameter)
                maps += [
                    ParamMap(d + "mlp.shared_experts.linear_fc1.weight", (f("shared_gate"), f("shared_up")),
                             "glu", i),
                    ParamMap(d + "mlp.shared_experts.linear_fc2.weight", (f("shared_down"),), "row", i),
                ]
            for e in range(experts):
                x = d + f"mlp.experts.local_experts.{e}."
                maps += [
                    ParamMap(x + "linear_fc1.weight", (f("expert_gate", e), f("expert_up", e)), "glu", i, e),
                    ParamMap(x + "linear_fc2.weight", (f("expert_down", e),), "row", i, e),
                ]
        else:
            maps += [
                ParamMap(d + "mlp.linear_fc1.weight", (f("dense_gate"), f("dense_up")), "glu", i),
                ParamMap(d + "mlp.linear_fc2.weight", (f("dense_down"),), "row", i),
            ]
    maps.append(ParamMap("decoder.final_layernorm.weight", (n["final_norm"],), "replicated"))
    if value_head:
        maps += [ParamMap("output_layer.weight", (VALUE_HEAD_HF[0],), "replicated"),
                 ParamMap("output_layer.bias", (VALUE_HEAD_HF[1],), "replicated")]
    elif not hf.tie_word_embeddings:
        maps.append(ParamMap("output_layer.weight", (n["output"],), "vocab"))
    return maps


# ---- HF tensors <-> full megatron tensor (TP1 layout) -------------------------------------------
def hf_to_full(kind: str, tensors: list[torch.Tensor], dims: Dims) -> torch.Tensor:
    if kind == "qkv":  # weights [rows, hidden] and biases [rows] alike
        q, k, v = tensors
        g, hd = dims.groups, dims.head_dim
        rest = tuple(q.shape[1:])
        return torch.cat([q.reshape(g, -1, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)],
                         dim=1).reshape(-1, *rest)
    if kind == "glu":
        return torch.cat(tensors, dim=0)
    if kind == "vocab":
        (w,) = tensors
        pad = dims.padded_vocab - w.shape[0]
        return torch.cat([w, w.new_zeros((pad,) + tuple(w.shape[1:]))]) if pad else w
    (w,) = tensors
    return w


def new_tensor(shape, dtype, device) -> torch.Tensor:
    """The default allocator of full_to_hf and the export (ExportStream may pass a pooled one)."""
    return torch.empty(shape, dtype=dtype, device=device)


def full_to_hf(kind: str, full: torch.Tensor, dims: Dims, empty=new_tensor) -> list[torch.Tensor]:
    """HF tensors (contiguous) of one full megatron tensor; `empty(shape, dtype, device)` allocates the
    q/k/v copies (the only ones made: other kinds are views of `full`)."""
    if kind == "qkv":
        g, hd = dims.groups, dims.head_dim
        per_group = dims.heads // g
        rest = tuple(full.shape[1:])
        grouped = full.reshape(g, per_group + 2, hd, *rest)
        out = []
        for part in (grouped[:, :per_group], grouped[:, per_group:per_group + 1], grouped[:, per_group + 1:]):
            t = empty((part.shape[0] * part.shape[1] * hd, *rest), full.dtype, full.device)
            t.view(part.shape).copy_(part)
            out.append(t)
        return out
    if kind == "glu":
        return [t.contiguous() for t in full.chunk(2, dim=0)]
    if kind == "vocab":
        return [full[: dims.vocab].contiguous()]
    return [full]


# ---- full megatron tensor <-> tensor-parallel shards ---------------------------------------------
def full_to_shard(kind: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if size == 1 or kind == "replicated":
        return full
    if kind in ("qkv", "vocab", "column"):  # qkv rows are group-major, so a contiguous split splits groups
        return full.chunk(size, dim=0)[rank].contiguous()
    if kind == "glu":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]]).contiguous()
    if kind == "row":
        return full.chunk(size, dim=1)[rank].contiguous()
    raise ValueError(f"unknown parameter kind {kind!r}")


def shards_to_full(kind: str, shards: list[torch.Tensor]) -> torch.Tensor:
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind in ("qkv", "vocab", "column"):
        return torch.cat(shards, dim=0)
    if kind == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    raise ValueError(f"unknown parameter kind {kind!r}")


def hf_row_ranges(kind: str, dims: Dims, hf_shapes: list[tuple], rank: int, size: int):
    """For reading only this TP rank's slice: per HF tensor, (dim, start, stop) to read."""
    if size == 1 or kind == "replicated":
        return [(0, 0, s[0]) for s in hf_shapes]
    if kind == "qkv":
        g0, g1 = rank * dims.groups // size, (rank + 1) * dims.groups // size
        per_group = [s[0] // dims.groups for s in hf_shapes]  # rows per KV group in q, k, v
        return [(0, g0 * r, g1 * r) for r in per_group]
    if kind in ("glu", "column"):
        return [(0, rank * s[0] // size, (rank + 1) * s[0] // size) for s in hf_shapes]
    if kind == "row":
        return [(1, rank * s[1] // size, (rank + 1) * s[1] // size) for s in hf_shapes]
    if kind == "vocab":
        rows = dims.padded_vocab // size
        return [(0, min(rank * rows, s[0]), min((rank + 1) * rows, s[0])) for s in hf_shapes]
    raise ValueError(f"unknown parameter kind {kind!r}")


def shard_to_hf(kind: str, shard: torch.Tensor, dims: Dims, rank: int, size: int, empty=new_tensor) -> list[torch.Tensor]:
    """Inverse of `hf_slices_to_shard`: this rank's megatron shard -> its slice of each HF tensor (the rows or
    columns `hf_row_ranges` names; views of the shard except q/k/v, which `empty` allocates). What a rank sends
    of its own shard without gathering the parameter (moe/bridge/reshard.py)."""
    if size == 1 or kind == "replicated":
        return full_to_hf(kind, shard, dims, empty)
    if kind == "vocab":
        ((_, start, stop),) = hf_row_ranges(kind, dims, [(dims.vocab,)], rank, size)
        return [shard[: stop - start]]
    if kind == "qkv":
        local = Dims(dims.heads // size, dims.groups // size, dims.head_dim, dims.vocab, dims.padded_vocab)
        return full_to_hf("qkv", shard, local, empty)
    if kind == "glu":
        return list(shard.chunk(2, dim=0))
    return [shard]


def hf_slices_to_shard(kind: str, slices: list[torch.Tensor], dims: Dims, rank: int, size: int):
    """Inverse of `hf_row_ranges`: the HF slices this rank read -> its megatron shard."""
    if kind == "vocab":
        (w,) = slices
        rows = dims.padded_vocab // size
        pad = rows - w.shape[0]
        return torch.cat([w, w.new_zeros((pad,) + tuple(w.shape[1:]))]) if pad else w
    if kind == "qkv":
        local = Dims(dims.heads // size, dims.groups // size, dims.head_dim, dims.vocab, dims.padded_vocab)
        return hf_to_full("qkv", slices, local)
    if kind == "glu":
        return torch.cat(slices, dim=0)
    (w,) = slices
    return w
