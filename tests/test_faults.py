"""The fault harness: a run survives its cluster's bad days.

Trainer side (one launch, tests/workers/faults.py; 2 ranks, EP2, the embedded engine): a SIGTERM to every rank
in each phase of a step, under the sync and the async producer, ends with the last completed step saved and exit
75 (EXIT_STOPPED), whether the weight sync then works or fails (servers stopping with the job); a stop while the
engine fails starts no rebuild; a failed sync (also failing at its re-sync, also half-way through one rank's
export) is rebuilt and retried; the run resumed from a stop trains the prompts of an uninterrupted run, none
twice, none lost.

Server side (stub SGLang servers that answer as SGLang 0.5.23 does, in this process): two servers on one driver
report their digests through one store; a failed sync closes every server's update session, and a session left
open by someone else is closed before the next begin.

rollout.partial_rollout_kv=keep (one launch, tests/workers/keep_faults.py, stub servers that hold in place): a
SIGTERM while the servers are held saves and lets them go; the resume trains what an uninterrupted run trains; a
server that dies while held costs only its requests.
"""
import base64
import contextlib
import json
import os
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import rlpo_mega.rollout.sglang_engine as sglang_engine
import rlpo_mega.rollout.engines as engines_module
from moe.bridge.digest import tensor_digest
from rlpo_mega.errors import EXIT_STOPPED
from moe.model import load_hf_config
from rlpo_mega.config import SGLangEngineConfig, load_config
from rlpo_mega.rollout import EngineError, SamplingParams
from rlpo_mega.rollout.sglang_engine import SGLangEngine
from rlpo_mega.rollout.sglang_reports import REPORT_LOADER
from rlpo_mega.rollout.engines import EngineSlot
from rlpo_mega.weight_sync.transports import InProcessTransport
from tests.dist import ROOT, torchrun
from tests.test_engine_timeouts import engine_for

STEPS = 3
PER_STEP = 16  # prompts.prompts_per_step=4 x n_samples=4 (tests/workers/train_scenarios.BASE), over both ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return torchrun("faults.py", 2, str(tmp_path_factory.mktemp("faults")), env={"WANDB_MODE": "disabled"},
                    timeout=900)


def _trained(run) -> dict[int, list]:
    """step -> the prompts trained at it, both ranks together."""
    out = {}
    for per_rank in run["trained"]:
        for step, prompts in per_rank.items():
            out.setdefault(int(step), []).extend(tuple(p) for p in prompts)
    return out


# (run, the last step completed = saved): a stop during step 2's phase saves step 2 once the phase can finish
# (the embedded engine's rollout completes, as do old log-probs and the update; the sync is skipped or fails);
# the async producer's rollout wait is interrupted (step 1); a stop during step 1's save exits after it
CASES = [("sync_rollout", 2), ("sync_old_logprob", 2), ("sync_update", 2), ("sync_sync", 2), ("sync_sync_dead", 2),
         ("sync_eval", 2), ("sync_save", 1), ("async_rollout", 2), ("async_update", 2), ("async_sync", 2),
         ("async_sync_dead", 2), ("rollout_dead", 1),
         # colocated: the stops with the learner's state on the host (rollout, eval) save it once it is back
         ("colocate_rollout", 2), ("colocate_update", 2), ("colocate_sync", 2), ("colocate_eval", 2),
         ("colocate_save", 1)]


@pytest.mark.parametrize("name,last", CASES, ids=[c[0] for c in CASES])
def test_a_stop_in_any_phase_saves_the_last_completed_step(runs, name, last):
    r = runs[name]
    assert r["rc"] == EXIT_STOPPED and r["stopped"], r
    assert max(r["saved"]) == last, r  # the last completed step is on disk
    assert [s for s in r["steps"] if s > 0] == list(range(1, last + 1)), r  # every completed step was logged
    trained = _trained(r)
    assert sorted(trained) == list(range(1, last + 1)), r
    assert all(len(p) == PER_STEP for p in trained.values()), {s: len(p) for s, p in trained.items()}
    # each step's prompts are the uninterrupted run's (the same producer)
    clean = _trained(runs[("async" if name.startswith("async") else "sync") + "_clean"])
    assert all(sorted(trained[s]) == sorted(clean[s]) for s in trained), name
    assert not any(r["restarts"][1:]), r  # no rebuild began once the stop was requested
    if name.endswith("sync_dead"):  # the sync was skipped or failed: no retry of it under the stop
        assert r["syncs"] == 3, r  # start, step 1, step 2's (failed)


