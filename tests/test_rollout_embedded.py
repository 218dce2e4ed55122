"""The embedded rollout engine: sampling (seeded, batch-independent, top-k/top-p, stop/length/abort),
log-probs and routes against transformers' full forward, and against the Megatron learner after weight
sync and a training step (torchrun workers, TP1 and EP2)."""
import dataclasses
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe.bridge.hf_inmemory import HFModelWeights
from moe.model import load_hf_config
from moe.routing.decoders import HFRouteCapture
from moe.routing.trace import TraceSpec, validate_trace
from rlpo_mega.config import EmbeddedEngineConfig, load_config
from rlpo_mega.rollout import ENGINES, EngineError, SamplingParams
from rlpo_mega.rollout.embedded import EmbeddedEngine, filter_probs
from tests.dist import torchrun

FAMILIES = {"qwen3_moe": "configs/models/tiny_qwen3_moe.json", "mixtral": "configs/models/tiny_mixtral.json"}
PLEN = [3, 7, 1, 5, 4]


class Setup:
    """A perturbed reference model (the "learner" weights) loaded into an engine through its receiver."""

    def __init__(self, path):
        self.hf = load_hf_config(path)
        torch.manual_seed(0)
        self.ref = AutoModelForCausalLM.from_config(self.hf).eval()
        with torch.no_grad():
            for p in self.ref.parameters():  # routers start at zero: perturb so routes are meaningful
                p.add_(torch.randn_like(p) * 0.05)
        self.spec = TraceSpec.from_hf(self.hf)
        self.engine = EmbeddedEngine(self.hf, EmbeddedEngineConfig(batch_size=3), self.spec)
        w = HFModelWeights(self.ref)
        self.engine.begin_weight_update()
        self.engine.load_weights([(n, w.read(n)) for n in w.names()])
        self.engine.end_weight_update()
        g = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(3, self.hf.vocab_size, (n,), generator=g).tolist() for n in PLEN]

    @torch.no_grad()
    def full_forward(self, sample, temperature=1.0):
        """transformers' own full forward of prompt+response: (response log-probs, argmax, routes)."""
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        with HFRouteCapture(self.ref, self.spec) as cap:
            logits = self.ref(ids).logits[0, :-1].double() / temperature
            routes = cap.sample(0)[:-1]
        p = len(sample.prompt_ids)
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        return lp[p - 1:], logits[p - 1:].argmax(-1), routes


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is faster, and spinning OpenMP threads on a shared, busy 2-core
    machine slow every small op by 10x or more."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(request):
    return Setup(FAMILIES[request.param])


def test_registered_and_built_from_config():
    assert ENGINES.get("embedded") is EmbeddedEngine
    cfg = load_config(None, ("model.hf_config=configs/models/tiny_mixtral.json",
                             "rollout.embedded.capture_routes=false"))
    engine = EmbeddedEngine.from_config(cfg)
    assert engine.capture is None and engine.hf.model_type == "mixtral" and engine.health()
    engine.flush_cache()
    engine.shutdown()
    assert not engine.health()
    with pytest.raises(EngineError, match="after shutdown"):
        engine.generate([[1, 2]], SamplingParams())


