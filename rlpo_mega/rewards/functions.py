"""Reward functions, one registry: `REWARDS.get(cfg.reward.function)`.

A per-sample function is `fn(sample, cfg) -> float`; a `@batched` one is `fn(samples, cfg) -> [float]`
(the scorer calls it on chunks, e.g. one HTTP request per chunk). Functions may raise: the scorer turns
that into the configured default reward, a per-sample flag and a count, never a stopped run.
"""
from __future__ import annotations

import json
import logging
import math
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional

from ..algorithms.registry import Registry

REWARDS: Registry = Registry("reward function")


@dataclass
class RewardInput:
    prompt: Any  # the dataset's prompt (string or chat messages), before the chat template
    response: str  # decoded response, special tokens skipped
    reference: Optional[str]  # the dataset's reference answer
    metadata: dict = field(default_factory=dict)  # the record's other fields


def batched(fn):
    fn.batched = True
    return fn


def _require_reference(sample: RewardInput) -> str:
    if sample.reference is None:
        raise ValueError("sample has no reference answer")
    return str(sample.reference)


# --- math: final answer (boxed first, else the last number/expression) checked symbolically ---------

# math-verify warns that its timeout is off; moot here, the scorer's per-call timeout bounds each call.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(lambda record: "Timeout is disabled" not in record.getMessage())

@REWARDS.register("math")
def math_reward(sample: RewardInput, cfg=None) -> float:
    """1.0 if the response's final answer equals the reference mathematically (1/2 == 0.5 == \\frac12).

    math-verify extracts \\boxed{...} with priority, else the last expression; an answer it cannot find
    or parse is wrong (0.0), not an error. Its signal-based timeouts only work in the main thread, so
    they are off here and the scorer's per-call timeout bounds the time instead.
    """
    from math_verify import parse, verify

    gold = parse(_require_reference(sample), parsing_timeout=None)
    if not gold:
        raise ValueError(f"reference answer {sample.reference!r} could not be parsed")
    answer = parse(sample.response, parsing_timeout=None)
    return float(bool(answer) and verify(gold, answer, timeout_seconds=None))


# --- exact match ------------------------------------------------------------------------------------

_WS = re.compile(r"\s+")


def _norm(text: str, ignore_case: bool) -> str:
    text = _WS.sub(" ", text).strip()
    return text.lower() if ignore_case else text


@REWARDS.register("exact_match")
def exact_match(sample: RewardInput, cfg=None) -> float:
    """Whole response == reference, up to surrounding/repeated whitespace (and case if configured)."""
    ignore_case = bool(getattr(cfg, "ignore_case", False))
    return float(_norm(sample.response, ignore_case) == _norm(_require_reference(sample), ignore_case))


# --- toy tasks of the CPU demo (tools/make_toy_data.py) ----------------------------------------------

@REWARDS.register("toy_sequence")
def toy_sequence(sample: RewardInput, cfg=None) -> float:
    """Copy / reverse / count-up tasks on short strings: fraction of positions right, over the longer of
    response and reference, so a tiny random model gets a gradient long before it is exactly right
    (1.0 only for the exact answer; dynamic sampling's all-0 / all-1 groups stay meaningful)."""
    ref, resp = _require_reference(sample).strip(), sample.response.strip()
    if not ref and not resp:
        return 1.0
    hits = sum(a == b for a, b in zip(resp, ref))
    return hits / max(len(ref), len(resp))


_INT = re.compile(r"-?\d+")


@REWARDS.register("toy_arith")
def toy_arith(sample: RewardInput, cfg=None) -> float:
    """Small-integer arithmetic: 1.0 if the first integer in the response is the reference (no answer,
    or a wrong one, is 0.0). Cheap and deterministic, unlike the symbolic math check."""
    want = int(_require_reference(sample).strip())
    m = _INT.search(sample.response)
    return float(m is not None and int(m.group()) == want)


# --- remote reward model over HTTP -------------------------------------------------------------------

class RemoteRewardError(RuntimeError):
    pass


def _retryable(err: Exception) -> bool:
    if isinstance(err, urllib.error.HTTPError):
        return err.code == 429 or err.code >= 500
    return isinstance(err, (urllib.error.URLError, TimeoutError, ConnectionError, OSError))


def _body_snippet(raw: bytes, limit: int = 200) -> str:
    text = raw.decode("utf-8", "replace")
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def parse_remote_reply(raw: bytes, n: int, url: str) -> list[float]:
    """{"rewards": [n numbers]} (a bare list is accepted too); anything else names what was wrong."""
    try:
        reply = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RemoteRewardError(f"reward server {url}: reply is not JSON ({e}): {_body_snippet(raw)}") from None
    rewards = reply.get("rewards") if isinstance(reply, dict) else reply
    if not isinstance(rewards, list):
        raise RemoteRewardError(
            f"reward server {url}: reply has no 'rewards' list (expected {{\"rewards\": [float] * {n}}}): "
            f"{_body_snippet(raw)}")
    if len(rewards) != n:
        raise RemoteRewardError(f"reward server {url}: {len(rewards)} rewards for a batch of {n}")
    bad = [i for i, r in enumerate(rewards)
           if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)]
    if bad:
        raise RemoteRewardError(
            f"reward server {url}: reward {bad[0]} is {rewards[bad[0]]!r}, not a finite number "
            f"({len(bad)} such)")
    return [float(r) for r in rewards]


@REWARDS.register("remote")
@batched
def remote_reward(samples: list[RewardInput], cfg) -> list[float]:
    """POST a JSON batch to cfg.remote.url. Connection errors, timeouts, 429 and 5xx are retried with
    exponential backoff; a 4xx or a malformed reply is not (the server would answer the same again)."""
    rcfg = cfg.remote
    if not rcfg.url:
        raise RemoteRewardError("reward.function=remote needs reward.remote.url")
    payload = json.dumps({"prompts": [s.prompt for s in samples],
                          "responses": [s.response for s in samples],
                          "references": [s.reference for s in samples]}).encode()
    last: Exception | None = None
    for attempt in range(rcfg.retries + 1):
        if attempt:
            time.sleep(rcfg.backoff * 2 ** (attempt - 1))
        req = urllib.request.Request(rcfg.url, data=payload, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=rcfg.timeout) as resp:
                raw = resp.read()
        except Exception as e:  # noqa: BLE001 - classified just below
            if isinstance(e, urllib.error.HTTPError) and not _retryable(e):
                raise RemoteRewardError(
                    f"reward server {rcfg.url}: HTTP {e.code} {e.reason}: {_body_snippet(e.read())}") from None
            if not _retryable(e):
                raise
            last = e
            continue
        return parse_remote_reply(raw, len(samples), rcfg.url)
    raise RemoteRewardError(f"reward server {rcfg.url}: no reply after {rcfg.retries + 1} attempts "
                            f"(timeout {rcfg.timeout}s): {last}")