def test_a_stop_while_the_engine_fails_starts_no_rebuild(runs):
    r = runs["rollout_dead"]  # rank 1's engine fails in step 2's rollout while the stop is requested
    assert r["restarts"] == [0] and r["saved"] == [1] and r["syncs"] == 2, r
    assert r["saves"] == [{"step": 1, "on_signal": False}], r  # step 1 was saved already: not written again


def test_a_failed_sync_is_rebuilt_and_retried(runs):
    r = runs["sync_retry"]  # every rank's step-1 sync fails, then its re-sync after the rebuild fails too
    assert r["rc"] == 0 and r["steps"] == [1, 2, 3] and r["restarts"][-1] == 2, r
    # start, step 1's (failed), the re-syncs (failed, then done: the step's sync, not followed by another), 2, 3
    assert r["syncs"] == 6, r
    r = runs["sync_mid_bucket"]  # rank 1 fails at the first bucket; rank 0's export collectives complete
    assert r["rc"] == 0 and r["steps"] == [1, 2, 3] and r["restarts"][-1] == 1 and r["syncs"] == 5, r
    for name in ("sync_retry", "sync_mid_bucket"):
        trained = _trained(runs[name])
        assert {s: sorted(p) for s, p in trained.items()} == {s: sorted(p) for s, p in
                                                              _trained(runs["sync_clean"]).items()}, name


def test_the_resumed_run_trains_what_an_uninterrupted_run_trains(runs):
    stopped, resumed, clean = runs["sync_update"], runs["resumed"], runs["sync_clean"]
    assert resumed["rc"] == 0 and resumed["steps"] == [STEPS], resumed
    both = {**_trained(stopped), **_trained(resumed)}
    assert sorted(both) == list(range(1, STEPS + 1))
    assert sum(len(p) for p in both.values()) == STEPS * PER_STEP  # none twice, none lost
    assert {s: sorted(p) for s, p in both.items()} == {s: sorted(p) for s, p in _trained(clean).items()}


# --- stub SGLang servers --------------------------------------------------------------------------------------
class StubSGLang:
    """A server answering the weight-update calls as SGLang 0.5.23 does: one session at a time (a begin while one
    is open is refused), the report hook (REPORT_LOADER) writes its digests to the driver's TCP store, and
    /update_weights_from_tensor fails (500) `fail_loads` times; while `hung` is set its loads and /health do not
    answer (a stuck scheduler)."""

    def __init__(self, fail_loads: int = 0, fail_reports: int = 0):
        self.session, self.fail_loads, self.weights, self.calls = False, fail_loads, {}, []
        # rollout.colocate: the tags released (SGLang's offload_tags), and release/resume calls to fail (500)
        self.released, self.fail_memory = set(), 0
        self.fail_reports = fail_reports  # the digest report hook answers 500 this many times
        self.hung = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/health":
                    stub.wait_while_hung()
                if self.path == "/server_info":
                    return self._send(200, {"tp_size": 1})
                self._send(200 if self.path == "/health" else 404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                stub.calls.append(self.path)
                status, out = stub.answer(self.path, body)
                self._send(status, out)

            def _send(self, status, out):
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, path, body):
        if path == "/begin_weight_update":
            if self.session:
                return 400, {"success": False, "message": "a weight-update session is already open; call "
                                                          "end_weight_update() first"}
            self.session = True
            return 200, {"success": True}
        if path == "/end_weight_update":
            was, self.session = self.session, False
            return (200, {"success": True}) if was else (400, {"success": False, "message": "no session is open"})
        if path == "/flush_cache":
            return 200, {}
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            if self.fail_memory > 0:
                self.fail_memory -= 1
                return 500, {"success": False, "message": "test: memory call failed"}
            tags = set(body.get("tags") or ("weights", "kv_cache", "cuda_graph"))
            if path == "/release_memory_occupation":
                if tags & self.released:
                    return 500, {"success": False, "message": f"already released: {sorted(tags & self.released)}"}
                self.released |= tags
            else:
                if tags - self.released:  # SGLang: offload_tags.remove(tag) -> KeyError
                    return 500, {"success": False, "message": f"KeyError: {sorted(tags - self.released)}"}
                self.released -= tags
            return 200, {}
        if path == "/update_weights_from_tensor":
            named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
            if body.get("load_format") == REPORT_LOADER:
                if self.fail_reports > 0:
                    self.fail_reports -= 1
                    return 500, {"success": False, "message": "test: the digest hook failed"}
                req = json.loads(named[0][0])
                store = torch.distributed.TCPStore(*req["store"][:1], int(req["store"][1]), is_master=False,
                                                   timeout=__import__("datetime").timedelta(seconds=req["timeout"]))
                store.set(req["key"], json.dumps({"digests": {n: tensor_digest(t, req["algorithm"])
                                                              for n, t in self.weights.items()}}))
                return 200, {"success": True}
            self.wait_while_hung()
            if "weights" in self.released:  # on a GPU: writes into memory the server gave up
                return 500, {"success": False, "message": "test: weights loaded while released"}
            if self.fail_loads > 0:
                self.fail_loads -= 1
                return 500, {"success": False, "message": "test: load failed"}
            self.weights.update((n, t.clone()) for n, t in named)
            return 200, {"success": True}
        return 404, {}

    def wait_while_hung(self):
        while self.hung.is_set():
            time.sleep(0.02)

    def close(self):
        self.hung.clear()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stubs():
    made = []

    def make(n, **kw):
        made.extend(StubSGLang(**kw) for _ in range(n))
        return made[-n:]
    yield make
    for s in made:
        s.close()


