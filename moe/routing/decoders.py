"""Rollout engines' routing output -> per-sample traces (moe.routing.trace contract).

- SGLang: `meta_info["routed_experts"]` is base64 of little-endian int32 shaped
  [prompt + completion - 1 - start_len, num_hidden_layers, topk] over ALL hidden layers (dense ones too,
  with garbage ids); `routed_experts_start_len` makes a request return rows from that absolute position
  on, so a multi-turn sample is assembled from several pieces.
- The embedded HF engine: forward hooks on each MoE block's router (`model.model.layers[i].mlp.gate`)
  give the same [tokens - 1, layers, topk] contract, also under `generate` (prefill rows, then one row per
  decoding step; the last sampled token never runs a forward).
"""
from __future__ import annotations

import base64
from typing import Optional, Sequence

import numpy as np
import torch

from .trace import RoutingTrace, RoutingTraceError, TraceSpec, validate_trace


def decode_sglang(data, num_hidden_layers: int, topk: int) -> torch.Tensor:
    """base64 (str/bytes) or an already-decoded array -> int32 [rows, num_hidden_layers, topk]."""
    if data is None:
        raise RoutingTraceError("routed_experts is None: the engine returned no routes for this sample")
    if isinstance(data, (str, bytes)):
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError as e:  # binascii.Error
            raise RoutingTraceError(f"routed_experts: not valid base64 ({e})") from None
        if len(raw) % 4:
            raise RoutingTraceError(f"routed_experts: {len(raw)} bytes is not a whole number of int32")
        arr = np.frombuffer(raw, dtype="<i4")
    else:
        try:
            arr = np.asarray(data, dtype=np.int64)
        except (TypeError, ValueError) as e:
            raise RoutingTraceError(f"routed_experts: not base64 or an array of expert ids ({e})") from None
    per_row = num_hidden_layers * topk
    if arr.size % per_row:
        raise RoutingTraceError(f"routed_experts: {arr.size} ids is not a multiple of num_hidden_layers * "
                                f"topk = {num_hidden_layers} * {topk}")
    return torch.from_numpy(arr.astype(np.int32)).reshape(-1, num_hidden_layers, topk)


def assemble_pieces(pieces: Sequence[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, dict]:
    """Multi-turn: (start_len, rows) pieces -> one [rows, layers, topk] tensor over absolute positions.

    A gap (a position no piece covers) is filled with -1, which validation reports as missing route data
    naming the token. Where pieces overlap the earlier piece is kept: its routes are the ones the tokens
    were generated under.
    """
    if not pieces:
        raise RoutingTraceError("no routed_experts pieces")
    pieces = sorted(pieces, key=lambda p: p[0])
    end = max(s + r.shape[0] for s, r in pieces)
    shape = pieces[0][1].shape[1:]
    out = torch.full((end, *shape), -1, dtype=torch.int32)
    filled = torch.zeros(end, dtype=torch.bool)
    overlap = 0
    for start, rows in pieces:
        if start < 0:
            raise RoutingTraceError(f"routed_experts_start_len={start} is negative")
        if rows.shape[1:] != shape:
            raise RoutingTraceError(f"routed_experts pieces disagree in shape: {tuple(rows.shape[1:])} vs {tuple(shape)}")
        pos = torch.arange(start, start + rows.shape[0])
        new = ~filled[pos]
        overlap += int((~new).sum())
        out[pos[new]] = rows[new].to(torch.int32)
        filled[pos] = True
    return out, {"gap_rows": int((~filled).sum()), "overlap_rows": overlap}


def select_moe_layers(rows: torch.Tensor, spec: TraceSpec, num_hidden_layers: Optional[int] = None) -> torch.Tensor:
    """All-hidden-layer rows -> the MoE layers' columns (dense-layer rows are dropped)."""
    if rows.dim() != 3:
        raise RoutingTraceError(f"expected [rows, layers, topk], got shape {tuple(rows.shape)}")
    if num_hidden_layers is not None and rows.shape[1] != num_hidden_layers:
        raise RoutingTraceError(f"{rows.shape[1]} layers of routes, the model has {num_hidden_layers}")
    if spec.moe_layers and max(spec.moe_layers) >= rows.shape[1]:
        raise RoutingTraceError(f"routes cover {rows.shape[1]} layers; MoE layer {max(spec.moe_layers)} is missing")
    return rows[:, list(spec.moe_layers)]


def sglang_trace(pieces, spec: TraceSpec, num_hidden_layers: int, num_tokens: int, sample,
                 on_error: str = "error") -> RoutingTrace:
    """One sample's SGLang output -> validated RoutingTrace.

    pieces: `meta_info["routed_experts"]` (single turn) or [(routed_experts_start_len, routed_experts), ...].
    num_tokens: prompt + completion - 1 of the whole sample as the trainer sees it.
    """
    if isinstance(pieces, (str, bytes)):
        pieces = [(0, pieces)]
    decoded = [(int(s), decode_sglang(d, num_hidden_layers, spec.topk)) for s, d in pieces]
    rows, _ = assemble_pieces(decoded)
    return validate_trace(select_moe_layers(rows, spec, num_hidden_layers), spec, num_tokens, sample, on_error)


def encode_sglang(rows: torch.Tensor) -> str:
    """The inverse of decode_sglang (tests, fake engines)."""
    return base64.b64encode(np.ascontiguousarray(rows.numpy().astype("<i4")).tobytes()).decode()


class HFRouteCapture:
    """Context manager recording the top-k ids of every MoE router of an HF transformers MoE model.

    `routes()` -> [batch, positions, moe_layers, topk] over all forward calls so far (a full forward, or
    prefill + one position per decoding step under `generate`). The embedded rollout engine uses it.
    """

    def __init__(self, model, spec: TraceSpec):
        self.spec = spec
        layers = model.model.layers
        self._handles = []
        self._calls: dict[int, list[torch.Tensor]] = {i: [] for i in spec.moe_layers}
        self._pending: dict[int, torch.Tensor] = {}
        for i in spec.moe_layers:
            block = layers[i].mlp
            gate = getattr(block, "gate", None)
            if gate is None:
                raise ValueError(f"decoder layer {i} has no MoE router (mlp.gate); the family's MoE layer "
                                 "pattern disagrees with the model")
            self._handles.append(gate.register_forward_hook(self._gate_hook(i)))
            self._handles.append(block.register_forward_hook(self._block_hook(i)))

    def _gate_hook(self, i):
        def hook(module, args, output):
            if isinstance(output, tuple) and len(output) >= 3:
                idx = output[2]
            else:  # routers returning logits only: the HF top-k of the softmax
                logits = output[0] if isinstance(output, tuple) else output
                idx = torch.topk(torch.softmax(logits.float(), -1), self.spec.topk, dim=-1).indices
            self._pending[i] = idx.detach()

        return hook

    def _block_hook(self, i):
        def hook(module, args, output):
            b, s = args[0].shape[:2]  # the block sees [batch, positions, hidden]; the gate a flat view
            self._calls[i].append(self._pending.pop(i).reshape(b, s, -1).to(torch.int32))

        return hook

    def routes(self) -> torch.Tensor:
        per_layer = [torch.cat(self._calls[i], dim=1) for i in self.spec.moe_layers]
        return torch.stack(per_layer, dim=2)

    def sample(self, b: int, positions=None) -> torch.Tensor:
        """Sample b's rows [T, L, k]; `positions` selects its real tokens (e.g. left padding removed)."""
        r = self.routes()[b]
        return r if positions is None else r[positions]

    def clear(self):
        for v in self._calls.values():
            v.clear()

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
