"""What every MoE family provides: HF config -> megatron-core TransformerConfig fields and layer kinds."""
from __future__ import annotations

from typing import Any, Optional

import torch.nn.functional as F


# A critic's head in HF form (transformers' *ForTokenClassification, num_labels=1), the same for every family.
VALUE_HEAD_HF = ("score.weight", "score.bias")


class UnsupportedModelError(ValueError):
    pass


class MoEFamily:
    """Base of a family entry. Subclasses set `model_type`/`hf_config_class` and override hooks."""

    model_type: str = ""
    hf_config_class: type | None = None

    def num_experts(self, hf) -> int:
        return hf.num_local_experts

    def moe_layer_pattern(self, hf) -> list[int]:
        """1 for a MoE layer, 0 for a dense-MLP layer, one entry per decoder layer."""
        return [1] * hf.num_hidden_layers

    def head_dim(self, hf) -> int:
        return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads

    def rope_theta(self, hf) -> float:
        params = getattr(hf, "rope_parameters", None) or {}
        if params.get("rope_type", "default") != "default":
            raise UnsupportedModelError(
                f"{self.model_type}: rope_type {params['rope_type']!r} is not supported yet "
                "(only 'default' RoPE); remove rope scaling from config.json or add it to the family."
            )
        return float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))

    def router_pre_softmax(self, hf) -> bool:
        """True: softmax over all experts, then top-k (probs not renormalised).
        False: top-k logits, then softmax over the k (== softmax then renormalise)."""
        return False

    def qk_layernorm(self, hf) -> bool:
        return False

    def qkv_bias(self, hf) -> bool:
        """q/k/v projections with a bias (the output projection never has one here)."""
        return bool(getattr(hf, "attention_bias", False))

    def rotary_percent(self, hf) -> float:
        """The fraction of each head's dims that RoPE rotates (the first ones, rotate-half style)."""
        return 1.0

    def shared_expert_size(self, hf) -> int:
        """Intermediate size of the always-on shared expert MLP of a MoE layer (0: none)."""
        return 0

    def expert_bias(self, hf) -> bool:
        """The router selects with a score-correction bias (a checkpointed buffer, aux-loss-free balancing)."""
        return False

    def fp32_hf_tensor(self, hf, name: str) -> bool:
        """A checkpoint tensor every side keeps in fp32 whatever the model dtype (transformers'
        _keep_in_fp32_modules, megatron, SGLang): exported and synced in fp32."""
        return False

    def extra_hf_tensor(self, hf, name: str) -> bool:
        """A checkpoint tensor that is neither mapped nor an error (e.g. multi-token-prediction layers)."""
        return False

    def attention_maps(self, hf) -> list[tuple[str, tuple[str, ...], str, Optional[tuple]]]:
        """The attention block's parameters: (megatron name under `self_attention.`, hf_names keys, mapping
        kind (moe/bridge/mapping.py), the HF shapes or None for the bridge's defaults). GQA with a fused
        q/k/v projection here; multi-latent attention (deepseek_v3) states its own."""
        maps = [("linear_qkv.weight", ("q", "k", "v"), "qkv", None)]
        if self.qkv_bias(hf):
            maps.append(("linear_qkv.bias", ("q_bias", "k_bias", "v_bias"), "qkv", None))
        maps.append(("linear_proj.weight", ("o",), "row", None))
        if self.qk_layernorm(hf):
            maps += [("q_layernorm.weight", ("q_norm",), "replicated", None),
                     ("k_layernorm.weight", ("k_norm",), "replicated", None)]
        return maps

    def loaded_with_previous(self, hf) -> set[str]:
        """hf_names keys of attention tensors an inference engine loads only together with the map just before
        them (one fused parameter it fills once both parts arrived in the same load call): the weight sync
        never starts a new bucket at them."""
        return set()

    def sglang_whole(self, hf) -> set[str]:
        """hf_names keys of tensors megatron splits over TP but SGLang holds whole on every TP rank (a
        ReplicatedLinear where megatron has a column-parallel one): the refit plan (moe/bridge/reshard.py) sends
        these to every server rank in full."""
        return set()

    def sglang_loader_keys(self, hf) -> set[str]:
        """hf_names keys of tensors SGLang must load with its own `load_weights` at every sync (it post-processes
        them, or loads them only together with another): the in-server receiver never replays them
        (launch/rlpo_sglang_receiver.py)."""
        return set()

    def fp8_weights(self, hf) -> set[str]:
        """hf_names keys of the weights rollout.weights=fp8 sends in block FP8 (moe/bridge/fp8.py): the attention
        and MLP projections (routed, shared and dense experts), which SGLang builds as Fp8 linear / MoE layers
        under a block-FP8 quantization_config. Everything else -- the embedding and output layer (SGLang never
        quantises them: sglang/srt/layers/quantization/fp8.py:389-476), every norm (q/k norms too), the router
        (built with quant_config=None: sglang/srt/models/qwen3_moe.py:282-296; R3 replays the learner's routes, so it
        must score as the learner's does), biases -- goes in the model's dtype. A family whose attention SGLang
        post-processes from FP8 in its own way (MLA) overrides this to refuse until it is built."""
        names = self.hf_names(hf)
        keys = ("q", "k", "v", "o", "expert_gate", "expert_up", "expert_down", "dense_gate", "dense_up", "dense_down",
                "shared_gate", "shared_up", "shared_down")
        return {k for k in keys if k in names}

    def fp8_ignored_layers(self, hf) -> list[str]:
        """SGLang module names (quantization_config.ignored_layers) of linear layers SGLang would build in FP8 but
        the family keeps in the model's dtype; matched on dotted prefixes (sglang/srt/layers/quantization/utils.py:
        48-61). None for the GQA families: SGLang already builds their routers, embeddings and heads unquantised."""
        return []

    def megatron_config_class(self, hf):
        """megatron-core's config class for this architecture (MLA has its own)."""
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig

    def family_fields(self, hf) -> dict[str, Any]:
        """Extra TransformerConfig fields specific to this family."""
        return {}

    def transformer_fields(self, hf) -> dict[str, Any]:
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{self.model_type}: hidden_act {hf.hidden_act!r}; only silu (SwiGLU)")
        aux = hf.router_aux_loss_coef if getattr(hf, "output_router_logits", False) else 0.0
        fields = dict(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_attention_heads,
            num_query_groups=hf.num_key_value_heads,
            kv_channels=self.head_dim(hf),
            ffn_hidden_size=getattr(hf, "intermediate_size", None) or hf.moe_intermediate_size,
            normalization="RMSNorm",
            layernorm_epsilon=hf.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias(hf),
            qk_layernorm=self.qk_layernorm(hf),
            attention_dropout=float(getattr(hf, "attention_dropout", 0.0)),
            hidden_dropout=0.0,
            init_method_std=hf.initializer_range,
            num_moe_experts=self.num_experts(hf),
            moe_router_topk=hf.num_experts_per_tok,
            moe_router_pre_softmax=self.router_pre_softmax(hf),
            moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
            moe_aux_loss_coeff=aux,
            moe_layer_freq=self.moe_layer_pattern(hf),
        )
        if self.shared_expert_size(hf):
            fields["moe_shared_expert_intermediate_size"] = self.shared_expert_size(hf)
        fields.update(self.family_fields(hf))
        return fields

    def identity(self, hf) -> dict[str, Any]:
        """What makes two configs the same model, independent of the parallel layout: recorded in every
        checkpoint and compared on resume (a checkpoint of another model is refused before it is loaded)."""
        return {
            "model_type": self.model_type,
            "num_hidden_layers": int(hf.num_hidden_layers),
            "hidden_size": int(hf.hidden_size),
            "num_attention_heads": int(hf.num_attention_heads),
            "num_key_value_heads": int(hf.num_key_value_heads),
            "head_dim": int(self.head_dim(hf)),
            "vocab_size": int(hf.vocab_size),
            "num_experts": int(self.num_experts(hf)),
            "num_experts_per_tok": int(hf.num_experts_per_tok),
            "ffn_hidden_size": int(getattr(hf, "intermediate_size", None) or hf.moe_intermediate_size),
            "moe_ffn_hidden_size": int(getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size),
            "moe_layers": self.moe_layer_pattern(hf),
            "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
        }

    # --- transformers' in-memory names of a MoE layer; {i} = layer -----------------------------
    def hf_inmemory_names(self, hf) -> dict[str, str]:
        """Where a live transformers 5 model holds a MoE layer: the router, and the experts fused as
        `gate_up_proj` [E, 2F, H] (gate rows, then up rows) and `down_proj` [E, H, F]. Checkpoints (and the
        weight stream) name experts one by one (`hf_names`); the embedded engine maps between the two."""
        m = "model.layers.{i}.mlp."
        return {"router": m + "gate.weight", "experts_gate_up": m + "experts.gate_up_proj",
                "experts_down": m + "experts.down_proj"}

    def peft_modules(self, hf) -> dict[str, str]:
        """transformers 5's module paths ({i} = layer) of what a PEFT LoRA adapter of this model targets
        (moe/bridge/peft.py): the attention's projections and a dense or shared-expert MLP's as modules
        (`target_modules`), a MoE layer's fused experts as the parameters named by `hf_inmemory_names`
        (`target_parameters`: peft's ParamWrapper on `gate_up_proj` and `down_proj`)."""
        a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
        return {"q": a + "q_proj", "k": a + "k_proj", "v": a + "v_proj", "o": a + "o_proj",
                "dense_gate": m + "gate_proj", "dense_up": m + "up_proj", "dense_down": m + "down_proj",
                "shared_gate": m + "shared_experts.gate_proj", "shared_up": m + "shared_experts.up_proj",
                "shared_down": m + "shared_experts.down_proj"}

    # --- HF checkpoint names (the weight bridge); {i} = layer, {e} = expert -------------------
    def hf_names(self, hf) -> dict[str, str]:
        """Templates of released-checkpoint names; families override the MLP/router parts."""
        a = "model.layers.{i}.self_attn."
        return {
            "embedding": "model.embed_tokens.weight",
            "final_norm": "model.norm.weight",
            "output": "lm_head.weight",
            "input_norm": "model.layers.{i}.input_layernorm.weight",
            "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
            "q": a + "q_proj.weight",
            "k": a + "k_proj.weight",
            "v": a + "v_proj.weight",
            "o": a + "o_proj.weight",
            "q_norm": a + "q_norm.weight",
            "k_norm": a + "k_norm.weight",
            "q_bias": a + "q_proj.bias",
            "k_bias": a + "k_proj.bias",
            "v_bias": a + "v_proj.bias",
        }


def gated_mlp_names(m: str = "model.layers.{i}.mlp.") -> dict[str, str]:
    """The MoE block's names shared by Qwen3-MoE and the DeepSeek-V3 block (glm4_moe, deepseek_v3): router
    `gate`, experts' gate/up/down projections, and a dense layer's."""
    return {"router": m + "gate.weight", "expert_gate": m + "experts.{e}.gate_proj.weight",
            "expert_up": m + "experts.{e}.up_proj.weight", "expert_down": m + "experts.{e}.down_proj.weight",
            "dense_gate": m + "gate_proj.weight", "dense_up": m + "up_proj.weight",
            "dense_down": m + "down_proj.weight"}
