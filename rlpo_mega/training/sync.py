"""Phase 6 of an RL step, and of the run's start: the learner's weights to the rollout engine(s).

The export stream (moe.bridge.megatron_io) gathers each parameter from the learner's layout into HF names and
the engine's dtype, bucket by bucket; the configured transport (rlpo_mega.weight_sync) delivers it and
verifies the digests. Every rank takes part in the export; only the engine ranks receive, each the full weights.
"""
from __future__ import annotations

import torch.distributed as dist

from moe.bridge.megatron_io import ExportStream
from rlpo_mega.model_setup import PARAMS_DTYPES
from rlpo_mega.training.engines import engine_ranks


def sync_weights(chunks, cfg, slot) -> dict:
    """Learner -> engine(s) through `slot`'s transport (training/engines.EngineSlot), digest-verified."""
    ranks = engine_ranks(cfg)
    # every rank an engine (embedded): one broadcast per tensor; a few (SGLang drivers): sent to each of them
    dst = None if len(ranks) == dist.get_world_size() else ranks
    # every tensor in the engine's dtype (= model.params_dtype): megatron's local spec keeps some
    # parameters (torch norms) in fp32 under bf16, and the engine holds the checkpoint dtype
    stream = ExportStream(chunks, bucket_bytes=cfg.rollout.sync_bucket_mb << 20, dst=dst,
                          vocab_divisible_by=cfg.model.vocab_divisible_by, dtype=PARAMS_DTYPES[cfg.model.params_dtype])
    if not stream.receives:  # ranks without an engine take part in the collective export only
        for _ in stream:
            pass
        return {}
    return slot.transport.sync(stream)