class Stream:
    """An export stream's receiving side, as a transport reads it: one bucket of named tensors."""

    def __init__(self, named, algorithm="xxh3"):
        self.named, self.receives, self.digest_algorithm, self.bytes_sent = named, True, algorithm, 0
        self.digests = {n: tensor_digest(t, algorithm) for n, t in named}

    def __iter__(self):
        yield self.named


def test_two_servers_on_one_driver_report_through_one_store(stubs, monkeypatch):
    """The cause of the first sync's failure with two real servers per driver: the digest reports are asked for
    concurrently, and each thread that found no store created one; the first server was told a port whose store
    was dropped. TCPStore is made slower here (as a loaded host makes it) so that the two threads always meet."""
    created, make = [], sglang_engine.dist.TCPStore

    def slow_store(*args, **kw):
        if not kw.get("is_master"):  # the stub servers' clients (the same torch.distributed here)
            return make(*args, **kw)
        time.sleep(0.3)
        created.append(make(*args, **kw))
        return created[-1]
    monkeypatch.setattr(sglang_engine.dist, "TCPStore", slow_store)
    servers = stubs(2)
    engine = engine_for([s.url for s in servers], control_timeout=5.0)
    named = [("model.embed_tokens.weight", torch.arange(6.0).reshape(2, 3))]
    try:
        report = InProcessTransport(engine).sync(Stream(named))
    finally:
        engine.shutdown()
    assert report["tensors"] == 1 and len(created) == 1, (report, created)
    assert all(s.calls.count("/update_weights_from_tensor") == 2 and not s.session for s in servers)


def test_a_failed_sync_closes_every_session_and_the_next_sync_succeeds(stubs):
    servers = stubs(2, fail_loads=0)
    servers[1].fail_loads = 1  # the second server fails its load: the first has a session open by then
    engine = engine_for([s.url for s in servers], control_timeout=5.0)
    named = [("model.embed_tokens.weight", torch.ones(2, 3))]
    transport = InProcessTransport(engine)
    try:
        with pytest.raises(EngineError, match="test: load failed"):
            transport.sync(Stream(named))
        assert not any(s.session for s in servers)  # closed: SGLang refuses every begin while one is open
        assert transport.sync(Stream(named))["tensors"] == 1
        # a session left open by another learner (one that died mid-sync): closed before this begin
        servers[0].session = True
        assert transport.sync(Stream(named))["tensors"] == 1
    finally:
        engine.shutdown()