def test_seeded_generation_is_reproducible(setup):
    params = SamplingParams(max_new_tokens=8, seed=3)
    a = setup.engine.generate(setup.prompts, params, n=2)
    b = setup.engine.generate(setup.prompts, params, n=2)
    assert len(a) == 2 * len(setup.prompts) and [s.prompt_index for s in a] == [i // 2 for i in range(len(a))]
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    c = setup.engine.generate(setup.prompts, dataclasses.replace(params, seed=4), n=2)
    assert [s.response_ids for s in a] != [s.response_ids for s in c]
    # the two samples of a prompt are distinct draws
    assert any(a[2 * i].response_ids != a[2 * i + 1].response_ids for i in range(len(setup.prompts)))
    # seed=None: fresh randomness, and the drawn seed (meta) replays it
    d = setup.engine.generate(setup.prompts, SamplingParams(max_new_tokens=8), n=2)
    e = setup.engine.generate(setup.prompts, SamplingParams(max_new_tokens=8), n=2)
    assert [s.response_ids for s in d] != [s.response_ids for s in e]
    replay = setup.engine.generate(setup.prompts, dataclasses.replace(params, seed=d[0].meta.seed), n=2)
    assert [s.response_ids for s in d] == [s.response_ids for s in replay]


def test_inverse_cdf_sampling_draws_the_distribution():
    """The sampler's pick (one uniform per row, inverse CDF over the filtered probabilities) has the
    softmax's frequencies, and never a token that top-k / top-p removed."""
    from types import SimpleNamespace

    from rlpo_mega.rollout.embedded import _Uniforms

    n, vocab = 40000, 6
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0]).repeat(n, 1)
    rows = [SimpleNamespace(gen=torch.Generator().manual_seed(i)) for i in range(n)]
    for top_k, top_p in ((-1, 1.0), (3, 1.0), (-1, 0.8)):
        params = SamplingParams(top_k=top_k, top_p=top_p, max_new_tokens=1)
        picks = EmbeddedEngine._choose(None, logits, params, _Uniforms(rows, 1), 0)
        freq = torch.bincount(picks, minlength=vocab).double() / n
        want = filter_probs(logits[:1], top_k, top_p)[0].double()
        want = want / want.sum()
        assert float((freq - want).abs().max()) < 0.01, (top_k, top_p, freq, want)
        assert bool((freq[want == 0] == 0).all()), (top_k, top_p, freq)


def test_samples_do_not_depend_on_batch_composition(setup):
    params = SamplingParams(max_new_tokens=8, seed=5, top_p=0.95)
    runs = []
    # alone, mixed with padding and early finishers, everything in one batch (the default), cut by a token budget
    for bs, budget in ((1, None), (4, None), (None, None), (None, 40)):
        engine = setup.engine
        old, engine.cfg = engine.cfg, dataclasses.replace(engine.cfg, batch_size=bs, max_batch_tokens=budget)
        try:
            runs.append(engine.generate(setup.prompts, params, n=2))
        finally:
            engine.cfg = old
    for other in runs[1:]:
        assert [s.response_ids for s in other] == [s.response_ids for s in runs[0]]
        err = max(float((x.logprobs - y.logprobs).abs().max()) for x, y in zip(other, runs[0]))
        assert err < 1e-5, err


def test_logprobs_match_full_forward_and_respect_top_k(setup):
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=10, seed=11)
    samples = setup.engine.generate(setup.prompts, params, n=2)
    err = 0.0
    for s in samples:
        assert s.logprobs.dtype == torch.float32 and s.logprobs.shape == (len(s.response_ids),)
        lp, _, _ = setup.full_forward(s, params.temperature)
        err = max(err, float((s.logprobs.double() - lp).abs().max()))
        # log-probs are of the unfiltered distribution; the tokens come from the filtered one
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = setup.ref(ids).logits[0, len(s.prompt_ids) - 1:-1]
        rank = (logits > logits.gather(1, ids[0, len(s.prompt_ids):, None])).sum(-1)
        assert int(rank.max()) < params.top_k
    assert err < 1e-5, err


def test_filter_probs_top_k_then_top_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda k, p: (filter_probs(logits, k, p) > 0).int().tolist()[0]  # noqa: E731
    assert kept(-1, 1.0) == [1, 1, 1, 1]
    assert kept(-1, 0.7) == [1, 1, 0, 0] and kept(-1, 0.75) == [1, 1, 0, 0] and kept(-1, 0.81) == [1, 1, 1, 0]
    assert kept(2, 1.0) == [1, 1, 0, 0] and kept(-1, 0.1) == [1, 0, 0, 0]
    assert kept(3, 0.9) == [1, 1, 1, 0]  # top-p of the renormalised top-3: 0.53, 0.32, 0.16


