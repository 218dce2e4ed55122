"""Phase 6 of an RL step, and of the run's start: the learner's weights to the rollout engine(s).

The export stream (moe.bridge.megatron_io) gathers each parameter from the learner's layout into HF names and
the engine's dtype, bucket by bucket; the configured transport (rlpo_mega.weight_sync) delivers it and
verifies the digests. Every rank takes part in the export; only the engine ranks receive, each the full weights.
Colocated SGLang servers (rollout.colocate) are the exception: every rank receives, and the rank on each server
rank's GPU makes that rank's payload, which the driver gathers and posts (weight_sync/sglang_payloads.py).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from moe.bridge.fp8 import Fp8Selection, QuantizedStream, sglang_quantization_config
from moe.bridge.digest import sha256
from moe.bridge.megatron_io import AdapterStream, ExportStream, stacked_factors
from moe.bridge.peft import sglang_adapter
from moe.bridge.peft import write_dir as write_adapter
from rlpo_mega.model_setup import PARAMS_DTYPES
from rlpo_mega.rollout import ENGINES, EngineError
from rlpo_mega.rollout.engines import engine_ranks
from rlpo_mega.weight_sync.sglang_payloads import PayloadRelay, tied_aliases


def sync_weights(chunks, cfg, slot) -> dict:
    """Learner -> engine(s) through `slot`'s transport (rollout/engines.EngineSlot), digest-verified."""
    if cfg.rollout.lora_sync == "adapter":
        return sync_adapter(chunks, cfg, slot)
    return _sync_model(chunks, cfg, slot)


def sync_adapter(chunks, cfg, slot) -> dict:
    """rollout.lora_sync=adapter: the servers hold the frozen base and the run's adapter beside it. The base goes
    whole (unmerged, through the transport, digest-verified) when a server lacks it -- the run's first sync, a
    server restarted or rejoining: decided together, the export being collective -- then the factors alone,
    gathered whole from the learner's layout onto the drivers (megatron_io.AdapterStream) in the layout SGLang loads
    (moe/bridge/peft.sglang_adapter), each checked by its sha256 inside the server (in_process), or written as a
    PEFT directory the servers load (disk)."""
    engine = slot.engine
    need = torch.tensor([int(engine is not None and engine.needs_base())])
    dist.all_reduce(need, op=dist.ReduceOp.MAX, group=_control_group(cfg, slot))
    report = _sync_model(chunks, cfg, slot, merged=False) if need.item() else {}
    ranks = engine_ranks(cfg)
    stream = AdapterStream(chunks, bucket_bytes=cfg.rollout.sync_bucket_mb << 20,
                           dst=None if len(ranks) == dist.get_world_size() else ranks)
    named = [item for bucket in stream for item in bucket]  # every rank takes part; the drivers receive
    if not stream.receives:
        return report
    lo = cfg.model.lora
    config, tensors = sglang_adapter(slot.hf, lo.rank, lo.alpha, lo.targets, stacked_factors(named))
    # to the host once (SGLang holds adapters there, lora/lora.py): what is digested is what is sent
    tensors = {n: t.cpu() for n, t in tensors.items()}
    sent = sum(t.numel() * t.element_size() for t in tensors.values())
    if cfg.rollout.sync_transport == "disk":
        path = slot.transport.adapter_directory  # checked when the transport was built: its own, or new
        write_adapter(path, config, tensors, overwrite=True)
        engine.load_adapter_from_disk(path)
    else:
        engine.load_adapter(config, tensors, {n: sha256(t) for n, t in tensors.items()})
    return {**report, "adapter_tensors": len(tensors), "adapter_bytes": sent, "base_sent": bool(need.item())}


def _control_group(cfg, slot):
    if slot.group is not None:
        return slot.group
    from rlpo_mega import distributed  # a slot built without the trainer's control group

    return distributed.control_group(cfg.rollout.wait_timeout)


def _sync_model(chunks, cfg, slot, merged: bool = True) -> dict:
    """The whole model (a LoRA run's adapters merged into it, or its frozen base alone: merged=False)."""
    if getattr(slot.transport, "all_ranks", False):  # every rank sends its own shards (rollout.sync_transport=reshard)
        return slot.transport.sync_model(chunks)
    ranks = engine_ranks(cfg)
    relay = payload_relay(cfg, slot)
    # every rank an engine (embedded), or colocated servers on (normally) every GPU: one broadcast per tensor; a
    # few (SGLang drivers): sent to each of them
    dst = None if relay is not None or len(ranks) == dist.get_world_size() else ranks
    # every tensor in the engine's dtype (= model.params_dtype): megatron's local spec keeps some
    # parameters (torch norms) in fp32 under bf16, and the engine holds the checkpoint dtype. FP8 servers serve in
    # bf16 (SGLang's fp8 takes bf16 or fp16 only: model_loader/loader.py:268): the tensors kept unquantised go in
    # bf16, and the quantised ones are quantised from bf16, as on a bf16 learner
    dtype = torch.bfloat16 if cfg.rollout.weights == "fp8" else PARAMS_DTYPES[cfg.model.params_dtype]
    stream = ExportStream(chunks, bucket_bytes=cfg.rollout.sync_bucket_mb << 20, dst=dst,
                          vocab_divisible_by=cfg.model.vocab_divisible_by, dtype=dtype, merged=merged)
    if cfg.rollout.weights == "fp8":  # quantised on the receiving ranks, after the bridge made the HF tensors
        stream = QuantizedStream(stream, Fp8Selection(slot.hf),
                                 quantization_config=sglang_quantization_config(slot.hf))
    if not stream.receives:  # ranks without an engine take part in the collective export only
        for _ in stream:
            pass
        return {}
    if relay is not None:
        if not relay.drives:  # its server ranks' payloads to their drivers, bucket by bucket
            relay.produce(stream)
            return {}
        stream = relay.gathering(stream)
    stream = Resumable(stream)
    try:
        return slot.transport.sync(stream)
    except EngineError:
        stream.drain()  # the other ranks' collectives of this export complete; the failure is agreed after
        raise


def payload_relay(cfg, slot) -> Optional[PayloadRelay]:
    """rollout.colocate with an engine whose servers take per-GPU payloads (SGLang): this sync's relay, on every
    rank (each server TP rank's payload made by the learner rank on its GPU, gathered by its driver over the
    control group); None otherwise."""
    engine = ENGINES.get(cfg.rollout.engine)
    if not (cfg.rollout.colocate and cfg.rollout.sync_transport == "in_process"
            and hasattr(engine, "colocated_placements")):
        return None
    world = dist.get_world_size()
    servers = engine.colocated_placements(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return PayloadRelay(servers, dist.get_rank(), _control_group(cfg, slot), tied_aliases(slot.hf))


class Resumable:
    """An export stream as a transport sees it, its one iterator kept: when a receiving rank's transport fails
    half-way (a server dead mid-sync), `drain` runs the rest of the same export, so the other ranks' collectives
    (sends to this rank, all-gathers) complete and the failure is agreed by all on the control group
    (engines.EngineGuard) instead of leaving them in NCCL until its timeout."""

    def __init__(self, stream):
        object.__setattr__(self, "_stream", stream)
        object.__setattr__(self, "_it", None)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __setattr__(self, name, value):  # the transport's settings (compute_digests, recycle) are the stream's
        setattr(self._stream, name, value)

    def __iter__(self):
        if self._it is None:
            object.__setattr__(self, "_it", iter(self._stream))
        return self._it

    def drain(self):
        for _ in self:
            pass