def test_a_resume_that_moves_the_engine_ranks_is_refused_before_anything_loads(runs, monkeypatch):
    """async_update's checkpoint (step 2) holds each rank's planned prompts of step 3 (rank_state/): a resume
    driving the engine from other ranks (SGLang with one driver of two ranks) is refused with one line naming
    the change; the same checkpoint resumes with the settings that saved it (test above: sync_update)."""
    from rlpo_mega.config import ConfigError
    from rlpo_mega.training.trainer import Trainer
    from tests.workers.scenario_config import cfg

    ck = runs["async_update"]["ckpt"]
    assert os.path.isdir(os.path.join(ck, "step_00000002", "rank_state")), os.listdir(ck)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    c = cfg(str(os.path.dirname(ck)), "moved", f"checkpoint.save_dir={ck}", "checkpoint.resume=true",
            "checkpoint.overwrite=false", "rollout.engine=sglang", "rollout.sglang.drivers=1",
            "reward.function=toy_arith",  # (the run's test_parity is registered in its workers, not here)
            "rollout.sglang.urls=[http://127.0.0.1:9,http://127.0.0.1:10]", "train_iters=3")
    with pytest.raises(ConfigError, match=r"engine ranks \[0, 1\].*from ranks \[0\].*rollout.sglang.drivers=1"):
        Trainer(c)
    # the same ranks driving another server list (one server fewer: 2 drivers of 3 servers -> of 2) resume
    from types import SimpleNamespace

    from rlpo_mega.checkpoint import run as state

    for urls in ("[http://127.0.0.1:9,http://127.0.0.1:10,http://127.0.0.1:11]", "[http://127.0.0.1:9,http://127.0.0.1:10]"):
        same = cfg(str(os.path.dirname(ck)), "same", "rollout.engine=sglang", "rollout.sglang.drivers=2",
                   f"rollout.sglang.urls={urls}")
        plan = SimpleNamespace(start=state.latest_checkpoint(ck))
        Trainer._check_engine_ranks(SimpleNamespace(plan=plan, cfg=same), 2)  # no refusal


# --- a dead server costs its requests (fake servers in their own processes: tools/bench_rollout_scale.serve) ---
@pytest.fixture
def fake_servers():
    import multiprocessing as mp

    from tools.bench_rollout_scale import serve

    ctx, procs = mp.get_context("spawn"), []

    def start(count, latency=0.2, port=0):
        q = ctx.Queue()
        mine = [ctx.Process(target=serve, args=(q, 8, 4, BENCH_HF.num_hidden_layers, BENCH_HF.num_experts_per_tok,
                                                BENCH_HF.num_experts, latency, port), daemon=True)
                for _ in range(count)]
        urls = []
        for p in mine:  # one at a time: each URL is its process's
            p.start()
            urls.append(f"http://127.0.0.1:{q.get(timeout=120)}")
        procs.extend(mine)
        return mine, urls
    yield start
    for p in procs:
        p.kill()
        p.join(10)


BENCH_HF = load_hf_config(os.path.join(ROOT, "configs", "models", "qwen3_30b_a3b.json"))  # the bench's model


def _engine(urls, **kw):
    settings = dict(request_timeout=600.0, control_timeout=60.0, health_timeout=0.5, health_interval=0.25,
                    hang_timeout=600.0, max_in_flight_per_server=4)
    return SGLangEngine(SGLangEngineConfig(urls=list(urls), **{**settings, **kw}), BENCH_HF)


def _kill_after(engine, prompts, after, proc):
    """Generate one sample per prompt, SIGKILLing `proc` once `after` answers are back -> the samples."""
    out, killed = [None] * len(prompts), False
    for i, group in engine.stream(prompts, SamplingParams(max_new_tokens=4), n=1):
        out[i] = group[0]
        if not killed and sum(x is not None for x in out) >= after:
            proc.kill()
            killed = True
    return out


