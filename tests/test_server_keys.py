"""Keyed SGLang servers (issue 64, items 3 and 4), without SGLang: a stand-in server that decides every request as
SGLang 0.5.23's auth middleware does (srt/utils/auth.py: open /health*, /ready*, /metrics*; the API key on
generation and /server_info; the admin key, when set, else the API key on the control endpoints; 401 otherwise).

- every request the engine sends carries the job's key, on every path it has (generation, aborts, every control
  call, the weight update and its digest report, health);
- the key check at engine start: a server started with another key, one whose control endpoints take another
  (admin) key, and one that answers without a key are each one error at start; without a key of its own the
  engine warns and a keyed server's refusal names the variable to set;
- the hooks' reports: sealed with the job's key and checked (launch/rlpo_sglang_keys.py); a forged report -- the
  driver's TCP store returning a tampered, resealed, unsigned or replayed one -- fails the sync, where the same
  forgery passed a corrupted sync against servers without a key;
- the key shim, the launcher (log 0600, the key never on a command line or in the config), the config's checks,
  and the ranks' agreement on one key for the servers they launch.
The real servers (started as the trainer and the sbatch start them) are tests/test_sglang.py's and
tests/test_slurm.py's.
"""
from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from launch import sglang_server
from launch.sglang_server import SGLangServer
from moe.bridge.digest import DigestMismatchError, tensor_digest
from moe.model import load_hf_config
from rlpo_mega.config import ConfigError, SGLangEngineConfig, load_config
from rlpo_mega.rollout import EngineError, SamplingParams
from rlpo_mega.rollout.sglang_auth import keys_module
from rlpo_mega.rollout.sglang_checks import check_sglang
from rlpo_mega.rollout.sglang_engine import SGLangEngine
from rlpo_mega.rollout.sglang_reports import REPORT_LOADER
from rlpo_mega.weight_sync.transports import TRANSPORTS
from tests.dist import ROOT, free_port, torchrun

KEYS = keys_module()
KEY = "job-key-" + "k" * 40
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy, as the engine
OTHER = "another-key-" + "o" * 40
HF = load_hf_config(os.path.join(ROOT, "configs", "models", "tiny_qwen3_moe.json"))
OPEN = ("/health", "/ready", "/metrics")  # SGLang 0.5.23 lets these through whatever the keys (by prefix)
NORMAL = ("/generate", "/server_info")  # the API key when one is set (the admin key is not asked)
# every control endpoint the project calls (http_server.py @auth_level ADMIN_OPTIONAL): the admin key when set, else
# the API key
CONTROL = ("/abort_request", "/flush_cache", "/freeze_gc", "/update_weights_from_disk", "/update_weights_from_tensor",
           "/update_weights_from_distributed", "/init_weights_update_group", "/destroy_weights_update_group",
           "/begin_weight_update", "/end_weight_update", "/update_weight_version", "/release_memory_occupation",
           "/resume_memory_occupation", "/pause_generation", "/continue_generation")


