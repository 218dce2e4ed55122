"""A real SGLang 0.5.23 server on this CPU, through our client (rlpo_mega.rollout.sglang_engine), for a tiny
Qwen3-MoE and a tiny Mixtral with random weights: generation with log-probs and routes, routes equal to the
Megatron learner's on the same tokens, weight updates through every transport (tensor, distributed, disk)
taking effect and passing the digest check, a corrupted tensor caught, abort by rid, a killed server. The server
is keyed as the trainer starts it (a key made for the run: --api-key/--admin-api-key added inside its process):
requests without the key are refused on generation and on every control endpoint the project uses, and a forged
digest report fails the sync.

SGLang runs from its own venv (tests/sglang_support/build_env.sh: .venv-sglang, built by `make test`, or
here if missing) with the CPU workarounds of tests/sglang_support/path on its PYTHONPATH. One server per
family (module scope): each start costs 20-45 s.
"""
import json
import math
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch

from moe.model import load_hf_config
from rlpo_mega.config import SGLangEngineConfig
from rlpo_mega.rollout import ENGINES, EngineError, SamplingParams
from rlpo_mega.rollout.sglang_engine import EngineRestarted, SGLangEngine
from moe.bridge.digest import DigestMismatchError, tensor_digest, verify
from rlpo_mega.weight_sync.transports import TRANSPORTS
from tests.dist import ROOT, free_port, torchrun
from tests.workers.bridge import make_hf_checkpoint

SUPPORT = os.path.join(ROOT, "tests", "sglang_support")
VENV = os.environ.get("RLPO_SGLANG_VENV", os.path.join(ROOT, ".venv-sglang"))
FAMILIES = {"qwen3_moe": "configs/models/tiny_qwen3_moe.json", "mixtral": "configs/models/tiny_mixtral.json"}
# the measured CPU recipe (shared/notes/sglang.md); float32 so log-probs compare with the learner's.
# Every CPU server here also runs with TORCHDYNAMO_DISABLE=1: sglang torch.compiles a few helpers (the vocabulary
# mask at TP > 1, seeded sampling) with inductor, which on this CPU compiles C++ in every server's scheduler
# (measured: a TP-1 server's processes used 29.9 s of CPU with it, 24.4 s without; the suite starts ~45 servers);
# the model's forward, its log-probs and routes, are not compiled either way.
# sleep_on_idle: an idle server's scheduler otherwise polls without pause; measured on this 2-core machine, an
# idle TP-2 server used 1.27 cores without it, 0.04 with it, and the learners launched beside it ran that
# much slower.
SERVER_ARGS = dict(device="cpu", attention_backend="torch_native", disable_overlap_schedule=True,
                   max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=512,
                   mem_fraction_static=0.15, skip_server_warmup=True, enable_return_routed_experts=True,
                   skip_tokenizer_init=True, dtype="float32", sleep_on_idle=True)
PROMPTS = [[5, 17, 33, 90, 41], [7, 8, 200, 3], [11, 12, 13, 14, 15, 16, 99]]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="session")
def sglang_python():
    py = os.path.join(VENV, "bin", "python")
    if not os.path.exists(os.path.join(VENV, ".sglang_installed")):
        proc = subprocess.run(["bash", os.path.join(SUPPORT, "build_env.sh"), VENV], capture_output=True,
                              text=True, timeout=1500)
        if proc.returncode != 0:
            pytest.skip(f"the SGLang venv could not be built (tests/sglang_support/build_env.sh, rc "
                        f"{proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}")
    return py