def test_a_dead_server_costs_its_requests_and_rejoins_after_it_answers(fake_servers):
    procs, urls = fake_servers(3)
    engine = _engine(urls)
    prompts = [[5 + i % 7] * 8 for i in range(36)]
    try:
        out = _kill_after(engine, prompts, 4, procs[0])
        # every prompt answered once (a full answer: 4 tokens, routes for every row), the dead server's on others
        assert all(s is not None and len(s.response_ids) == 4 and s.finish_reason == "length" for s in out)
        assert engine.faults["requests_resent"] >= 1 and engine.faults["servers_lost"] == 1, engine.faults
        assert [s.url for s in engine.live] == urls[1:]
        served = [sum(s.meta.server == u for s in out) for u in urls]
        assert served[0] < min(served[1:]), served  # the dead one only until the kill
        engine.refresh()  # before a sync: still dead, still out
        assert len(engine.live) == 2 and engine.faults["server_rejoins"] == 0
        fake_servers(1, port=int(urls[0].rsplit(":", 1)[1]))  # the server comes back (same address)
        engine.refresh()
        assert [s.url for s in engine.live] == urls and engine.faults["server_rejoins"] == 1
        again = engine.generate(prompts[:12], SamplingParams(max_new_tokens=4), n=1)
        assert urls[0] in {s.meta.server for s in again}  # back in the pool
    finally:
        engine.shutdown()


def test_below_min_servers_the_rollout_fails_naming_them(fake_servers):
    procs, urls = fake_servers(2)
    engine = _engine(urls, min_servers=2)
    try:
        with pytest.raises(EngineError, match=r"(dead or unreachable|min_servers)"):
            _kill_after(engine, [[5] * 8 for _ in range(24)], 2, procs[1])
    finally:
        engine.shutdown()
    with pytest.raises(EngineError, match="min_servers=3 but driver 0 drives 2 server"):
        _engine(urls, min_servers=3)


def test_min_servers_is_checked_against_each_drivers_share():
    from rlpo_mega.config import ConfigError, load_config
    from rlpo_mega.config_checks import check_run_config

    urls = "rollout.sglang.urls=[http://a:1,http://b:1,http://c:1,http://d:1]"
    c = load_config("configs/demo_cpu.yaml", ("rollout.engine=sglang", urls, "rollout.sglang.drivers=2",
                                               "rollout.sglang.min_servers=3"))
    hf = load_hf_config(os.path.join(ROOT, c.model.hf_config))
    with pytest.raises(ConfigError, match=r"min_servers=3.*between 1 and the servers of its share \(2: 4 server"):
        check_run_config(c, hf, world_size=2, nodes=1)


@contextlib.contextmanager
def failing_server(mode: str):
    """A server that accepts /generate and fails it: "500" answers 500 without an answer (its /health says 200),
    "close" sends half a body and closes, "hang" never answers (nor /health)."""
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if mode == "hang":
                release.wait(60)
            body = b"{}"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if mode == "hang":
                release.wait(60)
                return
            body = json.dumps({"error": "test: out of memory"}).encode()
            self.send_response(500 if mode == "500" else 200)
            self.send_header("Content-Length", str(len(body) + (1000 if mode == "close" else 0)))
            self.end_headers()
            self.wfile.write(body)
            if mode == "close":
                self.close_connection = True

    class Server(ThreadingHTTPServer):
        daemon_threads = True

    httpd = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("mode", ["500", "close", "hang"])
def test_a_failing_server_costs_its_requests(mode):
    """A server that answers 500, closes mid-body or hangs (no /health within hang_timeout) beside a good one:
    every sample comes from the good one, the failing one is out, the requests it held were sent again."""
    from tests.test_sglang_client import Gauge, fake_sglang

    with fake_sglang(Gauge(), delay=0.05) as (good, _, _), failing_server(mode) as bad:
        engine = engine_for([bad, good], hang_timeout=1.5, max_in_flight_per_server=4)
        try:
            t0 = time.monotonic()
            out = engine.generate([[5, 6, 7]] * 6, SamplingParams(max_new_tokens=3), n=2)
            took = time.monotonic() - t0
        finally:
            engine.shutdown()
    assert len(out) == 12 and all(s.meta.server == good and s.finish_reason == "length" for s in out)
    assert [s.url for s in engine.live] == [good] and engine.faults["servers_lost"] == 1, engine.faults
    assert engine.faults["requests_resent"] >= 1, engine.faults
    assert took < 10, took  # a hang costs hang_timeout (1.5 s) and a health poll, not request_timeout (600 s)


