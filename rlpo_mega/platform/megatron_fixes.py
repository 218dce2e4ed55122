"""megatron-core 0.16.1 defects that are not about CPUs: applied whenever Transformer Engine is absent.

Without TE, `moe.model` builds megatron's local layer spec, on a CPU and on a GPU alike (TE is an
optional extra, `pip install -e ".[gpu]"`). These fixes make that spec work for our models on any
device; they touch only code that the local spec reaches, so a run with TE gets none of them.
OFFLOAD_FIXES (at the end) answer defects of the optimizer CPU offload that a run with TE reaches too, and are
applied with or without it.

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

- `distributed_optimizer_group_order`: the distributed optimizer builds each param group's list as its fp32
  params, then the fp32 copies of its 16-bit params (distrib_optimizer.py:434-443), but records each model
  param's position in bucket order (:297) and reads optimizer state through that position (:894-908). A group
  holding both (the local spec's fp32 norms with 16-bit 1-D params: glm4_moe's q/k/v biases, both without
  weight decay) got another param's state: the first bf16 checkpoint of glm4_moe failed on a shape mismatch
  (and a same-shape swap would have saved wrong state silently). The positions are rebuilt in the list's order.
- `distributed_optimizer_without_params`: with torch's Adam the distributed optimizer takes its step from the
  per-param states and asserts there is exactly one (distrib_optimizer.py:639-643). A pipeline stage that
  holds only dense layers (glm4_moe / deepseek_v3's first layers, PP2) has an expert optimizer without
  params, so the first checkpoint failed there. Such an optimizer reports step 0 (rlpo_mega.checkpoint leaves
  it out of the chain's step check).
- `mla_have_te_flag`: multi_latent_attention.py sets HAVE_TE from an import of megatron's TE extension,
  which succeeds without TE (MagicMock stand-ins), and then tests isinstance(linear_proj, TELinear) with a
  MagicMock as the class (multi_latent_attention.py:183-185): no MLA model (deepseek_v3) could be built.
  Its flag is set to what is true. (The local DotProductAttention also lacks MLA's k_channels/v_channels
  arguments: moe/packed_attention.py's subclass, the local spec's core attention here, takes them.)

Each has an ablation test in tests/test_platform.py; tests/test_platform.py also builds the norms of a
TP2+SP spec with CUDA simulated, apex stood in and TE absent (a GPU node without TE).

SPEEDUPS change no result, only the cost of the same path (applied with and without TE; tested bitwise equal on
the CPU):
- `thd_rope_vectorized`: megatron's unfused RoPE for packed (THD) sequences slices the frequencies sequence
  by sequence in Python, one `.item()` per sequence plus a `.tolist()` of the lengths (rope_utils.py:178-245):
  host syncs twice per layer on a GPU, and for an RL batch of 512 short samples a loop that cost more than
  the attention it feeds. Without context parallelism the slices are `freqs[position within its sequence]`
  (or `freqs[:T]` when freqs already cover every packed position), one gather without a host sync; with
  context parallelism megatron's loop runs as shipped. With TE it serves whenever TE's fused RoPE is off.
- `grad_norm_on_device`: without TE and apex, the gradient clipping's norm is megatron's local stand-in for
  apex's multi_tensor_l2norm (utils.py:1197-1207), which builds `torch.tensor(list of per-tensor norms)` and
  reads the total with float(): a host sync per gradient tensor, every optimizer step (66 per update at 2 layers,
  126 at 4 on an H100, counted by tools/gpu_smoke.py; tests/test_host_syncs.py's CPU emulation cannot see
  them: torch.tensor is not dispatched to torch-function modes). The same norms are stacked on the device.
  With TE or apex their fused kernel is used and this changes nothing. On a GPU the norm of the norms is now
  summed there instead of on the CPU, so it can differ from megatron's in the last bit (as apex's kernel does).
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

    from moe import context_parallel

    original = rope_utils._apply_rotary_pos_emb_thd
    if getattr(original, "_rlpo_vectorized", False):
        return

    def _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False,
                                  mscale=1.0, cp_group=None):
        if cp_group is None:
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
        # No host sync (this runs twice per layer): megatron's torch.split of t by the sequence lengths
        # requires cu_seqlens[-1] == cp x t.size(0), so its test `freqs.size(0) == cu_seqlens[-1]` is this one
        # on host ints, and the per-token offsets are sized by n, not by reading the lengths.
        n, cp = t.size(0), cp_group.size()
        cu = cu_seqlens.to(device=t.device, dtype=torch.long)
        if cp > 1:
            # megatron's CP layout (cu_seqlens: the padded ones, global): each local row's place in the whole
            # row, chunks rank and 2cp-1-rank per sequence (megatron's _get_thd_freqs_on_this_cp_rank, vectorised)
            rows = context_parallel.local_rows(cu, cp, cp_group.rank(), n)
        else:
            rows = torch.arange(n, device=t.device)
        if freqs.dim() >= 1 and freqs.size(0) == cp * n:  # freqs of every packed position (case 1)
            packed = freqs[:n] if cp == 1 else freqs[rows.to(freqs.device)]
        else:  # freqs of positions 0..max_s-1: each token's position within its own sequence (case 2)
            pos = rows - cu[torch.searchsorted(cu[1:], rows, right=True)]
            packed = freqs[pos.to(freqs.device)]
        return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                                     multi_latent_attention=multi_latent_attention,
                                                     mscale=mscale).squeeze(1)

    _apply_rotary_pos_emb_thd._rlpo_vectorized = True
    _apply_rotary_pos_emb_thd._rlpo_original = original
    rope_utils._apply_rotary_pos_emb_thd = _apply_rotary_pos_emb_thd


def _grad_norm_on_device():
    import torch
    from megatron.core import utils as core_utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is not core_utils.local_multi_tensor_l2_norm:
        return  # TE's or apex's fused kernel, or already replaced

    def local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        # megatron's arithmetic (each tensor's torch.norm, then the norm of those norms, as float32) with the
        # norms kept on the device: torch.tensor(norms) and float() each copied them to the host
        norms = torch.stack([torch.norm(t) for tensors in tensor_lists for t in tensors])
        return torch.norm(norms).to(torch.float).reshape(1), None

    local_multi_tensor_l2_norm._rlpo_original = core_utils.local_multi_tensor_l2_norm
    clip_grads.l2_norm_impl = local_multi_tensor_l2_norm


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


def _distributed_optimizer_group_order():
    from megatron.core.optimizer import distrib_optimizer as dopt

    cls = dopt.DistributedOptimizer
    if getattr(cls.__init__, "_rlpo_fixed", False):
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # the optimizer's groups list a group's fp32 params first, then (the fp32 copies of) its 16-bit ones
        # (distrib_optimizer.py:434-443); index the model params the same way
        for g in range(len(self.opt_group_ranges)):
            for j, p in enumerate(list(self.model_fp32_groups[g]) + list(self.model_float16_groups[g])):
                self.model_param_group_index_map[p] = (g, j)

    __init__._rlpo_fixed = True
    cls.__init__ = __init__


def _distributed_optimizer_without_params():
    import torch
    from megatron.core.optimizer import distrib_optimizer as dopt

    cls = dopt.DistributedOptimizer
    if getattr(cls.state_dict, "_rlpo_fixed", False):
        return
    original = cls.state_dict

    def state_dict(self):
        if dopt.HAVE_APEX_OR_TE or any(g["params"] for g in self.optimizer.param_groups):
            return original(self)
        # no params here (the expert optimizer of a pipeline stage without MoE layers): megatron reads the step
        # from per-param states and asserts there is exactly one; this optimizer has none to take
        inner = self.optimizer.state_dict
        self.optimizer.state_dict = lambda: {**inner(), "state": {0: {"step": torch.tensor(0.0)}}}
        try:
            return original(self)
        finally:
            del self.optimizer.state_dict

    state_dict._rlpo_fixed = True
    cls.state_dict = state_dict


def _hybrid_optimizer_fp32_shards_as_leaves():
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import distrib_optimizer as dopt

    cls = dopt.DistributedOptimizer
    if getattr(cls._build_model_and_main_param_groups, "_rlpo_fixed", False):
        return
    original = cls._build_model_and_main_param_groups.__func__

    def build(klass, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        groups = original(klass, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        # An fp32 param's shard is `model_param.view(-1)[a:b]` (distrib_optimizer.py:420): a view of a param
        # that requires grad, so not a leaf. torch's Adam takes it (the groups are assigned, :606), but the
        # HybridDeviceOptimizer is rebuilt through torch.optim.Optimizer.__init__ (:603), whose
        # add_param_group refuses non-leaves. A detached view is the same memory (the optimizer's in-place
        # update still lands in the model param) and a leaf; it replaces the view everywhere it is held.
        shard_fp32_groups = groups[3]
        for g, shards in enumerate(shard_fp32_groups):
            leaves = {}
            for i, shard in enumerate(shards):
                leaf = shard.detach()
                tensor_parallel.copy_tensor_model_parallel_attributes(leaf, shard)
                if hasattr(shard, "shared"):
                    leaf.shared = shard.shared
                leaves[id(shard)] = leaf
                shards[i] = leaf
            params = opt_group_ranges[g]["orig_group"]["params"]
            opt_group_ranges[g]["orig_group"]["params"] = [leaves.get(id(p), p) for p in params]
        return groups

    build._rlpo_fixed = True
    cls._build_model_and_main_param_groups = classmethod(build)


def _te_min_version_without_te():
    from megatron.core.optimizer import optimizer_config

    # optimizer_config.py:383 asks is_te_min_version("2.1.0") of every precision-aware config, before its own
    # "CPU offload needs no TE FusedAdam" return (:390); without TE the version is None and the comparison
    # raises TypeError ('>=' between NoneType and Version). No TE is older than any version.
    optimizer_config.is_te_min_version = lambda version, check_equality=True: False


def _hybrid_optimizer_fp32_params_load():
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as hdo

    cls = hdo.HybridDeviceOptimizer
    if getattr(cls._update_fp32_params_by_new_state, "_rlpo_fixed", False):
        return

    def _update_fp32_params_by_new_state(self):
        # hybrid_optimizer.py:372-374 looks every param up in param_to_fp32_param, which holds only the 16-bit ones:
        # loading any state with an fp32 param (the local spec's norms under bf16, every param of an fp32 model)
        # raised KeyError. An fp32 param's master is its inner param, which the state already carries.
        if not self.param_update_in_fp32:
            return
        for param, v in self.state.items():
            fp32_param = self.param_to_fp32_param.get(param)
            if fp32_param is not None:
                fp32_param.data.copy_(v["master_param"])

    _update_fp32_params_by_new_state._rlpo_fixed = True
    cls._update_fp32_params_by_new_state = _update_fp32_params_by_new_state


def _mla_have_te_flag():
    from megatron.core.transformer import multi_latent_attention as mla

    # The module's `try: from megatron.core.extensions.transformer_engine import TELinear` succeeds without
    # TE (that module stands MagicMocks in for TE's classes), so HAVE_TE is True and the TELinear check
    # after building linear_proj calls isinstance(x, <MagicMock>): a TypeError for every MLA model.
    mla.HAVE_TE = False


SPEEDUPS: tuple[Patch, ...] = (
    Patch(
        "thd_rope_vectorized",
        ("models/common/embeddings/rope_utils.py:178-245",),
        "the unfused THD RoPE slices frequencies per sequence in a Python loop; one gather gives the same "
        "tensor (context parallel size 1)",
        _thd_rope_vectorized,
    ),
    Patch(
        "grad_norm_on_device",
        ("utils.py:1197-1207", "optimizer/clip_grads.py:42,108-113"),
        "without TE and apex the gradient norm's local stand-in reads every per-tensor norm on the host; the "
        "same norms are stacked on the device (no host sync)",
        _grad_norm_on_device,
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
    Patch(
        "distributed_optimizer_group_order",
        ("optimizer/distrib_optimizer.py:297,434-443,894-908,1068",),
        "the distributed optimizer indexes a param group's params in bucket order but lists them fp32 first: "
        "with fp32 norms and 16-bit biases in one group (glm4_moe's q/k/v biases) its checkpoint swapped their "
        "states (a shape error at the first save)",
        _distributed_optimizer_group_order,
    ),
    Patch(
        "distributed_optimizer_without_params",
        ("optimizer/distrib_optimizer.py:639-643",),
        "a distributed optimizer without params (the expert optimizer of a pipeline stage holding only dense "
        "layers) failed `assert len(steps) == 1` at the first checkpoint: torch Adam's step is read from "
        "per-param states, and it has none",
        _distributed_optimizer_without_params,
    ),
    Patch(
        "te_min_version_without_te",
        ("optimizer/optimizer_config.py:383", "utils.py:348"),
        "use_precision_aware_optimizer (with optimizer CPU offload, which needs no TE) raised TypeError without "
        "TE: the TE version check compares None with a Version; no TE counts as older than any",
        _te_min_version_without_te,
    ),
    Patch(
        "mla_have_te_flag",
        ("transformer/multi_latent_attention.py:54-65,183-185",),
        "multi_latent_attention.py believes TE is installed (its import of megatron's TE extension succeeds "
        "with MagicMock stand-ins), so building MLA's output projection fails in isinstance(x, TELinear)",
        _mla_have_te_flag,
    ),
)

# Defects of megatron-core 0.16.1's optimizer CPU offload (HybridDeviceOptimizer under the distributed optimizer),
# reached with or without TE, on any device, whenever a model has fp32 params (the local spec's norms under bf16, or
# an fp32 model). Both are fixed upstream (Megatron-LM#6212, #5929).
OFFLOAD_FIXES: tuple[Patch, ...] = (
    Patch(
        "hybrid_optimizer_fp32_shards_as_leaves",
        ("optimizer/distrib_optimizer.py:420,603", "optimizer/cpu_offloading/hybrid_optimizer.py:57"),
        "with optimizer CPU offload the distributed optimizer rebuilds its HybridDeviceOptimizer through "
        "torch.optim.Optimizer, which refuses the local spec's fp32 norm shards (views of params that require "
        "grad: 'can't optimize a non-leaf Tensor', Megatron-LM#6212); they are passed as detached views",
        _hybrid_optimizer_fp32_shards_as_leaves,
    ),
    Patch(
        "hybrid_optimizer_fp32_params_load",
        ("optimizer/cpu_offloading/hybrid_optimizer.py:372-374",),
        "loading optimizer-offload state with any fp32 param raised KeyError: the master lookup holds only the "
        "16-bit params' fp32 copies; an fp32 param is its own master",
        _hybrid_optimizer_fp32_params_load,
    ),
)
