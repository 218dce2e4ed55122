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


QWEN, MIXTRAL, GLM, DEEPSEEK = ("configs/models/tiny_qwen3_moe.json", "configs/models/tiny_mixtral.json",
                                "configs/models/tiny_glm4_moe.json", "configs/models/tiny_deepseek_v3.json")
# name: (processes, model=loss[+loss] pairs, overrides). "critic": PPO with GAE and the value model. "lora": GSPO
# on adapters (model.lora: attention and experts, shared_outer) over the frozen base, every B drawn non-zero;
# "critic_lora": the critic with its own adapters (critic.lora), its trunk frozen, its head trained.
CP_LAYOUTS = {
    "cp2": (2, f"{QWEN}=grpo+gspo+lora,{MIXTRAL}=critic,{GLM}=grpo,{DEEPSEEK}=gspo", ()),
    "ep2_cp2": (2, f"{QWEN}=gspo,{MIXTRAL}=grpo+lora", ("parallel.expert=2",)),
    "tp2_sp_cp2": (4, f"{QWEN}=gspo+critic+lora+critic_lora", ("parallel.tensor=2",)),
    "pp2_cp2": (4, f"{QWEN}=gspo+critic", ("parallel.pipeline=2", "parallel.num_micro_batches=2")),
}
REL_TOL = 1e-5  # tests/test_parity.py's, for every layout against the single process


@pytest.mark.parametrize("layout", list(CP_LAYOUTS))
def test_context_parallel_equals_the_layout_without_it(layout):
    """tests/workers/cp_parity.py: the trainer's packed micro-batches of mixed lengths (one sample shorter than
    2 x cp, so a CP rank holds none of its loss tokens), R3 replayed, one policy step and one optimizer step, at
    `layout` against the same layout with context=1 (data-parallel over those ranks instead; each such layout is
    tested equal to the single process in tests/test_parity.py), from the same weights on the same samples:
    - every gradient, after megatron's finalize (DP x CP reduction, per-token normalisation), and the update;
    - every sample's old log-probs, gathered back from the CP shards (some responses hold observation spans, out
      of the loss as in multi-turn episodes);
    - the losses' metrics (GSPO's sequence ratios and clip fractions, entropy, mismatch), the critic's GAE
      statistics, value loss and gradients;
    - R3 under CP: each rank's attached routes equal the engine's record at every position it holds (its CP
      chunks, then its SP slice, its stage's layers), PAD only on padding; the exchange brought it only those
      rows."""
    nproc, models, overrides = CP_LAYOUTS[layout]
    report = torchrun("cp_parity.py", nproc, models, *overrides)
    for model, by_loss in report.items():
        for loss, r in by_loss.items():
            where = f"{layout} {model} {loss}"
            assert r["cp"] == [2, 1], where
            assert r["zero_grads"] == 0, f"{where}: a parameter without gradient proves nothing"
            if loss == "lora":  # only the factors train: every base parameter and the router frozen in both runs
                assert r["base_trainable"] == [0, 0] and r["trained"] > 0, f"{where}: {r['base_trainable']}"
            assert r["grad_rel_max"] <= REL_TOL, f"{where}: gradient rel error {r['grad_rel_max']:.2e}"
            assert r["logp_rel_max"] <= REL_TOL, f"{where}: old log-prob rel error {r['logp_rel_max']:.2e}"
            a, b = r["grad_norm"]
            assert abs(a - b) <= REL_TOL * b, f"{where}: grad norm {a} vs {b}"
            # Adam's first step is ~lr * sign(g): entries with |g| near float32 noise move the update's error up
            assert r["update_rel_max"] <= 1e-3, f"{where}: update rel error {r['update_rel_max']:.2e}"
            for key, (got, want) in r["metrics"].items():
                # the policy loss sums O(1) terms of both signs to ~1e-3 (GSPO, PPO): float32 rounding of that
                # sum in another micro-batch order is ~1e-8 absolute
                tol = 1e-7 if key == "policy_loss" else REL_TOL * max(abs(want), 1e-6)
                assert abs(got - want) <= tol, f"{where} {key}: {got} vs {want}"
            good, total, stray = r["placement"]
            assert total > 0 and good == total and stray == 0, f"{where}: R3 placement {r['placement']}"
            assert r["routing"]["routing/update/tokens"] > 0
            # the exchange sends each CP rank only its chunks' route rows: its bytes over its own share's (every
            # row of every layer) fall below the data-parallel layout's, where each rank holds whole samples
            got, ref = r["bytes_over_own_share"]
            assert got < ref, f"{where}: exchange bytes / own share {got:.3f} (CP) vs {ref:.3f}"
            if loss == "critic_lora":  # the critic's adapters and its head train, nothing else of it
                c = r["critic"]
                assert c["lora_grads"] > 0 and c["other_grads"] == ["output_layer.bias", "output_layer.weight"], c
                assert r["base_trainable"] == [0, 0], r["base_trainable"]
            if loss in ("critic", "critic_lora"):
                c = r["critic"]
                assert c["grad_rel_max"] <= REL_TOL, f"{where}: critic gradient rel error {c['grad_rel_max']:.2e}"
                for key, (got, want) in c["metrics"].items():
                    assert abs(got - want) <= REL_TOL * max(abs(want), 1e-3), f"{where} critic {key}: {got} vs {want}"