def test_a_server_dead_during_the_sync_leaves_the_group_at_the_retry(stubs):
    """One of two servers dies between the session's begin and its load: the sync fails (the live server's
    session closed); the guard's retry (a rebuilt engine over the same servers) finds it dead before the begin,
    leaves it out, and syncs and verifies the other."""
    servers = stubs(2)
    engine = engine_for([s.url for s in servers], control_timeout=5.0, health_timeout=0.5)
    named = [("model.embed_tokens.weight", torch.ones(2, 3))]
    answer = servers[1].answer

    def dies_at_load(path, body):
        if path == "/update_weights_from_tensor":
            threading.Thread(target=servers[1].close).start()  # gone before it answers
            time.sleep(0.5)
        return answer(path, body)
    servers[1].answer = dies_at_load
    try:
        with pytest.raises(EngineError):
            InProcessTransport(engine).sync(Stream(named))
        assert not servers[0].session  # closed after the failure
    finally:
        engine.shutdown()
    retry = engine_for([s.url for s in servers], control_timeout=5.0, health_timeout=0.5)
    try:
        assert InProcessTransport(retry).sync(Stream(named))["tensors"] == 1
        assert [s.url for s in retry.live] == [servers[0].url] and retry.faults["servers_lost"] == 1
    finally:
        retry.shutdown()


def test_a_server_hung_in_the_sync_is_left_out_of_the_rebuild_and_rejoins_once_it_answers(stubs, monkeypatch):
    """A server whose load hangs, its /health too (a stuck scheduler): the sync fails after control_timeout with
    the other server's session closed and the hung one out. The guard's rebuild (EngineSlot: a new engine over the
    same URLs) starts without it, so the retry syncs and verifies the other instead of hanging again; once it
    answers /health, a sync's refresh takes it back with the full weights."""
    servers = stubs(2)
    urls = [s.url for s in servers]
    monkeypatch.setattr(engines_module, "build_engine",
                        lambda cfg, hf: engine_for(urls, control_timeout=1.0, health_timeout=0.3))
    monkeypatch.setattr(engines_module, "make_transport", lambda cfg, engine, hf: InProcessTransport(engine))
    slot = EngineSlot(load_config(None, ("rollout.engine=sglang",)), None)
    named = [("model.embed_tokens.weight", torch.arange(6.0).reshape(2, 3))]
    servers[1].hung.set()
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="is out"):
            slot.transport.sync(Stream(named))
        assert time.monotonic() - t0 < 10 and not servers[0].session  # control_timeout (1 s) and a health poll
        slot.close()
        slot.build()  # the guard's rebuild
        assert [s.url for s in slot.engine.live] == urls[:1]
        assert slot.transport.sync(Stream(named))["tensors"] == 1  # the retry: verified on the other, no hang
        servers[1].hung.clear()
        assert slot.transport.sync(Stream(named))["tensors"] == 1  # refresh: it answers again, and rejoins
        assert [s.url for s in slot.engine.live] == urls and slot.faults["server_rejoins"] == 1, slot.faults
        assert torch.equal(servers[1].weights["model.embed_tokens.weight"], named[0][1])
    finally:
        servers[1].hung.clear()
        slot.close()


def test_async_pause_waits_on_the_control_group_not_in_the_export(tmp_path):
    """rollout.partial_rollout=false: each sync waits for the driver's running round (6 s here) while the world
    group's collectives time out after 3 s (NCCL's 30 minutes at the recipes' scale): the other rank waits for the
    pause on the gloo control group (rollout.wait_timeout), so all 3 steps train."""
    r = torchrun("async_wait.py", 2, str(tmp_path), env={"WANDB_MODE": "disabled"}, timeout=600)
    assert r["rc"] == 0 and r["steps"] == [1, 2, 3], r


def test_a_launched_server_that_died_is_relaunched_at_the_sync_and_rejoins(fake_servers):
    """A server this process launched (its handle: alive/stop/start, as launch/sglang_server.SGLangServer) dies:
    out at once; the next sync's refresh relaunches it (rollout.sglang.max_restarts) and it rejoins."""
    procs, urls = fake_servers(2)
    port = int(urls[1].rsplit(":", 1)[1])

    class Launched:  # the fake server's process as a launched server's handle
        proc = procs[1]

        def alive(self):
            return self.proc.is_alive()

        def stop(self):
            self.proc.kill()

        def start(self, timeout):
            (self.proc,), _ = fake_servers(1, port=port)

    engine = _engine(urls)
    engine.servers[1].launched = Launched()
    try:
        _kill_after(engine, [[5] * 8 for _ in range(24)], 2, procs[1])
        assert [s.url for s in engine.live] == urls[:1]
        engine.refresh()
        assert [s.url for s in engine.live] == urls and engine.servers[1].restarts == 1, engine.faults
        assert engine.faults["server_rejoins"] == 1
    finally:
        engine.servers[1].launched = None  # the fixture stops the processes
        engine.shutdown()


