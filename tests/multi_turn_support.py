"""Test-only pieces of the multi-turn tests (tests/test_multi_turn.py and its workers): scripted environments
and an engine that answers with given tokens and records what it returned."""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

import torch

from rlpo_mega.environments import ENVIRONMENTS, Environment, Feedback
from rlpo_mega.rollout import Sample


STEPPING = threading.Event()


def write_episode_data(folder) -> None:
    """prompts.jsonl (16 prompts) and warmup.jsonl, whose answers close the turn: after the warm-up, episodes of
    the scripted environment run several turns."""
    with open(os.path.join(folder, "prompts.jsonl"), "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"k{i}?", "answer": "0"}) + "\n")
    with open(os.path.join(folder, "warmup.jsonl"), "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"k{i}?", "answer": "go"}) + "\n")


@ENVIRONMENTS.register("test_script")
class ScriptEnv(Environment):
    """Observation k of options["observations"] after model turn k; done after len(observations) + 1 turns
    (reward 1 on the last); options["fail"]: "raise" / "sleep" / "bad" on the turn given by options["fail_turn"]
    for the record whose prompt is options["fail_prompt"]; options["vary_reward"]: the last turn's reward is
    1, 2 or 3 by the order the episodes were made (mixed rewards in a group: non-zero advantages);
    options["step_seconds"]: every step takes that long."""
    made = 0

    def __init__(self, record, cfg):
        super().__init__(record, cfg)
        ScriptEnv.made += 1
        self.serial = ScriptEnv.made

    def step(self, action):
        o = self.cfg.options
        if self.record.prompt == o.get("fail_prompt") and action.turn == o.get("fail_turn", 0):
            if o["fail"] == "raise":
                raise RuntimeError("the tool broke")
            if o["fail"] == "sleep":
                time.sleep(5)
            if o["fail"] == "bad":
                return "not feedback"
        if o.get("step_seconds"):  # a slow tool: STEPPING is set while a step runs
            STEPPING.set()
            time.sleep(o["step_seconds"])
        obs = o.get("observations", ["x"])
        if action.turn >= len(obs):
            return Feedback(reward=1.0 + (self.serial % 3 if o.get("vary_reward") else 0), done=True, correct=True)
        return Feedback([{"role": "tool", "content": obs[action.turn]}], reward=0.25, tool_calls=1,
                        tool_errors=int(action.turn == 1))


@dataclass
class Call:
    prompt: list
    tokens: list
    routes: torch.Tensor
    logprobs: torch.Tensor


class ScriptedEngine:
    """RolloutEngine.stream's protocol with scripted answers: turn(prompt) -> the tokens to 'sample'. Routes and
    log-probs are made up per call, distinct for every (call, position), and recorded (`calls`)."""

    def __init__(self, turn, layers=2, topk=2, abort_at=None):
        self.turn, self.layers, self.topk, self.calls = turn, layers, topk, []
        self.abort_at = abort_at or {}  # call index -> tokens after which that call's answers are aborted
        self.budgets = []  # per call: the max_new_tokens asked for
        self.routes_from = []  # per call: the first routing row asked for (the rows are all returned)

    def stream(self, prompts, params, n=1, request_ids=None, max_new_tokens=None, affinity=None, routes_from=None):
        assert n == 1
        self.budgets.append(list(max_new_tokens))
        self.routes_from.append(list(routes_from))
        for i, p in enumerate(prompts):
            toks = list(self.turn(list(p)))[:max_new_tokens[i]]
            finish = "stop" if toks and toks[-1] in params.stop_token_ids else "length"
            k = len(self.calls)
            if k in self.abort_at:  # a weight update's abort: the tokens so far
                toks, finish = toks[:self.abort_at[k]], "abort"
            rows = len(p) + len(toks) - 1
            routes = (torch.arange(rows, dtype=torch.int32)[:, None, None] + 1000 * (k + 1)).expand(
                rows, self.layers, self.topk).contiguous()
            lps = -(torch.arange(len(toks), dtype=torch.float32) + 1) / (k + 2)
            self.calls.append(Call(list(p), toks, routes, lps))
            yield i, [Sample(list(p), toks, lps, finish, routes=routes)]