def test_samples_follow_the_filtered_distribution(setup):
    """800 one-token samples of one prompt: frequencies ~ the renormalised top-k of softmax(logits / T)."""
    params = SamplingParams(temperature=0.15, top_k=4, max_new_tokens=1, seed=0)  # peaked, not uniform
    engine = setup.engine
    old, engine.cfg = engine.cfg, dataclasses.replace(engine.cfg, batch_size=200)
    try:
        out = engine.generate(setup.prompts[:1], params, n=800)
    finally:
        engine.cfg = old
    with torch.no_grad():
        logits = setup.ref(torch.tensor([setup.prompts[0]])).logits[0, -1] / params.temperature
    top = torch.topk(logits, params.top_k)
    want = torch.softmax(top.values, -1)
    got = torch.tensor([sum(s.response_ids[0] == t for s in out) / len(out) for t in top.indices.tolist()])
    assert abs(float(got.sum()) - 1) < 1e-6  # nothing outside the top-k
    assert float((got - want).abs().max()) < 0.06, (got, want)  # ~3.4 sigma at n=800


def test_greedy_is_exactly_the_argmax(setup):
    samples = setup.engine.generate(setup.prompts, SamplingParams(top_k=1, max_new_tokens=10))
    for s in samples:
        _, argmax, _ = setup.full_forward(s)
        assert s.response_ids == argmax.tolist()
        assert s.finish_reason == "length" and len(s.response_ids) == 10


def test_stop_tokens_and_length(setup):
    greedy = setup.engine.generate(setup.prompts, SamplingParams(top_k=1, max_new_tokens=10))
    resp = greedy[1].response_ids
    k = next(i for i in range(2, len(resp)) if resp[i] not in resp[:i])  # a first occurrence, not at 0
    stop = resp[k]
    samples = setup.engine.generate(setup.prompts, SamplingParams(top_k=1, max_new_tokens=10,
                                                                  stop_token_ids=(stop,)))
    assert samples[1].finish_reason == "stop" and samples[1].response_ids == resp[:k + 1]
    for g, s in zip(greedy, samples):  # the stop token is kept; otherwise the run hits the length cap
        if stop in g.response_ids:
            cut = g.response_ids.index(stop) + 1
            assert (s.finish_reason, s.response_ids) == ("stop", g.response_ids[:cut])
        else:
            assert (s.finish_reason, s.response_ids) == ("length", g.response_ids)
        assert len(s.logprobs) == len(s.response_ids)
        validate_trace(s.routes, setup.spec, s.num_tokens - 1, "stop")


def _generate_in_thread(engine, *args, **kwargs):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", engine.generate(*args, **kwargs)))
    t.start()
    deadline = time.time() + 60
    # in_flight() and decode_steps are reset together when the call starts: aborts land mid-generation
    while (not engine.in_flight() or engine.decode_steps < 3) and time.time() < deadline:
        time.sleep(0.005)
    return t, box


def test_abort_from_another_thread(setup):
    engine, spec = setup.engine, setup.spec
    max_new = 400
    t, box = _generate_in_thread(engine, setup.prompts[:2], SamplingParams(max_new_tokens=max_new, seed=1),
                                 n=2, request_ids=["a", "b"])
    assert engine.in_flight() == {"a", "b"}
    with pytest.raises(EngineError, match="weight update while generate"):
        engine.begin_weight_update()
    engine.abort(["b"])
    time.sleep(0.05)
    engine.abort()  # everything else, too
    t.join(120)
    out = box["out"]
    assert [s.meta.request_id for s in out] == ["a", "a", "b", "b"]
    assert all(s.finish_reason == "abort" for s in out)
    # batch_size=3: samples 0-2 were decoding; sample 3's batch never started (no tokens, no routes)
    assert all(3 <= len(s.response_ids) < max_new for s in out[:3])
    assert out[2].response_ids and len(out[2].response_ids) < min(len(s.response_ids) for s in out[:2])
    assert out[3].response_ids == [] and out[3].routes is None and out[3].logprobs.shape == (0,)
    for s in out[:3]:
        validate_trace(s.routes, spec, s.num_tokens - 1, "aborted")
    assert engine.in_flight() == set()
    # an aborted engine serves the next call normally
    after = engine.generate(setup.prompts[:1], SamplingParams(max_new_tokens=4, seed=1))
    assert after[0].finish_reason == "length"


