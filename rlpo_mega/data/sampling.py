"""Prompt sampling for RL steps: seeded shuffling per epoch, a resumable cursor, chat templates through
the tokenizer, groups of n samples per prompt, and DAPO dynamic sampling's over-sample/refill loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..algorithms.dynamic_sampling import filter_groups
from .dataset import DataError, PromptRecord, load_prompts


@dataclass
class PromptItem:
    uid: int  # unique over the run (draw counter): the group id of this prompt's n responses
    record: PromptRecord
    input_ids: Optional[list[int]]  # None when the sampler has no tokenizer (an engine that takes text)


def render_prompt(tokenizer, prompt, chat_template: str = "auto", system_prompt: Optional[str] = None) -> list[int]:
    """Token ids of a prompt: through the tokenizer's chat template (with the generation prompt) when
    chat_template is 'on', or 'auto' and the tokenizer has one; else the plain text tokenized."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template not in ("auto", "on", "off"):
        raise DataError(f"prompts.chat_template must be auto | on | off, got {chat_template!r}")
    if chat_template == "on" and not has:
        raise DataError("prompts.chat_template=on but the tokenizer has no chat template")
    if chat_template == "off" or not has:
        if not isinstance(prompt, str):
            raise DataError("a prompt given as chat messages needs a tokenizer with a chat template "
                            "(or prompts.chat_template not 'off')")
        text = prompt if system_prompt is None else f"{system_prompt}\n{prompt}"
        return list(tokenizer(text)["input_ids"])
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # the template already holds any BOS / role markers; adding special tokens again would double them
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class PromptSampler:
    """Endless stream of prompts: each epoch is a permutation seeded by (seed, epoch), so the order is
    reproducible and a resumed run (load_state_dict) draws exactly the prompts it would have drawn."""

    def __init__(self, records: Sequence[PromptRecord], tokenizer=None, *, seed: int = 0, shuffle: bool = True,
                 chat_template: str = "auto", system_prompt: Optional[str] = None):
        if not records:
            raise DataError("prompt sampler needs at least one record")
        self.records = list(records)
        self.tokenizer = tokenizer
        self.seed, self.shuffle = seed, shuffle
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.epoch, self.pos, self.drawn = 0, 0, 0
        self._order = self._permutation(0)

    @classmethod
    def from_config(cls, pcfg, tokenizer=None, run_seed: int = 0) -> "PromptSampler":
        if not pcfg.path:
            raise DataError("prompts.path is not set")
        records = load_prompts(pcfg.path, pcfg.format, pcfg.prompt_key, pcfg.answer_key)
        return cls(records, tokenizer, seed=run_seed if pcfg.seed is None else pcfg.seed, shuffle=pcfg.shuffle,
                   chat_template=pcfg.chat_template, system_prompt=pcfg.system_prompt)

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
                ids = render_prompt(self.tokenizer, rec.prompt, self.chat_template, self.system_prompt)
            out.append(PromptItem(self.drawn, rec, ids))
            self.pos += 1
            self.drawn += 1
        return out

    def check_lengths(self, max_new_tokens: int, context: Optional[int], path: str = "prompts.path") -> None:
        """Every prompt, rendered as the engine will see it, plus max_new_tokens fits the model's context:
        checked once, up front (else the first rollout that draws the prompt fails, hours in)."""
        if not context or self.tokenizer is None:
            return
        for rec in self.records:
            n = len(render_prompt(self.tokenizer, rec.prompt, self.chat_template, self.system_prompt))
            if n + max_new_tokens > context:
                raise DataError(f"{path}: record {rec.index} renders to {n} prompt tokens; with rollout.max_new_tokens="
                                f"{max_new_tokens} that exceeds the model's context (max_position_embeddings={context}): "
                                "shorten or drop the prompt, or lower rollout.max_new_tokens")

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


# --- DAPO dynamic sampling ------------------------------------------------------------------------------

@dataclass
class DynamicSamplingReport:
    target_groups: int
    groups_kept: int = 0
    tries: int = 0
    prompts_drawn: int = 0
    dropped_all_zero: int = 0
    dropped_all_one: int = 0
    dropped_other_constant: int = 0

    @property
    def complete(self) -> bool:
        return self.groups_kept >= self.target_groups

    def stats(self) -> dict:
        return {f"dynamic_sampling/{k}": v for k, v in (
            ("tries", self.tries), ("prompts_drawn", self.prompts_drawn), ("groups_kept", self.groups_kept),
            ("dropped_all_zero", self.dropped_all_zero), ("dropped_all_one", self.dropped_all_one),
            ("dropped_other_constant", self.dropped_other_constant), ("complete", int(self.complete)))}


@dataclass
class GroupBatch:
    items: list[PromptItem]  # kept prompts
    samples: list[Any]  # their rollouts, group-major, n per prompt
    scores: torch.Tensor  # [len(items) * n]
    report: DynamicSamplingReport
    n: int = 1
    group_ids: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.group_ids = group_ids(self.items, self.n)


Rollout = Callable[[list[PromptItem]], "tuple[torch.Tensor, list[Any]]"]


def collect_groups(sampler: PromptSampler, rollout: Rollout, target_groups: int, n: int, *,
                   enabled: bool = True, max_tries: int = 3, oversample: float = 1.0) -> GroupBatch:
    """Fill a step with `target_groups` prompts whose n responses do not all score the same.

    rollout(items) generates and scores n responses per item and returns (scores [len(items) * n],
    samples) group-major. Each try draws ceil(missing * oversample) prompts; groups with constant scores
    (accuracy 0 or 1) are dropped by algorithms.dynamic_sampling.filter_groups. After max_tries the
    batch may be short (report.complete is False): the caller decides whether to train on it. Extra
    groups beyond the target are discarded, as in DAPO. Disabled: one try of exactly target_groups.
    """
    if target_groups < 1 or n < 1 or max_tries < 1 or oversample < 1.0:
        raise ValueError(f"need target_groups, n, max_tries >= 1 and oversample >= 1; got {target_groups}, "
                         f"{n}, {max_tries}, {oversample}")
    report = DynamicSamplingReport(target_groups)
    items_kept, samples_kept, scores_kept = [], [], []
    for _ in range(max_tries if enabled else 1):
        missing = target_groups - len(items_kept)
        items = sampler.next_prompts(math.ceil(missing * oversample) if enabled else missing)
        scores, samples = rollout(items)
        scores = torch.as_tensor(scores, dtype=torch.float32).flatten()
        if scores.numel() != len(items) * n or len(samples) != len(items) * n:
            raise ValueError(f"rollout returned {scores.numel()} scores and {len(samples)} samples for "
                             f"{len(items)} prompts x n={n}")
        report.tries += 1
        report.prompts_drawn += len(items)
        if enabled:
            f = filter_groups(scores, group_ids(items, n))
            report.dropped_all_zero += f.dropped_all_zero
            report.dropped_all_one += f.dropped_all_one
            report.dropped_other_constant += f.dropped_other_constant
            keep = f.keep.view(len(items), n)[:, 0].tolist()  # constant within a group
        else:
            keep = [True] * len(items)
        for j, item in enumerate(items):
            if keep[j] and len(items_kept) < target_groups:
                items_kept.append(item)
                samples_kept += samples[j * n:(j + 1) * n]
                scores_kept.append(scores[j * n:(j + 1) * n])
        if len(items_kept) >= target_groups:
            break
    report.groups_kept = len(items_kept)
    scores_out = torch.cat(scores_kept) if scores_kept else torch.zeros(0)
    return GroupBatch(items_kept, samples_kept, scores_out, report, n)