def _launched(model_type, config, sglang_python, tmp_path_factory):
    """(engine, hf config, checkpoint dir, original tensors): one launched server, every weight synced."""
    from safetensors.torch import load_file

    hf = load_hf_config(os.path.join(ROOT, config))
    ckpt = str(tmp_path_factory.mktemp(model_type) / "hf")
    make_hf_checkpoint(hf, ckpt)
    cfg = SGLangEngineConfig(launch=True, base_port=free_port(), server_args=SERVER_ARGS, python=sglang_python,
                             log_dir=str(tmp_path_factory.mktemp("sglang_logs")), startup_timeout=240,
                             request_timeout=120, max_restarts=1 if model_type == "qwen3_moe" else 0,
                             env={"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": os.path.join(SUPPORT, "path")})
    t0 = time.monotonic()
    assert ENGINES.get("sglang") is SGLangEngine
    engine = ENGINES.get("sglang")(cfg, hf, model_path=ckpt)
    print(f"{model_type}: SGLang server up in {time.monotonic() - t0:.1f} s")
    weights = load_file(os.path.join(ckpt, "model.safetensors"))
    # the trainer's first sync, digest-verified inside the server; it also mends sglang's Mixtral, which ignores
    # tie_word_embeddings and starts with an unloaded lm_head (the digest check catches that: test_tied_lm_head_caught)
    TRANSPORTS.get("in_process")(engine).sync(ListStream(weights.items(), bucket=16))
    return engine, hf, ckpt, weights


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, sglang_python, tmp_path_factory):
    launched = _launched(request.param, FAMILIES[request.param], sglang_python, tmp_path_factory)
    yield launched
    launched[0].shutdown()


class ListStream:
    """ExportStream's contract from a list of (name, tensor): buckets, sender digests, bytes.
    corrupt(name, t): what actually goes out (after the digest), to test the check."""

    def __init__(self, named, bucket=3, corrupt=None):
        self.named, self.bucket, self.corrupt = list(named), bucket, corrupt
        self.digests, self.bytes_sent, self.receives = {}, 0, True
        self.digest_algorithm = "xxh3"

    def __iter__(self):
        for i in range(0, len(self.named), self.bucket):
            out = []
            for n, t in self.named[i:i + self.bucket]:
                self.digests[n] = tensor_digest(t, self.digest_algorithm)
                self.bytes_sent += t.numel() * t.element_size()
                out.append((n, self.corrupt(n, t) if self.corrupt else t))
            yield out


def greedy(max_new=4):
    return SamplingParams(temperature=1.0, top_k=1, max_new_tokens=max_new)


def out_head(hf):
    return "model.embed_tokens.weight" if hf.tie_word_embeddings else "lm_head.weight"


def test_generate_logprobs_routes_match_learner(family, tmp_path):
    _routes_and_logprobs_match_learner(*family[:3], tmp_path)


def _routes_and_logprobs_match_learner(engine, hf, ckpt, tmp_path):
    assert engine.health()
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6), n=2)
    assert len(out) == 6 and [s.prompt_index for s in out] == [0, 0, 1, 1, 2, 2]
    k, n_moe = int(hf.num_experts_per_tok), engine.spec.num_layers
    for s in out:
        assert s.finish_reason == "length" and len(s.response_ids) == 6 and s.logprobs.shape == (6,)
        assert bool((s.logprobs < 0).all())
        assert s.routes.shape == (s.num_tokens - 1, n_moe, k)
        assert 0 <= int(s.routes.min()) and int(s.routes.max()) < engine.spec.num_experts
    # the learner (Megatron, replay-free) on the same tokens: same top-k sets, same log-probs
    seqs = [s.prompt_ids + s.response_ids for s in out]
    inp, res = tmp_path / "in.json", tmp_path / "out.pt"
    inp.write_text(json.dumps({"seqs": seqs}))
    torchrun(os.path.join(SUPPORT, "learner_routes.py"), 1, ckpt, str(inp), str(res), timeout=600)
    learner = torch.load(res)
    agree = total = 0
    for s, routes, logp in zip(out, learner["routes"], learner["logp"]):
        mine = routes[:s.num_tokens - 1].long().sort(-1).values
        theirs = s.routes.long().sort(-1).values
        agree += int((mine == theirs).all(-1).sum())
        total += mine.shape[0] * mine.shape[1]
        resp = logp[len(s.prompt_ids) - 1:].float()
        torch.testing.assert_close(s.logprobs, resp, atol=2e-3, rtol=0)
    print(f"{hf.model_type}: SGLang vs learner top-k sets {agree}/{total}")
    assert agree == total