def test_routes_valid_and_match_a_full_forward(setup):
    samples = setup.engine.generate(setup.prompts, SamplingParams(max_new_tokens=12, seed=2), n=2)
    agree = total = 0
    for i, s in enumerate(samples):
        assert s.routes.dtype == torch.int32
        assert s.routes.shape == (s.num_tokens - 1, setup.spec.num_layers, setup.spec.topk)
        trace = validate_trace(s.routes, setup.spec, s.num_tokens - 1, i)
        assert trace.num_replaced == 0
        _, _, full = setup.full_forward(s)
        same = (s.routes.sort(-1).values == full.sort(-1).values).all(-1)
        agree += int(same.sum())
        total += same.numel()
    # KV-cached incremental routing may flip near-tied tokens; most (token, layer) pairs agree
    assert agree / total >= 0.9, agree / total


def test_reload_from_disk_serves_the_checkpoint(setup, tmp_path):
    """The disk transport's path: a fresh engine reloads an HF checkpoint and samples what the first does."""
    setup.ref.save_pretrained(tmp_path)
    fresh = EmbeddedEngine(setup.hf, EmbeddedEngineConfig(batch_size=3), setup.spec)
    fresh.reload_from_disk(str(tmp_path))
    names = HFModelWeights(setup.ref).names()
    assert fresh.weight_digests(names, "xxh3") == setup.engine.weight_digests(names, "xxh3")
    params = SamplingParams(max_new_tokens=6, seed=8)
    a, b = setup.engine.generate(setup.prompts, params), fresh.generate(setup.prompts, params)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]


def test_no_capture_no_routes():
    engine = EmbeddedEngine(FAMILIES["qwen3_moe"], EmbeddedEngineConfig(capture_routes=False))
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, seed=0))
    assert out[0].routes is None and len(out[0].response_ids) == 3


def test_bad_input_names_cause_and_fix(setup):
    e, p = setup.engine, SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="no prompts"):
        e.generate([], p)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        e.generate([[1], []], p)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.generate([[1, setup.hf.vocab_size]], p)
    with pytest.raises(ValueError, match="max_position_embeddings=512: truncate the prompt or lower"):
        e.generate([[1] * 510], p)
    with pytest.raises(ValueError, match="one per prompt or one per sample"):
        e.generate([[1], [2]], p, n=2, request_ids=["x", "y", "z"])
    with pytest.raises(ValueError, match="stop_token_ids"):
        e.generate([[1]], SamplingParams(stop_token_ids=(10 ** 6,)))


# dp2: every tensor is a data-parallel replica, taken from the rank's own copy (no broadcast); ep2: the experts
# are broadcast from their holders, the dense tensors local
@pytest.fixture(scope="module", params=[("tp1", 1, ()), ("dp2", 2, ()), ("ep2", 2, ("parallel.expert=2",))],
                ids=lambda p: p[0])
def learner_report(request, tmp_path_factory):
    _, nproc, overrides = request.param
    return torchrun("rollout_learner.py", nproc, str(tmp_path_factory.mktemp("rollout")),
                    ",".join(FAMILIES.values()), *overrides, timeout=300)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_matches_megatron_learner(learner_report, family):
    r = learner_report[family]
    assert r["sync_tensors"] > 0 and r["digests_equal"], r
    assert r["lp_abs_err"] < 1e-5 and r["lp_rel_err"] < 1e-5, r  # sampled log-probs == learner's
    assert r["greedy_tokens"] > 0 and r["greedy_mismatch"] == 0, r  # top_k=1 == learner's argmax
    # after a training step and a re-sync: digests verified, the engine follows the learner
    assert r["digests_equal_after_step"], r
    assert r["lp_abs_err_after_step"] < 1e-5 and r["lp_rel_err_after_step"] < 1e-5, r
    assert r["lp_moved_by_step"] > 1e-3, r
    assert r["ranks_identical"], r  # dst=None: every rank's engine got the same weights
