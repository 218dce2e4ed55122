"""Asynchronous RL (rollout.producer=async, trainer.max_staleness): the partial-rollout join, the off-policy
objective against a float64 transcription, and the trainer under torchrun (tests/workers/async_scenarios.py, one
launch): staleness 0 equals the synchronous step exactly; with staleness 1 every weight sync lands mid-generation
and every trained sample agrees with the engine's own record; a sample held past the bound is not trained on;
SIGTERM with requests in flight saves and the resume trains the planned prompts; a crashed engine mid-overlap is
rebuilt."""
import math

import pytest
import torch

from rlpo_mega.config import ConfigError, load_config
from rlpo_mega.config_checks import check_run_config
from rlpo_mega.errors import EXIT_STOPPED
from rlpo_mega.rollout import EngineError, Sample
from rlpo_mega.rollout.partial import continuable, continuation_prompt, join, span_versions, tag
from tests.dist import torchrun
from tests.test_algorithms_losses import algo_cfg, assert_close, make_batch, paper_params, run_impl

SKIP = ("time", "time/", "perf/", "async/")  # wall-clock fields and the producer's own counters


def _part(prompt, tokens, finish, version, layers=2, topk=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = len(prompt) + len(tokens) - 1
    s = Sample(prompt_ids=list(prompt), response_ids=list(tokens), logprobs=-torch.rand(len(tokens), generator=g),
               finish_reason=finish, routes=torch.randint(0, 8, (rows, layers, topk), generator=g, dtype=torch.int32))
    return tag(s, version)


def test_join_keeps_each_tokens_own_routes_logprobs_and_version():
    prompt = [5, 6, 7]
    first = _part(prompt, [1, 2], "abort", version=3, seed=1)
    assert continuable(first) and continuation_prompt(first) == [5, 6, 7, 1, 2]
    cont = _part(continuation_prompt(first), [3, 4, 9], "stop", version=4, seed=2)  # its prefill re-routes 0..4
    out = join(first, cont, max_new_tokens=8, stop_token_ids=(9,))
    assert out.response_ids == [1, 2, 3, 4, 9] and out.finish_reason == "stop"
    assert torch.equal(out.logprobs, torch.cat([first.logprobs, cont.logprobs]))
    assert out.meta.versions == [(3, 2), (4, 3)]
    assert span_versions(out.meta.versions).tolist() == [3, 3, 4, 4, 4]
    P, k = len(prompt), 2
    assert out.routes.shape[0] == out.span == P + 5 - 1
    # rows 0..P+k-2 (the prompt and the first part's tokens, whose successors version 3 sampled): the first part's;
    # from row P+k-1 (the forward that sampled token k+1): the continuation's, never its prefill of the prefix
    assert torch.equal(out.routes[:P + k - 1], first.routes[:P + k - 1])
    assert torch.equal(out.routes[P + k - 1:], cont.routes[P + k - 1:])
    assert not torch.equal(cont.routes[:P + k - 1], first.routes[:P + k - 1])  # the case the rule guards


def test_join_takes_a_continuation_that_returned_only_its_new_routing_rows():
    """A continuation asked for the rows from its part's last token on (SGLang's routed_experts_start_len, the
    answer's routes_from) joins to the same sample as one that returned every row."""
    from dataclasses import replace as dc_replace

    first = _part([5, 6, 7], [1, 2], "abort", version=3, seed=1)
    cont = _part(continuation_prompt(first), [3, 4, 9], "stop", version=4, seed=2)
    start = len(continuation_prompt(first)) - 1
    short = dc_replace(cont, routes=cont.routes[start:].clone(), routes_from=start)
    full, joined = join(first, cont, 8, (9,)), join(first, short, 8, (9,))
    assert torch.equal(full.routes, joined.routes) and joined.routes_from == 0
    assert continuable(dc_replace(short, finish_reason="abort"))
    with pytest.raises(EngineError, match="lacks routing rows"):
        join(first, dc_replace(cont, routes=cont.routes[start + 1:].clone(), routes_from=start + 1), 8, (9,))


def test_held_requests_take_each_tokens_version_from_the_engines_spans():
    """rollout.partial_rollout_kv=keep: a weight update lands under a running request; SGLang names each token's
    version (meta_info weight_versions spans), which become the sample's versions; a span before the version the
    request was sent on, out of order, or not covering the tokens is refused."""
    def answer(spans, said, n=5):
        s = Sample(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), logprobs=torch.zeros(n), finish_reason="stop")
        s.meta.weight_version, s.meta.weight_versions = said, spans
        return s

    def span(v, a, b):
        return {"version": str(v), "start": a, "end": b}

    assert tag(answer([span(3, 0, 2), span(4, 2, 5)], "4"), 3, held=True).meta.versions == [(3, 2), (4, 3)]
    assert tag(answer(None, "4"), 3, held=True).meta.versions == [(4, 5)]  # sent while held: all on the next one
    assert tag(answer([span(3, 0, 5)], "3"), 3, held=True).meta.versions == [(3, 5)]
    for bad in ([span(2, 0, 2), span(3, 2, 5)], [span(4, 0, 2), span(3, 2, 5)], [span(3, 0, 2), span(4, 2, 4)]):
        with pytest.raises(EngineError, match="not the updates it ran through"):
            tag(answer(bad, "4"), 3, held=True)
    with pytest.raises(EngineError, match="not the step numbers"):
        tag(answer([span("default", 0, 5)], "default"), 3, held=True)
    with pytest.raises(EngineError, match="a weight update reached a running request"):  # recompute: never
        tag(answer([span(3, 0, 2), span(4, 2, 5)], "4"), 3)