def http_status(url: str, path: str, auth=None) -> int:
    """The HTTP status of one request to a real server: GET for /server_info, /health and /ready, else POST {}
    (a control endpoint answers 401 before it reads the body); `auth` the Authorization header, if any."""
    post = path != "/server_info" and not path.startswith(("/health", "/ready"))
    req = urllib.request.Request(url + path, data=b"{}" if post else None, method="POST" if post else "GET",
                                 headers={"Content-Type": "application/json", **({"Authorization": auth} if auth else {})})
    try:
        with _OPENER.open(req, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def sglang_allows(path: str, header, api_key, admin_key) -> bool:
    """srt/utils/auth.py decide_request_auth for the endpoints above."""
    if path.startswith(OPEN):
        return True

    def bearer(expected):
        parts = (header or "").split(" ", 1)
        return len(parts) == 2 and parts[0].lower() == "bearer" and parts[1] == expected

    if path in CONTROL:
        expected = admin_key or api_key
    else:
        expected = api_key
    return expected is None or bearer(expected)


class KeyedServer:
    """A stand-in SGLang server behind SGLang's key rules: answers what the engine asks (generation without
    routes, sessions, loads, the digest report hook sealed with its own API key as launch/rlpo_sglang_hooks.py
    does), records every request as (method, path, allowed)."""

    def __init__(self, api_key=None, admin_key=None, port: int = 0):
        self.api_key, self.admin_key = api_key, admin_key
        self.requests, self.weights, self.session = [], {}, False
        self.lock = threading.Lock()
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self, method):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}") if n else {}
                path = self.path.split("?", 1)[0]
                ok = sglang_allows(path, self.headers.get("Authorization"), srv.api_key, srv.admin_key)
                with srv.lock:
                    srv.requests.append((method, path, ok))
                status, out = (srv.answer(method, path, body) if ok else (401, {"error": "Unauthorized"}))
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def answer(self, method, path, body):
        if path == "/server_info":
            return 200, {"tp_size": 1, "disable_radix_cache": True}
        if path in ("/health", "/ready"):
            return 200, {}
        if path == "/generate":
            return 200, {"output_ids": [3, 4], "meta_info": {"finish_reason": {"type": "length"},
                                                               "output_token_logprobs": [[-0.5, 3, None],
                                                                                         [-0.7, 4, None]]}}
        if path == "/begin_weight_update":
            if self.session:
                return 400, {"success": False, "message": "a weight-update session is already open"}
            self.session = True
        if path == "/end_weight_update":
            was, self.session = self.session, False
            if not was:
                return 400, {"success": False, "message": "no session is open"}
        if path == "/update_weights_from_tensor":
            named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
            if body.get("load_format") == REPORT_LOADER:
                req = json.loads(named[0][0])
                store = torch.distributed.TCPStore(req["store"][0], int(req["store"][1]), is_master=False,
                                                   timeout=timedelta(seconds=req["timeout"]))
                report = ({"environment": {"torch": torch.__version__, "cuda": None, "nccl": None}}
                          if req.get("what") == "environment" else
                          {"digests": {n: tensor_digest(t, req["algorithm"]) for n, t in self.weights.items()}})
                store.set(req["key"], KEYS.seal(self.api_key, req["key"], report))
                return 200, {"success": True}
            self.weights.update((n, t.clone()) for n, t in named)
        return 200, {"success": True}

    def paths(self, allowed=True) -> set:
        return {p for _, p, ok in self.requests if ok == allowed}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made = []

    def make(*args, **kw):
        made.append(KeyedServer(*args, **kw))
        return made[-1]
    yield make
    for s in made:
        s.close()


def engine_for(url, **kw):
    cfg = SGLangEngineConfig(urls=[url], control_timeout=30, health_timeout=2, flush_retries=2)
    return SGLangEngine(cfg, HF, return_routes=False, **kw)


class ListStream:
    """An export stream's receiving side: one bucket, the sender's digests taken before `corrupt` (what goes out)."""

    def __init__(self, named, corrupt=None, algorithm="xxh3"):
        self.named, self.receives, self.digest_algorithm, self.bytes_sent = named, True, algorithm, 0
        self.digests = {n: tensor_digest(t, algorithm) for n, t in named}
        self.corrupt = corrupt

    def __iter__(self):
        yield [(n, self.corrupt(t) if self.corrupt else t) for n, t in self.named]