def test_receiver_replays_every_tensor_bit_exactly(family, tmp_path):
    """The in-server receiver (launch/rlpo_sglang_receiver.py) on every TP rank: a sync of changed weights is
    loaded by SGLang and learned, the next sync replays every tensor as the copies SGLang made -- the digests of
    all of them equal the sender's (bit for bit) and the server's log-probs equal the learner's on the checkpoint
    (nothing SGLang derives from a weight went stale)."""
    engine, hf, ckpt, w = family
    # installed by the engine before its servers' first weights (begin_weight_update): every transport loads
    # through it; the tensors it has seen so far are learned
    (base,) = engine.receivers().values()
    g = torch.Generator().manual_seed(5)
    changed = {n: t + 0.01 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in w.items()}
    TRANSPORTS.get("in_process")(engine).sync(ListStream(changed.items(), bucket=16))  # learned; digest-verified
    (first,) = engine.receivers().values()
    # every tensor sent (a tied head also goes as lm_head: SGLang's Mixtral holds one apart), learned or replayed
    n = len(w) + engine.tied
    assert first["learned"] + first["replayed"] - base["learned"] - base["replayed"] == n, (base, first)
    assert first["learned"] == n and first["loaded"] == base["loaded"], (base, first)
    TRANSPORTS.get("in_process")(engine).sync(ListStream(w.items(), bucket=16))  # replayed; digest-verified
    (second,) = engine.receivers().values()
    assert second["replayed"] - first["replayed"] == n and second["loaded"] == first["loaded"], second
    assert second["learned"] == n and second["not_replayed"] == {}, second
    _routes_and_logprobs_match_learner(engine, hf, ckpt, tmp_path)


# The weight-update, disk and abort paths are the engine's, the same for every family: run on qwen3_moe's server
# only (mixtral's own: its routes, its tied head, a killed server detected).
engine_path_once = pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)


@engine_path_once
def test_tensor_update_and_digest(family):
    engine, hf, ckpt, w = family
    name = out_head(hf)
    zero = torch.zeros_like(w[name])
    stats = TRANSPORTS.get("in_process")(engine).sync(ListStream([(name, zero)]))  # digest-verified
    assert stats["tensors"] == 1
    lp = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3))[0].logprobs
    vocab = int(hf.vocab_size)
    torch.testing.assert_close(lp, torch.full_like(lp, -math.log(vocab)), atol=1e-5, rtol=0)
    # a tensor altered after the sender's digest is caught
    bad = ListStream([(name, w[name])], corrupt=lambda n, t: t.clone().index_fill_(0, torch.tensor([1]), 0.5))
    with pytest.raises(DigestMismatchError):
        TRANSPORTS.get("in_process")(engine).sync(bad)
    # restore through the tensor path; the digest of everything equals the checkpoint's
    TRANSPORTS.get("in_process")(engine).sync(ListStream(w.items(), bucket=16))


@engine_path_once
def test_colocated_flattened_bucket_update(family):
    """rollout.colocate's payloads (weight_sync/sglang_payloads.py) into the real server: each bucket goes as one
    load_format=flattened_bucket post, its tensors' bytes in one uint8 tensor (one shared-memory file, made by this
    process) with SimpleNamespace metadata, which SGLang's SafeUnpickler admits. The server then holds exactly what
    was sent: the digests taken inside it agree (the transport's check), a zeroed output head gives uniform
    log-probs, and the checkpoint's weights come back through the same path, several tensors to a bucket."""
    import dataclasses

    from tests.workers.colocated_payloads import producer_pids

    engine, hf, ckpt, w = family
    colocated = SGLangEngine(dataclasses.replace(engine.cfg, urls=[engine.servers[0].url], launch=False), hf,
                             colocate=True, api_key=engine._api_key)
    posts, post = [], colocated._post_ok

    def recording(server, path, payload=None, timeout=None):
        if path == "/update_weights_from_tensor":
            posts.append(payload)
        return post(server, path, payload, timeout)

    colocated._post_ok = recording
    try:
        name = out_head(hf)
        stats = TRANSPORTS.get("in_process")(colocated).sync(ListStream([(name, torch.zeros_like(w[name]))]))
        assert stats["tensors"] == 1
        lp = colocated.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3))[0].logprobs
        torch.testing.assert_close(lp, torch.full_like(lp, -math.log(int(hf.vocab_size))), atol=1e-5, rtol=0)
        stats = TRANSPORTS.get("in_process")(colocated).sync(ListStream(w.items(), bucket=16))
        assert stats["tensors"] == len(w)
    finally:
        colocated.shutdown()
    assert len(posts) == 1 + math.ceil(len(w) / 16)
    for p in posts:
        assert p["load_format"] == "flattened_bucket" and len(p["serialized_named_tensors"]) == 1
        assert producer_pids(p["serialized_named_tensors"][0]) == [os.getpid()]  # one file per bucket


