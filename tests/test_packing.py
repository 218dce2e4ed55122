"""The data path: the step plan (Karmarkar-Karp DP split, token-budget micro-batches), packed micro-batches,
and packed == padded parity through the real path (gather_scalars -> exchange -> micro-batches -> R3 old
pass -> policy_step) at TP2+SP, EP2, PP2 and TP2/EP2/PP2, both families."""
from dataclasses import replace

import pytest
import torch

from moe.routing.transport import Recipient
from rlpo_mega.data.packing import aligned, karmarkar_karp, plan_step
from rlpo_mega.training.batches import build_micro_batch
from rlpo_mega.rollout import Sample
from tests.dist import torchrun

# both families, each with one loss (GSPO: sequence ratio; SAPO: token gates), to keep CI short
MODELS = "configs/models/tiny_qwen3_moe.json=gspo,configs/models/tiny_mixtral.json=sapo"
REL_TOL = 1e-5


def test_karmarkar_karp_balances_and_is_deterministic():
    g = torch.Generator().manual_seed(0)
    w = torch.distributions.LogNormal(8.0, 0.7).sample((256,)).long().clamp(max=8192).tolist()
    parts = karmarkar_karp(w, 8)
    assert sorted(i for p in parts for i in p) == list(range(256))
    sums = [sum(w[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(w) * 0.05  # near-perfect balance of a long-tailed set
    assert parts == karmarkar_karp(w, 8)
    assert karmarkar_karp([5], 3) == [[0], [], []]
    del g


def test_plan_token_budget_and_equal_micro_batch_counts():
    g = torch.Generator().manual_seed(1)
    spans = torch.distributions.LogNormal(7.5, 0.8).sample((128,)).long().clamp(1, 8192).tolist()
    plan = plan_step(spans, 2, 4, max_tokens=16384, align=2)
    assert sorted(i for mini in plan.micro for r in mini for mb in r for i in mb) == list(range(128))
    for m, mini in enumerate(plan.micro):
        assert all(64 * m <= i < 64 * (m + 1) for r in mini for mb in r for i in mb)  # contiguous mini-batches
        assert len({len(r) for r in mini}) == 1  # every DP rank runs the same number of micro-batches
        for r in mini:
            assert all(aligned(sum(spans[i] for i in mb), 2) <= 16384 for mb in r)
        tokens = [sum(spans[i] for mb in r for i in mb) for r in mini]
        assert max(tokens) - min(tokens) <= 0.1 * max(tokens)
    assert plan.computed_tokens(spans, 2) / sum(spans) < 1.01
    padded = plan_step(spans, 2, 4, num_micro_batches=2, layout="padded")
    assert sum(spans) / padded.computed_tokens(spans) < 0.5  # long-tailed: most of a padded batch is padding
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_step([10, 5000], 1, 1, max_tokens=4096)


def test_plan_fixed_micro_batch_count_with_uneven_samples_per_rank():
    """The recipes' fixed count at their real size: 512 samples of 300..8500 tokens, 4 mini-batches, DP8,
    16 micro-batches. The token-balanced DP split leaves some rank fewer than 16 samples (the mean): its extra
    micro-batches are empty (one masked pad segment each), every rank runs 16, every sample trains once."""
    g = torch.Generator().manual_seed(26)
    for draw in range(20):
        spans = torch.randint(300, 8501, (512,), generator=g).tolist()
        plan = plan_step(spans, 4, 8, num_micro_batches=16, layout="packed", align=2)
        assert sorted(i for mini in plan.micro for r in mini for mb in r for i in mb) == list(range(512))
        counts = [sum(len(mb) for mb in r) for mini in plan.micro for r in mini]
        assert all(len(r) == 16 for mini in plan.micro for r in mini)
        if draw == 0:
            assert min(counts) < 16 < max(counts)  # the case that used to raise
    # a budget: never fewer micro-batches than the count, never more than a rank's samples unless the count says so
    plan = plan_step([100] * 3 + [4000] * 5, 1, 2, num_micro_batches=4, max_tokens=8192)
    assert {len(r) for r in plan.micro[0]} == {4}


def _sample(i, plen, rlen, g, layers=2, topk=2, experts=4):
    ids = torch.randint(3, 50, (plen + rlen,), generator=g)
    routes = torch.rand(plen + rlen - 1, layers, experts, generator=g).argsort(-1)[..., :topk].to(torch.uint8)
    s = Sample(ids[:plen], ids[plen:], -torch.rand(rlen, generator=g), "stop", routes, reward=1.0, correct=True,
               owner=0)
    return s, replace(s)  # the scalars every rank knows, the sample as it arrived


def test_packed_micro_batch_layout():
    """Each sample's tokens and labels at its own positions (no cross-sample labels), cu_seqlens with the
    alignment tail as its own sequence, the [n, s] loss view through `index`, routes at the right tokens."""
    g = torch.Generator().manual_seed(2)
    pairs = [_sample(i, p, r, g) for i, (p, r) in enumerate([(3, 4), (2, 1), (5, 6)])]
    samples, received = [p[0] for p in pairs], {i: p[1] for i, p in enumerate(pairs)}
    rcpt = Recipient(0, 0, 1, 0, 1, (0, 1))
    adv, keep = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([True, True, False])
    mb = build_micro_batch(samples, received, [0, 1, 2], adv, keep, layout="packed", align=4, pad_id=0,
                           recipient=rcpt, topk=2)
    spans = [6, 2, 10]
    assert mb.tokens.shape == (1, 20) and mb.cu_seqlens.tolist() == [0, 6, 8, 18, 20]
    off = 0
    for k, (s, r) in enumerate(zip(spans, received.values())):
        assert mb.tokens[0, off:off + s].tolist() == r.ids[:-1].tolist()
        assert mb.labels[0, off:off + s].tolist() == r.ids[1:].tolist()
        assert mb.index[k, :s].tolist() == list(range(off, off + s))
        assert mb.position_ids[0, off:off + s].tolist() == list(range(s))
        assert (mb.routes[0, off:off + s].long() == r.routes.long()).all()
        off += s
    assert (mb.routes[0, 18:] == -2).all()  # the tail routes live
    assert mb.loss_mask.sum(1).tolist() == [4, 1, 0]  # sample 2 filtered (keep=False)
    assert mb.loss_mask[0].nonzero().flatten().tolist() == [2, 3, 4, 5]  # prompt 3: first label at 2
    assert torch.equal(mb.rollout_logp[0, 2:6], received[0].logprobs)
    assert mb.advantages.tolist() == [0.5, -1.0, 2.0]
    empty = build_micro_batch(samples, received, [], adv, keep, layout="packed", align=4, pad_id=0)
    assert empty.tokens.shape == (1, 4) and not empty.loss_mask.any()
    # the whole-batch route cut equals the per-piece one (moe.routing.transport.local_routes), fallback entries
    # (LIVE) and sequence-parallel shards included
    from moe.routing.trace import RoutingTrace
    from moe.routing.transport import LIVE, Segment, local_routes

    received[1] = replace(received[1], replaced=torch.tensor([[True, False], [False, True]]))
    samples[1].replaced_entries = 2
    for sp_rank in (0, 1):
        r = Recipient(0, 0, 1, sp_rank, 2, (0, 1))
        mb = build_micro_batch(samples, received, [0, 1, 2], adv, keep, layout="packed", align=4, pad_id=0,
                               recipient=r, topk=2)
        placement = [Segment(k, 0, o, s) for k, (o, s) in enumerate(zip([0, 6, 8], spans))]
        traces = [RoutingTrace(x.routes, 0, x.replaced) for x in received.values()]
        want = local_routes(traces, placement, r, 1, 20, 2)
        assert mb.routes.dtype == want.dtype and torch.equal(mb.routes, want), sp_rank
    assert (want == LIVE).sum() == 0  # shard 1 (positions 10-19) holds none of sample 1's positions
    first = build_micro_batch(samples, received, [0, 1, 2], adv, keep, layout="packed", align=4, pad_id=0,
                              recipient=Recipient(0, 0, 1, 0, 2, (0, 1)), topk=2).routes
    assert (first[0, 6, 0] == LIVE).all() and (first[0, 7, 1] == LIVE).all() and (first == LIVE).sum() == 4


LAYOUTS = {
    "tp2_sp": (2, ["parallel.tensor=2"]),
    "ep2": (2, ["parallel.expert=2"]),
    "pp2_mb2": (2, ["parallel.pipeline=2", "parallel.num_micro_batches=2"]),
    "tp2_ep2_pp2": (8, ["parallel.tensor=2", "parallel.expert=2", "parallel.pipeline=2",
                        "parallel.num_micro_batches=2"]),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_equals_padded(layout):
    nproc, overrides = LAYOUTS[layout]
    report = torchrun("packed_parity.py", nproc, MODELS, *overrides, timeout=900)
    assert set(report) == {"tiny_qwen3_moe.json", "tiny_mixtral.json"}
    for model, losses in report.items():
        for loss, r in losses.items():
            where = f"{layout} {model} {loss}"
            assert r["zero_grads"] == 0, where
            assert r["grad_rel_max"] <= REL_TOL, f"{where}: gradient rel error {r['grad_rel_max']:.2e}"
            for key, (packed, padded) in r["metrics"].items():  # loss and metrics, as tests/test_parity.py
                assert abs(packed - padded) <= REL_TOL * max(abs(padded), 0.1), (where, key, packed, padded)
            good, total = r["placement_packed"]
            assert total > 0 and good == total, f"{where}: R3 routes at the wrong packed tokens {good}/{total}"
            assert r["placement_padded"] == r["placement_packed"] == r["placement_budget"]
            # the token budget cuts micro-batches of varied lengths: more than parallel.num_micro_batches where
            # one DP rank holds all 16 samples (at DP2 the 8 per rank fit the budget in 2)
            mbs = r["micro_batches"]
            assert mbs["budget"] > mbs["packed"] if layout in ("tp2_sp", "pp2_mb2") else mbs["budget"] >= 2, (where, mbs)
            # packed computes only the alignment tail beyond the real tokens (< TP per micro-batch)
            assert r["efficiency"]["packed"] >= 0.95 > 0.6 > r["efficiency"]["padded"], (where, r["efficiency"])
            assert r["bytes_over_own_share"] <= 1.1, where
            if layout == "tp2_sp":  # each rank of the TP group receives only its sequence shard's route rows
                assert r["bytes_over_own_share"] < 0.9, (where, r["bytes_over_own_share"])
        if "gspo" in losses:
            assert 0 < losses["gspo"]["clip_frac"] < 1  # the data exercises the clip


@pytest.mark.parametrize("overrides, message", [
    (["trainer.max_tokens_per_micro_batch=8", "rollout.max_new_tokens=16"], "below one sample's length"),
    (["trainer.layout=padded", "trainer.max_tokens_per_micro_batch=4096"], "cuts packed micro-batches"),
    (["parallel.pipeline=2", "model.token_dispatcher=allgather"], "variable micro-batch shapes"),
    (["trainer.layout=unpacked"], "expected one of"),
])
def test_check_rejects_bad_data_path_settings(overrides, message):
    """`rlpo-mega check` (check_run_config) refuses what the packed path would fail on, in one line."""
    from rlpo_mega.config import ConfigError, load_config
    from rlpo_mega.config_checks import check_run_config

    with pytest.raises(ConfigError, match=message):
        check_run_config(load_config(None, tuple(overrides)), world_size=2)


@pytest.mark.parametrize("layout", ["single", "tp2_sp", "pp2_mb2"])
def test_old_logprobs_from_the_update_equal_the_old_pass(layout):
    """One optimizer step per rollout batch: the update's own detached log-probs as pi_old give exactly the
    losses, metrics (mismatch from the same forward) and gradients of the separate old-log-prob pass, with
    R3 replay and with live routing (policy_step.old_pass_needed)."""
    nproc, overrides = (1, []) if layout == "single" else LAYOUTS[layout]
    report = torchrun("old_from_update.py", nproc, *overrides, timeout=600)
    for mode, r in report.items():
        assert r["zero_grads"] == 0, mode
        assert r["grad_abs_diff"] == 0.0, (layout, mode, r["grad_abs_diff"])
        assert r["metrics"]["mismatch/k3_kl"][0] > 0.1  # the rollout log-probs differ: the metric is exercised
        for key, (separate, skipped) in r["metrics"].items():
            assert separate == skipped, (layout, mode, key, separate, skipped)
        assert r["agreement"][0] == r["agreement"][1] < 0.5, (layout, mode)


def test_old_pass_needed_names_why():
    from types import SimpleNamespace

    from rlpo_mega.config import load_config
    from rlpo_mega.training.old_logprobs import old_pass_needed

    hf = SimpleNamespace(attention_dropout=0.0)
    assert old_pass_needed(load_config(None, ()), hf) is None
    for overrides, why in ((("trainer.epochs=2",), "epochs=2"), (("trainer.mini_batches=4",), "mini_batches=4"),
                           (("routing.mode=r2",), "r2"), (("trainer.old_logprobs=recompute",), "recompute")):
        assert why in old_pass_needed(load_config(None, overrides), hf)
    assert "attention_dropout" in old_pass_needed(load_config(None, ()), SimpleNamespace(attention_dropout=0.1))