WEIGHTS = [("model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
           ("model.norm.weight", torch.ones(4))]


def _bump(t):
    return t + 1  # what a server is given after the sender's digest: a corrupted sync


# --- every request carries the key -----------------------------------------------------------------------------

def test_every_request_the_engine_sends_carries_the_job_key(servers, monkeypatch, tmp_path):
    """Against a server that refuses anything else (401), every path of the engine works: generation (keep-alive
    connections of its own client), aborts by rid and of all, every control call, a weight sync with its digest
    report, the environment report, health and readiness, the quiet close of a session."""
    monkeypatch.setenv("RLPO_SGLANG_KEY", KEY)
    srv = servers(KEY, KEY)
    e = engine_for(srv.url)
    try:
        out = e.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=2), n=2)
        assert [s.response_ids for s in out] == [[3, 4]] * 4
        e.abort(["rlpo-some-rid"])
        e.abort()
        e._abort_quietly({"rlpo-other-rid": e.servers[0]})  # the stream's aborts: the engine's own client
        e.flush_cache()
        e.pause()
        e.resume()
        e.set_weight_version("7")
        e.release_memory()
        e.resume_memory("weights")
        stats = TRANSPORTS.get("in_process")(e).sync(ListStream(WEIGHTS))  # begin, load, end, flush, digest report
        assert stats["tensors"] == 2
        e.resume_memory("kv_cache")
        assert e.environments()[srv.url]["torch"] == torch.__version__
        e.reload_from_disk(str(tmp_path))
        e.begin_weight_update()
        e.abandon_weight_update()  # the raw, quiet end
        assert e.health() and not e._gone(e.servers[0])
    finally:
        e.shutdown()
    # nothing was sent without the key but the start check's own probe (it must be refused: _check_key)
    assert srv.requests[:3] == [("GET", "/server_info", True), ("POST", "/abort_request", True),
                                ("GET", "/server_info", False)], srv.requests[:3]
    assert all(ok for _, _, ok in srv.requests[3:]), srv.requests
    used = {"/generate", "/server_info", "/health", "/ready", "/abort_request", "/flush_cache", "/pause_generation",
            "/continue_generation", "/update_weight_version", "/release_memory_occupation",
            "/resume_memory_occupation", "/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor",
            "/update_weights_from_disk"}
    assert used <= srv.paths(), used - srv.paths()


# --- the check at start ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["another key", "another admin key", "no key", "a short key"])
def test_a_server_that_does_not_take_the_job_key_is_one_error_at_start(servers, monkeypatch, case):
    monkeypatch.setenv("RLPO_SGLANG_KEY", "short" if case == "a short key" else KEY)
    srv = servers(*{"another key": (OTHER, OTHER), "another admin key": (KEY, OTHER), "no key": (None, None),
                    "a short key": (KEY, KEY)}[case])
    want = {"another key": r"refused GET /server_info with this job's key \(HTTP 401; the key in \$RLPO_SGLANG_KEY\)",
            "another admin key": r"takes this job's key for generation but refuses it on its control endpoints",
            "no key": r"answers without a key \(GET /server_info: HTTP 200\): anyone who reaches it",
            "a short key": r"the SGLang key in \$RLPO_SGLANG_KEY is shorter than 16 characters"}[case]
    with pytest.raises(EngineError, match=want) as e:
        engine_for(srv.url)
    assert len(str(e.value).splitlines()) == 1
    assert KEY not in str(e.value) and OTHER not in str(e.value)  # a key is never in an error


def test_without_a_key_the_engine_warns_and_a_keyed_server_names_the_variable(servers, monkeypatch, caplog):
    monkeypatch.delenv("RLPO_SGLANG_KEY", raising=False)
    srv = servers(KEY, KEY)
    with caplog.at_level(logging.WARNING, logger="rlpo_mega"):
        e = engine_for(srv.url)
    try:
        assert any("$RLPO_SGLANG_KEY is not set" in r.getMessage() and "answers anyone" in r.getMessage()
                   for r in caplog.records), caplog.text
        assert not srv.requests  # no probe without a key: nothing to check it with
        with pytest.raises(EngineError, match=r"refused /generate without a key \(HTTP 401\).*export its key as "
                                              r"\$RLPO_SGLANG_KEY"):
            e.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        with pytest.raises(EngineError, match=r"refused /server_info without a key"):
            e.begin_weight_update()
    finally:
        e.shutdown()


