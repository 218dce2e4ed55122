"""moe/packed_attention.py's packed branch (torch's scaled_dot_product_attention on the padded layout) vs the
attention it replaced (megatron's local DotProductAttention math on the same padded layout, the old forward
copied below as the reference): outputs and gradients w.r.t. q, k, v, max abs errors reported.

World size 1 (TP1): float32 and float64, several sequences of different lengths (one of length 1, one
empty), GQA (expanded heads, and SDPA's enable_gqa as flash takes it), one sequence, an MLA-like head layout
(q/k head dim 12, v head dim 8, MLA's explicit softmax scale), query-key layer scaling at layer 3,
max_seqlen_q above the longest, bf16; the host syncs the packed branch makes (none), and those of the old one
(the spy works); its refusals; dropout in training mode.
World size 2 (TP2 + sequence parallel, the world as the TP group): every rank's share of the heads through
the packed branch, gathered over TP, vs the single-process result (the same module class on a one-rank TP
group, all heads) and the old reference, outputs and gradients.
Rank 0 writes the report.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.dist import write_report  # noqa: E402

CU = [0, 5, 6, 13, 13, 20, 31]  # lengths 5, 1, 7, 0, 7, 11


def setup():
    from megatron.core import parallel_state

    from rlpo_mega import distributed, platform

    platform.apply()
    distributed.init_process_group()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    distributed.set_seed(1234)


def attention(heads, groups, v_dim, dtype=torch.float32, tp=1, layer=1, qk_scaling=False, dropout=0.0,
              softmax_scale=None, k_channels=None, pg=None):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from moe.packed_attention import PackedDotProductAttention

    config = TransformerConfig(num_layers=4, hidden_size=heads * v_dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=v_dim, tensor_model_parallel_size=tp,
                               sequence_parallel=tp > 1, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               attention_dropout=dropout, apply_query_key_layer_scaling=qk_scaling,
                               masked_softmax_fusion=False, use_cpu_initialization=True)
    mla = {} if k_channels is None else {"k_channels": k_channels, "v_channels": v_dim}
    attn = PackedDotProductAttention(config=config, layer_number=layer, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self", softmax_scale=softmax_scale, pg_collection=pg, **mla)
    return attn.eval()


def reference(attn, query, key, value, cu):
    """The packed branch before SDPA (moe/packed_attention.py up to this change), host syncs included."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cu = cu.to(device=query.device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    longest = int(lens.max())
    pos = torch.arange(longest, device=query.device)
    valid = pos[None, :] < lens[:, None]
    index = torch.where(valid, cu[:-1, None] + pos[None, :], torch.zeros((), dtype=torch.long, device=query.device))
    q, k, v = (x[index].transpose(0, 1) for x in (query, key, value))  # [longest, n, heads, dim]
    k, v = k.contiguous(), v.contiguous()
    out = DotProductAttention.forward(attn, q, k, v, None)  # [longest, n, heads * dim]
    return out.transpose(0, 1)[valid].unsqueeze(1)


