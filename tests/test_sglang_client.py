"""The SGLang client at scale, without a real SGLang (fast): the per-server in-flight limit
(rollout.sglang.max_in_flight_per_server) against fake /generate servers that count what they hold at once,
and the vectorized route decoding (rlpo_mega.rollout.sglang_client) against the reference path
(moe.routing.decoders.decode_sglang + select_moe_layers). Hang and stop handling: tests/test_engine_timeouts.py."""
import base64
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from moe.model import load_hf_config
from moe.routing.decoders import decode_sglang, encode_sglang, select_moe_layers
from moe.routing.trace import RoutingTraceError, TraceSpec, validate_trace
from rlpo_mega.config import ConfigError, SGLangEngineConfig, load_config
from rlpo_mega.config_checks import check_run_config
from rlpo_mega.rollout import EngineError, RolloutInterrupted, SamplingParams
from rlpo_mega.rollout.sglang_client import IOLoop, ServerSlots, SlotsClosed, decode_routes, parse_logprobs
from rlpo_mega.rollout.sglang_engine import SGLangEngine
from rlpo_mega.weight_sync.sglang_distributed import SGLangDistributedTransport
from tests.dist import ROOT, free_port
from tests.test_engine_timeouts import engine_for, silent_server


class Gauge:
    """Requests held at once (now, most), under a lock: one per fake server, one over all of them."""

    def __init__(self):
        self.lock, self.now, self.peak = threading.Lock(), 0, 0

    def enter(self):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def leave(self):
        with self.lock:
            self.now -= 1


class AbortLog(dict):
    """{rid: routes sent} of a fake server, and its requests' waits that /abort_request ends early."""

    def __init__(self):
        super().__init__()
        self.lock, self.events, self.aborted, self.requests = threading.Lock(), {}, [], []

    def wait(self, rid, seconds: float, finishing: bool = False) -> bool:
        """Sleep `seconds` unless aborted first (and not `finishing`); True when aborted."""
        with self.lock:
            ev = self.events.setdefault(rid, threading.Event())
        if finishing:
            time.sleep(seconds)
        elif ev.wait(seconds):
            self.aborted.append(rid)
            return True
        return False

    def abort(self, rid):
        with self.lock:
            self.events.setdefault(rid, threading.Event()).set()


@contextlib.contextmanager
def fake_sglang(total: Gauge, delay=0.25, new_tokens=3, layers=2, topk=2, experts=4, first_id=10,
                finishing=lambda req: False, tokens=None):
    """A /generate server answering after `delay` s (or delay(request) s) with `new_tokens` tokens (or
    tokens(request)), their log-probs and routes over all `layers` hidden layers (SGLang's format; the rows from
    the request's routed_experts_start_len on, as SGLang); POST /abort_request {"rid"} ends that request's wait
    at once with finish_reason "abort", as SGLang does (unless finishing(request): a request whose generation
    ends anyway, answered in full). Yields (url, its Gauge, {rid: routes sent}); `sent.aborted` lists the rids
    aborted while they waited, `sent.requests` every /generate request."""
    mine, sent = Gauge(), AbortLog()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # /health
            self._send({})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/abort_request":
                sent.abort(req.get("rid"))
                return self._send({})
            if self.path != "/generate":
                return self._send({})
            mine.enter()
            total.enter()
            out = list(range(first_id, first_id + new_tokens)) if tokens is None else tokens(req)
            sent.requests.append({**req, "output_ids": out})
            stop = out and out[-1] in req["sampling_params"].get("stop_token_ids", ())
            try:
                aborted = sent.wait(req["rid"], delay(req) if callable(delay) else delay, finishing(req))
                rows = len(req["input_ids"]) + len(out) - 1 - req.get("routed_experts_start_len", 0)
                rng = np.random.default_rng(abs(hash(req["rid"])) % 2 ** 32)
                routes = torch.from_numpy(np.argsort(rng.random((rows, layers, experts)), -1)[..., :topk]
                                          .astype(np.int32))
                sent[req["rid"]] = routes
            finally:  # before the answer goes out: the client may send its next request as soon as it reads it
                mine.leave()
                total.leave()
            self._send({"output_ids": out, "meta_info": {
                "finish_reason": {"type": "abort" if aborted else "stop" if stop else "length"}, "weight_version": "w0",
                "output_token_logprobs": [[-0.5 - t / 8, 10 + t, None] for t in range(len(out))],
                "routed_experts": encode_sglang(routes)}})

    class Server(ThreadingHTTPServer):
        # the client opens up to max_in_flight_per_server connections at once; the default listen backlog (5)
        # resets some of them when the accept loop lags (a loaded machine), as SGLang's (2048) would not
        request_queue_size = 1024
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", mine, sent
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)