def test_a_server_not_up_at_start_is_checked_before_it_takes_part(servers, monkeypatch):
    """A server that does not answer at start is not an error there (the engine's fault handling decides); its
    key is checked before it joins a weight sync."""
    monkeypatch.setenv("RLPO_SGLANG_KEY", KEY)
    port = free_port()
    e = engine_for(f"http://127.0.0.1:{port}")
    srv = None
    try:
        assert not e.servers[0].key_checked
        srv = KeyedServer(None, None, port=port)  # a server without a key comes up there
        with pytest.raises(EngineError, match="answers without a key"):
            e.begin_weight_update()
        assert "/update_weights_from_tensor" not in srv.paths() and "/begin_weight_update" not in srv.paths()
    finally:
        e.shutdown()
        if srv is not None:
            srv.close()


# --- reports ---------------------------------------------------------------------------------------------------

def test_report_seals():
    sealed = KEYS.seal(KEY, "rlpo_reports/a", {"digests": {"w": "1"}})
    assert KEYS.unseal(KEY, "rlpo_reports/a", sealed) == {"digests": {"w": "1"}}
    env = json.loads(sealed)
    bad = {"another request's store key": ("rlpo_reports/b", sealed),  # a replay
           "tampered": ("rlpo_reports/a", json.dumps({**env, "report": json.dumps({"digests": {"w": "2"}})})),
           "another key": ("rlpo_reports/a", KEYS.seal(OTHER, "rlpo_reports/a", {"digests": {"w": "1"}})),
           "unsigned": ("rlpo_reports/a", json.dumps({"digests": {"w": "1"}})),
           "mac null": ("rlpo_reports/a", KEYS.seal(None, "rlpo_reports/a", {"digests": {"w": "1"}})),
           "not JSON": ("rlpo_reports/a", b"\xff\x00"),
           "non-ASCII mac": ("rlpo_reports/a", json.dumps({**env, "mac": "\u00e9" * 64}))}
    for what, (store_key, raw) in bad.items():
        with pytest.raises(KEYS.ReportAuthError):
            KEYS.unseal(KEY, store_key, raw)
    # servers without a key: nothing to check a report against (they answer anyone anyway)
    assert KEYS.unseal(None, "k", json.dumps({"digests": {}})) == {"digests": {}}
    assert KEYS.unseal(None, "k", KEYS.seal(None, "k", {"digests": {}})) == {"digests": {}}


class TamperingStore:
    """The driver's TCP store as another writer to its port makes it look: get() returns forge(key, genuine)."""

    def __init__(self, store, forge):
        self._store, self._forge = store, forge

    def get(self, key):
        return self._forge(key, self._store.get(key))

    def __getattr__(self, name):
        return getattr(self._store, name)


def forgeries(expected: dict, replay: list) -> dict:
    """What a forger who cannot compute the job key's HMAC can put in the driver's store for a report whose true
    digests betray a corrupted sync: each claims the sender's digests (`expected`: a pass)."""
    def claim(raw):
        env = json.loads(raw)
        report = json.loads(env["report"])
        return env, {**report, "digests": {**report["digests"], **expected}}

    def tampered(key, raw):
        env, report = claim(raw)
        return json.dumps({**env, "report": json.dumps(report, sort_keys=True)})  # the genuine HMAC kept

    return {"tampered": tampered,
            "resealed with another key": lambda key, raw: KEYS.seal(OTHER, key, claim(raw)[1]),
            "unsigned": lambda key, raw: json.dumps(claim(raw)[1]),
            "replayed": lambda key, raw: replay[0]}  # a genuine report of an earlier sync (sniffed)