def test_join_cuts_at_the_budget_and_refuses_half_routed_parts():
    first = _part([5, 6], [1, 2, 3], "abort", version=0)
    cont = _part(continuation_prompt(first), [4, 4, 4], "length", version=1)  # asked for more than was left
    out = join(first, cont, max_new_tokens=4)
    assert out.response_ids == [1, 2, 3, 4] and out.finish_reason == "length" and out.meta.versions == [(0, 3), (1, 1)]
    assert out.routes.shape[0] == 2 + 4 - 1
    # an aborted part whose routes do not cover its tokens (SGLang: queued or retracted) is restarted instead
    short = _part([5, 6], [1, 2, 3], "abort", version=0)
    short.routes = short.routes[:2]
    assert not continuable(short)
    assert not continuable(_part([5, 6], [], "abort", version=0))
    bare = _part(continuation_prompt(first), [4], "stop", version=1)
    bare.routes = None
    with pytest.raises(EngineError, match="routes in one part only"):
        join(first, bare, max_new_tokens=8)


@pytest.mark.parametrize("level,cap", [("token", 2.0), ("token", 1e9), ("sequence", 1.5), ("sequence", 1e9)])
def test_off_policy_objective_matches_float64_decoupled_ppo(level, cap):
    """Samples whose tokens come from two policy versions (a continued sample: tokens before its continuation
    from version v - 1, after from v): the trained loss is the decoupled PPO objective
    l_it = -min(W_it, C) * min(r_it A_i, clip(r_it, 1 - eps, 1 + eps) A_i), r_it = pi_theta / pi_old, token-mean,
    with W_it = w_it = pi_old(o_it) / mu_{v_it}(o_it) (level token) or W_it = prod_t w_it, the whole sequence's
    ratio (level sequence: the one the demo learns with, README); C = 1e9 is the untruncated form. Written out
    here in float64 loops."""
    batch = make_batch(21, "far")
    mask = batch["loss_mask"]
    g = torch.Generator().manual_seed(22)
    older = batch["old_logp"] + 0.5 * torch.randn(mask.shape, generator=g, dtype=torch.float64)  # version v - 1
    newer = batch["old_logp"] + 0.05 * torch.randn(mask.shape, generator=g, dtype=torch.float64)  # version v
    cut = torch.tensor([2, 0, 1, 5, 0, 1, 3, 1])  # each row's tokens sampled before its continuation
    col = torch.arange(mask.shape[1])[None, :] - torch.tensor([0, 2, 4, 1, 0, 6, 3, 0])[:, None]
    behaviour = torch.where(col < cut[:, None], older, newer)
    batch["rollout_logp"] = torch.where(mask, behaviour, float("nan"))
    cfg = algo_cfg("ppo_clip")
    cfg.mismatch.mode, cfg.mismatch.level, cfg.mismatch.tis_cap = "tis", level, cap
    got, got_g, _ = run_impl(batch, cfg)
    eps_lo, eps_hi = paper_params(cfg)["eps_low"], paper_params(cfg)["eps_high"]
    lp = batch["logp"].double().clone().requires_grad_()
    total, count = 0.0, 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            steps = [t] if level == "token" else [u for u in range(mask.shape[1]) if mask[i, u]]
            w = math.exp(sum(float(batch["old_logp"][i, u]) - float(behaviour[i, u]) for u in steps))
            r = torch.exp(lp[i, t] - batch["old_logp"][i, t])
            adv = batch["advantages"]
            a = float(adv[i] if adv.dim() == 1 else adv[i, t])
            total = total - min(w, cap) * torch.minimum(r * a, torch.clamp(r, 1 - eps_lo, 1 + eps_hi) * a)
            count += 1
    want = total / count
    want.backward()
    assert_close(got, want.detach(), 1e-12, "decoupled objective")
    assert_close(got_g, torch.nan_to_num(lp.grad), 1e-10, "its gradient")