def test_per_server_in_flight_limit():
    """2 servers, max_in_flight_per_server=3, 20 requests: no server ever holds more than 3, both serve,
    and 6 are in flight at once; answers decode into the right samples, in prompt order."""
    total = Gauge()
    with fake_sglang(total) as (url_a, a, sent_a), fake_sglang(total) as (url_b, b, sent_b):
        engine = engine_for([url_a, url_b], max_in_flight_per_server=3)
        prompts = [[1, 2, 3 + i % 4] + [7] * (i % 3) for i in range(10)]
        out = engine.generate(prompts, SamplingParams(max_new_tokens=3), n=2)
        engine.shutdown()
    assert a.peak <= 3 and b.peak <= 3, (a.peak, b.peak)
    assert len(sent_a) > 0 and len(sent_b) > 0, (len(sent_a), len(sent_b))
    assert total.peak == 6, total.peak
    sent = {**sent_a, **sent_b}
    assert len(out) == 20 and len(sent) == 20 and {s.meta.request_id for s in out} == set(sent)
    assert [s.prompt_index for s in out] == [i for i in range(10) for _ in range(2)]
    for s in out:
        assert s.prompt_ids == prompts[s.prompt_index] and s.response_ids == [10, 11, 12]
        assert s.finish_reason == "length" and s.meta.server in (url_a, url_b)
        assert s.meta.request_id in (sent_a if s.meta.server == url_a else sent_b)
        assert s.logprobs.dtype == torch.float32
        assert torch.equal(s.logprobs, torch.tensor([-0.5, -0.625, -0.75], dtype=torch.float32))
        assert s.routes.dtype == torch.uint8 and torch.equal(s.routes.long(), sent[s.meta.request_id].long())


def test_token_ids_outside_the_vocabulary_are_one_engine_error():
    """A server of another model answers token ids the learner's embedding has no row for (on a GPU: a
    device-side assert in the next forward): one EngineError naming the id and the vocabulary, on the host."""
    with fake_sglang(Gauge(), delay=0.0, first_id=254) as (url, _, _):
        engine = engine_for(url)
        with pytest.raises(EngineError, match=r"returned token id 256 outside the model's vocabulary \[0, 256\): "
                                              r"does it serve another model"):
            engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3), n=1)
        engine.shutdown()