def _forged_syncs_fail(engine, fails=DigestMismatchError):
    """engine: one server holding WEIGHTS. Each forgery of the report of a corrupted sync fails the sync."""
    replay = []
    genuine = TamperingStore(engine.store(), lambda key, raw: replay.append(raw) or raw)
    engine._store = genuine
    expected = {n: tensor_digest(t, "xxh3") for n, t in WEIGHTS}
    TRANSPORTS.get("in_process")(engine).sync(ListStream(WEIGHTS))  # genuine: passes (and is captured)
    for what, forge in forgeries(expected, replay).items():
        engine._store = TamperingStore(genuine._store, forge)
        with pytest.raises(fails, match=r"report fails authentication .*an HMAC with the job's key, "
                                        r"\$RLPO_SGLANG_KEY.*the sync fails") as e:
            TRANSPORTS.get("in_process")(engine).sync(ListStream(WEIGHTS, corrupt=_bump))
        assert what and KEY not in str(e.value)
    engine._store = genuine._store
    with pytest.raises(DigestMismatchError, match="mismatch"):  # the truth: the server holds other weights
        TRANSPORTS.get("in_process")(engine).sync(ListStream(WEIGHTS, corrupt=_bump))
    TRANSPORTS.get("in_process")(engine).sync(ListStream(WEIGHTS))


def test_a_forged_digest_report_fails_the_sync(servers, monkeypatch):
    monkeypatch.setenv("RLPO_SGLANG_KEY", KEY)
    srv = servers(KEY, KEY)
    e = engine_for(srv.url)
    try:
        _forged_syncs_fail(e)
        e._store = TamperingStore(e._store, lambda key, raw: json.dumps(json.loads(json.loads(raw)["report"])))
        with pytest.raises(EngineError, match="its environment report fails authentication"):
            e.environments()
    finally:
        e.shutdown()


def test_without_keys_the_same_forgery_passes_a_corrupted_sync(servers, monkeypatch):
    """What the seal stops: with servers and an engine without a key, a report claiming the sender's digests
    passes a sync that corrupted the weights (nothing can tell it from the server's)."""
    monkeypatch.delenv("RLPO_SGLANG_KEY", raising=False)
    srv = servers(None, None)
    e = engine_for(srv.url)
    try:
        expected = {n: tensor_digest(t, "xxh3") for n, t in WEIGHTS}
        e._store = TamperingStore(e.store(), forgeries(expected, [])["unsigned"])
        TRANSPORTS.get("in_process")(e).sync(ListStream(WEIGHTS, corrupt=_bump))  # passes: the forgery wins
        assert not torch.equal(srv.weights["model.norm.weight"], WEIGHTS[1][1])
    finally:
        e.shutdown()


# --- the shim, the launcher, the config -------------------------------------------------------------------------

PROBE = """\
import json, os, sys
with open(os.environ["PROBE_OUT"], "w") as f:
    json.dump({"argv": sys.argv[1:], "cmdline": open("/proc/self/cmdline").read().split("\\0")}, f)
"""


