"""megatron-core's Transformer Engine layer spec built on a machine without Transformer Engine, for checkpoint tests.

The model is megatron's own TE spec (get_gpt_decoder_block_spec(use_transformer_engine=True), what
moe.model.build_gpt_model builds wherever TE is installed): which norms are modules of their own, which are fused
into the linear after them, the layers' sharded_state_dict_keys_map, megatron's TransformerLayer/TransformerBlock/MoE
sharded_state_dict. Only the leaves TE would supply are stand-ins, each a megatron local module with what TE's adds
to the state dict, as megatron's TE wrappers checkpoint it (megatron/core/extensions/transformer_engine.py):
- TELayerNormColumnParallelLinear: the fused norm's `layer_norm_weight`, replicated (its sharded_state_dict shards
  only weight and bias along axis 0, :909-920 -- the same call as ColumnParallelLinear's);
- every TE module: `_extra_state`, an empty uint8 tensor without FP8 (TE's TransformerEngineBaseModule);
- TENorm: a torch RMSNorm with that extra state; TEDotProductAttention: megatron's local DotProductAttention (TE's
  checkpoints nothing but a learnable softmax offset, :1436-1454); TELinear (MLA's duplicated down-projections): the
  whole linear the local spec is given here too (moe.model._mla_duplicated_down_projections).
The experts are megatron's SequentialMLP of TE linears, the TE spec's choice without grouped GEMM
(transformer_engine_spec_provider.py:83-96); megatron keeps TEGroupedMLP's checkpoint interchangeable with it
(moe/experts.py:773-775). Nothing here runs a forward pass: it is the checkpoint's key set that is TE's."""
from __future__ import annotations

import contextlib

import torch


class _TEExtraState:
    """TE modules' `_extra_state`: FP8 metadata, an empty uint8 tensor when FP8 is off; set_extra_state returns on an
    empty one (transformer_engine/pytorch/module/base.py)."""

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        if state is not None and not (isinstance(state, torch.Tensor) and state.numel() == 0):
            raise AssertionError(f"{type(self).__name__} given extra state {state!r}: only TE's empty state is ours")


def standins():
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class TEColumnParallelLinear(_TEExtraState, ColumnParallelLinear):
        pass

    class TERowParallelLinear(_TEExtraState, RowParallelLinear):
        pass

    class TELayerNormColumnParallelLinear(_TEExtraState, ColumnParallelLinear):
        def __init__(self, input_size, output_size, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            config = kwargs["config"]
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            setattr(self.layer_norm_weight, "sequence_parallel", config.sequence_parallel)

    class TELinear(_TEExtraState, Linear):
        def __init__(self, input_size, output_size, *, parallel_mode=None, skip_weight_param_allocation=False,
                     **kwargs):
            kwargs.pop("tp_comm_buffer_name", None)
            super().__init__(input_size, output_size, skip_weight_param_allocation=skip_weight_param_allocation,
                             **kwargs)

    class TENorm(_TEExtraState, torch.nn.RMSNorm):
        def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
            super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
            for p in self.parameters():
                setattr(p, "sequence_parallel", config.sequence_parallel)

    class TEDotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):  # MLA's head sizes: TE's arguments
            super().__init__(*args, **kwargs)

    return {c.__name__: c for c in (TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear,
                                   TELinear, TENorm, TEDotProductAttention)}


@contextlib.contextmanager
def te_spec():
    """Within: rlpo_mega.model_setup.build_policy builds megatron's TE spec with the stand-ins (its model records
    layer_spec "transformer_engine", as on a GPU with TE); the config is the one this machine gets (no grouped GEMM)."""
    import moe.model
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import multi_latent_attention
    from rlpo_mega import model_setup

    classes = standins()
    missing = object()
    patches = [(provider, name, cls) for name, cls in classes.items()]
    patches += [(provider, "is_te_min_version", lambda *a, **k: True),  # the pinned TE >= 2.9
                # bound by gpt_layer_specs.py:42-50 only where TE imports
                (gpt_layer_specs, "TENorm", classes["TENorm"]),
                (gpt_layer_specs, "TESpecProvider", provider.TESpecProvider),
                (gpt_layer_specs, "TEFusedMLP", te_ext.TEFusedMLP),
                # MLA tells its down-projections' parallel mode by these names (multi_latent_attention.py:55-57,408)
                (multi_latent_attention, "TELinear", classes["TELinear"]),
                (multi_latent_attention, "TEColumnParallelLinear", classes["TEColumnParallelLinear"])]
    original_build = model_setup.build_gpt_model

    def build_gpt_model(*args, **kwargs):
        probe = moe.model.have_transformer_engine
        moe.model.have_transformer_engine = lambda: True
        try:
            return original_build(*args, **kwargs)
        finally:
            moe.model.have_transformer_engine = probe

    patches.append((model_setup, "build_gpt_model", build_gpt_model))
    saved = [(obj, name, getattr(obj, name, missing)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
