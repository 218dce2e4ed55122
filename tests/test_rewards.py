"""Reward functions on real answer strings, the scorer's failure isolation, and the remote reward model
against an HTTP server on loopback started here."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlpo_mega.algorithms.registry import UnknownNameError
from rlpo_mega.config import RemoteRewardConfig, RewardConfig, load_config
from rlpo_mega.rewards import REWARDS, RemoteRewardError, RewardInput, RewardScorer, batched


def _s(response, reference="42"):
    return RewardInput(prompt="q", response=response, reference=reference)


@pytest.mark.parametrize("response, reference, want", [
    ("The answer is $\\boxed{42}$.", "42", 1.0),  # boxed
    ("First 3 then 5, so the total is 8", "8", 1.0),  # last number
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # equal value, other form
    ("so x = 1/2", "\\frac{1}{2}", 1.0),
    ("\\boxed{41} though 42 came to mind", "42", 0.0),  # boxed wins over a later number: wrong
    ("I got 8, no wait, it is 9", "8", 0.0),  # wrong final answer
    ("The answer is \\boxed{", "42", 0.0),  # malformed
    ("I do not know.", "42", 0.0),  # missing
    ("", "42", 0.0),
])
def test_math(response, reference, want):
    assert REWARDS.get("math")(_s(response, reference)) == want


def test_exact_match():
    em = REWARDS.get("exact_match")
    assert em(_s("  Paris \n", "Paris")) == 1.0
    assert em(_s("New  York", "New York")) == 1.0  # inner whitespace normalised
    assert em(_s("paris", "Paris")) == 0.0
    assert em(_s("paris", "Paris"), RewardConfig(ignore_case=True)) == 1.0
    assert em(_s("Paris, France", "Paris")) == 0.0


def test_toy_tasks():
    seq, arith = REWARDS.get("toy_sequence"), REWARDS.get("toy_arith")
    assert seq(_s("cba", "cba")) == 1.0
    assert seq(_s("cbx", "cba")) == pytest.approx(2 / 3)
    assert seq(_s("cbaaa", "cba")) == pytest.approx(3 / 5)  # too long is penalised
    assert seq(_s("", "cba")) == 0.0
    assert arith(_s("7", "7")) == 1.0
    assert arith(_s(" 12 and more", "12")) == 1.0
    assert arith(_s("13", "12")) == 0.0
    assert arith(_s("twelve", "12")) == 0.0  # missing
    assert arith(_s("-3", "-3")) == 1.0


def test_registry_unknown_name():
    with pytest.raises(UnknownNameError, match="known: exact_match, math"):
        RewardScorer(RewardConfig(function="maths"))


def test_raising_reward_is_counted_and_run_goes_on():
    def flaky(sample, cfg):
        if sample.response == "boom":
            raise RuntimeError("reward bug")
        if sample.response == "nan":
            return float("nan")
        if sample.response == "slow":
            time.sleep(1.0)
        return 1.0

    with RewardScorer(RewardConfig(default=-1.0, timeout=0.3, num_workers=4), fn=flaky) as scorer:
        res = scorer.score([_s("ok"), _s("boom"), _s("nan"), _s("slow"), _s("ok")])
        assert res.rewards == [1.0, -1.0, -1.0, -1.0, 1.0]
        assert res.failed == [False, True, True, True, False]
        assert "RuntimeError: reward bug" in res.errors[1] and "not a finite number" in res.errors[2]
        assert "timed out" in res.errors[3]
        assert res.stats()["reward/failed"] == 3
        res2 = scorer.score([_s("boom"), _s("ok")])  # the scorer keeps working
        assert res2.rewards == [-1.0, 1.0]
        assert (scorer.total_failed, scorer.total_scored) == (4, 7)


def test_scorer_runs_concurrently():
    def slow(sample, cfg):
        time.sleep(0.2)
        return 1.0

    with RewardScorer(RewardConfig(num_workers=8), fn=slow) as scorer:
        t0 = time.perf_counter()
        assert scorer.score([_s("x")] * 8).rewards == [1.0] * 8
        assert time.perf_counter() - t0 < 1.0  # serial would take 1.6 s


def test_batched_reward_failure_marks_its_chunk():
    @batched
    def fn(samples, cfg):
        if any(s.response == "boom" for s in samples):
            raise ValueError("bad chunk")
        return [float(len(s.response)) for s in samples]

    cfg = RewardConfig(remote=RemoteRewardConfig(batch_size=2))
    with RewardScorer(cfg, fn=fn) as scorer:
        res = scorer.score([_s("a"), _s("bb"), _s("boom"), _s("c"), _s("dd")])
    assert res.rewards == [1.0, 2.0, 0.0, 0.0, 2.0]
    assert res.failed == [False, False, True, True, False]


def test_reward_config_from_yaml_overrides():
    cfg = load_config(None, ("reward.function=remote", "reward.remote.url=http://127.0.0.1:1/r",
                             "prompts.n_samples=8"))
    assert cfg.reward.function == "remote" and cfg.reward.remote.retries == 2 and cfg.prompts.n_samples == 8


# --- remote reward model on loopback ---------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    hits: dict = {}

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = len(body["responses"])
        self.hits[self.path] = self.hits.get(self.path, 0) + 1
        if self.path == "/flaky" and self.hits[self.path] <= 2:
            return self._reply(503, b"busy")
        if self.path == "/slow":
            time.sleep(0.5)
        reply = {
            "/notjson": b"<html>oops</html>",
            "/nolist": json.dumps({"score": 1}).encode(),
            "/short": json.dumps({"rewards": [1.0] * (n - 1)}).encode(),
            "/nan": json.dumps({"rewards": ["high"] * n}).encode(),
        }.get(self.path)
        if self.path == "/forbidden":
            return self._reply(403, b"no token")
        if reply is None:  # the real one: 1 if the response equals the reference
            reply = json.dumps({"rewards": [float(r == a) for r, a in zip(body["responses"], body["references"])]
                                }).encode()
        self._reply(200, reply)

    def _reply(self, code, data):
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # /slow: the client timed out and left
            pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _remote(url, **kw):
    kw = {"timeout": 0.2, "retries": 2, "backoff": 0.01, "batch_size": 3, **kw}
    return RewardConfig(function="remote", remote=RemoteRewardConfig(url=url, **kw))


def test_remote_ok_batched(server):
    samples = [_s("7", "7"), _s("8", "7"), _s("x", "x"), _s("1", "2"), _s("5", "5")]
    with RewardScorer(_remote(server + "/ok")) as scorer:
        res = scorer.score(samples)
    assert res.rewards == [1.0, 0.0, 1.0, 0.0, 1.0] and res.num_failed == 0
    assert _Handler.hits["/ok"] == 2  # two requests of up to 3 samples


def test_remote_retries_then_succeeds(server):
    assert REWARDS.get("remote")([_s("7", "7")], _remote(server + "/flaky")) == [1.0]
    assert _Handler.hits["/flaky"] == 3


@pytest.mark.parametrize("path, msg", [
    ("/notjson", "reply is not JSON"),
    ("/nolist", "reply has no 'rewards' list"),
    ("/short", "1 rewards for a batch of 2"),
    ("/nan", "reward 0 is 'high', not a finite number"),
    ("/forbidden", "HTTP 403"),
])
def test_remote_bad_reply_is_a_clear_error(server, path, msg):
    fn = REWARDS.get("remote")
    with pytest.raises(RemoteRewardError, match=msg) as e:
        fn([_s("a"), _s("b")], _remote(server + path))
    assert server + path in str(e.value)


def test_remote_timeout_and_dead_server(server):
    t0 = time.perf_counter()
    with pytest.raises(RemoteRewardError, match="no reply after 2 attempts"):
        REWARDS.get("remote")([_s("a")], _remote(server + "/slow", retries=1))
    assert time.perf_counter() - t0 < 1.0
    # a dead server inside the scorer: every sample flagged with the default, the run goes on
    with RewardScorer(_remote("http://127.0.0.1:9/r", retries=0)) as scorer:
        res = scorer.score([_s("a"), _s("b")])
    assert res.failed == [True, True] and "RemoteRewardError" in res.errors[0]
