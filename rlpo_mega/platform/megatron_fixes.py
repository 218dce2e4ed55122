"""megatron-core 0.16.1 defects that are not about CPUs: applied whenever Transformer Engine is absent.

Without TE, `moe.model` builds megatron's local layer spec, on a CPU and on a GPU alike (TE is an
optional extra, `pip install -e ".[gpu]"`). These fixes make that spec work for our models on any
device; they touch only code that the local spec reaches, so a run with TE gets none of them.

- `te_general_gemm_undefined`: moe_utils.py imports `te_general_gemm` only inside its
  `try: import transformer_engine` block, then tests `te_general_gemm is not None` (moe_utils.py:1192,
  1225): without TE that is a NameError. Defining the name as None selects megatron's own torch.mm path,
  as the code intends.
- `torch_norm_sequence_parallel`: the local spec's norm, `WrappedTorchNorm`, asserts no sequence
  parallelism (torch_norm.py:32), but MoE with TP requires it (moe_layer.py:379), so every TP > 1 layout
  (the recipes' TP2+SP) stopped while building the first layer.
- `final_norm_rmsnorm_apex`: with apex installed, the local spec's final norm is apex's FusedLayerNorm
  whatever the normalization (gpt_layer_specs.py:644; its layers already get the torch norm for RMSNorm),
  and FusedLayerNorm rejects RMSNorm (fused_layer_norm.py:66), which both our families use.

- `float16_optimizer_fp32_param_ids`: the local spec keeps its norms in fp32 under bf16 parameters, and
  the mixed-precision optimizer (Float16OptimizerWithFloat16Params) then holds fp32 params next to the
  fp32 copies of the 16-bit ones. Its sharded_state_dict maps optimizer state ids to model params through
  the 16-bit params alone (optimizer.py:812-814), while the torch optimizer numbers every param of every
  group: the first save after an optimizer step stopped with "Param id N does not match any model sharded
  param" (dist_checkpointing/optimizer.py:145), so bf16 with the plain optimizer could not checkpoint.
  The ids are mapped through every param in the optimizer's own order (the 16-bit param for its copy).

Each has an ablation test in tests/test_platform.py; tests/test_platform.py also builds the norms of a
TP2+SP spec with CUDA simulated, apex stood in and TE absent (a GPU node without TE).

SPEEDUPS change no result, only the cost of the same path (also only without TE; tested bitwise equal):
- `thd_rope_vectorized`: megatron's unfused RoPE for packed (THD) sequences slices the frequencies sequence
  by sequence in Python, one `.item()` per sequence (rope_utils.py:178-245): for an RL batch of 512 short
  samples that loop cost more than the attention it feeds. Without context parallelism the slices are
  `freqs[position within its sequence]` (or `freqs[:T]` when freqs already cover every packed position),
  one gather; with context parallelism megatron's loop runs as shipped.
"""
from __future__ import annotations

import copy

from .cpu_megatron import Patch


def _define_te_general_gemm():
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _torch_norm_sequence_parallel():
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        # A norm is position-wise, so it is exact on a sequence shard. Its weight is replicated across
        # TP and each rank sees only part of the tokens: tagging it sequence_parallel makes
        # finalize_model_grads all-reduce its grad over TP (finalize_model_grads.py:354), as TENorm's
        # and FusedLayerNorm's are.
        sp = config.sequence_parallel
        if sp:
            config = copy.copy(config)
            object.__setattr__(config, "sequence_parallel", False)
        norm = original_new(cls, config, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", sp)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


def _final_norm_not_apex_for_rmsnorm():
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = gpt_layer_specs.get_gpt_decoder_block_spec

    def get_gpt_decoder_block_spec(config, use_transformer_engine, *args, **kwargs):
        spec = original(config, use_transformer_engine, *args, **kwargs)
        # The same choice the local spec makes for its layers' norms (backends.py LocalSpecProvider).
        if spec.layer_norm is FusedLayerNorm and config.normalization != "LayerNorm":
            spec.layer_norm = WrappedTorchNorm
        return spec

    gpt_layer_specs.get_gpt_decoder_block_spec = get_gpt_decoder_block_spec


def _thd_rope_vectorized():
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd
    if getattr(original, "_rlpo_vectorized", False):
        return

    def _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False,
                                  mscale=1.0, cp_group=None):
        if cp_group is None or cp_group.size() != 1:
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
        n = t.size(0)
        if freqs.dim() >= 1 and freqs.size(0) == cu_seqlens[-1]:  # freqs of every packed position (case 1)
            packed = freqs[:n]
        else:  # freqs of positions 0..max_s-1: each token's position within its own sequence (case 2)
            cu = cu_seqlens.to(device=t.device, dtype=torch.long)
            pos = torch.arange(n, device=t.device) - torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
            packed = freqs[pos.to(freqs.device)]
        return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                                     multi_latent_attention=multi_latent_attention,
                                                     mscale=mscale).squeeze(1)

    _apply_rotary_pos_emb_thd._rlpo_vectorized = True
    _apply_rotary_pos_emb_thd._rlpo_original = original
    rope_utils._apply_rotary_pos_emb_thd = _apply_rotary_pos_emb_thd