def permuted(hf, w, perm):
    """Layer 0's router rows and experts permuted together: the same function, expert ids renamed."""
    pre = "model.layers.0.block_sparse_moe" if hf.model_type == "mixtral" else "model.layers.0.mlp"
    parts = ("w1", "w2", "w3") if hf.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    new = [(f"{pre}.gate.weight", w[f"{pre}.gate.weight"][perm].contiguous())]
    for i, src in enumerate(perm.tolist()):
        new += [(f"{pre}.experts.{i}.{p}.weight", w[f"{pre}.experts.{src}.{p}.weight"]) for p in parts]
    return new


@engine_path_once
def test_distributed_update_permutes_routes(family):
    engine, hf, ckpt, w = family
    base = engine.generate(PROMPTS, greedy())
    perm = torch.tensor([2, 0, 3, 1])
    transport = TRANSPORTS.get("sglang_distributed")(engine, backend="gloo")
    try:
        transport.sync(ListStream(permuted(hf, w, perm), bucket=5))
        after = engine.generate(PROMPTS, greedy())
        inv = torch.argsort(perm)  # expert e is now called inv[e]
        for b, a in zip(base, after):
            assert a.response_ids == b.response_ids
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
            assert torch.equal(a.routes[:, 0].sort(-1).values, inv[b.routes[:, 0].long()].sort(-1).values.int())
            assert torch.equal(a.routes[:, 1:], b.routes[:, 1:])
        transport.sync(ListStream(permuted(hf, w, torch.arange(4)), bucket=5))  # back to the checkpoint
    finally:
        transport.close()
    again = engine.generate(PROMPTS, greedy())
    assert [a.routes.tolist() for a in again] == [b.routes.tolist() for b in base]


@engine_path_once
def test_disk_update(family, tmp_path):
    from safetensors.torch import save_file

    engine, hf, ckpt, w = family
    new_dir = tmp_path / "zeroed"
    shutil.copytree(ckpt, new_dir)
    name = out_head(hf)
    changed = dict(w)
    changed[name] = torch.zeros_like(w[name])
    save_file(changed, str(new_dir / "model.safetensors"), metadata={"format": "pt"})
    # the disk transport's engine half (its writer half needs a Megatron stream: tests/test_weight_sync.py)
    engine.reload_from_disk(str(new_dir))
    verify({n: tensor_digest(t, "sums") for n, t in changed.items()}, engine.weight_digests(list(changed), "sums"))
    lp = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3))[0].logprobs
    torch.testing.assert_close(lp, torch.full_like(lp, -math.log(int(hf.vocab_size))), atol=1e-5, rtol=0)
    engine.reload_from_disk(ckpt)
    d = engine.weight_digests(list(w), "xxh3")
    assert d == {n: tensor_digest(t, "xxh3") for n, t in w.items()}


