"""Multi-turn episodes, token in and token out.

An episode is one token sequence that only grows: the prompt as rendered for a single-turn sample, then the
model's turns exactly as the engine sampled them (the closing end-of-turn token included), and between them
the observations (a tool's output, a user's reply) in the chat template's turn format. Nothing is ever
re-tokenised: the engine continues from the episode's token ids, the environment reads a turn's text only to
parse it, and an observation is the template's rendering of its messages alone (`TurnFormat`).

The learner's view (`Episode.sample`): the response is everything after the prompt; its observation and
template tokens are `obs_spans` (out of the loss; log-prob 0); the model's tokens carry the log-probs they were
sampled with. Routes (R3): row t is the routing of the forward that produced the distribution position t + 1
was sampled from, stitched across turns as a partial rollout's are (rollout/partial.py): the rows an episode
holds are kept, and a turn's answer contributes its rows from the first position the episode has none for
(the previous turn's last token, then the observation, whose rows come from this turn's prefill: the forward
the turn's tokens attended to) on. So every position is replayed with the routing it had when the tokens after
it were sampled.

The turn format (`TurnFormat`) renders an anchor conversation (a user turn and an assistant turn) with and
without the new messages and takes the difference, after checking that the template is append-only there (the
shorter render is a prefix of the longer). The anchor's assistant turn shows which token closes a model turn
(a stop token) and what the template puts after it that the model never samples (ChatML's "\\n": dropping it
at each turn boundary is verl#6501/#6921); those "bridge" tokens start every observation. A model turn that
ended otherwise (the token budget, another stop token) ends the episode: nothing is appended after a turn the
template would not have closed that way.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch

from rlpo_mega.data.dataset import DataError
from rlpo_mega.environments import Action
from rlpo_mega.rollout.base import EngineError, Sample

ANCHOR = ({"role": "user", "content": "?"}, {"role": "assistant", "content": "."})


class TurnFormat:
    """A chat template's turn format as token ids: the observation tokens of new messages."""

    def __init__(self, tokenizer, stop_token_ids: Sequence[int]):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("multi-turn episodes (environment.name) need a tokenizer with a chat template: the "
                            "observations are appended in its turn format")
        self.tokenizer = tokenizer
        self.anchor = self.render(list(ANCHOR), generation_prompt=False)
        stops = set(int(t) for t in stop_token_ids)
        ends = [i for i, t in enumerate(self.anchor) if t in stops]
        if not ends:
            raise DataError("the chat template does not close an assistant turn with a stop token "
                            f"(rollout.stop_token_ids {sorted(stops)}): a multi-turn episode could not tell where "
                            "the model's turn ends; set rollout.stop_token_ids to the template's end-of-turn token")
        self.end_id = self.anchor[ends[-1]]  # the token that closes a model turn (sampled by the model)
        self.bridge = self.anchor[ends[-1] + 1:]  # what the template puts after it (ChatML: "\n")

    def render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        # text then ids, as data.sampling.render_prompt renders the episode's prompt
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def observation(self, messages: list[dict]) -> list[int]:
        """The tokens that follow a model turn closed by `end_id`: the bridge, the messages' turns and the next
        generation prompt, exactly as the template renders them after an assistant turn."""
        full = self.render(list(ANCHOR) + list(messages), generation_prompt=True)
        if full[:len(self.anchor)] != self.anchor:
            raise DataError("the chat template is not append-only: rendering an observation after an assistant turn "
                            "changes the tokens before it, so an episode's tokens would not be what the model saw; "
                            "use a template that renders each turn independently of the ones after it")
        return self.bridge + full[len(self.anchor):]


