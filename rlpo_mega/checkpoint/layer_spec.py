"""Checkpoints across megatron-core's two layer specs: the local one (every CPU run, `rlpo-mega convert`, `rlpo-mega
export` on a machine without Transformer Engine) and the Transformer Engine one (GPU runs where TE is installed,
moe.model.build_gpt_model).

Both specs hold the same tensors, but some norms under other sharded keys (megatron-core 0.16.1):
- the TE spec fuses a norm into the linear after it (TELayerNormColumnParallelLinear, parameter `layer_norm_weight`)
  wherever it has an IdentityOp for that norm: the input norm of a non-MLA layer (`input_layernorm` left at its
  IdentityOp default, transformer/transformer_layer.py:224; `linear_qkv` the fused linear, models/gpt/
  gpt_layer_specs.py:279), the pre-MLP norm of a *dense* layer (gpt_layer_specs.py:265,291 `backend.layer_norm() if
  num_experts else IdentityOp`; its MLP's fc1 the fused linear, :494-497) and MLA's q/kv norms (:260-261, fused into
  the up-projections, :235-244). A MoE layer keeps a separate TENorm `pre_mlp_layernorm` (:265,291): key
  `pre_mlp_layernorm.weight`.
- the local spec has every norm as a module of its own and renames two of them in the sharded keys of *every*
  non-MLA layer, MoE layers included (`sharded_state_dict_keys_map`, gpt_layer_specs.py:417-420, applied by
  TransformerLayer.sharded_state_dict, transformer_layer.py:851-857): `input_layernorm.` ->
  `self_attention.linear_qkv.layer_norm_`, `pre_mlp_layernorm.` -> `mlp.linear_fc1.layer_norm_`. Its MLA layers
  have no such map (:366-391).
So a MoE layer's pre-MLP norm (all families), and under MLA a dense layer's pre-MLP norm and the q/kv norms, are
stored under different keys by the two specs. TE's modules also carry `_extra_state` (FP8 metadata) that local
modules lack or hold as None, and the experts differ in theirs (TEGroupedMLP vs SequentialMLP, whose weights
megatron keeps interchangeable, moe/experts.py:773-775).

What is known of the specs is read from megatron's own spec builder (get_gpt_decoder_layer_specs, for this model's
config): which norms a layer spec has as modules, which it leaves as an IdentityOp before the spec's fused
norm-linear, and the layer's sharded_state_dict_keys_map. The one fact written here is which linear follows which
norm (_FUSED_INTO, cited). At load, the model's sharded keys are renamed to the saved spec's before the load (the
optimizer's keys are made from them, so they follow), and every `_extra_state` is kept as the module has it:
neither spec's extra state means anything to the other (TE's set_extra_state returns on an empty state; megatron's
local linears ignore theirs, tensor_parallel/layers.py:1072-1077,1315-1320)."""
from __future__ import annotations

import contextlib
import warnings

LOCAL = "local"
TRANSFORMER_ENGINE = "transformer_engine"
SPECS = (LOCAL, TRANSFORMER_ENGINE)

# norm -> the linear after it, into which the TE spec fuses the norm where the norm itself is an IdentityOp
_FUSED_INTO = {
    "input_layernorm": "self_attention.linear_qkv",  # gpt_layer_specs.py:279
    "pre_mlp_layernorm": "mlp.linear_fc1",  # dense MLP, gpt_layer_specs.py:494-497
    "self_attention.q_layernorm": "self_attention.linear_q_up_proj",  # MLA, gpt_layer_specs.py:235-239
    "self_attention.kv_layernorm": "self_attention.linear_kv_up_proj",  # MLA, gpt_layer_specs.py:240-244
}
_NORM_PARAMS = ("weight", "bias")
EXTRA_STATE = "_extra_state"


def model_layer_spec(model) -> str:
    """The spec a (unwrapped) GPTModel was built with: moe.model.build_gpt_model records it; otherwise a model holding
    megatron's TE wrappers (megatron/core/extensions/transformer_engine.py) is a TE-spec model."""
    spec = getattr(model, "layer_spec", None)
    if spec in SPECS:
        return spec
    for m in model.modules():
        if type(m).__module__.startswith(("megatron.core.extensions.transformer_engine", "transformer_engine")):
            return TRANSFORMER_ENGINE
    return LOCAL


