"""Context parallelism's layout and its attention without Transformer Engine (moe/context_parallel.py)."""
import pytest
import torch

from moe.context_parallel import padded_length, shard_index
from tests.dist import torchrun


def test_the_shards_are_megatrons_thd_layout():
    """TE's thd_get_partitioned_indices (megatron's get_thd_batch_on_this_cp_rank): per sequence, 2 x cp chunks,
    rank r keeps chunks r and 2cp-1-r in that order; together the ranks hold every position once."""
    cp, lengths = 4, [8, 24, 16]
    cu = torch.tensor([0] + lengths).cumsum(0)
    held = []
    for r in range(cp):
        want = []
        for a, n in zip(cu[:-1].tolist(), lengths):
            c = n // (2 * cp)
            want += [a + r * c + i for i in range(c)] + [a + (2 * cp - 1 - r) * c + i for i in range(c)]
        got = shard_index(cu, cp, r).tolist()
        assert got == want, (r, got, want)
        held += got
    assert sorted(held) == list(range(int(cu[-1])))
    assert [padded_length(n, 2) for n in (1, 4, 5, 9)] == [4, 4, 8, 12]
    assert padded_length(9, 2, tp=2) == 16  # sequence parallel: the CP-local row is scattered over TP
    with pytest.raises(ValueError, match=r"multiples of 4 \(2 x cp\)"):
        shard_index(torch.tensor([0, 4, 10]), 2, 0)


def test_allgather_kv_attention_equals_the_single_rank_attention():
    """CP2 on gloo, GQA, five packed sequences of mixed lengths (one shorter than 2 x cp): every rank's output
    rows and the gradients of the whole row's loss (dq, and dk/dv summed back to their owners) equal each
    sequence's causal attention on one rank, in float64."""
    r = torchrun("cp_attention.py", 2)
    assert all(e < 1e-12 for e in r.values()), r
