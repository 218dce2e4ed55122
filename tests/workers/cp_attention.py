"""moe/context_parallel.py on 2 CP ranks (gloo): the all-gather-KV attention against the single-rank causal
attention of every sequence (float64), outputs and the gradients of the whole row's loss, with GQA and packed
sequences of mixed padded lengths. Rank 0 writes {"out", "dq", "dk", "dv"}: the largest absolute errors."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe.context_parallel import attention, padded_length, shard_index
from rlpo_mega import platform
from tests.dist import write_report

CP, HEADS, KV, DIM = 2, 4, 2, 8
REAL = [5, 9, 3, 1, 16]  # mixed lengths, one below 2 x cp, one a multiple already


def reference(q, k, v, cu, scale):
    """Each sequence on its own: causal attention over its padded span (pads after its real tokens)."""
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qq, kk, vv = (x[a:b].transpose(0, 1) for x in (q, k, v))
        kk, vv = kk.repeat_interleave(HEADS // KV, 0), vv.repeat_interleave(HEADS // KV, 0)
        out.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(out).reshape(cu[-1], -1)


def main():
    platform.apply()  # megatron's collectives on a CPU (the CP gather is megatron's sequence-parallel one)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lengths = [padded_length(n, CP) for n in REAL]
    cu = torch.tensor([0] + lengths).cumsum(0)
    g = torch.Generator().manual_seed(0)  # the same row on both ranks
    total = int(cu[-1])
    q, k, v = (torch.randn(total, h, DIM, generator=g, dtype=torch.float64) for h in (HEADS, KV, KV))
    w = torch.randn(total, HEADS * DIM, generator=g, dtype=torch.float64)
    scale = DIM ** -0.5
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    want = reference(*full, cu, scale)
    (want * w).sum().backward()
    mine = shard_index(cu, CP, rank)
    local = [x[mine].clone().requires_grad_() for x in (q, k, v)]
    got = attention(*local, cu, max(lengths), dist.group.WORLD, scale)
    (got * w[mine]).sum().backward()  # this rank's share of the row's loss
    err = {"out": float((got - want[mine]).abs().max())}
    for name, a, b in zip(("dq", "dk", "dv"), local, full):
        err[name] = float((a.grad - b.grad[mine]).abs().max())
    errs = [None] * CP
    dist.all_gather_object(errs, err)
    if rank == 0:
        write_report({key: max(e[key] for e in errs) for key in err})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