def test_tied_lm_head_caught(family):
    engine, hf, _, w = family
    if not hf.tie_word_embeddings:
        pytest.skip(f"{hf.model_type}: untied")
    engine.begin_weight_update()
    engine.load_weights([("lm_head.weight", torch.randn_like(w["model.embed_tokens.weight"]))])
    engine.end_weight_update()
    with pytest.raises(DigestMismatchError, match="tie_word_embeddings"):
        engine.weight_digests(["model.embed_tokens.weight"], "xxh3")
    TRANSPORTS.get("in_process")(engine).sync(ListStream([("model.embed_tokens.weight", w["model.embed_tokens.weight"])]))


@engine_path_once
def test_server_tp_size_and_environment_are_read(family):
    """rollout.sglang.tp_size sizes the weight-update group and the per-rank payloads: a server of another TP
    size (the launch README's TP4 example without the config knob) is refused before the first transfer, with
    one line naming both sizes -- it failed or hung at the first sync before. The server's own /server_info says."""
    engine, hf, *_ = family
    key = engine._api_key  # the server's (made for the run when the fixture launched it)
    wrong = SGLangEngine(SGLangEngineConfig(urls=[engine.servers[0].url], tp_size=4, control_timeout=60), hf,
                         api_key=key)
    with pytest.raises(EngineError, match=r"runs at tensor parallel size 1 but rollout\.sglang\.tp_size=4: set "
                                          r"rollout\.sglang\.tp_size=1"):
        wrong.begin_weight_update()
    wrong.shutdown()
    # rollout.partial_rollout_kv=keep updates weights under held requests with no flush: a server with its radix
    # cache on (this one) is refused, from its own /server_info (external servers have no server_args to check)
    held = SGLangEngine(SGLangEngineConfig(urls=[engine.servers[0].url], control_timeout=60), hf, keep_kv=True,
                        api_key=key)
    with pytest.raises(EngineError, match="runs with its radix cache on.*--disable-radix-cache"):
        held.begin_weight_update()
    held.shutdown()
    engine._layout_checked = False
    engine._check_layout()  # the launched one agrees
    assert engine._layout_checked
    # what the NCCL preflight of sglang_distributed reads, reported from inside the server (no CUDA here)
    env = engine.environments()[engine.servers[0].url]
    assert env["nccl"] is None and env["cuda"] is None and env["torch"].startswith("2."), env


@engine_path_once
def test_abort_by_rid(family):
    engine, *_ = family
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("s", engine.generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=450), request_ids=["rlpo-test-abort"])))
    t.start()
    # Abort until the request ends: one fixed sleep either fired before the server knew the request or
    # after a fast server had generated all 450 tokens (seen: 'length', 450).
    deadline = time.monotonic() + 60
    while t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
        engine.abort(["rlpo-test-abort"])
    t.join(60)
    s = got["s"][0]
    assert s.finish_reason == "abort" and len(s.response_ids) < 450, (s.finish_reason, len(s.response_ids))
    assert len(s.logprobs) == len(s.response_ids)
    engine.flush_cache()  # retried until the aborted request has left
    assert engine.generate([PROMPTS[1]], greedy(2))[0].finish_reason == "length"


@engine_path_once
def test_held_requests_wait_and_an_abort_while_held_ends_them(family):
    """rollout.partial_rollout_kv=keep's hold (POST /pause_generation mode=in_place): a request sent while the
    server is held waits (as one running does: tests/test_sglang_trainer.py's keep run) and is answered after
    resume(); an abort while held (the rebuild after a failed sync) resumes first -- a held scheduler never ends
    what it aborts -- so the request ends at once instead of hanging."""
    engine, *_ = family
    for abort in (False, True):
        got, rid = {}, f"rlpo-test-held-{abort}"
        engine.pause()
        t = threading.Thread(target=lambda: got.setdefault("s", engine.generate(
            [PROMPTS[0]], SamplingParams(max_new_tokens=400 if abort else 16), request_ids=[rid])))
        t.start()
        t.join(1.5)
        assert t.is_alive()  # held: not answered
        if abort:
            engine.abort([rid])
            assert not engine._held
            deadline = time.monotonic() + 60  # (as test_abort_by_rid: again until it ends, the first may come early)
            while t.is_alive() and time.monotonic() < deadline:
                t.join(0.2)
                engine.abort([rid])
        else:
            engine.resume()
        t.join(60)
        assert not t.is_alive()
        s = got["s"][0]
        assert (s.finish_reason == "abort") == abort and len(s.logprobs) == len(s.response_ids), s
    engine.flush_cache()


