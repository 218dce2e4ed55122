"""Weight-sync transports: how the learner's export stream reaches a rollout engine, then is verified.

TRANSPORTS (rollout.sync_transport): `in_process` and `disk` here; `sglang_distributed` (SGLang's own
weight-update group) is sglang_distributed.py, beside this module.

Receiver contract (what an engine implements; SGLang's session API has the same shape):
  begin_weight_update() / load_weights([(hf_name, tensor), ...]) / end_weight_update()
                                                  load_weights must copy: the in-process transport
                                                  reuses a bucket's buffers once it returns
  reload_from_disk(hf_dir)                       (disk transport)
  abandon_weight_update()                        optional: after a failed sync, close what begin opened (SGLang
                                                  refuses a begin while a session is open)
  weight_digests(names, algorithm) -> {name: digest}   digests of what the engine now holds, computed
                                                  with the sender's algorithm (stream.digest_algorithm)

Built once per engine through the registry (`from_config(cfg, engine, hf)`); `close()`, where a transport
has one, runs before its engine shuts down. Every transport ends with `digest.verify(sent, received)`: a mismatch raises before any rollout uses
the new weights. All learner ranks call `sync(stream)` (the export is collective); only the stream's
receiving rank talks to the engine.
"""
from __future__ import annotations

import copy
import os

import torch.distributed as dist

from moe.bridge import peft
from moe.bridge.digest import DigestMismatchError, tensor_digest, verify
from moe.bridge.hf_checkpoint import HFCheckpointWriter, write_stream
from moe.bridge.hf_inmemory import HFModelWeights
from moe.bridge.outputs import check_target
from rlpo_mega.algorithms.registry import Registry

TRANSPORTS = Registry("weight-sync transport")


@TRANSPORTS.register("in_process")
class InProcessTransport:
    """The engine lives in this process (the embedded engine): buckets are loaded as they arrive."""

    def __init__(self, receiver):
        self.receiver = receiver

    @classmethod
    def from_config(cls, cfg, engine, hf):
        return cls(engine)

    def sync(self, stream) -> dict:
        try:
            return self._sync(stream)
        except BaseException:
            if stream.receives and hasattr(self.receiver, "abandon_weight_update"):
                self.receiver.abandon_weight_update()  # the next sync's begin must not find a session open
            raise

    def _sync(self, stream) -> dict:
        # A receiver that can digest while it copies (load_weights_verified) takes the sender's digest
        # from the streamed tensor in the same cache-blocked pass; otherwise the stream digests on export
        # and the receiver re-reads what it holds after the update.
        fused = stream.receives and hasattr(self.receiver, "load_weights_verified")
        if fused:
            stream.compute_digests = False
        stream.recycle = True  # the receiver copies each bucket before asking for the next
        if stream.receives:
            self.receiver.begin_weight_update()
        loaded = {}
        for bucket in stream:
            if bucket and stream.receives:
                if fused:
                    sent, got = self.receiver.load_weights_verified(bucket, stream.digest_algorithm)
                    stream.digests.update(sent)
                    loaded.update(got)
                else:
                    self.receiver.load_weights(bucket)
        if not stream.receives:
            return {}
        self.receiver.end_weight_update()
        verify(stream.digests, loaded if fused
               else self.receiver.weight_digests(list(stream.digests), stream.digest_algorithm))
        return {"tensors": len(stream.digests), "bytes": stream.bytes_sent}


@TRANSPORTS.register("disk")
class DiskTransport:
    """Write an HF checkpoint directory (atomically), then the engine reloads it in place."""

    def __init__(self, receiver, directory: str, hf_config, source_dir: str | None = None, adapters: bool = False):
        # at construction, not at the first sync (whose stream is collective): a directory of other files
        # is refused before anything runs; an earlier run's export there is replaced
        check_target(directory, HFCheckpointWriter.KIND, overwrite=True)
        self.receiver, self.directory, self.hf_config, self.source_dir = receiver, directory, hf_config, source_dir
        # rollout.lora_sync=adapter: each sync's PEFT adapter directory, beside the HF export (training/sync.py)
        self.adapter_directory = f"{directory.rstrip(os.sep)}-lora_adapter" if adapters else None
        if adapters:
            check_target(self.adapter_directory, peft.KIND, overwrite=True)

    @classmethod
    def from_config(cls, cfg, engine, hf):
        directory = cfg.rollout.sync_dir or "runs/weight_sync"
        ranks = type(engine).ranks(cfg, dist.get_world_size()) if dist.is_initialized() else [0]
        if len(ranks) > 1:
            # every engine rank writes the whole export and has its engine reload it: one subdirectory each, or
            # one writer would swap the directory out under another's reload (sglang drivers on a shared sync_dir)
            directory = os.path.join(directory, f"driver_{ranks.index(dist.get_rank())}")
        return cls(engine, directory, hf, source_dir=cfg.model.init_from_hf, adapters=cfg.rollout.lora_sync == "adapter")

    def sync(self, stream) -> dict:
        # overwrite: each sync replaces the previous sync's export (and nothing else: a directory of other
        # files is refused). Block FP8 (rollout.weights=fp8): the export is an FP8 checkpoint, its config.json
        # naming its quantization_config as an FP8 HF checkpoint does (the servers load it with their own)
        hf_config = self.hf_config
        quantization = getattr(stream, "quantization_config", None)
        if quantization is not None:
            hf_config = copy.deepcopy(hf_config)
            hf_config.quantization_config = quantization
        write_stream(stream, HFCheckpointWriter(self.directory, hf_config, source_dir=self.source_dir,
                                                overwrite=True)
                     if stream.receives else None)
        if not stream.receives:
            return {}
        self.receiver.reload_from_disk(self.directory)
        verify(stream.digests, self.receiver.weight_digests(list(stream.digests), stream.digest_algorithm))
        return {"tensors": len(stream.digests), "bytes": stream.bytes_sent, "path": self.directory}


class HFModelReceiver:
    """A transformers model as a weight receiver (the embedded engine's weights; also used in tests)."""

    def __init__(self, model):
        self.weights = HFModelWeights(model)
        self.updating = False

    def begin_weight_update(self):
        self.updating = True
        self.weights.begin()

    def load_weights(self, named_tensors):
        self._check_updating()
        self.weights.load(named_tensors)

    def load_weights_verified(self, named_tensors, algorithm: str):
        """Load and return (sent, loaded) digests from one pass over the bytes (InProcessTransport)."""
        self._check_updating()
        return self.weights.load_verified(named_tensors, algorithm)

    def _check_updating(self):
        if not self.updating:
            raise RuntimeError("load_weights outside begin_weight_update()/end_weight_update()")

    def end_weight_update(self):
        self.updating = False
        self.weights.end()

    def reload_from_disk(self, path: str):
        from safetensors import safe_open

        self.begin_weight_update()
        for file in sorted(os.listdir(path)):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(path, file), "pt") as f:
                    self.load_weights([(k, f.get_tensor(k)) for k in f.keys()])
        self.end_weight_update()

    def weight_digests(self, names, algorithm: str) -> dict[str, str]:
        return {n: tensor_digest(self.weights.read(n), algorithm) for n in names}


__all__ = ["TRANSPORTS", "DigestMismatchError", "DiskTransport", "HFModelReceiver",
           "InProcessTransport"]
