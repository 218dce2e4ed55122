"""Packed sequences (THD) without Transformer Engine: a core attention that respects sequence boundaries.

Packed micro-batches hold several samples back to back in one row ([t, b=1]); megatron describes them with
PackedSeqParams (qkv_format="thd", cu_seqlens). With TE, TEDotProductAttention runs them with its varlen
kernels. megatron's local DotProductAttention (the spec without TE: CPU, and GPUs without TE) refuses them,
so without TE the layer spec's core attention is this subclass: it runs the parent's own attention math
(scale, softmax, dropout, GQA expansion: identical numerics to the padded path) on the sequences laid
out side by side, so a token never attends across a boundary. RoPE positions restart per sequence in megatron's attention itself
(apply_rotary_pos_emb with cu_seqlens), before the core attention is called.

Cost: n x longest^2 per head for the attention scores alone (varlen kernels: sum of len_i^2); the
projections, MoE layers and logits, most of the compute, run on the packed tokens only.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        # Multi-latent attention passes its q/k and v head dims (megatron-core 0.16.1's MLA was written for
        # TE's attention; the local DotProductAttention has no such arguments and fails to build). The local
        # math takes the q/k dim from the tensors and sizes its output by config.kv_channels, which the MLA
        # family sets to the value head dim: checked here, not assumed.
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.config.kv_channels:
            raise ValueError(f"core attention: v_channels={v_channels} but config.kv_channels="
                             f"{self.config.kv_channels}; an MLA config must set kv_channels to v_head_dim")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in format {packed_seq_params.qkv_format!r}; only 'thd' is supported")
        if attention_mask is not None:
            raise ValueError("packed sequences take their boundaries from cu_seqlens, not an attention_mask")
        # thd: query [t, heads, dim] (megatron squeezed the dummy batch dimension). The sequences are laid
        # out as a padded batch [longest, n, heads, dim] for ONE call of the parent (a Python loop over
        # hundreds of short sequences costs more than the padding), then gathered back: causal attention
        # never lets a real position see the pads after it, so the outputs equal per-sequence attention.
        cu = packed_seq_params.cu_seqlens_q.to(device=query.device, dtype=torch.long)
        t = query.shape[0]
        if int(cu[0]) != 0 or int(cu[-1]) != t:
            raise ValueError(f"cu_seqlens {int(cu[0])}..{int(cu[-1])} do not cover the packed row of {t} tokens")
        lens = cu[1:] - cu[:-1]
        longest = int(packed_seq_params.max_seqlen_q or int(lens.max()))
        pos = torch.arange(longest, device=query.device)
        valid = pos[None, :] < lens[:, None]  # [n, longest]
        index = torch.where(valid, cu[:-1, None] + pos[None, :], torch.zeros((), dtype=torch.long,
                                                                             device=query.device))
        q, k, v = (x[index].transpose(0, 1) for x in (query, key, value))  # [longest, n, heads, dim]
        # the parent views k and v as [s, b * heads, dim]: fine after its GQA expansion copies them, not for
        # multi-latent attention (as many k/v heads as q heads, nothing expanded)
        k, v = k.contiguous(), v.contiguous()
        out = super().forward(q, k, v, None, attn_mask_type, attention_bias)  # [longest, n, heads * dim]
        return out.transpose(0, 1)[valid].unsqueeze(1)  # [t, 1, heads * dim] in packed order


def use_packed_core_attention(block_spec):
    """Without TE: swap the local DotProductAttention of every layer spec for the packed-aware subclass."""
    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        sub = getattr(attn, "submodules", None)
        if sub is not None and getattr(sub, "core_attention", None) is DotProductAttention:
            sub.core_attention = PackedDotProductAttention
    return block_spec
