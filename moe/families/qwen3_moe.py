"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): q/k RMSNorm, GQA, softmax router, optional dense layers."""
from __future__ import annotations

from transformers import Qwen3MoeConfig

from . import register_family
from .base import MoEFamily, UnsupportedModelError, gated_mlp_names


@register_family
class Qwen3MoeFamily(MoEFamily):
    model_type = "qwen3_moe"
    hf_config_class = Qwen3MoeConfig

    def moe_layer_pattern(self, hf):
        # HF: layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
        dense = set(hf.mlp_only_layers or [])
        step = hf.decoder_sparse_step
        return [
            int(i not in dense and step > 0 and (i + 1) % step == 0) for i in range(hf.num_hidden_layers)
        ]

    def router_pre_softmax(self, hf):
        # norm_topk_prob=True renormalises the top-k softmax probs == softmax over the top-k logits.
        return not hf.norm_topk_prob

    def qk_layernorm(self, hf):
        return True

    def family_fields(self, hf):
        if getattr(hf, "use_sliding_window", False):
            raise UnsupportedModelError("qwen3_moe: use_sliding_window=True is not supported")
        return {"moe_ffn_hidden_size": hf.moe_intermediate_size}

    def hf_names(self, hf):
        return {**super().hf_names(hf), **gated_mlp_names()}