def test_connections_bound_their_receive_buffer(monkeypatch):
    """Each /generate connection's kernel receive buffer is bounded: a third of net.ipv4.tcp_mem's pressure
    threshold per connection in flight, within [256 KB, 2 MB] (sglang_client.receive_buffer; Linux reports twice
    what was set, capped at net.core.rmem_max); a keep-alive connection serves the next request."""
    import socket

    import rlpo_mega.rollout.sglang_client as client

    pressure = client._tcp_mem_pressure()
    assert pressure > 0  # Linux
    assert client.receive_buffer(1) == client.RECEIVE_BUFFER_MAX
    assert client.receive_buffer(10 ** 6) == client.RECEIVE_BUFFER_MIN
    assert client.receive_buffer(512) == max(client.RECEIVE_BUFFER_MIN, min(client.RECEIVE_BUFFER_MAX, pressure // 1536))
    monkeypatch.setattr(client, "_tcp_mem_pressure", lambda: 1536 << 20)  # this machine's: 1.5 GB
    assert client.receive_buffer(512) == 1 << 20  # the bench's 4 servers x 128 in flight
    engine = SGLangEngine(SGLangEngineConfig(urls=["http://127.0.0.1:1", "http://127.0.0.1:2"],
                                             max_in_flight_per_server=256),
                          load_hf_config(f"{ROOT}/configs/models/tiny_qwen3_moe.json"))
    assert engine._conns.receive_buffer == 1 << 20
    engine.shutdown()

    class KeepAlive(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    server = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    io = client.IOLoop()
    url, conns = f"http://127.0.0.1:{server.server_address[1]}", client.Connections(io, 512 << 10)

    async def post():
        status, buf, size = await conns.post(url, "/generate", b"{}", 5.0)
        return bytes(buf[:size])

    try:
        for _ in range(2):
            assert io.run(post, timeout=5.0) == b"{}"
            (conn,) = conns._idle[url]  # the same one both times
        with open("/proc/sys/net/core/rmem_max") as f:
            rmem_max = int(f.read())
        got = conn.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        assert got == 2 * min(512 << 10, rmem_max), got
    finally:
        conns.close()
        io.close()
        server.shutdown()
        server.server_close()


def test_stop_sends_nothing_more():
    """limit 1 on a hung server: one request in flight, the others wait for its slot; a stop aborts that
    one and the waiting ones are never sent."""
    with silent_server() as url:
        engine = engine_for(url, max_in_flight_per_server=1)
        generates, post = [], engine._conns.post

        def counting(url, path, *args, **kw):
            if path == "/generate":
                generates.append(path)
            return post(url, path, *args, **kw)

        engine._conns.post = counting
        t0 = time.monotonic()
        engine.should_stop = lambda: time.monotonic() - t0 > 1.0
        with pytest.raises(RolloutInterrupted, match="1 requests aborted"):
            engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4), n=3)
        time.sleep(0.5)  # time for a wrongly woken worker to send
        assert len(generates) == 1
        engine.shutdown()


def test_server_slots_least_loaded_then_round_robin():
    slots = ServerSlots(3, limit=2, start=1)
    io = IOLoop()

    def acquire():
        return io.run(slots.acquire, timeout=2.0)

    got = [acquire() for _ in range(6)]
    assert got == [1, 2, 0, 1, 2, 0] and slots.peak == [2, 2, 2]
    slots.release(2)
    assert acquire() == 2  # the only server with a free slot
    outcome = []

    async def wait_for_slot():
        try:
            outcome.append(await slots.acquire())
        except SlotsClosed:
            outcome.append("closed")

    (waiter,) = io.submit([(wait_for_slot, ())])  # every server full: it waits, and close() wakes it with SlotsClosed
    time.sleep(0.1)
    assert not waiter.done() and outcome == []
    slots.close()
    waiter.result(2)
    assert outcome == ["closed"]
    io.close()


@pytest.mark.parametrize("experts,dtype", [(64, torch.uint8), (256, torch.uint8), (300, torch.int16)])
def test_vectorized_decode_equals_reference(experts, dtype):
    hidden, k = 6, 4
    spec = TraceSpec(experts, k, (1, 3, 4))  # layers 0, 2 and 5 dense: garbage ids there, dropped
    rng = np.random.default_rng(experts)
    full = torch.from_numpy(rng.integers(0, experts, (37, hidden, k)).astype(np.int32))
    full[:, [0, 2, 5]] = -7
    payload = encode_sglang(full)
    ref = select_moe_layers(decode_sglang(payload, hidden, k), spec, hidden)
    new = decode_routes(payload, hidden, spec)
    assert new.dtype == dtype and new.shape == (37, 3, k) and torch.equal(new.long(), ref.long())
    assert torch.equal(decode_routes(payload.encode(), hidden, spec), new)  # bytes as well as str
    assert decode_routes("", hidden, spec).shape == (0, 3, k)


def test_out_of_range_ids_stay_visible():
    """Narrowing -1 (no data) or 300 to uint8 would make valid-looking ids: such traces keep int32 and
    validate_trace names them."""
    spec = TraceSpec(256, 2, (0, 1))
    rows = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [-1, 300]]], dtype=torch.int32)
    dec = decode_routes(encode_sglang(rows), 2, spec)
    assert dec.dtype == torch.int32 and torch.equal(dec, rows)
    with pytest.raises(RoutingTraceError, match="missing route"):
        validate_trace(dec, spec, 2, sample=0)


