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

import queue
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch

from rlpo_mega.data.dataset import DataError
from rlpo_mega.environments import Action
from rlpo_mega.rollout.base import EngineError, Feed, Sample, SampleMeta, drive
from rlpo_mega.rollout.partial import continuable, merge_spans, tag, versions_of

ANCHOR = ({"role": "user", "content": "?"}, {"role": "assistant", "content": "."})
# continuous turns: once the first environment step is back, how long a call waits for the others still running
# before it starts (steps that return together join one call; a slow one is not waited for)
GATHER_S = 0.02


class TurnFormat:
    """A chat template's turn format as token ids: the observation tokens of new messages."""

    def __init__(self, tokenizer, stop_token_ids: Sequence[int], tools: Optional[list] = None):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("multi-turn episodes (environment.name) need a tokenizer with a chat template: the "
                            "observations are appended in its turn format")
        self.tokenizer, self.tools = tokenizer, tools
        self.anchor = self.render(list(ANCHOR), generation_prompt=False)
        if tools and self.anchor == self.render(list(ANCHOR), generation_prompt=False, tools=None):
            raise DataError("the environment declares tools but the chat template does not render them (`tools=`): "
                            "the model would never see their schemas; use a template that renders tools")
        stops = set(int(t) for t in stop_token_ids)
        opened = self.render([ANCHOR[0]], generation_prompt=True)  # up to where the model's turn starts
        start = next((i for i, (a, b) in enumerate(zip(opened, self.anchor)) if a != b), min(len(opened),
                                                                                            len(self.anchor)))
        ends = [i for i, t in enumerate(self.anchor) if t in stops and i >= start]
        if not ends:  # no stop token after the assistant's content (a GLM-4.5-style template opens the next turn
            # with the stop token instead: not supported yet)
            raise DataError("the chat template does not close an assistant turn with a stop token "
                            f"(rollout.stop_token_ids {sorted(stops)}) after the turn's content: a multi-turn episode "
                            "could not tell where the model's turn ends; set rollout.stop_token_ids to the template's "
                            "end-of-turn token (templates whose next turn's opening token ends the model's turn, as "
                            "GLM-4.5's <|observation|>, are not supported yet)")
        self.end_id = self.anchor[ends[-1]]  # the token that closes a model turn (sampled by the model)
        self.bridge = self.anchor[ends[-1] + 1:]  # what the template puts after it (ChatML: "\n")

    def render(self, messages: list[dict], generation_prompt: bool, tools="same") -> list[int]:
        # text then ids, with the run's tools, as data.sampling.render_prompt renders the episode's prompt
        text = self.tokenizer.apply_chat_template(messages, tools=self.tools if tools == "same" else tools,
                                                  tokenize=False, add_generation_prompt=generation_prompt)
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
    versions: list[tuple[int, int]] = field(default_factory=list)  # per response token: the policy version spans
    turn_start: int = 0  # where the model turn in progress began in `response` (an interrupted turn continues)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    useful_tool_calls: int = 0
    reward: float = 0.0
    correct: bool = False
    failed: bool = False
    finish: Optional[str] = None  # set when the episode is over
    meta: SampleMeta = field(default_factory=SampleMeta)
    stepping: bool = False  # continuous turns: its environment step is running (no engine call until it returns)

    @property
    def ids(self) -> list[int]:
        """What the engine continues from."""
        return self.prompt_ids + self.response

    @property
    def held_rows(self) -> int:
        """Routing rows held: positions [0, held_rows) (the next call need return only the rows from there)."""
        return 0 if self.routes is None else int(self.routes.shape[0])

    def budget(self, max_new_tokens: int, max_tokens: int) -> int:
        """Tokens the next call may sample: the rest of the turn's budget, within the episode's."""
        return min(max_new_tokens - (len(self.response) - self.turn_start), max_tokens - len(self.response))

    def add_answer(self, answer: Sample) -> Optional[list[int]]:
        """Append the engine's answer to `ids` (tokens, log-probs, routes, its versions when tagged). Returns the
        whole turn's tokens once the turn has ended; None while it is open: an answer aborted by a weight update
        (rollout/partial.py), continued from the episode's ids by the next call, or dropped when it cannot be
        continued (no tokens, or no routes for them: that piece is sampled again)."""
        new = [int(t) for t in answer.response_ids]
        if list(answer.prompt_ids) != self.ids:
            raise EngineError(f"episode {self.prompt_index}: the engine answered another prompt than the episode's "
                              "tokens")
        aborted = answer.finish_reason == "abort"
        if aborted and not continuable(answer):
            return None
        if self.has_routes != (answer.routes is not None) and (self.turns or self.response):
            raise EngineError(f"episode {self.prompt_index}: the engine returned routed experts for one turn and not "
                              "for another")
        if answer.routes is not None:
            start, held = answer.routes_from, self.held_rows
            want = len(self.ids) + len(new) - 1 - start
            if int(answer.routes.shape[0]) != want or start > held:
                raise EngineError(f"episode {self.prompt_index}: the engine returned {answer.routes.shape[0]} routing "
                                  f"rows from position {start} for {want} positions after it (the episode holds "
                                  f"{held} rows)")
            rows = answer.routes[held - start:]
            self.routes = rows if self.routes is None else torch.cat([self.routes, rows])
            self.has_routes = True
        self.response += new
        self.logprobs.append(answer.logprobs.float())
        self.versions += versions_of(answer)
        for k in ("weight_version", "server"):
            if getattr(answer.meta, k) is not None:
                setattr(self.meta, k, getattr(answer.meta, k))
        if aborted:
            self.meta.parts += 1
            return None
        self.turns += 1
        return self.response[self.turn_start:]

    def add_observation(self, ids: list[int]) -> None:
        if ids:
            self.obs_spans.append((len(self.response), len(ids)))
            self.response += ids
            self.logprobs.append(torch.zeros(len(ids)))
            if self.versions:  # an observation belongs to the version of the turn it answers (never in the loss)
                self.versions.append((self.versions[-1][0], len(ids)))
        self.turn_start = len(self.response)

    def sample(self) -> Sample:
        meta = replace(self.meta, turns=self.turns, versions=merge_spans(self.versions) if self.versions else [])
        return Sample(list(self.prompt_ids), list(self.response), torch.cat(self.logprobs) if self.logprobs else
                      torch.zeros(0), self.finish or "stop", routes=self.routes, prompt_index=self.prompt_index,
                      meta=meta, reward=self.reward, failed=self.failed, correct=self.correct,
                      obs_spans=tuple(self.obs_spans),
                      episode=(self.turns, self.tool_calls, self.tool_errors, self.useful_tool_calls))


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int  # model turns
    max_tokens: int  # response tokens (the model's and the observations') per episode