def _float16_optimizer_fp32_param_ids():
    from megatron.core.optimizer import optimizer as opt_mod

    cls = opt_mod.Float16OptimizerWithFloat16Params
    if getattr(cls.sharded_state_dict, "_rlpo_fixed", False):
        return
    original = cls.sharded_state_dict

    def model_params_in_optimizer_order(self):
        for g, group in enumerate(self.optimizer.param_groups):
            model_of = {id(main): p for p, main in zip(self.float16_groups[g], self.fp32_from_float16_groups[g])}
            for param in group["params"]:
                yield model_of.get(id(param), param)  # an fp32 param is its own main param

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
        for g, group in enumerate(self.fp32_from_fp32_groups):
            if group and self.float16_groups[g]:  # its fp32_from_fp16_params list would be misaligned
                raise NotImplementedError("a mixed-precision optimizer param group holds both fp32 and 16-bit "
                                          "params; its checkpoint layout is not supported")
        mapper = opt_mod.get_param_id_to_sharded_param_map
        opt_mod.get_param_id_to_sharded_param_map = lambda sd, _params: mapper(sd, model_params_in_optimizer_order(self))
        try:
            return original(self, model_sharded_state_dict, is_loading, metadata)
        finally:
            opt_mod.get_param_id_to_sharded_param_map = mapper

    sharded_state_dict._rlpo_fixed = True
    cls.sharded_state_dict = sharded_state_dict


SPEEDUPS: tuple[Patch, ...] = (
    Patch(
        "thd_rope_vectorized",
        ("models/common/embeddings/rope_utils.py:178-245",),
        "the unfused THD RoPE slices frequencies per sequence in a Python loop; one gather gives the same "
        "tensor (context parallel size 1)",
        _thd_rope_vectorized,
    ),
)

FIXES: tuple[Patch, ...] = (
    Patch(
        "te_general_gemm_undefined",
        ("transformer/moe/moe_utils.py:1192,1225",),
        "te_general_gemm is undefined when Transformer Engine is not installed (NameError)",
        _define_te_general_gemm,
    ),
    Patch(
        "torch_norm_sequence_parallel",
        ("transformer/torch_norm.py:32", "transformer/moe/moe_layer.py:379",
         "distributed/finalize_model_grads.py:354"),
        "the local-spec norm asserts no sequence parallel, which MoE with TP requires; its params are "
        "tagged sequence_parallel so finalize_model_grads all-reduces their grads over TP",
        _torch_norm_sequence_parallel,
    ),
    Patch(
        "final_norm_rmsnorm_apex",
        ("models/gpt/gpt_layer_specs.py:644", "fusions/fused_layer_norm.py:66-68"),
        "with apex installed the local spec's final norm is FusedLayerNorm, which rejects RMSNorm; "
        "the torch RMSNorm is used instead, as for the layers' norms",
        _final_norm_not_apex_for_rmsnorm,
    ),
    Patch(
        "float16_optimizer_fp32_param_ids",
        ("optimizer/optimizer.py:812-814", "dist_checkpointing/optimizer.py:145"),
        "the mixed-precision optimizer's checkpoint maps state ids through its 16-bit params only; the local "
        "spec's fp32 norms made the first save after a step fail: ids are mapped through every param",
        _float16_optimizer_fp32_param_ids,
    ),
)