def test_async_config_refusals():
    def check(*over):  # the warnings of a config that passes
        return check_run_config(load_config("configs/demo_cpu.yaml", over), log_warnings=False)

    assert any("mismatch.mode=none trains tokens sampled by older policy versions" in w
               for w in check("rollout.producer=async", "trainer.max_staleness=2"))
    assert not any("older policy versions" in w for w in check(
        "rollout.producer=async", "trainer.max_staleness=1", "algorithm.mismatch.mode=tis",
        "algorithm.mismatch.level=sequence", "algorithm.mismatch.tis_cap=100"))
    with pytest.raises(ConfigError, match="needs rollout.producer=async"):
        check("trainer.max_staleness=1")
    with pytest.raises(ConfigError, match="trainer.max_staleness=-1 must be >= 0"):
        check("rollout.producer=async", "trainer.max_staleness=-1")
    # dynamic sampling composes with the async producer; its surplus groups are mostly past the staleness bound
    # by a later step, so carrying them is warned about
    for k in (0, 1):
        assert any("max_carry_steps=1 with rollout.producer=async" in w and "max_carry_steps=0" in w
                   for w in check("rollout.producer=async", "algorithm.dynamic_sampling.enabled=true",
                                  f"trainer.max_staleness={k}"))
    assert not any("max_carry_steps" in w for w in check(
        "rollout.producer=async", "algorithm.dynamic_sampling.enabled=true", "trainer.max_staleness=1",
        "algorithm.dynamic_sampling.max_carry_steps=0"))
    with pytest.raises(ConfigError, match="partial_rollout_mask"):
        check("rollout.partial_rollout_mask=true")
    # partial_rollout_kv=keep: a partial rollout's, on an engine that can hold its requests, servers without a radix
    # cache (external servers: the engine reads it from /server_info, tests/test_sglang_trainer.py)
    keep = ("rollout.producer=async", "trainer.max_staleness=1", "rollout.partial_rollout_kv=keep")
    with pytest.raises(ConfigError, match="only rollout.producer=async makes"):
        check("rollout.partial_rollout_kv=keep")
    with pytest.raises(ConfigError, match="set rollout.partial_rollout=true with it"):
        check(*keep)
    with pytest.raises(ConfigError, match="the embedded engine cannot hold its requests"):
        check(*keep, "rollout.partial_rollout=true")
    launched = ("rollout.engine=sglang", "rollout.sglang.launch=true", "model.init_from_hf=/m", "routing.mode=off",
                "rollout.sync_transport=sglang_distributed", "rollout.partial_rollout=true")
    with pytest.raises(ConfigError, match="server_args.disable_radix_cache=true"):
        check(*keep, *launched)
    check(*keep, *launched, "rollout.sglang.server_args.disable_radix_cache=true")
    with pytest.raises(ConfigError, match="partial_rollout_mask"):
        check("rollout.producer=async", "rollout.partial_rollout_mask=true")  # without partial_rollout=true
    with pytest.raises(ConfigError, match="client_switch_interval"):
        check("rollout.producer=async", "rollout.client_switch_interval=0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return torchrun("async_scenarios.py", 2, "everything", str(tmp_path_factory.mktemp("async")),
                    env={"WANDB_MODE": "disabled"}, timeout=900)