@dataclass
class Episode:
    """One episode's token state (append only) and what it has counted."""
    prompt_ids: list[int]
    prompt_index: int
    env: object
    response: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # per piece, 0 for observations
    routes: Optional[torch.Tensor] = None  # [prompt + model-turn end - 1, layers, topk]
    has_routes: bool = False
    obs_spans: list[tuple[int, int]] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    useful_tool_calls: int = 0
    reward: float = 0.0
    correct: bool = False
    failed: bool = False
    finish: Optional[str] = None  # set when the episode is over
    meta: dict = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        """What the engine continues from."""
        return self.prompt_ids + self.response

    def add_turn(self, answer: Sample) -> list[int]:
        """Append the engine's answer to `ids` (tokens, log-probs, routes); returns the turn's tokens."""
        new = [int(t) for t in answer.response_ids]
        if list(answer.prompt_ids) != self.ids:
            raise EngineError(f"episode {self.prompt_index}: the engine answered another prompt than the episode's "
                              "tokens")
        if self.turns and (answer.routes is None) != (self.routes is None):
            raise EngineError(f"episode {self.prompt_index}: the engine returned routed experts for one turn and not "
                              "for another")
        if answer.routes is not None:
            want = len(self.ids) + len(new) - 1
            if int(answer.routes.shape[0]) != want:
                raise EngineError(f"episode {self.prompt_index}: the engine returned {answer.routes.shape[0]} routing "
                                  f"rows for {want} positions")
            held = 0 if self.routes is None else int(self.routes.shape[0])
            self.routes = answer.routes if self.routes is None else torch.cat([self.routes, answer.routes[held:]])
            self.has_routes = True
        self.response += new
        self.logprobs.append(answer.logprobs.float())
        self.turns += 1
        for k in ("weight_version", "server"):
            if k in answer.meta:
                self.meta[k] = answer.meta[k]
        return new

    def add_observation(self, ids: list[int]) -> None:
        if ids:
            self.obs_spans.append((len(self.response), len(ids)))
            self.response += ids
            self.logprobs.append(torch.zeros(len(ids)))

    def sample(self) -> Sample:
        s = Sample(list(self.prompt_ids), list(self.response), torch.cat(self.logprobs) if self.logprobs else
                   torch.zeros(0), self.finish or "stop", routes=self.routes, prompt_index=self.prompt_index,
                   meta={**self.meta, "turns": self.turns}, reward=self.reward, failed=self.failed,
                   correct=self.correct, obs_spans=tuple(self.obs_spans),
                   episode=(self.turns, self.tool_calls, self.tool_errors, self.useful_tool_calls))
        return s


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int  # model turns
    max_tokens: int  # response tokens (the model's and the observations') per episode


def _turn_seed(seed: Optional[int], turn: int) -> Optional[int]:
    return None if seed is None else (seed * 1000003 + turn) % (1 << 62)


def run_episodes(engine, items: Sequence, n: int, params, runner, fmt: TurnFormat, limits: EpisodeLimits,
                 tokenizer):
    """Yields (item index, its n episodes as samples) as each group's episodes end, in any order (the protocol of
    RolloutEngine.stream without `send`). items: (prompt ids, prompt record) pairs. The episodes' turns run in
    lockstep: one engine call for every live episode's next turn (each with its own token budget), then every
    environment step at once on the runner's threads."""
    eps = [Episode([int(t) for t in ids], i, runner.make(record)) for i, (ids, record) in enumerate(items)
           for _ in range(n)]
    open_groups = set(range(len(items)))
    try:
        turn = 0
        while open_groups:
            live = [e for e in eps if e.finish is None]
            budgets = [min(params.max_new_tokens, limits.max_tokens - len(e.response)) for e in live]
            answers: list = [None] * len(live)
            gen = engine.stream([e.ids for e in live], _with_seed(params, turn), n=1, max_new_tokens=budgets)
            try:
                for i, got in gen:
                    answers[i] = got[0]
            finally:
                gen.close()
            actions = []
            for e, a in zip(live, answers):
                new = e.add_turn(a)
                actions.append(Action(tuple(new), tokenizer.decode(new, skip_special_tokens=True), e.turns - 1))
            for e, a, (fb, why) in zip(live, answers, runner.step([e.env for e in live], actions)):
                _settle(e, a, fb, why, runner.cfg.failure_reward, fmt, limits)
            for i in sorted(open_groups):
                group = eps[i * n:(i + 1) * n]
                if all(e.finish is not None for e in group):
                    open_groups.discard(i)
                    for e in group:
                        e.env.close()
                    yield i, [e.sample() for e in group]
            turn += 1
    finally:
        for e in eps:
            if e.finish is None:
                e.env.close()


def _with_seed(params, turn: int):
    return replace(params, seed=_turn_seed(params.seed, turn))


def _settle(e: Episode, answer: Sample, fb, why: str, failure_reward: float, fmt: TurnFormat,
            limits: EpisodeLimits) -> None:
    """After a model turn and its environment step: the episode ends (finish reason set) or gets its observation."""
    if fb is None:  # the environment failed: the episode ends, flagged (counted in episode/env_failures)
        e.failed, e.reward, e.finish = True, failure_reward, answer.finish_reason
        e.meta["env_error"] = why
        return
    e.reward += float(fb.reward)
    e.tool_calls += int(fb.tool_calls)
    e.tool_errors += int(fb.tool_errors)
    e.useful_tool_calls += int(fb.useful_tool_calls)
    e.correct = bool(fb.correct)
    if fb.done:
        e.finish = answer.finish_reason
    elif answer.finish_reason != "stop":  # the turn's budget ran out (or it was aborted): truncated
        e.finish = answer.finish_reason
    elif not answer.response_ids or int(answer.response_ids[-1]) != fmt.end_id:
        e.finish = "stop"  # another stop token (e.g. an end-of-text): the model ended the episode itself
    elif e.turns >= limits.max_turns:
        e.finish = "length"  # still going after the last turn allowed: truncated, as a response at its budget
    else:
        obs = fmt.observation(fb.messages)
        if len(e.response) + len(obs) >= limits.max_tokens:  # no room for the observation and a next token
            e.finish = "length"
        else:
            e.add_observation(obs)