@pytest.mark.parametrize("turns", ["lockstep", "continuous"])
def test_multi_turn_episodes_continue_from_token_ids_with_stitched_routes(family, monkeypatch, turns):
    """Multi-turn episodes on a real SGLang server (each family): each turn continues from the episode's token ids
    and asks only for the routing rows the episode lacks (routed_experts_start_len), and the stitched routes
    are the routing of every position: equal to a fresh prefill of the whole episode (cache flushed). A test-only
    logit bias on the end-of-turn token makes the random model close its turns. Continuous turns: every turn goes
    into one running call (a Feed)."""
    from transformers import AutoTokenizer

    import tests.multi_turn_support  # noqa: F401  (the test_script environment)
    from rlpo_mega.config import EnvironmentConfig
    from rlpo_mega.data.dataset import PromptRecord
    from rlpo_mega.environments import EnvRunner
    from rlpo_mega.rollout.episode import EpisodeLimits, TurnFormat, run_episodes

    engine, hf, *_ = family
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "configs", "tokenizers", "tiny_chatml"))
    fmt = TurnFormat(tok, (tok.eos_token_id,))
    sampling, answer, starts = engine._sampling, engine._answer, []
    bias = {str(fmt.end_id): 5.0}
    monkeypatch.setattr(engine, "_sampling", lambda p, seed: {**sampling(p, seed), "logit_bias": bias})

    def recorded(server, prompt_index, prompt, rid, status, body, size, start=0):
        got = answer(server, prompt_index, prompt, rid, status, body, size, start)
        rows = None if got.routes is None else int(got.routes.shape[0])
        starts.append((len(prompt), start, rows, len(got.response_ids)))
        return got

    monkeypatch.setattr(engine, "_answer", recorded)
    stream, fed = engine.stream, []

    def counted(*a, **kw):
        fed.append("more" in kw)
        return stream(*a, **kw)

    monkeypatch.setattr(engine, "stream", counted)
    runner = EnvRunner(EnvironmentConfig(name="test_script", options={"observations": ["ab", "cd"]}))
    items = [(fmt.render([{"role": "user", "content": f"k{i}?"}], True), PromptRecord(i, f"k{i}?", None))
             for i in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(tok.eos_token_id,), seed=5)
    out = [s for _, g in run_episodes(engine, items, 2, params, runner, fmt, EpisodeLimits(4, 200), tok,
                                      continuous=turns == "continuous") for s in g]
    assert len(out) == 6 and sum(s.episode[0] == 3 for s in out) >= 4, [s.episode for s in out]
    assert fed == [True] if turns == "continuous" else (len(fed) >= 3 and not any(fed)), fed
    # the server stopped each turn at the end-of-turn token (SGLang's ignore_eos would switch stop ids off)
    for s in out:
        spans = [0] + [a + c for a, c in s.obs_spans]
        ends = [a - 1 for a, _ in s.obs_spans]
        assert all(s.response_ids[e] == fmt.end_id for e in ends) and len(spans) == s.episode[0]
    later = [(p, st, rows, n) for p, st, rows, n in starts if st > 0]
    assert len(later) >= 8 and all(rows == p + n - 1 - st for p, st, rows, n in later), starts
    engine.flush_cache()
    monkeypatch.setattr(engine, "_answer", answer)
    monkeypatch.setattr(engine, "stream", stream)
    fresh = engine.generate([list(s.prompt_ids) + list(s.response_ids) for s in out], greedy(1))
    for s, f in zip(out, fresh):
        assert s.routes.shape[0] == s.prompt_len + s.response_len - 1
        rows = f.routes[:s.routes.shape[0]]
        same = (torch.sort(rows.long(), -1).values == torch.sort(s.routes.long(), -1).values).all(-1).float().mean()
        assert same >= 0.98, float(same)  # near-ties in float32 aside, every position's routing


