"""GLM-4.5 / GLM-4.6 (glm4_moe): GQA with q/k/v biases, optional per-head q/k RMSNorm, partial RoPE
(rotate-half on the first partial_rotary_factor of each head), and the DeepSeek-V3 MoE block
(sigmoid_router.py: sigmoid + score-correction bias, optional group-limited top-k, scaling factor, shared
expert, dense first layers)."""
from __future__ import annotations

from transformers import Glm4MoeConfig

from . import register_family
from .sigmoid_router import SigmoidRouterFamily


@register_family
class Glm4MoeFamily(SigmoidRouterFamily):
    model_type = "glm4_moe"
    hf_config_class = Glm4MoeConfig

    def qk_layernorm(self, hf):
        return bool(hf.use_qk_norm)

    def rotary_percent(self, hf):
        params = getattr(hf, "rope_parameters", None) or {}
        return float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))

    def family_fields(self, hf):
        return self.router_fields(hf)

    def identity(self, hf):
        ident = super().identity(hf)
        ident.update(qkv_bias=self.qkv_bias(hf), qk_norm=self.qk_layernorm(hf),
                     rotary_percent=self.rotary_percent(hf))
        return ident
