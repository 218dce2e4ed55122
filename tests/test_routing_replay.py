"""Routing replay through megatron (torchrun, gloo, CPU).

The engine is an HF transformers model with router hooks on a tiny Qwen3-MoE checkpoint; the learner
loads the same weights. Single process (TP1): R3 with identical weights, after perturbing the learner's
routers (replay vs off), activation recompute, R2, per-token fallback, refusals. Layouts: EP2 and TP2+SP
(2 processes), TP2/EP2/PP2 with recompute (8 processes): routes, log-probs and gradient norm vs TP1.
"""
import pytest

from tests.dist import torchrun

L_TIMES_K = 2 * 2  # tiny model: 2 MoE layers, top-2, 4 experts -> uint8 ids


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    return root, torchrun("routing_single.py", 1, str(root))


def test_r3_identical_weights_replays_trace_and_matches_engine(single):
    r = single[1]["identical"]
    assert r["old_routes_vs_trace"] == 1.0 and r["update_routes_vs_trace"] == 1.0
    assert r["metrics"]["routing/old/agreement"] == 1.0  # same weights: the live router agrees too
    assert r["mismatch_r3/ratio_dev_max"] < 1e-5  # learner log-probs == engine log-probs
    assert r["wire"]["routing/bytes_per_token"] <= L_TIMES_K


def test_perturbed_router_replay_restores_routes_and_router_learns(single):
    off, r3 = single[1]["perturbed_off"], single[1]["perturbed_r3"]
    # off: the learner's own routes disagree with the trace for most tokens; the metric says so
    assert off["old_routes_vs_trace"] < 0.5
    assert off["metrics"]["routing/old/agreement"] == pytest.approx(off["old_routes_vs_trace"])
    # r3: every dispatched route is the trace's, although the live router still disagrees
    assert r3["old_routes_vs_trace"] == 1.0 and r3["update_routes_vs_trace"] == 1.0
    assert r3["metrics"]["routing/update/agreement"] < 0.5
    assert all(g > 1e-4 for g in r3["router_grad_norms"]), r3["router_grad_norms"]
    assert r3["mismatch_r3/k3_kl"] < off["mismatch_off/k3_kl"]
    # the metric with and without replay in one step: the no-replay pass is the off run's old pass
    ww = r3["with_without"]
    assert ww["routing/mismatch_replay/k3_kl"] == pytest.approx(r3["mismatch_r3/k3_kl"], rel=1e-6)
    assert ww["routing/mismatch_no_replay/k3_kl"] == pytest.approx(off["mismatch_off/k3_kl"], rel=1e-6)
    assert ww["routing/no_replay/agreement"] == pytest.approx(off["old_routes_vs_trace"])


def test_replay_under_activation_recompute(single):
    r, plain = single[1]["perturbed_r3_recompute"], single[1]["perturbed_r3"]
    assert r["recompute_calls"] > 0 and r["recompute_routes_equal_forward"] and r["replay_queues_empty"]
    assert r["old_routes_vs_trace"] == 1.0 and r["update_routes_vs_trace"] == 1.0
    assert single[1]["recompute_logp_max_abs"] == 0.0
    assert r["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)


def test_r2_records_then_replays_ratio_one(single):
    r = single[1]["r2"]
    assert r["ratio_exactly_one"] and r["ratio_max_dev"] == 0.0
    assert r["update_equals_recorded"] and r["recompute_calls"] > 0
    # the router moved after the record: replay still dispatches the recorded routes
    assert r["after_router_change_equals_recorded"] and r["after_router_change_live_agreement"] < 0.6
    assert all(g > 1e-4 for g in r["router_grad_norms"])


def test_fallback_counts_and_uses_live_router(single):
    r = single[1]["fallback"]
    assert r["stats"]["routing/fallback_entries"] == 7 and r["stats"]["routing/fallback_tokens"] == 5
    assert r["metric_fallback_entries"] == 7
    assert r["fallback_entries_use_live_router"] and r["other_entries_replayed"] and r["live_differs_at_fallback"]


def test_refusals(single):
    r = single[1]["refusals"]
    assert "moe_router_fusion=True" in r["fused"] and "bypasses RouterReplay" in r["fused"]
    assert "no rollout routes" in r["no_routes"]
    assert "moe_enable_routing_replay=True" in r["not_enabled"]


def check_layout(res, recompute=False):
    assert res["old_routes_vs_trace"] == 1.0 and res["update_routes_vs_trace"] == 1.0
    assert res["logp_max_abs_vs_single"] < 1e-5
    assert res["grad_norm"] == pytest.approx(res["ref_grad_norm"], rel=1e-5)
    assert res["update_agreement"] == pytest.approx(res["ref_update_agreement"])
    assert res["wire"]["routing/bytes_per_token"] <= L_TIMES_K
    if recompute:
        assert res["recompute_calls"] > 0 and res["recompute_routes_equal_forward"]


def test_r3_ep2_and_tp2_sp(single):
    res = torchrun("routing_layouts.py", 2, str(single[0]), "ep2,tp2sp")
    check_layout(res["ep2"])
    check_layout(res["tp2sp"])
    assert {tuple(r[1:3]) for r in res["tp2sp"]["recipients"]} == {(0, 2), (1, 2)}  # one SP shard each


def test_r3_tp2_ep2_pp2_recompute(single):
    res = torchrun("routing_layouts.py", 8, str(single[0]), "tp2ep2pp2")["tp2ep2pp2"]
    check_layout(res, recompute=True)
    # each rank receives one PP stage's MoE layer and one sequence shard of its DP rank's rows
    assert sorted(tuple(r[3]) for r in res["recipients"]) == [(0,)] * 4 + [(1,)] * 4