class EpisodeBatch:
    """n episodes per prompt item, advanced one engine call at a time (`call`): every live episode's next turn,
    or the rest of a turn a weight update interrupted, each with its own token budget; then the environment steps
    of the turns that ended. items: (prompt ids, prompt record) pairs. The synchronous producer calls it until
    done (`run_episodes`); the asynchronous one call by call, each on the engine's current policy version,
    pausing between calls for weight updates.

    Lockstep turns: a call's environment steps run at once on the runner's threads and the next call waits for
    all of them, so every turn waits for the slowest step. Continuous turns (`continuous`): each step runs on its
    own (EnvRunner.submit) as soon as its turn's answer is back, and its episode's next turn is sent as soon as it
    returns -- into the running call on an engine that `takes_more` (a Feed: the call ends once no turn runs and
    no step is out, or when a weight update stops its sending), else with the next call, which carries the
    episodes whose steps have returned (waiting only when none has: for the first, and GATHER_S for the others)
    -- so a slow tool holds back its own episode only. Budgets, versions, partial rollout and R3 stitching are
    the episode's own either way."""

    def __init__(self, items: Sequence, n: int, runner, fmt: TurnFormat, limits: EpisodeLimits, tokenizer,
                 continuous: bool = False):
        self.n, self.runner, self.fmt, self.limits, self.tokenizer = n, runner, fmt, limits, tokenizer
        self.continuous = continuous
        self.returned: queue.Queue = queue.Queue()  # continuous: (episode, answer, step outcome) as steps return
        self.stepping = 0
        self._feed: Optional[Feed] = None  # continuous, an engine that takes_more: the running call's feed
        self.eps = [Episode([int(t) for t in ids], i, runner.make(record)) for i, (ids, record) in enumerate(items)
                    for _ in range(n)]
        self.open_groups = set(range(len(items)))
        self.calls = 0
        self.progressed = True  # the last call appended tokens or ended a turn
        self.confirmed = 0  # answers whose weight version the engine itself named (checked: partial.tag)

    @property
    def done(self) -> bool:
        return not self.open_groups

    def extend(self, items: Sequence) -> None:
        """n episodes more per item (dynamic sampling's next chunk of prompts), numbered after the ones here."""
        start = len(self.eps) // self.n
        self.eps += [Episode([int(t) for t in ids], start + i, self.runner.make(record))
                     for i, (ids, record) in enumerate(items) for _ in range(self.n)]
        self.open_groups |= set(range(start, start + len(items)))

    def call(self, engine, params, version: Optional[int] = None, interrupt=None) -> list[tuple[int, list[Sample]]]:
        """One engine call for every live episode, then the environment steps of the turns that ended (`generate`
        then `settle`); returns (item index, its n episodes as samples) for each group whose episodes have all
        ended."""
        return self.settle(self.generate(engine, params, version, interrupt))

    def generate(self, engine, params, version: Optional[int] = None, interrupt=None,
                 held: bool = False) -> list[tuple]:
        """The engine phase of a call: every live episode's answer appended; returns the turns that ended, for
        `settle`. version: the policy version the engine holds (each answer tagged with it, rollout/partial.tag;
        held: weight updates may land under the call, each token tagged with its own).
        interrupt(): a message for the engine's stream after each answer ("stop_sending" when a weight update
        waits: the episodes not answered, or answered "abort", continue at the next call)."""
        live = [e for e in self.eps if e.finish is None and not e.stepping]
        fed = self.continuous and getattr(engine, "takes_more", False)
        if not live and not (fed and self.stepping):
            self.progressed = True
            return []
        sent = list(live)  # by the stream's prompt index: then the feed's, as it takes them
        ended = []
        self.progressed = False  # an answer appended tokens or ended a turn, or a returned step was settled

        def take() -> Optional[list]:
            """The feed: the episodes whose steps have returned and go on, sent into the running call (appended to
            `sent`); None once a weight update stops the sending."""
            if interrupt is not None and interrupt() == "stop_sending":
                return None
            got = self._drain()
            self.progressed |= bool(got)
            back = self._settle_returned(got)
            sent.extend(back)
            return [(e.ids, e.budget(params.max_new_tokens, self.limits.max_tokens),
                     e.meta.server or ("prompt", e.prompt_index), e.held_rows) for e in back]

        feed = Feed(take, lambda: self.stepping > 0) if fed else None
        # each episode back to the server whose prefix cache holds it (a prompt's n episodes start on one server:
        # their prompt is cached once), asking only for the routing rows it lacks
        gen = engine.stream([e.ids for e in live], params, n=1,
                            max_new_tokens=[e.budget(params.max_new_tokens, self.limits.max_tokens) for e in live],
                            affinity=[e.meta.server or ("prompt", e.prompt_index) for e in live],
                            routes_from=[e.held_rows for e in live], **({} if feed is None else {"more": feed}))
        self.calls += 1

        def answered(i, got):
            a = got[0] if version is None else tag(got[0], version, held)
            self.confirmed += got[0].meta.weight_version is not None
            e, before = sent[i], len(sent[i].response)
            turn = e.add_answer(a)
            self.progressed |= turn is not None or len(e.response) > before
            if turn is not None:
                if feed is not None:  # its step now: the episode's next turn joins this call when it returns
                    self._step(e, a, turn)
                else:
                    ended.append((e, a, turn))
            return interrupt() if interrupt is not None else None

        self._feed = feed
        try:
            drive(gen, answered)
        finally:
            self._feed = None
        return ended

    def settle(self, ended: list[tuple]) -> list[tuple[int, list[Sample]]]:
        """The environment phase of a call (no engine: a weight sync may run meanwhile): the steps of the turns
        that ended, at once on the runner's threads, each episode then ended or given its observation; returns
        (item index, its n episodes as samples) for each group whose episodes have all ended."""
        if self.continuous:
            for e, a, turn in ended:
                self._step(e, a, turn)
            self._returns()
        elif ended:
            actions = [self._action(e, t) for e, _, t in ended]
            for (e, a, _), (fb, why) in zip(ended, self.runner.step([e.env for e, _, _ in ended], actions)):
                _settle(e, a, fb, why, self.runner.cfg.failure_reward, self.fmt, self.limits)
        out = []
        for i in sorted(self.open_groups):
            group = self.eps[i * self.n:(i + 1) * self.n]
            if all(e.finish is not None for e in group):
                self.open_groups.discard(i)
                for e in group:
                    e.env.close()
                out.append((i, [e.sample() for e in group]))
        return out

    def _action(self, e: Episode, turn: list[int]) -> Action:
        return Action(tuple(turn), self.tokenizer.decode(turn, skip_special_tokens=True), e.turns - 1)

    def _step(self, e: Episode, answer: Sample, turn: list[int]) -> None:
        """Continuous turns: the environment step of e's ended turn, on its own (its outcome: `returned`)."""
        e.stepping, self.stepping = True, self.stepping + 1
        self.runner.submit(e.env, self._action(e, turn), lambda out: self._stepped(e, answer, out))

    def _stepped(self, e: Episode, answer: Sample, out) -> None:
        """On the runner's thread: a step returned (the running call's feed woken, to send the next turn)."""
        self.returned.put((e, answer, out))
        feed = self._feed
        if feed is not None:
            feed.wake()

    def _drain(self) -> list:
        got = []
        while True:
            try:
                got.append(self.returned.get_nowait())
            except queue.Empty:
                return got

    def _settle_returned(self, got: list) -> list[Episode]:
        """The returned steps settled (ended, or given their observation) -> the episodes that go on."""
        for e, a, (fb, why) in got:
            e.stepping, self.stepping = False, self.stepping - 1
            if e.finish is None:  # not closed meanwhile
                _settle(e, a, fb, why, self.runner.cfg.failure_reward, self.fmt, self.limits)
        return [e for e, _, _ in got if e.finish is None]

    def _returns(self) -> None:
        """Continuous turns: settle the environment steps that have returned; when no live episode is left to send
        (all wait for their steps), wait for the first to return and up to GATHER_S more for the others."""
        got = []
        if self.stepping and not any(e.finish is None and not e.stepping for e in self.eps):
            got.append(self.returned.get())
            deadline = time.monotonic() + GATHER_S
            while len(got) < self.stepping and (left := deadline - time.monotonic()) > 0:
                try:
                    got.append(self.returned.get(timeout=left))
                except queue.Empty:
                    break
        self._settle_returned(got + self._drain())

    def close(self) -> None:
        """Close the environments of the episodes still running (an abandoned batch)."""
        for e in self.eps:
            if e.finish is None:
                e.finish = "abort"
                e.env.close()


