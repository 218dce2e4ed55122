"""`lookup`: the multi-turn demo's task (`make demo-tools`), which only its tool can solve.

Each episode hides a random digit, drawn afresh per episode (nothing to memorise from the prompts). A model
turn "?" calls the lookup tool, whose answer (the digit) comes back as the next user turn; a turn "=d" answers
and ends the episode, reward 1 when d is the hidden digit and the episode looked it up (an unsupported answer
does not count: a guess would be right one time in ten, and on the demo's start, where the model reads the
tool wrongly, guessing paid more than the tool, so RL learned to stop calling it on some seeds). Anything else
ends the episode with reward 0. A tool call is useful when the answer that ends the episode is the digit it
returned.
"""
from __future__ import annotations

import random

from .base import ENVIRONMENTS, Environment, Feedback


@ENVIRONMENTS.register("lookup")
class Lookup(Environment):
    made = 0  # episodes made by this process: with options.seed, the draws repeat run after run

    def __init__(self, record, cfg):
        super().__init__(record, cfg)
        Lookup.made += 1
        rng = random.Random(f"{cfg.options.get('seed', 0)}/{record.index}/{Lookup.made}")
        self.digit = str(rng.randrange(10))
        self.looked = False

    def step(self, action):
        text = action.text.strip()
        if text == "?":
            self.looked = True
            return Feedback([{"role": "user", "content": self.digit}], tool_calls=1)
        right = self.looked and text == "=" + self.digit  # an answer counts only with its lookup behind it
        return Feedback(reward=float(right), done=True, correct=right, useful_tool_calls=int(right))