def test_corrupted_payload_raises():
    spec = TraceSpec(8, 2, (0, 1))
    good = encode_sglang(torch.zeros(3, 2, 2, dtype=torch.int32))
    with pytest.raises(RoutingTraceError, match="not valid base64"):
        decode_routes(good[:-3] + "!!!", 2, spec)
    with pytest.raises(RoutingTraceError, match="not a whole number of int32"):
        decode_routes(base64.b64encode(bytes(13)), 2, spec)
    with pytest.raises(RoutingTraceError, match="not a multiple"):
        decode_routes(encode_sglang(torch.zeros(3, 2, 2, dtype=torch.int32).reshape(-1)[:-2]), 2, spec)
    with pytest.raises(RoutingTraceError, match="MoE layer 2 is missing"):
        decode_routes(good, 2, TraceSpec(8, 2, (0, 2)))


def test_parse_logprobs():
    entries = [[-0.1, 5, None], [-2.5, 7, "x"], [-1e-9, 9, None]]
    assert torch.equal(parse_logprobs(entries), torch.tensor([float(x[0]) for x in entries], dtype=torch.float32))
    assert parse_logprobs([]).shape == (0,) and parse_logprobs(None).dtype == torch.float32


def test_config_check(monkeypatch):
    monkeypatch.chdir(ROOT)
    hf = load_hf_config(f"{ROOT}/configs/models/tiny_qwen3_moe.json")
    base = ("prompts.path=configs/data/toy_add_train.jsonl", "reward.function=toy_arith", "rollout.engine=sglang",
            "rollout.sglang.urls=[http://127.0.0.1:30000]", "rollout.sync_transport=sglang_distributed")
    assert check_run_config(load_config(None, base), hf) == []
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.max_in_flight_per_server=0 must be >= 1"):
        check_run_config(load_config(None, base + ("rollout.sglang.max_in_flight_per_server=0",)), hf)


def test_split_routes_cuts_only_the_routes_string():
    """The routes' base64 is cut out of the body before the JSON parse; a key-like text inside a string value
    (escaped quotes), null routes or a list are left to the parser."""
    from rlpo_mega.rollout.sglang_client import split_routes

    tricky = {"text": 'he wrote "routed_experts": "AAAA"', "meta_info": {"routed_experts": "AAAAAQAAAA=="}}
    for body in (json.dumps(tricky).encode(), json.dumps(tricky, separators=(",", ":")).encode()):
        rest, b64 = split_routes(body)
        assert bytes(b64) == b"AAAAAQAAAA==" and json.loads(rest) == {**tricky, "meta_info": {"routed_experts": None}}
        buf = bytearray(body) + b"garbage after the answer"
        rest2, b64b = split_routes(buf, len(body))
        assert bytes(b64b) == bytes(b64) and bytes(rest2) == rest
    for routes in (None, [[1, 2]]):
        body = json.dumps({"meta_info": {"routed_experts": routes}}).encode()
        assert split_routes(body) == (body, None)
    # a JSON escape inside ("\\/" is "/"): cut out as it stands, undone by decode_routes when base64 refuses it
    routes = torch.tensor([[[0, 1]], [[63, 62]]], dtype=torch.int32)  # 63, 62: bytes that base64 writes with "/"
    plain = base64.b64encode(routes.numpy().astype("<i4").tobytes())
    assert b"/" in plain
    escaped = b'{"meta_info": {"routed_experts": "' + plain.replace(b"/", b"\\/") + b'"}}'
    rest, b64 = split_routes(escaped)
    assert json.loads(rest) == {"meta_info": {"routed_experts": None}}
    assert torch.equal(decode_routes(b64, 1, TraceSpec(64, 2, (0,))), routes.to(torch.uint8))
    with pytest.raises(RoutingTraceError, match="not valid base64"):
        decode_routes(memoryview(b"AA\\qA"), 1, TraceSpec(64, 2, (0,)))  # an escape that is no JSON