@contextlib.contextmanager
def _te_spec_builder():
    """megatron's TE spec builder where TE is not installed (a CPU exporting or resuming a GPU checkpoint): the names
    its TE import block would have bound (gpt_layer_specs.py:42-50; megatron/core/extensions stands MagicMocks in for
    TE's classes, which are only named in a spec, never built here), and TE's version as the pinned range (>=2.9)
    answers the spec provider's checks (transformer_engine_spec_provider.py:50,71). Restored after."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs

    if gpt_layer_specs.HAVE_TE:
        yield
        return
    missing = object()
    bound = {"TENorm": te_ext.TENorm, "TEFusedMLP": te_ext.TEFusedMLP, "TESpecProvider": provider.TESpecProvider}
    saved = {name: getattr(gpt_layer_specs, name, missing) for name in bound}
    saved_version = provider.is_te_min_version
    try:
        for name, value in bound.items():
            setattr(gpt_layer_specs, name, value)
        provider.is_te_min_version = lambda *args, **kwargs: True
        yield
    finally:
        provider.is_te_min_version = saved_version
        for name, value in saved.items():
            if value is missing:
                delattr(gpt_layer_specs, name)
            else:
                setattr(gpt_layer_specs, name, value)


def layer_specs(config, spec: str) -> list:
    """megatron's layer spec of every layer (global index) of a GPT decoder with this config, under `spec`
    (get_gpt_decoder_layer_specs, gpt_layer_specs.py:517-610: MoE and dense layers by moe_layer_freq)."""
    from megatron.core.models.gpt import gpt_layer_specs

    te = spec == TRANSFORMER_ENGINE
    with warnings.catch_warnings(), (_te_spec_builder() if te else contextlib.nullcontext()):
        warnings.simplefilter("ignore")  # e.g. the legacy GroupedMLP deprecation, irrelevant to the keys
        return gpt_layer_specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=te, normalization="RMSNorm")


def _fused_linear_class(spec: str):
    """The spec's fused norm-linear class (None: the local spec has none, backends.py:100-102)."""
    if spec != TRANSFORMER_ENGINE:
        return None
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    return TESpecProvider().column_parallel_layer_norm_linear()


def _submodule(layer_spec, path: str):
    """The class a layer spec builds at a dotted submodule path (None: the spec has no such submodule)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    node = layer_spec
    for part in path.split("."):
        subs = node.submodules if isinstance(node, ModuleSpec) else None
        node = getattr(subs, part, None)
        if node is None:
            return None
    return node.module if isinstance(node, ModuleSpec) else node


def _is_identity(cls) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return isinstance(cls, type) and issubclass(cls, IdentityOp)


def norm_names(layer_spec, fused_linear) -> dict[tuple[str, str], tuple[str, str]]:
    """{(norm, param): (module path, sharded key)} of the norms a layer spec holds, layer-relative. A norm the spec
    leaves as an IdentityOp before its fused norm-linear lives in that linear as `layer_norm_<param>`; the sharded key
    is the module path through the layer's sharded_state_dict_keys_map, first matching prefix
    (dist_checkpointing/utils.py:210-233)."""
    keys_map = dict(getattr(layer_spec.submodules, "sharded_state_dict_keys_map", None) or {})
    out = {}
    for norm, linear in _FUSED_INTO.items():
        cls = _submodule(layer_spec, norm)
        if cls is None:
            continue
        fused = _is_identity(cls)
        if fused and (fused_linear is None or _submodule(layer_spec, linear) is not fused_linear):
            continue  # an IdentityOp that is no norm at all (e.g. no q/k norms in this model)
        for param in _NORM_PARAMS:
            path = f"{linear}.layer_norm_{param}" if fused else f"{norm}.{param}"
            key = next((new + path[len(old):] for old, new in keys_map.items() if path.startswith(old)), path)
            out[(norm, param)] = (path, key)
    return out


def _is_extra_state(value) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return isinstance(value, ShardedObject) and value.key.rsplit(".", 1)[-1] == EXTRA_STATE


def stored_keys(path: str) -> set[str]:
    """The keys of every tensor and object a megatron dist checkpoint holds (its metadata only)."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return {v.key for v in load_sharded_metadata(path).values()}  # objects: by unique key


def cross(sharded_sd: dict, model, saved: str, run: str, prefix: str = "") -> int:
    """Make this model's sharded state dict (built by the `run` spec) ask for a checkpoint written by the `saved` spec,
    in place: the norms' sharded keys renamed to the saved spec's, every `_extra_state` kept as the module has it
    (a LocalNonpersistentObject: megatron's load hands it back without reading the checkpoint,
    dist_checkpointing/serialization.py:123-126). Returns the number of keys renamed."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    renames = {}  # dict key -> (the run's sharded-key suffix, the saved spec's)
    layers = model.decoder.layers if getattr(model, "decoder", None) is not None else []
    if len(layers):
        run_specs, saved_specs = layer_specs(model.config, run), layer_specs(model.config, saved)
        run_linear, saved_linear = _fused_linear_class(run), _fused_linear_class(saved)
        for index, layer in enumerate(layers):
            number = layer.layer_number - 1  # global (transformer_block.py:864)
            mine = norm_names(run_specs[number], run_linear)
            theirs = norm_names(saved_specs[number], saved_linear)
            for what, (path, key) in mine.items():
                if what in theirs and theirs[what][1] != key:
                    renames[f"{prefix}decoder.layers.{index}.{path}"] = (key, theirs[what][1])
    renamed = 0
    for name, value in list(sharded_sd.items()):
        if _is_extra_state(value):
            sharded_sd[name] = LocalNonpersistentObject(value.data)
        elif name in renames and isinstance(value, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            mine, theirs = renames[name]
            if not value.key.endswith(mine):  # megatron named it otherwise than its spec says: do not guess
                raise RuntimeError(f"{name}: sharded key {value.key!r} does not end in {mine!r}, the key megatron's "
                                   f"{run} layer spec gives it")
            value.key = value.key[: len(value.key) - len(mine)] + theirs
            renamed += 1
    return renamed


def missing(sharded_sd: dict, stored: set[str]) -> list[str]:
    """The sharded keys the state dict asks for that the checkpoint does not hold."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return sorted({v.key for v in nested_values(sharded_sd) if isinstance(v, ShardedBase) and v.key not in stored})
