"""Continuous against lockstep episode turns (environment.turns), side by side in one run.

A step of 32 multi-turn episodes (8 prompts x 4) through rollout/episode.run_episodes with the real turn format
(configs/tokenizers/tiny_chatml) and environment runner; one tool call in eight takes SLOW_S (1 s), the others
return at once. The engine stands in for an SGLang server with continuous batching: an engine call takes CALL_S
whatever it carries, and answers each episode's turn with a few tokens closed by the end-of-turn token. Three
modes: lockstep; continuous, each returned turn sent with the next call; continuous into the running call (the
engine `takes_more`, as SGLangEngine: a Feed; each request answered CALL_S after it was sent, whenever that is).
Printed per mode: the step's wall time, the engine's busy fraction (the time with a call running, over the wall
time) and the number of engine calls; and the ratios of the wall times to lockstep's.

    python tools/bench_episodes.py [--slow-s 1.0] [--call-s 0.05] [--repeats 2]
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import os
import sys
import threading
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import AutoTokenizer  # noqa: E402

from rlpo_mega.config import EnvironmentConfig  # noqa: E402
from rlpo_mega.data.dataset import PromptRecord  # noqa: E402
from rlpo_mega.environments import ENVIRONMENTS, EnvRunner  # noqa: E402
from rlpo_mega.environments.base import Environment, Feedback  # noqa: E402
from rlpo_mega.rollout import Sample, SamplingParams  # noqa: E402
from rlpo_mega.rollout.base import Feed  # noqa: E402
from rlpo_mega.rollout.episode import EpisodeLimits, TurnFormat, run_episodes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS, N, TURNS = 8, 4, 4


@ENVIRONMENTS.register("bench_slow_tool")
class SlowTool(Environment):
    """A tool answer after each model turn, done after TURNS turns; the call of (prompt, episode, turn) sleeps
    options["slow_s"] when its hash falls in one eighth (the same calls are slow in both modes)."""
    made = 0

    def __init__(self, record, cfg):
        super().__init__(record, cfg)
        SlowTool.made += 1
        self.serial = SlowTool.made

    def step(self, action):
        if zlib.crc32(f"{self.serial % (PROMPTS * N)}:{action.turn}".encode()) % 8 == 0:
            time.sleep(self.cfg.options["slow_s"])
        if action.turn + 1 >= TURNS:
            return Feedback(reward=1.0, done=True, correct=True)
        return Feedback([{"role": "tool", "content": "ok"}], reward=0.0, tool_calls=1)


class TimedEngine:
    """RolloutEngine.stream's protocol: every call takes call_s, each answer a few tokens closed by end_id."""

    def __init__(self, call_s: float, end_id: int, word: list[int]):
        self.call_s, self.end_id, self.word = call_s, end_id, word
        self.busy, self.calls = 0.0, 0

    def answer(self, prompt, budget: int) -> list[Sample]:
        toks = (self.word + [self.end_id])[:budget]
        return [Sample(list(prompt), toks, torch.full((len(toks),), -0.5), "stop")]

    def stream(self, prompts, params, n=1, request_ids=None, max_new_tokens=None, affinity=None, routes_from=None):
        t0 = time.perf_counter()
        time.sleep(self.call_s)
        self.busy += time.perf_counter() - t0
        self.calls += 1
        for i, p in enumerate(prompts):
            yield i, self.answer(p, max_new_tokens[i])


class FedEngine(TimedEngine):
    """A running call takes prompts as they come (a Feed, as SGLangEngine's stream): each request is answered
    call_s after it was sent; busy while any request runs."""
    takes_more = True

    def stream(self, prompts, params, n=1, request_ids=None, max_new_tokens=None, affinity=None, routes_from=None,
               more=None):
        self.calls += 1
        due, count, woken = [], itertools.count(), threading.Event()
        if more is not None:
            more.woken = woken.set

        def send(ps, budgets):
            now = time.perf_counter()
            if not due:  # the engine turns busy
                self.since = now
            for p, b in zip(ps, budgets):
                heapq.heappush(due, (now + self.call_s, next(count), p, b))

        send(prompts, max_new_tokens)
        while due or (more is not None and more.waiting()):
            got = more.take() if more is not None else []
            if got is None:  # a weight update stops the sending
                more = None
            elif got:
                send([g[0] for g in got], [g[1] for g in got])
            now = time.perf_counter()
            if due and due[0][0] <= now:
                _, i, p, b = heapq.heappop(due)
                if not due:  # idle until the next request
                    self.busy += now - self.since
                yield i, self.answer(p, b)
                continue
            woken.wait(min(due[0][0] - now, Feed.POLL_S) if due else Feed.POLL_S)
            woken.clear()


def one(mode: str, slow_s: float, call_s: float) -> dict:
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "configs", "tokenizers", "tiny_chatml"))
    fmt = TurnFormat(tok, (tok.eos_token_id,))
    cfg = EnvironmentConfig(name="bench_slow_tool", max_turns=TURNS, max_tokens=400, num_workers=32, turns=mode,
                            options={"slow_s": slow_s})
    engine = (FedEngine if mode == "continuous_fed" else TimedEngine)(
        call_s, fmt.end_id, tok("look", add_special_tokens=False)["input_ids"])
    items = [(fmt.render([{"role": "user", "content": f"q{i}?"}], True), PromptRecord(i, f"q{i}?", None))
             for i in range(PROMPTS)]
    SlowTool.made = 0
    t0 = time.perf_counter()
    groups = dict(run_episodes(engine, items, N, SamplingParams(max_new_tokens=8, stop_token_ids=(fmt.end_id,)),
                               EnvRunner(cfg), fmt, EpisodeLimits(TURNS, 400), tok, continuous=mode != "lockstep"))
    wall = time.perf_counter() - t0
    turns = [s.meta.turns for g in groups.values() for s in g]
    assert len(turns) == PROMPTS * N and set(turns) == {TURNS}, turns
    return {"wall_s": wall, "busy": engine.busy / wall, "calls": engine.calls}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slow-s", type=float, default=1.0)
    ap.add_argument("--call-s", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    best = {}
    for _ in range(a.repeats):
        for mode in ("lockstep", "continuous", "continuous_fed"):
            r = one(mode, a.slow_s, a.call_s)
            if mode not in best or r["wall_s"] < best[mode]["wall_s"]:
                best[mode] = r
    print(f"{PROMPTS * N} episodes x {TURNS} turns, 1 tool call in 8 takes {a.slow_s} s, an engine call {a.call_s} s "
          f"(best of {a.repeats})")
    print("| turns | step wall | engine busy | engine calls |\n|---|---|---|---|")
    for mode, r in best.items():
        print(f"| {mode} | {r['wall_s']:.2f} s | {100 * r['busy']:.0f}% | {r['calls']} |")
    for mode in ("continuous", "continuous_fed"):
        print(f"{mode} / lockstep wall time: {best[mode]['wall_s'] / best['lockstep']['wall_s']:.2f}")
    fed, cont = best["continuous_fed"]["wall_s"], best["continuous"]["wall_s"]
    print(f"continuous_fed / continuous wall time: {fed / cont:.2f}")


if __name__ == "__main__":
    main()
