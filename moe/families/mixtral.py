"""Mixtral (8x7B, 8x22B): GQA, top-2 router with renormalised softmax, every layer MoE."""
from __future__ import annotations

from transformers import MixtralConfig

from . import register_family
from .base import MoEFamily, UnsupportedModelError


@register_family
class MixtralFamily(MoEFamily):
    model_type = "mixtral"
    hf_config_class = MixtralConfig

    def family_fields(self, hf):
        if getattr(hf, "sliding_window", None):
            raise UnsupportedModelError("mixtral: sliding_window attention is not supported; set it to null")
        if getattr(hf, "router_jitter_noise", 0.0):
            raise UnsupportedModelError("mixtral: router_jitter_noise > 0 is not supported (RL needs a deterministic router)")
        return {"moe_ffn_hidden_size": hf.intermediate_size}

    def hf_names(self, hf):
        names = super().hf_names(hf)
        m = "model.layers.{i}.block_sparse_moe."
        names.update(
            router=m + "gate.weight",
            expert_gate=m + "experts.{e}.w1.weight",
            expert_up=m + "experts.{e}.w3.weight",
            expert_down=m + "experts.{e}.w2.weight",
        )
        return names
