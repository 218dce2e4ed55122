"""The DeepSeek-V3 MoE block, shared by deepseek_v3 and glm4_moe (and Kimi-K2, a deepseek_v3 config).

Router: scores = sigmoid(logits) in fp32; the experts are chosen from scores + e_score_correction_bias (the
aux-loss-free balancing bias, a checkpointed buffer), within the `topk_group` best of `n_group` expert groups
(a group's score: the sum of its two best biased scores); the gate weights are the *unbiased* scores at the
chosen experts, renormalised (+1e-20) and multiplied by routed_scaling_factor. Each MoE layer adds an
always-on shared expert MLP; the first `first_k_dense_replace` layers are dense.

megatron-core expresses all of it (moe_router_score_function="sigmoid", moe_router_enable_expert_bias,
moe_router_num_groups/group_topk, moe_router_topk_scaling_factor, moe_shared_expert_intermediate_size)
with two differences that are refused rather than approximated:
- megatron scores a group by the sum of its top (topk // group_topk) scores, HF by its top 2: equal only
  when topk == 2 * topk_group (DeepSeek-V3: 8 = 2 * 4) or when there is one group;
- megatron always renormalises the top-k sigmoid weights: norm_topk_prob=False is not expressible.

The bias update (megatron's aux-loss-free rule, bias += rate * sign(mean load - load) after each step) is
off unless model.expert_bias_update_rate > 0, as slime runs RL on these models (its GLM-4.7-30B-A3B model
script passes --moe-router-bias-update-rate 0): the bias stays the checkpoint's, so replayed batches never
move it and the rollout engine routes with the bias the learner has. With a rate, megatron counts the loads
the layers dispatched: under R2/R3 the replayed routes (and padding tokens, which it counts unmasked).
"""
from __future__ import annotations

from .base import MoEFamily, UnsupportedModelError, gated_mlp_names


class SigmoidRouterFamily(MoEFamily):
    def num_experts(self, hf) -> int:
        return int(hf.n_routed_experts)

    def moe_layer_pattern(self, hf) -> list[int]:
        return [int(i >= hf.first_k_dense_replace) for i in range(hf.num_hidden_layers)]

    def shared_expert_size(self, hf) -> int:
        return int(hf.moe_intermediate_size) * int(hf.n_shared_experts or 0)

    def expert_bias(self, hf) -> bool:
        return True

    def fp32_hf_tensor(self, hf, name: str) -> bool:
        return name.endswith("e_score_correction_bias")

    def extra_hf_tensor(self, hf, name: str) -> bool:
        # multi-token-prediction layers follow the decoder (model.layers.{L + j}); transformers skips them too
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) >= hf.num_hidden_layers
        return False

    def router_fields(self, hf) -> dict:
        topk, groups, topk_group = int(hf.num_experts_per_tok), int(hf.n_group or 1), int(hf.topk_group or 1)
        if not hf.norm_topk_prob and topk > 1:
            raise UnsupportedModelError(
                f"{self.model_type}: norm_topk_prob=false is not supported (megatron-core always renormalises "
                "the top-k sigmoid weights); use a config with norm_topk_prob=true")
        if self.num_experts(hf) % groups:
            raise UnsupportedModelError(f"{self.model_type}: n_routed_experts={self.num_experts(hf)} is not a "
                                        f"multiple of n_group={groups}")
        fields = dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=float(hf.routed_scaling_factor),
            moe_ffn_hidden_size=int(hf.moe_intermediate_size),
        )
        if groups > 1:
            if topk != 2 * topk_group:
                raise UnsupportedModelError(
                    f"{self.model_type}: n_group={groups} with num_experts_per_tok={topk} and topk_group="
                    f"{topk_group}: HF scores a group by its top-2 experts, megatron-core by its top "
                    f"num_experts_per_tok // topk_group; they agree only when num_experts_per_tok == 2 * topk_group")
            fields.update(moe_router_num_groups=groups, moe_router_group_topk=topk_group)
        return fields

    def identity(self, hf):
        ident = super().identity(hf)
        ident.update(n_shared_experts=int(hf.n_shared_experts or 0), n_group=int(hf.n_group or 1),
                     topk_group=int(hf.topk_group or 1), routed_scaling_factor=float(hf.routed_scaling_factor))
        return ident

    def hf_names(self, hf):
        m = "model.layers.{i}.mlp."
        return {**super().hf_names(hf), **gated_mlp_names(m), "router_bias": m + "gate.e_score_correction_bias",
                "shared_gate": m + "shared_experts.gate_proj.weight", "shared_up": m + "shared_experts.up_proj.weight",
                "shared_down": m + "shared_experts.down_proj.weight"}