def packed_params(cu, longest):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(cu, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def inputs(cu, heads, groups, qk_dim, v_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = cu[-1]
    q, k = (torch.randn(t, h, qk_dim, generator=g, dtype=torch.float64).to(dtype) for h in (heads, groups))
    v = torch.randn(t, groups, v_dim, generator=g, dtype=torch.float64).to(dtype)
    up = torch.randn(t, 1, heads * v_dim, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, up


def run(fn, q, k, v, up):
    """fn's output and its gradients w.r.t. q, k, v for the upstream gradient `up`."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    assert out.shape == up.shape, (out.shape, up.shape)
    (out * up).sum().backward()
    return [out.detach()] + [x.grad for x in leaves]


def max_abs(a, b):
    return [float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b)]


def magnitude(a):
    return [float(x.double().abs().max()) if x.numel() else 0.0 for x in a]


class SyncSpy(TorchFunctionMode):
    """Records the tensor calls that make the host wait for the device (on CUDA)."""
    SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
             "masked_select", "unique", "unique_consecutive"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in self.SYNCS:
            self.seen.append(name)
        elif name == "__getitem__" and _has_bool_index(args[1] if len(args) > 1 else None):
            self.seen.append("__getitem__[bool]")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None \
                and torch.is_tensor(kwargs.get("repeats", args[1] if len(args) > 1 else None)):
            self.seen.append("repeat_interleave(no output_size)")
        return func(*args, **kwargs)


def _has_bool_index(index):
    items = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in items)


def single_process():
    import moe.packed_attention as pa

    longest = max(b - a for a, b in zip(CU[:-1], CU[1:]))
    cases = {  # name: (cu, heads, groups, qk dim, v dim, attention kwargs, max_seqlen_q)
        "several": (CU, 4, 4, 8, 8, {}, longest),
        "gqa": (CU, 6, 2, 8, 8, {}, longest),
        "gqa_native": (CU, 6, 2, 8, 8, {}, longest),
        "single": ([0, 17], 4, 2, 8, 8, {}, 17),
        "mla": (CU, 4, 4, 12, 8, {"softmax_scale": 0.23, "k_channels": 12}, longest),
        "qk_layer_scaling": (CU, 4, 2, 8, 8, {"qk_scaling": True, "layer": 3}, longest),
        "max_seqlen_above": (CU, 4, 2, 8, 8, {}, longest + 3),
    }
    report = {"errors": {}, "magnitudes": {}}
    native = pa._native_gqa
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for name, (cu, heads, groups, qk_dim, v_dim, kw, max_q) in cases.items():
            if dtype == torch.bfloat16 and name not in ("several", "gqa", "mla"):
                continue
            attn = attention(heads, groups, v_dim, dtype, **kw)
            params = packed_params(cu, max_q)
            tensors = inputs(cu, heads, groups, qk_dim, v_dim, dtype, seed=len(name))
            pa._native_gqa = (lambda q, v: True) if name == "gqa_native" else native
            try:
                new = run(lambda q, k, v: attn(q, k, v, None, packed_seq_params=params), *tensors)
            finally:
                pa._native_gqa = native
            ref = run(lambda q, k, v: reference(attn, q, k, v, params.cu_seqlens_q), *tensors)
            key = f"{name}:{str(dtype).split('.')[-1]}"
            report["errors"][key] = max_abs(new, ref)
            report["magnitudes"][key] = magnitude(ref)

    # host syncs: none in the packed branch; the old one's are seen (the spy works)
    attn = attention(4, 2, 8)
    params = packed_params(CU, longest)
    q, k, v, _ = inputs(CU, 4, 2, 8, 8, torch.float32)
    with SyncSpy() as spy:
        attn(q, k, v, None, packed_seq_params=params)
    with SyncSpy() as old_spy:
        reference(attn, q, k, v, params.cu_seqlens_q)
    report["syncs"], report["old_syncs"] = spy.seen, old_spy.seen

    refusals = {}
    for name, p in (("no_max_seqlen", packed_params(CU, None)),
                    ("tensor_max_seqlen", packed_params(CU, torch.tensor(11))),
                    ("max_seqlen_below", packed_params(CU, longest - 1)), ("cu_short", packed_params(CU[:-1], 7)),
                    ("cu_long", packed_params(CU + [40], 11)), ("cu_start", packed_params([2] + CU[1:], 11))):
        try:
            attn(q, k, v, None, packed_seq_params=p)
            refusals[name] = None
        except (ValueError, IndexError, RuntimeError) as e:
            refusals[name] = f"{type(e).__name__}: {e}"
    report["refusals"] = refusals

    # dropout (training mode) runs through SDPA's dropout; eval mode is the deterministic result
    attn = attention(4, 2, 8, dropout=0.5)
    evaluated = attn(q, k, v, None, packed_seq_params=params)
    attn.train()
    trained = attn(q, k, v, None, packed_seq_params=params)
    report["dropout"] = {"eval_vs_ref": max_abs([evaluated], [reference(attn.eval(), q, k, v, params.cu_seqlens_q)])[0],
                         "train_vs_eval": max_abs([trained], [evaluated])[0],
                         "train_finite": bool(torch.isfinite(trained).all())}
    return report


def tensor_parallel_2():
    """Every rank's heads through the packed branch at TP2+SP, gathered, vs all heads in one process."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank, world = dist.get_rank(), dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(world)][rank]  # this rank as a TP group of one
    heads, groups, dim = 4, 2, 8
    hp, gp = heads // world, groups // world  # this rank's heads and k/v groups (megatron's TP split)
    longest = max(b - a for a, b in zip(CU[:-1], CU[1:]))
    params = packed_params(CU, longest)
    report = {}
    for dtype in (torch.float32, torch.float64):
        q, k, v, up = inputs(CU, heads, groups, dim, dim, dtype, seed=5)
        mine = (q[:, rank * hp:(rank + 1) * hp], k[:, rank * gp:(rank + 1) * gp], v[:, rank * gp:(rank + 1) * gp],
                up.view(-1, heads, dim)[:, rank * hp:(rank + 1) * hp].reshape(-1, 1, hp * dim))
        tp2 = attention(heads, groups, dim, dtype, tp=world)
        assert tp2.num_attention_heads_per_partition == hp and tp2.num_query_groups_per_partition == gp
        local = run(lambda q, k, v: tp2(q, k, v, None, packed_seq_params=params), *mine)
        gathered = []
        for x, per_head in zip(local, (dim, dim, dim, dim)):
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous())
            gathered.append(torch.cat([p.reshape(p.shape[0], -1, per_head) for p in parts], dim=1))
        gathered[0] = gathered[0].reshape(-1, 1, heads * dim)
        tp1 = attention(heads, groups, dim, dtype, tp=world, pg=ProcessGroupCollection(tp=alone))
        assert tp1.num_attention_heads_per_partition == heads
        single = run(lambda q, k, v: tp1(q, k, v, None, packed_seq_params=params), q, k, v, up)
        old = run(lambda q, k, v: reference(tp1, q, k, v, params.cu_seqlens_q), q, k, v, up)
        key = str(dtype).split(".")[-1]
        report[f"tp2_vs_tp1:{key}"] = max_abs(gathered, single)
        report[f"tp2_vs_old:{key}"] = max_abs(gathered, old)
        report[f"magnitudes:{key}"] = magnitude(old)
    return report


def main():
    setup()
    report = single_process() if dist.get_world_size() == 1 else tensor_parallel_2()
    if dist.get_rank() == 0:
        write_report(report)
    from rlpo_mega import distributed

    distributed.destroy()


if __name__ == "__main__":
    main()