@pytest.mark.parametrize("block", [12, 24, 36, 1 << 18])  # 1, 2 and 3 rows of 3 per block, the whole answer
def test_decode_routes_in_blocks(monkeypatch, block):
    """Base64 decoded block by block (DECODE_BLOCK bytes; 3 rows of 4 ids here make 48 bytes) equals the whole
    decode: MoE layers gathered, uint8; an id out of range in a later block gives the whole answer in int32."""
    import rlpo_mega.rollout.sglang_client as client

    monkeypatch.setattr(client, "DECODE_BLOCK", block * 4)
    spec = TraceSpec(8, 2, (1,))  # 2 hidden layers, layer 0 dense
    full = torch.rand(10, 2, 8, generator=torch.Generator().manual_seed(1)).argsort(-1)[..., :2].to(torch.int32)
    full[:, 0] = 99  # the dense layer's rows hold garbage: dropped
    dec = decode_routes(encode_sglang(full), 2, spec, tokens=10)
    assert dec.dtype == torch.uint8 and torch.equal(dec, full[:, [1]].to(torch.uint8))
    full[8, 1, 0] = -1  # no data, in the last block
    dec = decode_routes(encode_sglang(full), 2, spec, tokens=10)
    assert dec.dtype == torch.int32 and torch.equal(dec, full[:, [1]])
    assert decode_routes(encode_sglang(full[:7]), 2, spec).shape == (7, 1, 2)  # 7 rows: a short last block


def test_stdlib_fallback_decodes_the_same(monkeypatch):
    """Without orjson and pybase64 (the stdlib parsers) an answer decodes to the same sample."""
    import rlpo_mega.rollout.sglang_client as client
    import rlpo_mega.rollout.sglang_engine as sglang_engine

    total = Gauge()
    with fake_sglang(total, delay=0.0, new_tokens=5, layers=2, topk=2, experts=4) as (url, _, sent):
        engine = engine_for(url)
        fast = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=5), n=2,
                               request_ids=["a", "b", "c", "d"])
        monkeypatch.setattr(client, "b64decode", base64.b64decode)
        monkeypatch.setattr(sglang_engine, "loads", json.loads)
        slow = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=5), n=2,
                               request_ids=["a", "b", "c", "d"])
        engine.shutdown()
    for f, s in zip(fast, slow):
        assert f.response_ids == s.response_ids and torch.equal(f.logprobs, s.logprobs)
        assert torch.equal(f.routes, s.routes) and f.trace_checked and s.trace_checked
        assert torch.equal(f.routes.long(), sent[f.meta.request_id].long())


def test_a_group_goes_to_one_server():
    """n samples of a prompt are sent to the server its first sample went to (one prefix cache per prompt);
    groups are still spread over the servers."""
    total = Gauge()
    with fake_sglang(total, delay=0.05) as (url_a, _, _), fake_sglang(total, delay=0.05) as (url_b, _, _):
        engine = engine_for([url_a, url_b], max_in_flight_per_server=3)
        out = engine.generate([[1, 2, 3 + i] for i in range(8)], SamplingParams(max_new_tokens=3), n=4)
        engine.shutdown()
    by_prompt = {}
    for s in out:
        by_prompt.setdefault(s.prompt_index, set()).add(s.meta.server)
    assert all(len(v) == 1 for v in by_prompt.values()), by_prompt
    assert {next(iter(v)) for v in by_prompt.values()} == {url_a, url_b}