def test_a_failed_digest_check_fails_the_sync_and_the_retry_passes(stubs):
    """The digest check is the sync's last phase: a server whose report fails (500) fails the sync, with every
    session closed (the report's own too), and the next sync (the guard's retry) verifies both."""
    servers = stubs(2)
    servers[1].fail_reports = 1
    engine = engine_for([s.url for s in servers], control_timeout=5.0)
    named = [("model.embed_tokens.weight", torch.ones(2, 3))]
    transport = InProcessTransport(engine)
    try:
        with pytest.raises(EngineError, match="could not report its weight digests"):
            transport.sync(Stream(named))
        assert not any(s.session for s in servers)
        assert transport.sync(Stream(named))["tensors"] == 1
    finally:
        engine.shutdown()


@pytest.fixture
def world_of_one():
    """A one-process gloo group (the engine guard agrees over one), in this process; destroyed after."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield torch.distributed.group.WORLD
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("fail", ["release", "resume"])
def test_a_colocated_server_that_fails_to_release_or_resume_is_a_failed_engine(stubs, monkeypatch, world_of_one,
                                                                               fail):
    """rollout.colocate with a stub server (SGLang's release/resume semantics: a tag resumed that was not released,
    or weights loaded while released, fail): a failed release (after a rollout) or resume (of the KV cache before
    the next) is a failed engine under the guard: rebuilt, re-synced with only the weights resumed and the learner's
    state back for the sync alone, the call retried. The learner's state is back after the rollout, bit-exact."""
    from rlpo_mega.residency import Residency
    from rlpo_mega.training.colocate import HandOver
    from rlpo_mega.rollout.engines import EngineGuard

    server = stubs(1)[0]

    def relaunched(cfg, hf):  # colocated servers are the trainer's own: a rebuild stops and relaunches them, fresh
        server.released, server.weights = set(), {}
        return engine_for([server.url], control_timeout=5.0)

    monkeypatch.setattr(engines_module, "build_engine", relaunched)
    monkeypatch.setattr(engines_module, "make_transport", lambda cfg, engine, hf: InProcessTransport(engine))
    slot = EngineSlot(load_config(None, ("rollout.engine=sglang",)), None)
    learner = torch.arange(1000, dtype=torch.float32)
    kept = learner.clone()
    named = [("model.embed_tokens.weight", torch.arange(6.0).reshape(2, 3))]
    seen = []

    def sync():
        with handover.weights_out():
            seen.append(learner.untyped_storage().nbytes())  # the learner's state is back for every sync
            return slot.transport.sync(Stream(named))

    guard = EngineGuard(slot, sync, restarts=2, group=world_of_one)
    handover = HandOver(True, Residency(lambda: [learner]), world_of_one, slot, guard)
    try:
        guard.run(sync)
        assert server.released == {"kv_cache", "cuda_graph"}  # a fresh server's KV released before the first sync
        with handover.generation():
            assert learner.untyped_storage().nbytes() == 0 and not server.released
            server.calls.clear()
            if fail == "release":
                server.fail_memory = 1
        if fail == "resume":
            guard.run(sync)
            server.calls.clear()
            server.fail_memory = 1
            with handover.generation():
                assert not server.released
        assert guard.restarts == 1 and torch.equal(learner, kept)
        # failed, rebuilt (the server relaunched), re-synced, the call retried
        memory = [c for c in server.calls if "memory" in c or c == "/update_weights_from_tensor"]
        release, resume, load = "/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_tensor"
        if fail == "release":  # failed; the re-sync: all released, the weights resumed, loaded (+ the digest
            # report); the retried release: what is still held
            assert memory == [release, release, resume, load, load, release], memory
            assert server.released == {"weights", "kv_cache", "cuda_graph"}
        else:  # failed; the re-sync; the retried resume (of the KV cache: the weights are held), the rollout's release
            assert memory == [resume, release, resume, load, load, resume, release], memory
            assert server.released == {"weights", "kv_cache", "cuda_graph"}
        assert seen and all(n == 4000 for n in seen), seen
    finally:
        slot.close()