@engine_path_once
def test_keyed_server_refuses_requests_without_the_key(family):
    """The server the trainer launched takes only the job's key: without it (or with another) generation and every
    control endpoint the project calls answer 401 -- SGLang 0.5.23 leaves /health* and /ready open whatever the keys
    (its rule: probes without secrets), and those answer. The key (made for this run) is on no command line of the
    server's processes; their log, where SGLang prints its arguments, is the owner's only."""
    from tests.test_server_keys import CONTROL, NORMAL, OTHER, http_status

    engine, *_ = family
    server = engine.servers[0]
    key = engine._api_key
    assert key and server.launched.api_key == key and server.key_checked

    def status(path, auth=None):
        return http_status(server.url, path, auth)

    refused = {p: (status(p), status(p, "Bearer " + OTHER), status(p, key)) for p in NORMAL + CONTROL}
    assert all(v == (401, 401, 401) for v in refused.values()), refused  # (a bare key is no Bearer header)
    assert status("/server_info", "bearer " + key) == 200  # the scheme is case-insensitive
    assert {p: status(p) for p in ("/health", "/ready")} == {"/health": 200, "/ready": 200}
    pgid = server.launched.proc.pid
    cmdlines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdlines.append(f.read().decode(errors="replace"))
        except (OSError, ProcessLookupError):
            pass
    assert cmdlines and not any(key in c or "--api-key" in c for c in cmdlines), cmdlines
    assert os.stat(server.launched.log_path).st_mode & 0o777 == 0o600


@engine_path_once
def test_forged_digest_report_caught(family):
    """The digest report of a corrupted sync, forged in the driver's TCP store (a wrapper on the store returning
    what another writer to its port could leave there: the genuine report with the sender's digests claimed, one
    sealed with another key, an unsigned one, a genuine one of an earlier sync replayed): each fails the sync
    (DigestMismatchError); the environment report likewise (EngineError)."""
    from tests.test_server_keys import TamperingStore, forgeries

    engine, hf, ckpt, w = family
    name = out_head(hf)
    store, replay = engine.store(), []
    try:
        engine._store = TamperingStore(store, lambda key, raw: replay.append(raw) or raw)
        TRANSPORTS.get("in_process")(engine).sync(ListStream([(name, w[name])]))  # genuine: passes (and is kept)
        for what, forge in forgeries({name: tensor_digest(w[name], "xxh3")}, replay).items():
            engine._store = TamperingStore(store, forge)
            corrupted = ListStream([(name, w[name])], corrupt=lambda n, t: t.clone().index_fill_(0, torch.tensor([1]), 0.5))
            with pytest.raises(DigestMismatchError, match="weight digests report fails authentication"):
                TRANSPORTS.get("in_process")(engine).sync(corrupted)
        engine._store = TamperingStore(store, lambda key, raw: json.dumps(json.loads(json.loads(raw)["report"])))
        with pytest.raises(EngineError, match="environment report fails authentication"):
            engine.environments()
    finally:
        engine._store = store
    TRANSPORTS.get("in_process")(engine).sync(ListStream(w.items(), bucket=16))  # the checkpoint's weights again


def test_killed_server_detected(family):  # last: it kills the family's server
    engine, hf, *_ = family
    server = engine.servers[0]
    server.launched.kill()
    server.launched.proc.wait(30)
    assert engine.health() is False
    if engine.cfg.max_restarts:  # qwen3_moe: restarted, the caller must re-sync, then it serves again
        with pytest.raises(EngineRestarted, match="restarted"):
            engine.generate([PROMPTS[0]], greedy(2))
        assert engine.health()
        assert engine.generate([PROMPTS[0]], greedy(2))[0].finish_reason == "length"
    else:  # mixtral (max_restarts 0): the run stops with the URL and the log named
        with pytest.raises(EngineError, match=server.url) as e:
            engine.generate([PROMPTS[0]], greedy(2))
        assert not isinstance(e.value, EngineRestarted) and "log" in str(e.value)
