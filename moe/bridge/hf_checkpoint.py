"""HF checkpoint directories: indexed lazy reads (slices only), validation, and atomic writes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe.families import get_family
from moe.model import load_hf_config

from . import outputs
from .mapping import param_maps

# Files copied through on export so that `from_pretrained` and tokenizers work on the result.
PASSTHROUGH = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
               "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")


class CheckpointFormatError(ValueError):
    pass


def expected_hf_shapes(hf, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a released checkpoint of this config holds (value_head: a critic's, with
    the token-classification head `score` [1, hidden] + [1] in place of the LM head)."""
    family = get_family(hf.model_type)
    h, hd = hf.hidden_size, family.head_dim(hf)
    q, kv = hf.num_attention_heads * hd, hf.num_key_value_heads * hd
    experts = family.num_experts(hf)
    f_moe = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    f_dense = hf.intermediate_size
    shapes = {}
    for m in param_maps(hf, value_head):
        kind, names = m.kind, m.hf
        if m.shapes is not None:
            shapes.update(zip(names, m.shapes))
        elif m.megatron.startswith("output_layer.") and value_head:
            shapes[names[0]] = (1, h) if m.megatron.endswith("weight") else (1,)
        elif kind == "vocab":
            shapes[names[0]] = (hf.vocab_size, h)
        elif kind == "qkv":
            bias = m.megatron.endswith(".bias")
            shapes.update({n: (rows,) if bias else (rows, h) for n, rows in zip(names, (q, kv, kv))})
        elif m.megatron.endswith("linear_proj.weight"):
            shapes[names[0]] = (h, q)
        elif m.megatron.endswith("router.weight"):
            shapes[names[0]] = (experts, h)
        elif m.megatron.endswith("router.expert_bias"):
            shapes[names[0]] = (experts,)
        elif kind in ("glu", "row"):
            f = f_moe if m.expert is not None else f_dense
            if ".shared_experts." in m.megatron:
                f = family.shared_expert_size(hf)
            if kind == "glu":
                shapes.update({names[0]: (f, h), names[1]: (f, h)})
            else:
                shapes[names[0]] = (h, f)
        elif "layernorm" in m.megatron and "self_attention" in m.megatron:
            shapes[names[0]] = (hd,)
        else:
            shapes[names[0]] = (h,)
    return shapes