def _turn_seed(seed: Optional[int], turn: int) -> Optional[int]:
    return None if seed is None else (seed * 1000003 + turn) % (1 << 62)


def with_call_seed(params, call: int):
    """The sampling seed of an episode batch's `call`-th engine call (each call its own stream)."""
    return replace(params, seed=_turn_seed(params.seed, call))


def run_episodes(engine, items: Sequence, n: int, params, runner, fmt: TurnFormat, limits: EpisodeLimits,
                 tokenizer, continuous: bool = False):
    """Yields (item index, its n episodes as samples) as each group's episodes end, in any order (the protocol of
    RolloutEngine.stream; `send("finish")`: no turn is started after the running call, whose groups that ended
    are still yielded, and the episodes still running are closed, their groups never yielded -- what dynamic
    sampling asks once it has its groups). items: (prompt ids, prompt record) pairs. The episodes' turns run in
    lockstep, or continuous (EpisodeBatch)."""
    batch = EpisodeBatch(items, n, runner, fmt, limits, tokenizer, continuous)
    finish = False
    try:
        while not batch.done and not finish:
            for group in batch.call(engine, with_call_seed(params, batch.calls)):
                finish |= (yield group) == "finish"
            if not batch.progressed:  # nothing interrupts this loop: an engine that aborts every request by itself
                raise EngineError("the engine aborted every request of an episode turn before it sampled a token")
    finally:
        batch.close()


def _settle(e: Episode, answer: Sample, fb, why: str, failure_reward: float, fmt: TurnFormat,
            limits: EpisodeLimits) -> None:
    """After a model turn and its environment step: the episode ends (finish reason set) or gets its observation."""
    if fb is None:  # the environment failed: the episode ends, flagged (counted in episode/env_failures)
        e.failed, e.reward, e.finish = True, failure_reward, answer.finish_reason
        e.meta.env_error = why
        return
    e.reward += float(fb.reward)
    e.tool_calls += int(fb.tool_calls)
    e.tool_errors += int(fb.tool_errors)
    e.useful_tool_calls += int(fb.useful_tool_calls)
    e.correct = bool(fb.correct)
    if fb.done:
        e.finish = answer.finish_reason
    elif answer.finish_reason != "stop":  # the turn's budget ran out: truncated
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