@pytest.mark.parametrize("how", ["module", "script"])
def test_the_key_shim_adds_the_key_inside_the_process(tmp_path, how):
    (tmp_path / "probe_server.py").write_text(PROBE)
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.join(ROOT, "launch")]),
           "PROBE_OUT": str(out), "RLPO_SGLANG_KEY": KEY}
    shim = ["-m", "rlpo_sglang_keys"] if how == "module" else [os.path.join(ROOT, "launch", "rlpo_sglang_keys.py")]
    r = subprocess.run([sys.executable, *shim, "probe_server", "--port", "1"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["argv"] == ["--port", "1", f"--api-key={KEY}", f"--admin-api-key={KEY}"]
    assert not any(KEY in t for t in got["cmdline"]) and "probe_server" in got["cmdline"], got["cmdline"]
    # a key that starts with "-" (a user's, or base64's) stays the flag's value for SGLang's argparse
    dash = "-" + KEY
    r = subprocess.run([sys.executable, *shim, "probe_server"], env={**env, "RLPO_SGLANG_KEY": dash},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key")
    parser.add_argument("--admin-api-key")
    parsed = parser.parse_args(json.loads(out.read_text())["argv"])
    assert parsed.api_key == parsed.admin_api_key == dash
    # a key on the command line is refused; without the variable the module runs as it is (no key)
    r = subprocess.run([sys.executable, *shim, "probe_server", "--api-key=x"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--api-key on the command line" in r.stderr and "=x" not in r.stderr, r.stderr
    env.pop("RLPO_SGLANG_KEY")
    r = subprocess.run([sys.executable, *shim, "probe_server"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(out.read_text())["argv"] == [], r.stderr


def test_the_launcher_starts_the_server_with_its_key_through_the_environment(monkeypatch, tmp_path):
    """SGLangServer: the command runs the shim (no key on it), the server's environment holds this server's key
    only (an inherited one is replaced), its log is 0600 (SGLang prints the key at start), and its own calls carry
    the key."""
    out = tmp_path / "env.json"
    real_popen = subprocess.Popen
    commands = []

    def popen(cmd, **kw):
        commands.append(cmd)
        dump = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
        return real_popen([sys.executable, "-c", dump], **kw)

    monkeypatch.setattr(sglang_server.subprocess, "Popen", popen)
    monkeypatch.setattr(SGLangServer, "wait_healthy", lambda self, timeout: self.proc.wait(30))
    monkeypatch.setenv("RLPO_SGLANG_KEY", OTHER)  # the launching process's: not this server's
    srv = KeyedServer(KEY, KEY)
    try:
        port = int(srv.url.rsplit(":", 1)[1])
        server = SGLangServer("/m", port=port, log_dir=str(tmp_path / "logs"), api_key=KEY)
        server.start(timeout=30)
        server.stop(grace=5)
    finally:
        srv.close()
    (cmd,) = commands
    assert cmd[1:4] == ["-m", "rlpo_sglang_keys", "sglang.launch_server"] and not any(KEY in t for t in cmd), cmd
    assert json.loads(out.read_text())["RLPO_SGLANG_KEY"] == KEY
    assert os.stat(server.log_path).st_mode & 0o777 == 0o600
    assert ("POST", "/freeze_gc", True) in srv.requests, srv.requests  # its own control call, keyed
    with pytest.raises(ValueError, match="server_args api_key"):
        SGLangServer("/m", server_args={"api_key": "x" * 20})


def test_the_launcher_cli_needs_the_key_in_its_environment(monkeypatch, capsys):
    monkeypatch.delenv("RLPO_SGLANG_KEY", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert sglang_server.main(["--model-path", "/m", "--port", "1"]) == 2
        assert "$RLPO_SGLANG_KEY is not set" in capsys.readouterr().err
        monkeypatch.setenv("RLPO_SGLANG_KEY", KEY)
        assert sglang_server.main(["--model-path", "/m", "--port", "1", f"--api-key={KEY}"]) == 2
        err = capsys.readouterr().err
        assert "--api-key: the server's key comes from $RLPO_SGLANG_KEY, never from a command line" in err
        assert KEY not in err
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


@pytest.mark.parametrize("override, message", [
    ("rollout.sglang.api_key_env=not-a-name", "the name of the environment variable"),
    ("rollout.sglang.server_args.api_key=abcdefghijklmnopqrstuvwxyz", "server_args.api_key: a key in the config"),
    ("rollout.sglang.server_args.admin_api_key=abcdefghijklmnopqrstuvwxyz", "server_args.admin_api_key"),
    ("rollout.sglang.server_args.tokenizer_worker_num=2", "multi-tokenizer mode checks no key")])
def test_the_config_names_the_key_never_holds_it(override, message):
    cfg = load_config(None, ("rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:30000]", override))
    with pytest.raises(ConfigError, match=message):
        check_sglang(cfg, [])


def test_ranks_agree_on_the_key_of_the_servers_they_launch():
    every = torchrun("key_agree.py", 2)
    rank0, rank1 = ({what: key for what, key in seen} for seen in every)
    made, given = rank0["built"], "rank-zero-key-" + "z" * 20
    assert made and len(made) >= 32 and rank1["built"] == made, every
    assert rank0["rebuilt"] == rank1["rebuilt"] == made  # a rebuild keeps it
    assert rank0["given"] == rank1["given"] == given  # rank 0's own, every rank's
    assert [k for what, k in every[0] if what == "launch"] == [made, made, given], every[0]  # the launcher's