class HFCheckpoint:
    """Lazy view of a safetensors checkpoint directory (sharded or not); reads slices on demand."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isdir(path):
            raise FileNotFoundError(f"HF checkpoint directory {path!r} does not exist")
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.file_of = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            files = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
            if not files:
                raise CheckpointFormatError(f"{path!r} holds no *.safetensors files; export the model "
                                            "with safetensors (save_pretrained(safe_serialization=True))")
            self.file_of = {}
            for file in files:
                with safe_open(os.path.join(path, file), "pt") as f:
                    self.file_of.update({k: os.path.join(path, file) for k in f.keys()})
        self._handles = {}

    def _handle(self, file):
        if file not in self._handles:
            self._handles[file] = safe_open(file, "pt")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.file_of[name]).get_slice(name).get_shape())

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None):
        sl = self._handle(self.file_of[name]).get_slice(name)
        if start is None:
            return sl[:]
        return sl[start:stop] if dim == 0 else sl[:, start:stop]

    def validate(self, hf, value_head: bool = False, ignore: tuple = ()):
        """Every expected tensor present with its shape, nothing unexplained: one error naming the cause.
        ignore: names that may be present and are not read (a policy checkpoint's LM head, for a critic)."""
        expected = {k: v for k, v in expected_hf_shapes(hf, value_head).items() if k not in ignore}
        family = get_family(hf.model_type)
        extra = sorted(n for n in set(self.file_of) - set(expected) if not family.extra_hf_tensor(hf, n))
        expert_extra = [n for n in extra if ".experts." in n]
        if expert_extra:
            found = {int(n.split(".experts.")[1].split(".")[0]) for n in self.file_of if ".experts." in n}
            raise CheckpointFormatError(
                f"{self.path}: checkpoint has experts up to index {max(found)} ({len(found)} experts) but the "
                f"config's num_experts is {family.num_experts(hf)} (e.g. unexpected tensor {expert_extra[0]!r}); "
                "use the config.json that belongs to this checkpoint")
        missing = [n for n in expected if n not in self.file_of]
        if missing:
            raise CheckpointFormatError(
                f"{self.path}: tensor {missing[0]!r} is missing ({len(missing)} missing in all); the checkpoint "
                "is incomplete or belongs to another architecture")
        for name, shape in expected.items():
            got = self.shape(name)
            if got != shape:
                raise CheckpointFormatError(
                    f"{self.path}: tensor {name!r} has shape {list(got)} but the config implies {list(shape)}")
        unexplained = [n for n in extra if not n.endswith("rotary_emb.inv_freq") and n not in ignore]
        if unexplained:
            raise CheckpointFormatError(f"{self.path}: unexpected tensor {unexplained[0]!r} "
                                        f"({len(unexplained)} in all) that the {hf.model_type} mapping does not know")


FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_BYTES = 16, 1 << 16


def fingerprint(path: str) -> str:
    """What tells an HF checkpoint's weights from another's without reading them (a LoRA run's adapter-only
    checkpoint records its base's, and a resume or an export from another base is refused): the sha256 of each
    safetensors file's name, size and header (every tensor's name, dtype, shape and offsets) and of 16 samples of
    64 KiB spread evenly through its data. Another architecture or layout differs in a header; another fine-tune of
    the same one (a full fine-tune, or a LoRA merged into attention and experts: most of the bytes) in the samples.
    A change confined to bytes between the samples is not seen: 1 MiB read per file, where the weights are GBs."""
    ckpt = HFCheckpoint(path)
    h = hashlib.sha256()
    for file in sorted(set(ckpt.file_of.values())):
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f"{os.path.basename(file)}/{size}/".encode())
            h.update(f.read(n))
            start = 8 + n
            for k in range(FINGERPRINT_SAMPLES):
                f.seek(start + (size - start) * k // FINGERPRINT_SAMPLES)
                h.update(f.read(FINGERPRINT_SAMPLE_BYTES))
    return h.hexdigest()


def load_hf_dir_config(path: str):
    return load_hf_config(os.path.join(path, "config.json"))


class HFCheckpointWriter:
    """Writes safetensors shards into a fresh temporary sibling of `out` and renames it to `out` on close: no
    half-written output. `out` must be absent or empty, or (overwrite=True) an earlier HF export: nothing
    else is ever replaced (moe/bridge/outputs.py)."""

    KIND = "hf_export"

    def __init__(self, out_dir: str, hf_config, shard_bytes: int = 2 << 30, source_dir: str | None = None,
                 overwrite: bool = False):
        self.out = os.path.abspath(out_dir)
        outputs.check_target(self.out, self.KIND, overwrite)
        self.tmp = outputs.temp_sibling(self.out)
        self.hf_config = hf_config
        self.shard_bytes = shard_bytes
        self.source_dir = source_dir
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor):
        self.pending[name] = tensor.detach().contiguous().cpu()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self):
        if not self.pending:
            return
        file = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, os.path.join(self.tmp, file), metadata={"format": "pt"})
        self.files.append((file, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def abort(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def close(self):
        self._flush()
        weight_map = {n: f for f, names in self.files for n in names}
        with open(os.path.join(self.tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
        self.hf_config.save_pretrained(self.tmp)
        if self.source_dir:
            for name in PASSTHROUGH:
                src = os.path.join(self.source_dir, name)
                if os.path.isfile(src):
                    shutil.copy2(src, os.path.join(self.tmp, name))
        outputs.mark(self.tmp, self.KIND)
        outputs.swap_in(self.tmp, self.out)


def write_stream(stream, writer: "HFCheckpointWriter | None"):
    """Drain an export stream into `writer` (None on ranks that only take part in the collective);
    on any error the partial output is removed and the error propagates."""
    try:
        for bucket in stream:
            for name, tensor in bucket:
                writer.add(name, tensor)
    except BaseException:
        if writer:
            writer.abort()
        raise
    if writer:
        writer.close()