# --- rollout.partial_rollout_kv=keep: the hold's bad days (stub servers that hold: tests/workers/keep_faults.py) ---
@pytest.fixture(scope="module")
def keep_runs(tmp_path_factory):
    from tests.multi_turn_support import write_episode_data

    data = tmp_path_factory.mktemp("keep_data")
    write_episode_data(data)
    # keyed stub servers (tests/model_sglang.py: 401 without the job's key, sealed reports), as the job's are
    return torchrun("keep_faults.py", 1, str(tmp_path_factory.mktemp("keep")), str(data),
                    env={"WANDB_MODE": "disabled", "RLPO_SGLANG_KEY": "keep-faults-job-key-" + "f" * 24}, timeout=900)


def _keep_steps(r):
    return [h for h in r["history"] if "reward/mean" in h]


def test_keep_holds_every_sync_and_lets_every_hold_go(keep_runs):
    """The clean run: every step's sync held both servers (a pause each) and let them go (a continue each); the
    samples are the engine's record (tokens, log-probs, each token's version its call's weights, R3 rows)."""
    r = keep_runs["clean"]
    assert r["rc"] == 0 and r["steps"] == [1, 2, 3] and max(r["saved"]) == 3, r
    assert r["pauses"] == r["continues"] and min(r["pauses"]) >= STEPS and r["held"] == [False, False], r
    assert r["checks"]["problems"] == [] and r["checks"]["samples"] == STEPS * 8, r["checks"]
    assert r["checks"]["versions"] == [0, 1, 2], r["checks"]  # requests held across a sync ran on the next weights
    steps = _keep_steps(r)
    assert all(h["async/restarted_samples"] == 0 and h["async/engine_calls"] == 1 for h in steps), steps
    assert all(h["async/held_s"] > 0 for h in steps[1:]), steps  # every sync held a running call


def test_a_stop_while_the_servers_are_held_saves_and_lets_them_go(keep_runs):
    """A SIGTERM once step 2's sync held the servers: the sync ends, step 2 is saved, exit 75, and no server is
    left held (each pause was followed by a continue: servers the trainer does not stop serve the next run)."""
    r = keep_runs["stop"]
    assert r["rc"] == EXIT_STOPPED and r["stopped"] and max(r["saved"]) == 2 and r["steps"] == [1, 2], r
    assert r["held"] == [False, False] and r["pauses"] == r["continues"], r
    assert r["checks"]["problems"] == [], r["checks"]
    clean = keep_runs["clean"]["trained"]
    assert all(sorted(r["trained"][s]) == sorted(clean[s]) for s in r["trained"]), (r["trained"], clean)


def test_the_resumed_keep_run_trains_what_the_uninterrupted_one_trains(keep_runs):
    r, clean = keep_runs["resumed"], keep_runs["clean"]
    assert r["rc"] == 0 and r["steps"] == [3] and max(r["saved"]) == 3, r
    assert sorted(r["trained"]["3"]) == sorted(clean["trained"]["3"])
    assert r["checks"]["problems"] == [], r["checks"]


def test_a_server_dead_while_held_costs_only_its_requests(keep_runs):
    """The second server dies while held in step 1's sync: the sync goes on without it, its requests are sent
    again to the first (held too: they run on the new weights), and the run trains every step, whole groups, on
    the engine's record; the survivor is let go after every hold."""
    r = keep_runs["dead"]
    assert r["rc"] == 0 and r["steps"] == [1, 2, 3], r
    assert r["groups"] == {str(s): {"samples": 8, "whole": True} for s in range(STEPS)}, r["groups"]
    assert r["checks"]["problems"] == [] and r["checks"]["samples"] == STEPS * 8, r["checks"]
    last = _keep_steps(r)[-1]
    assert last["engine/servers_lost"] == 1 and last["engine/servers_alive"] == 1, last
    assert last["engine/requests_resent"] >= 1 and last["engine/restarts"] == 0, last
    assert r["pauses"][0] == r["continues"][0] and not r["held"][0], r
