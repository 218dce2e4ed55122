"""DeepSeek-V3 / Kimi-K2 (deepseek_v3): multi-latent attention (MLA) and the DeepSeek-V3 MoE block
(sigmoid_router.py).

MLA (megatron-core's MLASelfAttention, MLATransformerConfig):
  q  = q_b_proj(RMSNorm(q_a_proj(x)))            [heads, nope + rope]  (q_proj(x) when q_lora_rank is null)
  kv = kv_a_proj_with_mqa(x) -> [kv_lora | rope]; k_rope is shared by every head
  k, v = kv_b_proj(RMSNorm(kv_lora))            [heads, nope + v]
  RoPE on the rope parts only. HF's rope_interleave=True keeps those dims interleaved in the weights and
  de-interleaves them before rotate-half; megatron's MLA RoPE does the same (rope_utils,
  multi_latent_attention=True), so the weights map unchanged. softmax scale 1/sqrt(nope + rope).
Megatron names: linear_q_down_proj / q_layernorm / linear_q_up_proj (or linear_q_proj), linear_kv_down_proj /
kv_layernorm / linear_kv_up_proj, linear_proj. The up-projections are split over TP by heads; the
down-projections are split over TP by rows in the local spec (gathered right after) and kept whole by
Transformer Engine's spec (megatron_io tells the two apart by the parameter).
"""
from __future__ import annotations

from transformers import DeepseekV3Config

from . import register_family
from .base import UnsupportedModelError
from .sigmoid_router import SigmoidRouterFamily


