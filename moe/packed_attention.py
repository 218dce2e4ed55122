"""Packed sequences (THD) without Transformer Engine: a core attention that respects sequence boundaries.

Packed micro-batches hold several samples back to back in one row ([t, b=1]); megatron describes them with
PackedSeqParams (qkv_format="thd", cu_seqlens). With TE, TEDotProductAttention runs them with its varlen
kernels. megatron's local DotProductAttention (the spec without TE: CPU, and GPUs without TE) refuses them,
so without TE the layer spec's core attention is this subclass: it lays the sequences out side by side as a
padded batch and runs torch's scaled_dot_product_attention on it, causal, with the parent's scale (query-key
layer scaling included), dropout probability, dropout RNG stream and GQA head grouping, so a token never
attends across a boundary and the result is the parent's padded-path attention (tested equal on CPU, outputs
and gradients, at TP1 and TP2: tests/test_packed_attention_sdpa.py). Where they differ: masked scores are
-inf instead of the parent's -10000 (no real token's result changes), and in half precision the softmax runs
in fp32 inside the kernel whatever attention_softmax_in_fp32 says (rounding only). Causal attention only, no
sliding window, no softmax offset: the packed branch refuses the rest (no family here uses them). RoPE
positions restart per sequence in megatron's attention itself (apply_rotary_pos_emb with cu_seqlens), before
the core attention is called.

Cost: n x longest^2 per head of attention compute (varlen kernels: sum of len_i^2), but no [longest, longest]
score matrix per head where torch runs a fused kernel (flash or memory-efficient on CUDA); the memory
overhead is the padded copies of q, k, v and the output, n x longest x heads x dim each (k and v expanded to
every query head under GQA unless the flash kernel takes them grouped: _native_gqa). The packed branch never
stops the host: longest is PackedSeqParams.max_seqlen_q (a Python int), and the tokens go back to packed order
by an index gather. The projections, MoE layers and logits, most of the compute, run on the packed tokens only.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from . import context_parallel


def _native_gqa(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether SDPA gets the grouped k/v heads as they are (enable_gqa) instead of expanded copies.

    torch's flash kernel takes grouped heads (CUDA, half precision, one head dim <= 256 for q, k and v). Its
    memory-efficient kernel (fp32, or MLA's smaller v head dim) admits them only in recent torch releases;
    older ones (and ROCm) would fall back to the math kernel, which builds the [L, L] scores: there expanded
    copies, as megatron makes, are the cheaper cost."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] == value.shape[-1] <= 256)


class PackedDotProductAttention(DotProductAttention):
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        # Multi-latent attention passes its q/k and v head dims (megatron-core 0.16.1's MLA was written for
        # TE's attention; the local DotProductAttention has no such arguments and fails to build). The local
        # math takes the q/k dim from the tensors and sizes its output by config.kv_channels, which the MLA
        # family sets to the value head dim: checked here, not assumed.
        config = kwargs.get("config", args[0] if args else None)
        cp = config.context_parallel_size
        if cp > 1:  # megatron's local attention asserts CP == 1 in its constructor: the CP branch below runs it
            kwargs["config"], args = copy.copy(config), args[1:] if args else args
            kwargs["config"].context_parallel_size = 1
        super().__init__(*args, **kwargs)
        self.config = config
        if v_channels is not None and v_channels != self.config.kv_channels:
            raise ValueError(f"core attention: v_channels={v_channels} but config.kv_channels="
                             f"{self.config.kv_channels}; an MLA config must set kv_channels to v_head_dim")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        cp = self.config.context_parallel_size
        if packed_seq_params is None:
            if cp > 1:
                raise ValueError(f"context parallelism ({cp}) without Transformer Engine runs packed (THD) "
                                 "micro-batches only; set trainer.layout=packed")
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in format {packed_seq_params.qkv_format!r}; only 'thd' is supported")
        if attention_mask is not None:
            raise ValueError("packed sequences take their boundaries from cu_seqlens, not an attention_mask")
        if attention_bias is not None:
            raise ValueError("packed sequences: attention_bias is not supported (nor by megatron's local attention)")
        # the parent ignores the forward's attn_mask_type too: its softmax was built with the layer's
        if self.attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"packed sequences need causal attention (the pads after each sequence are hidden "
                             f"by causality alone), not {self.attn_mask_type}")
        if self.scale_mask_softmax.window_size is not None or self.softmax_offset is not None:
            raise ValueError("packed sequences without Transformer Engine: sliding-window attention and softmax "
                             f"type {self.config.softmax_type!r} are not supported (plain causal softmax only)")
        longest = packed_seq_params.max_seqlen_q
        if longest is None or torch.is_tensor(longest):
            raise ValueError("packed sequences without Transformer Engine: the caller must set "
                             "PackedSeqParams.max_seqlen_q to a Python int (the longest sequence); reading it "
                             f"from cu_seqlens would stop the host at every layer (got {type(longest).__name__})")
        longest = int(longest)
        # query-key layer scaling divides the parent's scale by the layer number for the raw scores and its
        # softmax multiplies that back (in fp32): the net scale is the product
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        if cp > 1:
            # this rank's rows of megatron's THD CP layout (cu_seqlens_q_padded: every sequence padded to
            # 2 x cp, max_seqlen_q the longest padded one): moe.context_parallel's all-gather-KV attention
            if self.attention_dropout.training and self.attention_dropout.p > 0:
                raise ValueError("context parallelism without Transformer Engine: attention dropout is not "
                                 "supported (set the model's attention_dropout to 0)")
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                raise ValueError("context parallelism: PackedSeqParams.cu_seqlens_q_padded (the CP layout) is "
                                 "not set")
            out = context_parallel.attention(query, key, value, cu, longest,
                                             parallel_state.get_context_parallel_group(), scale)
            return out.unsqueeze(1)
        # thd: query [t, heads, dim] (megatron squeezed the dummy batch dimension). The sequences are laid out
        # as a padded batch [n, heads, longest, dim] for ONE kernel call (a Python loop over hundreds of short
        # sequences costs more than the padding); causal attention never lets a real position see the pads
        # after it, so the outputs equal per-sequence attention. No check that cu_seqlens cover the row (0 .. t):
        # it would stop the host every layer, and megatron's THD RoPE as shipped already requires it (torch.split
        # by the lengths); a row they do not cover, or a sequence longer than max_seqlen_q, puts an index of the
        # gathers below out of range: an error, not a silent result.
        cu = packed_seq_params.cu_seqlens_q.to(device=query.device, dtype=torch.long)
        t, n = query.shape[0], cu.shape[0] - 1
        pos = torch.arange(longest, device=query.device)
        start = cu[:-1, None]
        # pads read token 0: finite values, and their gradient is exactly zero
        index = torch.where(pos[None, :] < cu[1:, None] - start, start + pos[None, :], 0)  # [n, longest]
        q, k, v = (x[index].transpose(1, 2) for x in (query, key, value))  # [n, heads, longest, dim]
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        native_gqa = groups > 1 and _native_gqa(query, value)
        if groups > 1 and not native_gqa:
            # megatron's grouping: query head h reads k/v head h // groups (SDPA's enable_gqa does the same)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        dropout_p = self.attention_dropout.p if self.attention_dropout.training else 0.0
        # the parent draws its attention dropout from the TP rank's own stream unless sequence parallel
        rng = (tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 and not self.config.sequence_parallel
               else contextlib.nullcontext())
        with rng:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                                 enable_gqa=native_gqa)  # [n, heads, longest, v dim]
        out = out.transpose(1, 2).reshape(n * longest, -1)  # [n * longest, heads * v dim]
        # back to packed order: token j of the row sits at (its sequence) * longest + (its position in it)
        tok = torch.arange(t, device=query.device)
        seq = torch.searchsorted(cu[1:], tok, right=True)
        at = tok - cu[seq]
        flat = torch.where(at < longest, seq * longest + at, -1)  # -1: index_select refuses it, no wrap-around
        return out.index_select(0, flat).unsqueeze(1)  # [t, 1, heads * v dim]


def use_packed_core_attention(block_spec):
    """Without TE: swap the local DotProductAttention of every layer spec for the packed-aware subclass."""
    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        sub = getattr(attn, "submodules", None)
        if sub is not None and getattr(sub, "core_attention", None) is DotProductAttention:
            sub.core_attention = PackedDotProductAttention
    return block_spec