def test_staleness_zero_is_the_synchronous_step_exactly(runs):
    r = runs["equal_at_zero"]
    for rank in r["samples"]:  # each rank's own samples: tokens, log-probs and routes bitwise equal
        assert rank["samples"] == 24 and rank["differences"] == [], rank
    assert all(w["sync"] == w["async0"] for w in r["weights"])  # the weights after the last update: same gradients
    assert len(r["sync"]) == len(r["async0"]) == 3
    for a, b in zip(r["sync"], r["async0"]):
        diff = {k: (a[k], b.get(k)) for k in a if not k.startswith(SKIP) and a[k] != b.get(k)}
        assert not diff, diff  # losses, gradient norms, rewards, routing agreement: identical
    assert all(h["async/staleness_max"] == 0 for h in r["async0"])


def test_weight_update_mid_generation_matches_the_engines_record(runs):
    for run in ("k1", "k1_mask"):  # partial rollout
        r = runs["mid_generation"][run]
        hist = r["history"]
        assert [h["step"] for h in hist] == [1, 2, 3, 4]
        for rank in r["checks"]:
            # tokens, log-probs, per-token versions and every routing row as the engine gave them; nothing twice
            assert rank["problems"] == [] and rank["samples"] == 32 and rank["rows"] > 300, rank
            assert rank["continued"] >= 8, rank  # the syncs did interrupt generation
        for h in hist[1:]:  # each sync lands after the running call's first tokens (_sync_after_first_tokens)
            assert h["async/staleness_max"] == 1 and h["async/continued_samples"] > 0, h
            assert h["async/stale_dropped_groups"] == 0 and h["async/restarted_samples"] == 0, h
            # the continuation calls' share of generation, and the pause that interrupted them, are timed
            assert 0 < h["async/continue_s"] < h["async/generate_s"] and h["async/pause_s"] > 0, h
        assert hist[0]["async/staleness_max"] == 0
    assert runs["mid_generation"]["k1"]["masked"] == [0, 0]
    # partial_rollout=false (the default): each sync waited for the running call; every sample from one version
    wait = runs["mid_generation"]["k1_wait"]
    for rank in wait["checks"]:
        assert rank["problems"] == [] and rank["samples"] == 32 and rank["continued"] == 0, rank
    assert wait["old_tokens"] == [0, 0]
    for h in wait["history"][1:]:
        assert h["async/staleness_max"] == 1 and h["async/continued_samples"] == 0, h
        assert h["async/continue_s"] == 0 and h["async/pause_s"] >= 0, h
    # partial_rollout_mask: exactly the tokens sampled before each sample's last continuation leave the loss
    masked = runs["mid_generation"]["k1_mask"]
    assert masked["masked"] == masked["old_tokens"] and sum(masked["masked"]) > 0


def test_a_sample_past_the_staleness_bound_is_not_trained_on(runs):
    r = runs["held_past_bound"]
    hist = r["history"]
    assert r["rc"] == 0 and [h["step"] for h in hist] == [1, 2, 3]
    assert hist[1]["async/staleness_max"] == 1 and hist[1]["async/stale_dropped_groups"] == 0
    # step 3's groups were generated on version 0 (two behind): all 4 dropped, no update
    assert hist[2]["async/stale_dropped_groups"] == 4 and hist[2]["train/skipped_step"] == 1
    assert "policy_loss" not in hist[2] and "reward/mean" not in hist[2]


def test_sigterm_with_requests_in_flight_and_engine_restart(runs):
    r = runs["sigterm_and_restart"]
    assert r["stopped_rc"] == EXIT_STOPPED and r["busy_at_signal"] is True, r
    assert r["saved"] == [1] and r["threads"] == []  # saved after step 1; the generation thread ended
    assert r["resumed_rc"] == 0 and [h["step"] for h in r["resumed"]] == [2, 3]
    for rank in r["prompts"]:  # the planned prompts were saved and trained after the resume, where they belong
        assert rank["resumed_1"] == rank["full_1"] and len(rank["full_1"]) == 8, rank
    assert r["crash_rc"] == 0 and [h["step"] for h in r["crash"]] == [1, 2, 3, 4]
    assert r["crash"][-1]["engine/restarts"] == 1


