"""Prompt sampling for RL steps: seeded shuffling per epoch, a resumable cursor, chat templates through
the tokenizer, groups of n samples per prompt (DAPO dynamic sampling over an engine's stream is the rollout side's:
rlpo_mega/rollout/dynamic_sampling.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .dataset import DataError, PromptRecord, load_prompts


@dataclass
class PromptItem:
    uid: int  # unique over the run (draw counter): the group id of this prompt's n responses
    record: PromptRecord
    input_ids: Optional[list[int]]  # None when the sampler has no tokenizer (an engine that takes text)


def render_prompt(tokenizer, prompt, chat_template: str = "auto", system_prompt: Optional[str] = None,
                  tools: Optional[list] = None) -> list[int]:
    """Token ids of a prompt: through the tokenizer's chat template (with the generation prompt) when
    chat_template is 'on', or 'auto' and the tokenizer has one; else the plain text tokenized. tools: the
    environment's tool schemas, rendered by the template (environments.environment_tools)."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template not in ("auto", "on", "off"):
        raise DataError(f"prompts.chat_template must be auto | on | off, got {chat_template!r}")
    if chat_template == "on" and not has:
        raise DataError("prompts.chat_template=on but the tokenizer has no chat template")
    if chat_template == "off" or not has:
        if tools:
            raise DataError("the environment declares tools, which only a chat template renders: use a tokenizer "
                            "with one (and prompts.chat_template auto or on)")
        if not isinstance(prompt, str):
            raise DataError("a prompt given as chat messages needs a tokenizer with a chat template "
                            "(or prompts.chat_template not 'off')")
        text = prompt if system_prompt is None else f"{system_prompt}\n{prompt}"
        return list(tokenizer(text)["input_ids"])
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    # the template already holds any BOS / role markers; adding special tokens again would double them
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class PromptSampler:
    """Endless stream of prompts: each epoch is a permutation seeded by (seed, epoch), so the order is
    reproducible and a resumed run (load_state_dict) draws exactly the prompts it would have drawn."""

    def __init__(self, records: Sequence[PromptRecord], tokenizer=None, *, seed: int = 0, shuffle: bool = True,
                 chat_template: str = "auto", system_prompt: Optional[str] = None, tools: Optional[list] = None):
        if not records:
            raise DataError("prompt sampler needs at least one record")
        self.records = list(records)
        self.tokenizer = tokenizer
        self.seed, self.shuffle = seed, shuffle
        self.chat_template, self.system_prompt, self.tools = chat_template, system_prompt, tools
        self.epoch, self.pos, self.drawn = 0, 0, 0
        self._order = self._permutation(0)

    @classmethod
    def from_config(cls, pcfg, tokenizer=None, run_seed: int = 0, tools: Optional[list] = None) -> "PromptSampler":
        if not pcfg.path:
            raise DataError("prompts.path is not set")
        records = load_prompts(pcfg.path, pcfg.format, pcfg.prompt_key, pcfg.answer_key)
        return cls(records, tokenizer, seed=run_seed if pcfg.seed is None else pcfg.seed, shuffle=pcfg.shuffle,
                   chat_template=pcfg.chat_template, system_prompt=pcfg.system_prompt, tools=tools)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.records)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_prompts(self, k: int) -> list[PromptItem]:
        out = []
        for _ in range(k):
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            rec = self.records[int(self._order[self.pos])]
            ids = None
            if self.tokenizer is not None:
                ids = render_prompt(self.tokenizer, rec.prompt, self.chat_template, self.system_prompt, self.tools)
            out.append(PromptItem(self.drawn, rec, ids))
            self.pos += 1
            self.drawn += 1
        return out

    def check_lengths(self, max_new_tokens: int, context: Optional[int], path: str = "prompts.path",
                      budget_key: str = "rollout.max_new_tokens") -> None:
        """Every prompt, rendered as the engine will see it, plus max_new_tokens fits the model's context:
        checked once, up front (else the first rollout that draws the prompt fails, hours in)."""
        if not context or self.tokenizer is None:
            return
        for rec in self.records:
            n = len(render_prompt(self.tokenizer, rec.prompt, self.chat_template, self.system_prompt, self.tools))
            if n + max_new_tokens > context:
                raise DataError(f"{path}: record {rec.index} renders to {n} prompt tokens; with {budget_key}="
                                f"{max_new_tokens} that exceeds the model's context (max_position_embeddings={context}): "
                                f"shorten or drop the prompt, or lower {budget_key}")

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "drawn": self.drawn, "seed": self.seed,
                "shuffle": self.shuffle, "num_records": len(self.records)}

    def load_state_dict(self, state: dict) -> None:
        # A different file or seed would silently make the resumed order differ from the original one.
        for key, mine in (("num_records", len(self.records)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state.get(key) != mine:
                raise DataError(f"prompt cursor was saved with {key}={state.get(key)!r} but this run has "
                                f"{key}={mine!r}: the dataset or its settings changed since the checkpoint")
        self.epoch, self.pos, self.drawn = int(state["epoch"]), int(state["pos"]), int(state["drawn"])
        self._order = self._permutation(self.epoch)


def group_ids(items: Sequence[PromptItem], n: int) -> torch.Tensor:
    """[len(items) * n] group id per sample, group-major (item 0's n samples first)."""
    return torch.tensor([it.uid for it in items], dtype=torch.long).repeat_interleave(n)
