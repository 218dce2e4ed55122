"""HF config -> megatron-core TransformerConfig + layer spec + GPTModel (model code, no parallel logic).

The parallel sizes come in as plain numbers; the process groups are megatron's parallel_state, set up
by rlpo_mega.distributed before any model is built.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from .families import get_family


class TransformerEngineError(RuntimeError):
    """Transformer Engine is installed but unusable: its torch binding does not load, or megatron-core does not take it
    as present."""


# What megatron-core 0.16.1 is tested with (megatron_core-0.16.1.dist-info/METADATA:43); setup.py's "gpu" extra pins it.
TE_REQUIREMENT = "transformer-engine[pytorch]>=2.9,<2.12"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


@functools.cache
def have_transformer_engine() -> bool:
    """Whether Transformer Engine is present as megatron-core itself decides it -- its own flag, HAVE_TE, set by
    importing `transformer_engine.pytorch.fp8` (megatron/core/extensions/transformer_engine.py:61-77) -- so the TE
    layer spec is asked for exactly when megatron holds TE's classes and not its MagicMock stand-ins
    (transformer_engine.py:74-77), whose first use dies in TEDotProductAttention.__init__. Absent TE is False without
    importing megatron (megatron's `import transformer_engine` then fails too: HAVE_TE False). Installed but unusable
    is one TransformerEngineError naming the failure, never a silent fall back to the local spec on a GPU nor an
    uncaught error from deep inside megatron's imports:
    - a torch binding that does not load (built for another torch or CUDA: OSError, which megatron's
      `except ImportError` lets through); TE's top-level package imports without it (it swallows that failure);
    - a TE megatron-core does not import with (it imports `transformer_engine.pytorch.fp8` unguarded, fp8_utils.py:
      667-668: a TE outside the range megatron-core is tested with, where TE has removed that deprecated module);
    - a TE megatron's own import leaves out (HAVE_TE False: `fp8_autocast` or `FP8GlobalStateManager` gone)."""
    found = importlib.util.find_spec("transformer_engine")
    if found is None:
        return False
    where = found.origin or "?"
    uninstall = ("or uninstall it (pip uninstall transformer-engine transformer-engine-torch) to run megatron-core's "
                 "local layer spec")
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # ImportError, OSError (a missing libcudart/libtransformer_engine), RuntimeError
        raise TransformerEngineError(
            f"Transformer Engine is installed ({where}) but transformer_engine.pytorch does not load: "
            f"{_first_line(e)}; install the TE build for torch {torch.__version__} (CUDA "
            f"{torch.version.cuda or 'none'}), {uninstall}") from None
    try:
        from megatron.core.extensions import transformer_engine as megatron_te
    except Exception as e:
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "megatron":
            raise  # no megatron-core here at all: not Transformer Engine's doing
        # megatron-core imports some of TE's modules unguarded once `import transformer_engine` succeeds, e.g.
        # transformer_engine.pytorch.fp8 (megatron/core/fp8_utils.py:24-28,667-668, reached from megatron.core's own
        # __init__): a TE without it stops megatron-core's import itself
        raise TransformerEngineError(
            f"Transformer Engine is installed ({where}) but megatron-core does not import with it: {_first_line(e)}; "
            f"install {TE_REQUIREMENT} (what megatron-core 0.16.1 is tested with), {uninstall}") from None
    if megatron_te.HAVE_TE:
        return True
    try:  # megatron swallowed an ImportError: its own import statement again, for the reason
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, fp8_autocast  # noqa: F401
        cause = "ImportError"
    except Exception as e:
        cause = _first_line(e)
    raise TransformerEngineError(
        f"Transformer Engine is installed ({where}) but megatron-core does not take it as present (HAVE_TE is False: "
        "its import of FP8GlobalStateManager and fp8_autocast from transformer_engine.pytorch.fp8 fails with "
        f"{cause}); install {TE_REQUIREMENT} (what megatron-core 0.16.1 is tested with), {uninstall}")


def load_hf_config(path: str) -> PretrainedConfig:
    """A config.json file or a directory holding one; the family comes from its model_type."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"HF config {file!r} does not exist; pass a config.json or its directory")
    with open(file) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    family = get_family(model_type)  # unsupported model types fail here, with the list
    raw = {k: v for k, v in raw.items() if k != "model_type"}
    return family.hf_config_class(**raw)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    multiple = math.lcm(divisible_by, tensor_parallel)
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class ParallelSizes:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    expert_tensor: int = 1
    sequence_parallel: bool = False
    context: int = 1


FAST_PATH_FIELDS = ("gradient_accumulation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                    "masked_softmax_fusion", "moe_permute_fusion")


def fast_kernels() -> dict[str, bool]:
    """Which fused kernels this process can run, as megatron-core 0.16.1 itself finds them: TE's fused RoPE
    and MoE permutation (None in megatron's modules when TE is absent or too old), apex's weight-gradient
    accumulation (tensor_parallel.layers; megatron's local output layer needs it even under the TE spec) and
    apex's masked-softmax extensions."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import moe_utils

    have = importlib.util.find_spec
    return {
        "rope": rope_utils.fused_apply_rotary_pos_emb is not None and rope_utils.fused_apply_rotary_pos_emb_thd is not None,
        "permute": all(getattr(moe_utils, n, None) is not None for n in (
            "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
            "fused_sort_chunks_by_index_with_probs", "fused_unpermute")),
        "wgrad_accumulation": bool(layers._grad_accum_fusion_available),
        "masked_softmax": all(have(n) is not None for n in ("scaled_upper_triang_masked_softmax_cuda",
                                                            "scaled_masked_softmax_cuda")),
    }


def fast_path(on_gpu: bool, kernels: dict[str, bool], mla: bool = False) -> dict[str, bool]:
    """The fusions of the GPU fast path as TransformerConfig fields: each on under CUDA where its kernel
    exists (`fast_kernels`), all off on a CPU (the kernels are CUDA's). Bias-dropout-add needs only torch's
    jit. MLA's fused RoPE is left off: megatron-core 0.16.1 supports it only for YaRN and calls it
    experimental (transformer_config.py:1531-1534, 2068-2069); MLA takes the vectorised unfused THD RoPE
    (rlpo_mega.platform.megatron_fixes)."""
    if not on_gpu:
        return dict.fromkeys(FAST_PATH_FIELDS, False)
    return {"gradient_accumulation_fusion": kernels["wgrad_accumulation"], "bias_dropout_fusion": True,
            "apply_rope_fusion": kernels["rope"] and not mla, "masked_softmax_fusion": kernels["masked_softmax"],
            "moe_permute_fusion": kernels["permute"]}


def transformer_config(hf: PretrainedConfig, par: ParallelSizes, params_dtype=torch.float32,
                       token_dispatcher: str = "alltoall", recompute: bool = False, **extra):
    family = get_family(hf.model_type)
    fields = family.transformer_fields(hf)
    on_gpu = torch.cuda.is_available()
    fields.update(
        tensor_model_parallel_size=par.tensor,
        pipeline_model_parallel_size=par.pipeline,
        expert_model_parallel_size=par.expert,
        expert_tensor_parallel_size=par.expert_tensor,
        sequence_parallel=par.sequence_parallel,
        context_parallel_size=par.context,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        moe_token_dispatcher_type=token_dispatcher,
        moe_grouped_gemm=have_transformer_engine(),
        # On CPU full weights are built then split, so TP layouts initialise identically from one
        # seed; EP and PP draw in another order (load a checkpoint for identical weights there).
        use_cpu_initialization=not on_gpu,
        # apex's persistent LayerNorm has no RMSNorm, which every family here uses
        persist_layer_norm=False,
        moe_router_dtype="fp32",
        # packed micro-batches differ in length: pipeline stages exchange each one's shape first (megatron
        # refuses that with the allgather dispatcher; config_checks refuses allgather with PP then)
        variable_seq_lengths=token_dispatcher != "allgather",
    )
    fields.update(fast_path(on_gpu, fast_kernels() if on_gpu else {}, bool(fields.get("multi_latent_attention"))))
    if recompute:
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    fields.update(extra)
    return family.megatron_config_class(hf)(**fields)


def _mla_duplicated_down_projections(block_spec):
    """MLA without TE: the q/kv down-projections as whole (duplicated) linears, as TE's spec has them.

    The local spec makes them column-parallel and gathers their output over TP; the shared RoPE key k_pe then
    leaves that gather (whose backward only splits) into every rank's heads, so each rank kept only its own
    heads' part of k_pe's gradient: under TP2+SP the kv down-projection's gradient was 0.5% off and everything
    below it too. With a duplicated linear megatron takes its other branch (multi_latent_attention.py:615-622):
    k_pe is gathered along the sequence, whose backward reduce-scatters (sums) over TP; the weights are tagged
    sequence_parallel, so finalize_model_grads sums their gradients over TP too."""
    from megatron.core.post_training.modelopt.layers import Linear

    for layer in block_spec.layer_specs:
        sub = getattr(layer.submodules.self_attention, "submodules", None)
        if sub is not None and hasattr(sub, "linear_kv_down_proj"):
            sub.linear_q_down_proj = Linear
            sub.linear_kv_down_proj = Linear
    return block_spec


def build_gpt_model(hf: PretrainedConfig, config, vocab_divisible_by: int = 128,
                    pre_process: bool | None = None, post_process: bool | None = None,
                    value_head: bool = False, head_seed: int = 0):
    """The GPTModel of this pipeline stage (TE spec when Transformer Engine is installed, else local).
    value_head: a critic -- the output layer is moe.value_head.ValueHead (values [b, s, 1], never tied)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    family = get_family(hf.model_type)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    te = have_transformer_engine()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if not te:  # packed (THD) micro-batches: TE's attention takes them, the local one needs this
        # lazy: imports megatron, which a broken TE makes fail before have_transformer_engine() can report it
        from .packed_attention import use_packed_core_attention

        spec = use_packed_core_attention(spec)
        if config.multi_latent_attention:
            spec = _mla_duplicated_down_projections(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf.vocab_size, vocab_divisible_by, config.tensor_model_parallel_size),
        max_sequence_length=hf.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings) and not value_head,
        position_embedding_type="rope",
        rotary_base=int(family.rope_theta(hf)),
        rotary_percent=family.rotary_percent(hf),
    )
    if value_head and post_process:
        # lazy: imports megatron, which a broken TE makes fail before have_transformer_engine() can report it
        from .value_head import ValueHead

        model.output_layer = ValueHead(config, seed=head_seed)
        # The bias is 1-D: optimizers group it with the norms (no weight decay), and megatron-core 0.16.1's
        # distributed optimizer assumes a group holds one parameter dtype (it lists fp32 parameters first, then
        # the fp32 copies of 16-bit ones, but indexes them in bucket order). The norms' dtype differs by spec
        # (local: fp32 under bf16; Transformer Engine: bf16): the bias takes theirs.
        norm = model.decoder.final_layernorm.weight
        model.output_layer.bias.data = model.output_layer.bias.data.to(norm.dtype)
    model.hf_config = hf
    # the spec names some norms' checkpoint keys differently: recorded in checkpoints (rlpo_mega.checkpoint.layer_spec)
    model.layer_spec = "transformer_engine" if te else "local"
    model.real_vocab_size = hf.vocab_size
    model.value_head = value_head
    return model