def test_dynamic_sampling_through_the_async_producer(runs):
    """DAPO dynamic sampling composed with the async producer (tests/workers/async_scenarios.dynamic). At
    max_staleness 0 (nothing carried) it is the sync producer's dynamic sampling exactly: the same chunks of prompts
    per rank, the same samples (tokens, log-probs, routes), the same losses and counts. At max_staleness 1 with
    partial rollout, every trained sample is the engine's record (tokens, log-probs, per-token versions, every R3
    routing row), each step trains its full quota of whole groups, and a carried group is trained only while its
    tokens are within the staleness bound: what leaves the carry is counted (carried in or stale), never more than
    went in."""
    r = runs["dynamic"]
    for rank in r["samples"]:
        assert rank["samples"] == 24 and rank["differences"] == [], rank
    assert len(r["sync"]) == len(r["async0"]) == 3
    for a, b in zip(r["sync"], r["async0"]):
        diff = {k: (a[k], b.get(k)) for k in a if not k.startswith(SKIP) and a[k] != b.get(k)}
        assert not diff, diff
        assert a["dynamic_sampling/kept"] == 4 and a["reward/samples"] == 16
    assert sum(h["dynamic_sampling/dropped"] + h["dynamic_sampling/aborted"] for h in r["sync"]) > 0
    hist = r["async1"]
    assert [h["step"] for h in hist] == [1, 2, 3, 4]
    for rank in r["async1_checks"]:
        assert rank["problems"] == [] and rank["samples"] == 32 and rank["continued"] > 0, rank
    for h in hist:
        assert h["dynamic_sampling/kept"] == 4 and h["reward/samples"] == 16, h
        assert h["async/stale_dropped_groups"] == 0 and h["async/staleness_max"] <= 1, h
    out = [h["dynamic_sampling/carried_out"] for h in hist]
    left = [h["dynamic_sampling/carried_in"] + h["dynamic_sampling/carry_stale"] for h in hist]
    assert sum(out) > 0 and left[0] == 0, (out, left)
    assert all(sum(left[:k + 1]) <= sum(out[:k]) for k in range(len(hist))), (out, left)
    assert sum(h["dynamic_sampling/carried_in"] for h in hist) > 0


def test_sigterm_under_async_dynamic_sampling_saves_and_resumes(runs):
    """The bad day of async + dynamic sampling (max_staleness 1, partial rollout, groups carried): SIGTERM after
    step 1 while step 2's groups generate saves step 1 with the producer's state and stops; the resumed run trains
    steps 2 and 3, each its quota of whole groups, and no prompt's group is trained twice over both runs."""
    r = runs["dynamic"]["ds_sigterm"]
    assert r["stopped_rc"] == EXIT_STOPPED and r["busy_at_signal"] is True and r["saved"] == [1], r
    assert r["state"], r  # the producer had state to save (planned prompts, drawn chunks or carried groups)
    assert r["resumed_rc"] == 0 and [h["step"] for h in r["resumed"]] == [2, 3], r
    for h in r["resumed"]:
        assert h["dynamic_sampling/kept"] == 4 and h["reward/samples"] == 16, h
    for rank in r["trained"]:
        assert rank["stopped"] == [0] and rank["resumed"] == [1, 2], rank
        assert rank["groups"] == 3 * 2 and rank["distinct"] == rank["groups"], rank


def test_sample_meta_is_typed_and_an_older_checkpoints_dict_loads():
    """Sample.meta is a SampleMeta (rollout/base.py); a sample pickled by an earlier version (the carried groups
    of a dynamic-sampling checkpoint) held a dict of the same names ("rid" for the request id): it loads typed."""
    import pickle

    from rlpo_mega.rollout.base import SampleMeta

    s = Sample([1, 2], [3, 4], torch.zeros(2), "stop")
    assert isinstance(s.meta, SampleMeta) and s.meta.parts == 1 and s.meta.versions == []
    s.__dict__["meta"] = {"rid": "r7", "server": "http://s:1", "versions": [(1, 2)], "parts": 2, "finish": {"type": "stop"}}
    old = pickle.loads(pickle.dumps(s))
    assert old.meta == SampleMeta(request_id="r7", server="http://s:1", versions=[(1, 2)], parts=2)