def test_episode_turns_go_back_to_their_server_and_ask_only_for_new_routing_rows():
    """Multi-turn episodes through the SGLang client over two servers: a prompt's n episodes start on one server,
    every turn of an episode is sent to the server that holds its prefix (the first turn's), continues from the episode's token ids, and asks only for
    the routing rows the episode lacks (routed_experts_start_len); the stitched routes are the rows each server
    sent, in order."""
    from transformers import AutoTokenizer

    import tests.multi_turn_support  # noqa: F401  (the test_script environment)
    from rlpo_mega.config import EnvironmentConfig
    from rlpo_mega.data.dataset import PromptRecord
    from rlpo_mega.environments import EnvRunner
    from rlpo_mega.rollout.episode import EpisodeLimits, TurnFormat, run_episodes

    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "configs", "tokenizers", "tiny_chatml"))
    fmt = TurnFormat(tok, (tok.eos_token_id,))
    total = Gauge()
    # every turn: two tokens (the first by request: episodes differ), then the end of the turn
    reply = lambda req: [20 + int(req["rid"].rsplit("-", 1)[1]) % 7, 21, fmt.end_id]  # noqa: E731
    with fake_sglang(total, delay=0.02, tokens=reply) as (url_a, _, sent_a), \
            fake_sglang(total, delay=0.02, tokens=reply) as (url_b, _, sent_b):
        engine = engine_for([url_a, url_b], max_in_flight_per_server=2)
        runner = EnvRunner(EnvironmentConfig(name="test_script", options={"observations": ["ab", "cd"]}))
        items = [(fmt.render([{"role": "user", "content": f"k{i}?"}], True), PromptRecord(i, f"k{i}?", None))
                 for i in range(4)]
        params = SamplingParams(max_new_tokens=8, stop_token_ids=(tok.eos_token_id,))
        out = [s for _, g in run_episodes(engine, items, 2, params, runner, fmt, EpisodeLimits(4, 400), tok)
               for s in g]
        engine.shutdown()
    served, servers = {url_a: sent_a, url_b: sent_b}, {}
    assert len(out) == 8 and {url for url, sent in served.items() if sent.requests} == {url_a, url_b}
    for s in out:
        ids = list(s.prompt_ids) + list(s.response_ids)
        assert s.episode[0] == 3 and len(s.obs_spans) == 2
        turns = [(url, r) for url, sent in served.items() for r in sent.requests
                 if r["input_ids"] + r["output_ids"] == ids[:len(r["input_ids"]) + len(r["output_ids"])]]
        turns.sort(key=lambda t: len(t[1]["input_ids"]))
        assert len(turns) == 3 and len({url for url, _ in turns}) == 1, turns  # one server for the episode
        servers.setdefault(s.prompt_index, set()).add(turns[0][0])
        held = 0
        for url, r in turns:
            assert r.get("routed_experts_start_len", 0) == held  # only the rows it lacked
            rows = served[url][r["rid"]]
            assert torch.equal(s.routes[held:held + rows.shape[0]].to(torch.int32), rows)
            held += rows.shape[0]
        assert held == s.routes.shape[0] == len(ids) - 1
    # a prompt's n episodes start on one server (its prompt cached once), the prompts spread over both
    assert all(len(v) == 1 for v in servers.values()) and len(servers) == 4, servers
    assert {next(iter(v)) for v in servers.values()} == {url_a, url_b}


def test_drivers_each_drive_their_own_servers():
    """rollout.sglang.drivers: evenly spaced driver ranks, each over its own contiguous share of the URLs (no
    server gets a request from two drivers), with its own store port and weight-update group name; a driver
    without a server is one EngineError."""
    assert SGLangEngine.ranks(load_config(None, ("rollout.sglang.drivers=4",)), 16) == [0, 4, 8, 12]
    assert SGLangEngine.ranks(load_config(None, ()), 16) == [0]
    hf = load_hf_config(f"{ROOT}/configs/models/tiny_qwen3_moe.json")
    total, port = Gauge(), free_port()
    with fake_sglang(total, delay=0.0) as (a, _, at_a), fake_sglang(total, delay=0.0) as (b, _, at_b), \
            fake_sglang(total, delay=0.0) as (c, _, at_c):
        cfg = SGLangEngineConfig(urls=[a, b, c], drivers=2, store_port=port)
        engines = [SGLangEngine(cfg, hf, driver=d) for d in (0, 1)]
        try:
            assert [[s.url for s in e.servers] for e in engines] == [[a, b], [c]]
            for d, e in enumerate(engines):
                e.generate([[1, 2, 3 + i] for i in range(4)], SamplingParams(max_new_tokens=3), n=2,
                           request_ids=[f"d{d}-{k}" for k in range(8)])
            assert [e.store().port for e in engines] == [port, port + 1]
            assert "_d1_" in SGLangDistributedTransport(engines[1]).group_name
        finally:
            for e in engines:
                e.shutdown()
    assert {r[:2] for r in (*at_a, *at_b)} == {"d0"} and {r[:2] for r in at_c} == {"d1"} and len(at_c) == 8
    with pytest.raises(EngineError, match=r"rollout\.sglang\.drivers=2 but only 1 server\(s\): driver 1 has none"):
        SGLangEngine(SGLangEngineConfig(urls=[a], drivers=2), hf, driver=1)