@register_family
class DeepseekV3Family(SigmoidRouterFamily):
    model_type = "deepseek_v3"
    hf_config_class = DeepseekV3Config

    def megatron_config_class(self, hf):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig

    def qk_layernorm(self, hf):
        return True  # MLA's latent norms (q_a_layernorm, kv_a_layernorm): megatron builds them under this flag

    def qkv_bias(self, hf):
        return False

    def rope_fields(self, hf) -> dict:
        params = dict(getattr(hf, "rope_parameters", None) or {})
        kind = params.get("rope_type", "default")
        theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        if kind == "default":
            return dict(rope_type="rope", rotary_base=theta, rotary_scaling_factor=1.0, mscale=1.0,
                        mscale_all_dim=0.0)
        if kind == "yarn":
            return dict(rope_type="yarn", rotary_base=theta, rotary_scaling_factor=float(params["factor"]),
                        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                        beta_fast=float(params.get("beta_fast", 32)), beta_slow=float(params.get("beta_slow", 1)),
                        mscale=float(params.get("mscale", 1.0)), mscale_all_dim=float(params.get("mscale_all_dim", 0.0)))
        raise UnsupportedModelError(f"deepseek_v3: rope_type {kind!r} is not supported (default or yarn)")

    def rope_theta(self, hf):
        return self.rope_fields(hf)["rotary_base"]  # GPTModel's own RoPE is unused under MLA

    def family_fields(self, hf):
        if getattr(hf, "attention_bias", False):
            raise UnsupportedModelError("deepseek_v3: attention_bias=true is not supported (megatron's MLA "
                                        "projections have no bias); DeepSeek-V3 and Kimi-K2 have none")
        if not getattr(hf, "rope_interleave", True):
            raise UnsupportedModelError("deepseek_v3: rope_interleave=false is not supported (megatron's MLA "
                                        "RoPE reads the rope dims interleaved, as DeepSeek's weights hold them)")
        if int(getattr(hf, "moe_layer_freq", 1) or 1) != 1:  # DeepSeek's own code reads it, transformers does not
            raise UnsupportedModelError(f"deepseek_v3: moe_layer_freq={hf.moe_layer_freq} is not supported (only 1: "
                                        "every layer from first_k_dense_replace on is MoE, as transformers builds it)")
        if getattr(hf, "scoring_func", "sigmoid") != "sigmoid":
            raise UnsupportedModelError(f"deepseek_v3: scoring_func={hf.scoring_func!r}; only sigmoid (V3's router)")
        if hf.num_key_value_heads != hf.num_attention_heads:
            raise UnsupportedModelError("deepseek_v3: num_key_value_heads must equal num_attention_heads (MLA)")
        return {
            **self.router_fields(hf),
            **self.rope_fields(hf),
            "multi_latent_attention": True,
            "q_lora_rank": hf.q_lora_rank,
            "kv_lora_rank": int(hf.kv_lora_rank),
            "qk_head_dim": int(hf.qk_nope_head_dim),
            "qk_pos_emb_head_dim": int(hf.qk_rope_head_dim),
            "v_head_dim": int(hf.v_head_dim),
            # the local core attention sizes its output as kv_channels x heads: the value head dim
            "kv_channels": int(hf.v_head_dim),
        }

    def attention_maps(self, hf):
        h, heads = int(hf.hidden_size), int(hf.num_attention_heads)
        q_dim = int(hf.qk_nope_head_dim) + int(hf.qk_rope_head_dim)
        kv_lora, rope, v = int(hf.kv_lora_rank), int(hf.qk_rope_head_dim), int(hf.v_head_dim)
        kv_a = ("linear_kv_down_proj.weight", ("kv_a",), "column", ((kv_lora + rope, h),))
        if hf.q_lora_rank is None:
            maps = [("linear_q_proj.weight", ("q",), "column", ((heads * q_dim, h),)), kv_a]
        else:  # kv_a right after q_a: SGLang loads the two as one tensor (loaded_with_previous)
            r = int(hf.q_lora_rank)
            maps = [("linear_q_down_proj.weight", ("q_a",), "column", ((r, h),)), kv_a,
                    ("q_layernorm.weight", ("q_a_norm",), "replicated", ((r,),)),
                    ("linear_q_up_proj.weight", ("q_b",), "column", ((heads * q_dim, r),))]
        return maps + [
            ("kv_layernorm.weight", ("kv_a_norm",), "replicated", ((kv_lora,),)),
            ("linear_kv_up_proj.weight", ("kv_b",), "column", ((heads * (int(hf.qk_nope_head_dim) + v), kv_lora),)),
            ("linear_proj.weight", ("o",), "row", ((h, heads * v),)),
        ]

    def loaded_with_previous(self, hf):
        # SGLang fuses q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa and, within one load call,
        # holds whichever comes first until the other arrives; split over two calls, neither is ever loaded
        # (sglang/srt/models/deepseek_common/deepseek_weight_loader.py, `cached_a_proj`)
        return {"kv_a"} if hf.q_lora_rank is not None else set()

    def sglang_whole(self, hf):
        # SGLang keeps MLA's down-projections replicated (ReplicatedLinear: fused_qkv_a_proj_with_mqa, or
        # kv_a_proj_with_mqa without a q_lora_rank; sglang/srt/models/deepseek_v2.py DeepseekV2AttentionMLA)
        # where megatron's local spec splits them by rows
        return {"q_a", "kv_a"}

    def sglang_loader_keys(self, hf):
        # kv_b: SGLang derives w_kc/w_vc from it after loading (deepseek_weight_loader.post_load_weights, for the
        # names of the load call); q_a + kv_a: fused on their first load call together (loaded_with_previous)
        return {"kv_b", "q_a", "kv_a"} if hf.q_lora_rank is not None else {"kv_b"}

    def fp8_weights(self, hf):
        # SGLang derives MLA's absorbed w_kc/w_vc from kv_b_proj after every load, dequantising an FP8 one
        # (sglang/srt/models/deepseek_common/deepseek_weight_loader.py): not yet followed through by the digest
        # read-back (launch/rlpo_sglang_hooks.py) nor tested here
        raise UnsupportedModelError("rollout.weights=fp8 is not built for deepseek_v3 (MLA) yet: use "
                                    "rollout.weights=bf16")

    def identity(self, hf):
        ident = super().identity(hf)
        ident.update(q_lora_rank=hf.q_lora_rank, kv_lora_rank=int(hf.kv_lora_rank),
                     qk_nope_head_dim=int(hf.qk_nope_head_dim), qk_rope_head_dim=int(hf.qk_rope_head_dim),
                     v_head_dim=int(hf.v_head_dim))
        return ident

    def hf_names(self, hf):
        names = super().hf_names(hf)
        a = "model.layers.{i}.self_attn."
        names.update(q=a + "q_proj.weight", q_a=a + "q_a_proj.weight", q_a_norm=a + "q_a_layernorm.weight",
                     q_b=a + "q_b_proj.weight", kv_a=a + "kv_a_proj_with_mqa.weight",
                     kv_a_norm=a + "kv_a_layernorm.weight", kv_b=a + "kv_b_proj.weight")
        return names
