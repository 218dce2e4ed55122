"""Prompt sampling for RL steps: seeded shuffling per epoch, a resumable cursor, chat templates through
the tokenizer, groups of n samples per prompt, and DAPO dynamic sampling streamed per engine rank
(GroupCollector: chunks, a group filtered as its last sample arrives, surplus carried over).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
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


# --- DAPO dynamic sampling, streamed ---------------------------------------------------------------------

@dataclass
class Group:
    """One prompt's n scored samples, and the policy version (the step) whose weights sampled them."""
    item: PromptItem
    samples: list[Any]
    scores: list[float]
    version: int


@dataclass
class DynamicSamplingReport:
    """What one engine rank's dynamic sampling did in a step (summed over ranks by the producer)."""
    target_groups: int
    groups_kept: int = 0
    tries: int = 0  # chunks submitted
    prompts_drawn: int = 0
    dropped_all_zero: int = 0
    dropped_all_one: int = 0
    dropped_other_constant: int = 0
    aborted: int = 0  # groups submitted but not complete when the rank's share was (aborted or never sent)
    carried_in: int = 0  # groups of earlier steps trained on now
    carried_out: int = 0  # surplus groups kept for later steps
    carry_stale: int = 0  # carried groups dropped: older than max_carry_steps policy versions
    surplus_dropped: int = 0  # surplus groups not carried (max_carry_steps = 0)

    FIELDS = ("target_groups", "groups_kept", "tries", "prompts_drawn", "dropped_all_zero", "dropped_all_one",
              "dropped_other_constant", "aborted", "carried_in", "carried_out", "carry_stale", "surplus_dropped")

    @property
    def complete(self) -> bool:
        return self.groups_kept >= self.target_groups

    def counts(self) -> list[int]:
        return [getattr(self, k) for k in self.FIELDS]

    def stats(self) -> dict:
        out = {f"dynamic_sampling/{k}": getattr(self, k) for k in self.FIELDS if k != "target_groups"}
        out["dynamic_sampling/complete"] = int(self.complete)
        out["dynamic_sampling/kept"] = self.groups_kept
        out["dynamic_sampling/dropped"] = self.dropped_all_zero + self.dropped_all_one + self.dropped_other_constant
        return out


def judge_group(scores: Sequence[float], report: DynamicSamplingReport) -> bool:
    """DAPO's filter on one group: kept when its scores are not all equal; a dropped group is counted by kind."""
    f = filter_groups(torch.tensor(scores), torch.zeros(len(scores), dtype=torch.long))
    report.dropped_all_zero += f.dropped_all_zero
    report.dropped_all_one += f.dropped_all_one
    report.dropped_other_constant += f.dropped_other_constant
    return bool(f.kept_groups)


# stream(items, chunk index) -> a generator of (item index, its n samples) as groups complete, that accepts
# send("finish") (rlpo_mega.rollout.RolloutEngine.stream); score(item, samples) -> their n scores
Stream = Callable[[list[PromptItem], int], Any]
Score = Callable[[PromptItem, list[Any]], Sequence[float]]


class GroupCollector:
    """One engine rank's DAPO dynamic sampling, streamed (no whole-batch tries). Per step it fills `quota`
    groups whose n scores are not all equal:

    1. groups carried from earlier steps first, unless more than `max_carry_steps` policy versions old (dropped);
    2. then chunks of prompts (`draw()`), each submitted at once; every group is scored and filtered as its last
       sample arrives; once the quota is full the stream is told to finish: nothing more is sent, running
       requests are aborted;
    3. complete groups with mixed scores beyond the quota (those that end while the rest is aborted, or the rest
       of an engine that answers a chunk at once) are carried to the next step, marked with their version.

    At most `max_chunks` chunks per step: a short step is the caller's to handle. State (carried groups)
    changes only when a step's collection succeeds, so an engine failure retried by the caller loses nothing."""

    def __init__(self, max_chunks: int = 3, max_carry_steps: int = 1):
        if max_chunks < 1 or max_carry_steps < 0:
            raise ValueError(f"need max_chunks >= 1 and max_carry_steps >= 0; got {max_chunks}, {max_carry_steps}")
        self.max_chunks, self.max_carry_steps = max_chunks, max_carry_steps
        self.carry: list[Group] = []

    def collect(self, quota: int, version: int, draw: Callable[[], list[PromptItem]], stream: Stream,
                score: Score, timer=None) -> tuple[list[Group], DynamicSamplingReport]:
        report = DynamicSamplingReport(quota)
        kept, carry = [], []
        for g in self.carry:
            if version - g.version > self.max_carry_steps:
                report.carry_stale += 1
            elif len(kept) < quota:
                kept.append(g)
                report.carried_in += 1
            else:
                carry.append(g)
        while len(kept) < quota and report.tries < self.max_chunks:
            items = draw()
            if not items:
                break
            report.tries += 1
            report.prompts_drawn += len(items)
            ended = self._chunk(items, stream(items, report.tries - 1), quota, version, score, kept, carry, report,
                                timer)
            report.aborted += len(items) - ended
        report.groups_kept = len(kept)
        self.carry = carry
        return kept, report

    def _chunk(self, items, gen, quota, version, score, kept, carry, report, timer) -> int:
        """Run one chunk's stream; returns the number of groups that ended complete."""
        ended, msg = 0, None
        timer = timer or (lambda phase: nullcontext())
        try:
            while True:
                try:
                    with timer("rollout"):
                        i, samples = gen.send(msg)
                except StopIteration:
                    return ended
                msg = None
                if any(s.finish_reason == "abort" for s in samples):  # cut short by the finish: not a group
                    continue
                ended += 1
                with timer("reward"):
                    scores = [float(x) for x in score(items[i], samples)]
                if not judge_group(scores, report):
                    continue
                g = Group(items[i], samples, scores, version)
                if len(kept) < quota:
                    kept.append(g)
                    if len(kept) == quota:
                        if not self.max_carry_steps:  # no surplus wanted: end everything now
                            return ended
                        msg = "finish"
                elif self.max_carry_steps > 0:
                    carry.append(g)
                    report.carried_out += 1
                else:
                    report.surplus_dropped += 1
        finally:
            gen.close()