def test_closing_a_stream_aborts_the_rest_and_leaves_no_worker_busy():
    """stream() yields groups as they complete; leaving the loop after the first group ends every other
    request (sockets shut, nothing more sent), and shutdown() joins every worker thread."""
    total = Gauge()
    with fake_sglang(total, delay=0.3) as (url, _, sent):
        engine = engine_for(url, max_in_flight_per_server=2)
        stream = engine.stream([[1, 2, 3 + i] for i in range(6)], SamplingParams(max_new_tokens=3), n=2)
        i, group = next(stream)
        assert len(group) == 2 and all(s.prompt_index == i for s in group)
        stream.close()
        time.sleep(0.5)
        assert len(sent) <= 4, len(sent)  # the first group, plus at most one more in flight when it closed
        assert total.now == 0
        threads = list(engine._io.threads)
        engine.shutdown()
    assert threads and not any(t.is_alive() for t in threads)


def test_the_process_exits_cleanly_after_a_large_rollout():
    """Hundreds of requests at once, then the interpreter exits without engine.shutdown(): exit 0 and no
    abort ("terminate called without an active exception", exit 134, which daemon workers still running at
    exit caused), because the engine's finalizer joins its workers."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "workers", "sglang_exit.py"), "600", "48"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "samples=600" in r.stdout and "terminate called" not in r.stderr, (r.stdout, r.stderr[-2000:])


def test_bench_rollout_scale_line():
    """tools/bench_rollout_scale.py at a small size: the issue's line, exactly, and no worker left after
    the engine's shutdown."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_rollout_scale.py"), "--samples", "48",
                        "--tokens", "128", "--prompt-tokens", "64", "--servers-count", "2"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    line = re.fullmatch(r"rollout-scale: samples=48 tokens=128 servers=2 cpu_us_per_row=([0-9.]+) "
                        r"extra_bytes_per_row=(-?[0-9]+) tail_frac=([0-9.]+)", r.stdout.splitlines()[0])
    assert line, r.stdout
    assert "0 left after shutdown" in r.stdout, r.stdout


def test_dynamic_sampling_ends_the_step_when_its_groups_are_complete():
    """Streaming dynamic sampling against a server: of 10 prompts (n=2), 2 are answered all correct, 3 mixed at
    once, 3 mixed a little later (their generation ends whatever an abort says) and 2 mixed but slowly (30 s).
    The rank's share is 3 groups: the step ends as soon as 3 mixed groups are scored (long before the slow
    answers), the slow requests are aborted on the server, the mixed groups that ended meanwhile carry over to
    the next step marked with their policy version, where they are used first."""
    from rlpo_mega.data import PromptItem, PromptRecord
    from rlpo_mega.rollout.dynamic_sampling import GroupCollector

    total = Gauge()
    slow, later, all_right = {8, 9}, {5, 6, 7}, {0, 1}

    def prompt(req):
        return req["input_ids"][-1] - 100

    def delay(req):
        return 30.0 if prompt(req) in slow else 0.5 if prompt(req) in later else 0.05

    with fake_sglang(total, delay=delay, finishing=lambda req: prompt(req) in later) as (url, _, sent):
        engine = engine_for(url, max_in_flight_per_server=64)
        items = [PromptItem(i, PromptRecord(i, f"p{i}", "r"), [1, 2, 100 + i]) for i in range(10)]

        def stream(chunk, k):
            return engine.stream([it.input_ids for it in chunk], SamplingParams(max_new_tokens=3), n=2)

        def score(item, samples):  # all right, or one right and one wrong
            return [1.0, 1.0] if item.uid in all_right else [1.0, 0.0]

        chunks = iter([items])
        collector = GroupCollector(max_chunks=3, max_carry_steps=1)
        t0 = time.monotonic()
        kept, r = collector.collect(3, 5, lambda: next(chunks, []), stream, score)
        took = time.monotonic() - t0
        time.sleep(0.2)
        assert total.now == 0  # nothing left running on the server
        engine.shutdown()
    assert took < 10, took  # not the slow answers' 30 s
    assert sorted(g.item.uid for g in kept) == [2, 3, 4] and r.complete and r.tries == 1
    assert r.dropped_all_one == 2
    assert len(sent.aborted) == 4  # both samples of both slow prompts, aborted on the server
    assert r.carried_out == 3 and r.aborted == 2  # the later groups ended; the slow ones are not groups
    assert sorted(g.item.uid for g in collector.carry) == [5, 6, 7] and {g.version for g in collector.carry} == {5}
    kept2, r2 = collector.collect(3, 6, lambda: [], stream, score)
    assert r2.carried_in == 3 and sorted(g.item.uid for g in kept2) == [5, 6, 7]


@contextlib.contextmanager
def raw_http(answer):
    """A TCP server whose every connection runs answer(conn, request_number_on_it, total_so_far): raw bytes, to
    give the client what uvicorn, a proxy or a dying server can send."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    seen = {"connections": 0, "requests": 0}

    def read_request(conn) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
        while len(body) < length:
            body += conn.recv(65536)
        return True

    def serve(conn):
        with conn:
            k = 0
            while read_request(conn):
                seen["requests"] += 1
                if not answer(conn, k):
                    return
                k += 1

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            seen["connections"] += 1
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        listener.close()


def test_event_loop_client_failures_and_body_framings():
    """The one I/O loop's HTTP client (sglang_client.Connections) meets what a blocking client met: an idle
    keep-alive connection the server closed as the next request went out is retried once on a new one; a wait
    without data past its timeout is TimeoutError; a connection closed mid-body names how much arrived; bodies
    framed by Content-Length, chunks or the connection's end all read whole."""
    from rlpo_mega.rollout import sglang_client as client

    io = client.IOLoop()
    conns = client.Connections(io)

    def post(url, timeout=5.0):
        async def one():
            status, buf, size = await conns.post(url, "/generate", b'{"x": 1}', timeout)
            out = bytes(buf[:size])
            conns.buffers.give(buf)
            return status, out
        return io.run(one, timeout=10.0)

    # a server that answers one request per connection and drops the next one unanswered (uvicorn's idle close
    # racing the request): the second POST goes out on the kept connection, dies, and is sent again on a new one
    def one_per_connection(conn, k):
        if k:
            return False
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        return True

    with raw_http(one_per_connection) as (url, seen):
        assert post(url) == (200, b"{}")
        assert post(url) == (200, b"{}")
        assert seen == {"connections": 2, "requests": 3}, seen

    def framings(conn, k):
        if k == 0:  # chunked, with a trailer
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"3\r\n{\"a\r\n4;x=y\r\n\": 1\r\n1\r\n}\r\n0\r\nX-Trailer: 1\r\n\r\n")
            return True
        conn.sendall(b"HTTP/1.0 503 Busy\r\n\r\n" + b"z" * 100000)  # no length: the body ends with the connection
        return False

    with raw_http(framings) as (url, seen):
        assert post(url) == (200, b'{"a": 1}')
        assert post(url) == (503, b"z" * 100000)
        assert seen["connections"] == 1

    def silent(conn, k):
        time.sleep(3)
        return False

    with raw_http(silent) as (url, _):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no data for 0.3 s"):
            post(url, timeout=0.3)
        assert time.monotonic() - t0 < 2.0

    def cut(conn, k):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        return False

    with raw_http(cut) as (url, _):
        with pytest.raises(ConnectionResetError, match="after 10 of 100 bytes"):
            post(url)
    conns.close()
    io.close()
    assert not any(t.is_alive() for t in io.threads)
