"""The rollout-engine interface: one contract for the embedded (HF transformers) and SGLang engines.

An engine generates n samples per prompt (token ids in, token ids out) and returns, per sample, the
response ids, the log-probs the engine sampled them with (log softmax(logits / temperature), before
top-k/top-p, the SGLang convention), the finish reason and the raw routing rows. It is also a weight
receiver (rlpo_mega.weight_sync.transports' contract), so any transport can update it.

Routing rows: int32 [prompt_len + response_len - 1, moe_layers, topk], row t = the experts chosen for
input position t (the last sampled token never runs a forward); the trainer validates them into a
`moe.routing.trace.RoutingTrace`.
"""
from __future__ import annotations

import abc
from contextlib import nullcontext
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Literal, Optional, Sequence

import numpy as np
import torch

from rlpo_mega.algorithms.registry import Registry
from rlpo_mega.engine_errors import EngineError, RolloutInterrupted  # noqa: F401  (the engines' own types)
from rlpo_mega.planning.rows import EnginePlan

ENGINES = Registry("rollout engine")

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: Optional[int] = None  # same seed, same prompts, same weights -> same samples

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"sampling temperature {self.temperature} must be > 0 (greedy: use a small "
                             "temperature with top_k=1)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p {self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling top_k {self.top_k} must be -1 (off) or >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens {self.max_new_tokens} must be >= 1")


@dataclass
class SampleMeta:
    """What an engine's answer and the rollout side record of a sample besides its tokens, typed (no string keys
    crossing modules). It stays on the sample's owner: the scalars' gather does not carry it."""
    request_id: Optional[str] = None  # the engine's id of the request (SGLang's rid): aborts and errors name it
    server: Optional[str] = None  # the SGLang server that answered: an episode's next turn goes back there
    weight_version: Optional[str] = None  # the version the engine says it generated with (set_weight_version)
    weight_versions: Optional[list] = None  # SGLang: the versions' spans when one changed mid-request
    versions: list = field(default_factory=list)  # per response token, the policy versions: [(version, count)]
    parts: int = 1  # engine answers joined into it (a partial rollout's continuations, an episode's cut turns)
    policy_version: Optional[int] = None  # the policy version of its last token (sync: the step that sampled it)
    seed: Optional[int] = None  # the embedded engine's drawn seed (SamplingParams(seed=...) replays the call)
    turns: int = 0  # a multi-turn episode's model turns
    env_error: Optional[str] = None  # an episode its environment's failure ended: why


SampleState = Literal["answered", "owned", "remote", "received"]  # Sample.state


@dataclass
class Sample:
    """One response: the one sample type from the engine to the learner.

    The engine fills the tokens, the log-probs it sampled them with, the finish reason and the raw routing rows;
    the rollout producer (rollout/producers/) adds the reward and, validating the routes, the compact trace and
    the entries the live router decides (`replaced`). Every rank then learns every sample's scalars
    (`scalars` / `from_scalars`: the wire format of the scalars' gather); a sample another rank holds has no
    payload (`prompt_ids is None`). The exchange (training/exchange.py) carries the payload to the ranks that
    train the sample: there the ids are int64 tensors and `routes`/`replaced` hold only that rank's MoE layers."""
    prompt_ids: Optional[Sequence[int]]
    response_ids: Optional[Sequence[int]]
    logprobs: Optional[torch.Tensor]  # float32 [response_len]
    finish_reason: str  # one of FINISH_REASONS
    routes: Optional[torch.Tensor] = None  # [prompt_len + response_len - 1, moe_layers, topk] (int32 from the engine)
    prompt_index: int = 0  # index of the prompt in the generate() call
    meta: SampleMeta = field(default_factory=SampleMeta)
    reward: float = 0.0
    failed: bool = False  # the reward function failed (scored 0)
    correct: bool = False
    replaced: Optional[torch.Tensor] = None  # bool [span, moe_layers]: trace entries the live router decides
    owner: int = -1  # the rank whose engine generated it (set by the scalars' gather)
    prompt_len: int = -1  # from the ids when they are given
    response_len: int = -1
    replaced_entries: int = 0  # routing-trace entries the live router decides (routing.on_bad_trace=fallback)
    replaced_tokens: int = 0
    has_routes: bool = False
    trace_checked: bool = False  # routes already a clean compact trace (the engine checked them as they arrived)
    routes_from: int = 0  # the first trace row `routes` holds (a sequence-parallel rank receives its shard's rows)
    # after the exchange: the trace-row ranges ((lo, hi), ...) `routes` holds back to back (a context-parallel
    # rank receives its two chunks' rows; empty: every row from routes_from on)
    routes_rows: tuple = ()
    # the policy version (weight sync) that sampled the oldest token (-1: not tracked, the sync producer's); the
    # per-token versions are meta.versions on the owner (rollout/partial.py)
    version_min: int = -1
    masked_prefix: int = 0  # leading response tokens left out of the loss (rollout.partial_rollout_mask)
    # a multi-turn episode (rollout/episode.py): the response holds the model's turns and, between them, the
    # observation and template tokens the model did not sample: ((start, count), ...) in response coordinates,
    # out of the loss (their log-probs are 0). A scalar, so the learner's mask needs no payload of its own.
    obs_spans: tuple = ()
    episode: tuple = ()  # a multi-turn episode's (turns, tool calls, failed tool calls, useful tool calls)

    SCALARS = ("prompt_len", "response_len", "reward", "failed", "correct", "finish_reason", "replaced_entries",
               "replaced_tokens", "has_routes", "version_min", "masked_prefix", "obs_spans", "episode")

    def __setstate__(self, state: dict):
        # a checkpoint of an earlier version (carried groups) holds its meta as a dict of the same names
        meta = state.get("meta")
        if isinstance(meta, dict):
            known = {f.name for f in fields(SampleMeta)}
            state = {**state, "meta": SampleMeta(**{("request_id" if k == "rid" else k): v for k, v in meta.items()
                                                    if ("request_id" if k == "rid" else k) in known})}
        self.__dict__.update(state)

    def __post_init__(self):
        if self.prompt_ids is not None:
            self.prompt_len, self.response_len = len(self.prompt_ids), len(self.response_ids)
        self.has_routes = self.has_routes or self.routes is not None

    @property
    def state(self) -> "SampleState":
        """Where the sample is in its life (read from its fields, which say it):
        answered  an engine's answer on the rank that generated it: payload, no owner yet (the producer scores it)
        owned     on that rank after the scalars' gather (rollout/gather.py): payload, scalars, `owner` = this rank
        remote    another rank's sample after the gather: scalars only (`prompt_ids is None`)
        received  on a rank that trains it, after the exchange (training/exchange.py): int64 id tensors, `routes`
                  and `replaced` of that rank's MoE layers (and, under sequence parallelism, from `routes_from`)"""
        if self.prompt_ids is None:
            return "remote"
        if isinstance(self.prompt_ids, torch.Tensor):
            return "received"
        return "answered" if self.owner < 0 else "owned"

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def model_tokens(self) -> int:
        """Response tokens the model sampled (a multi-turn episode's observation tokens not counted)."""
        return self.response_len - sum(c for _, c in self.obs_spans)

    @property
    def span(self) -> int:
        """Input positions in the trainer: prompt + response - 1 (the last token is only a label)."""
        return self.prompt_len + self.response_len - 1

    @property
    def ids(self) -> torch.Tensor:
        """Prompt and response token ids as one int64 tensor (the sample's payload)."""
        if isinstance(self.prompt_ids, list) and isinstance(self.response_ids, list):
            # Python ints (the SGLang engine's): numpy reads a list of them ~3x faster than torch does
            return torch.from_numpy(np.array(self.prompt_ids + self.response_ids, dtype=np.int64))
        return torch.cat([torch.as_tensor(self.prompt_ids, dtype=torch.long),
                          torch.as_tensor(self.response_ids, dtype=torch.long)])

    def scalars(self) -> tuple:
        return tuple(getattr(self, k) for k in self.SCALARS)

    @classmethod
    def from_scalars(cls, row: Sequence, owner: int) -> "Sample":
        """A sample another rank holds: its scalars, no payload."""
        kw = dict(zip(cls.SCALARS, row))
        return cls(None, None, None, kw.pop("finish_reason"), owner=owner, **kw)


class RolloutEngine(abc.ABC):
    """Every engine implements these; the trainer uses nothing else. Built from a RunConfig through ENGINES
    (`from_config`) on the learner ranks `ranks` names: every rank holds an in-process engine, a client of
    remote servers lives on the few ranks its config names (the servers batch across all requests)."""

    @classmethod
    def ranks(cls, run_cfg, world_size: int) -> list[int]:
        """The global ranks that build this engine (of a RunConfig, at `world_size`): each generates a contiguous
        share of the prompts and receives the full weights at every sync."""
        return list(range(world_size))

    @classmethod
    def check_config(cls, run_cfg, warns: list, world_size: Optional[int] = None, nodes: Optional[int] = None) -> None:
        """`rlpo-mega check` of this engine's own settings (a ConfigError for a refusal, a line in `warns` for a
        warning), with the world size and node count when known. The engine's checks live with it."""

    @classmethod
    def launches_servers(cls, run_cfg) -> bool:
        """Whether the run starts this engine's servers itself, one launcher per node (rollout/engines.EngineSlot)."""
        return False

    @classmethod
    def plan_check(cls, run_cfg) -> None:
        """`rlpo-mega plan`: a PlanError for what the plan cannot size at all, before the model's meta build."""

    @classmethod
    @abc.abstractmethod
    def plan(cls, run_cfg, hf, world_size: int, n_params: int, gpu_bytes: int, prompt_tokens: int) -> EnginePlan:
        """`rlpo-mega plan`: this engine's rows and parts at the recipe's real size (planning/rows.EnginePlan)."""

    @classmethod
    @abc.abstractmethod
    def from_config(cls, run_cfg, hf_config) -> "RolloutEngine":
        """The engine of a RunConfig (on a rank of `ranks`)."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1,
                 request_ids: Optional[Sequence[str]] = None) -> list[Sample]:
        """len(prompts) * n samples, prompt-major (sample i*n + j is prompt i's j-th)."""

    def stream(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1,
               request_ids: Optional[Sequence[str]] = None, max_new_tokens: Optional[Sequence[int]] = None,
               affinity: Optional[Sequence] = None, routes_from: Optional[Sequence[int]] = None):
        """Yields (prompt index, its n samples) as each prompt's group completes, in any order. The caller may
        `send("finish")` to the generator once it has enough: nothing more is started, running requests are
        aborted, and the generator goes on yielding the groups that end meanwhile (complete ones, and ones with
        aborted samples, finish_reason "abort"); groups never started are not yielded. Closing the generator
        ends everything at once; `send("stop_sending")` is a finish that leaves the running requests to the
        caller's abort() (one abort of everything, for a weight update's pause). max_new_tokens: one budget per
        prompt instead of params' (the continuations of a partial rollout, rollout/partial.py). Per prompt, for
        a multi-turn episode's next turn (rollout/episode.py): affinity, the server (an answer's meta.server)
        whose prefix cache holds the prompt's tokens, or (not a string) a key the prompts of one server share (a
        prompt's n episodes at their first turn); routes_from, the first position whose routing row the
        caller needs (an engine may return only rows [routes_from, ...): the answer's `routes_from` says from where).
        An engine of one server, or that returns every row, ignores them. This default generates the whole call
        (one generate() per distinct budget), then yields every group (an engine that batches the call, e.g. the
        embedded one, has every group at the same time)."""
        budgets = [params.max_new_tokens] * len(prompts) if max_new_tokens is None else [int(b) for b in max_new_tokens]
        if len(budgets) != len(prompts):
            raise ValueError(f"{len(budgets)} max_new_tokens for {len(prompts)} prompts")
        out: list = [None] * len(prompts)
        for budget in sorted(set(budgets)):
            idx = [i for i, b in enumerate(budgets) if b == budget]
            rids = None if request_ids is None else [request_ids[i * n + j] for i in idx for j in range(n)]
            got = self.generate([prompts[i] for i in idx], replace(params, max_new_tokens=budget), n, rids)
            for k, i in enumerate(idx):
                out[i] = got[k * n:(k + 1) * n]
        for i in range(len(prompts)):
            yield i, out[i]

    @abc.abstractmethod
    def abort(self, request_ids: Optional[Sequence[str]] = None) -> None:
        """Abort in-flight requests (None: all); their samples finish with reason "abort"."""

    # weight receiver (rlpo_mega.weight_sync.transports)
    @abc.abstractmethod
    def begin_weight_update(self) -> None: ...

    @abc.abstractmethod
    def load_weights(self, named_tensors) -> None: ...

    @abc.abstractmethod
    def end_weight_update(self) -> None: ...

    @abc.abstractmethod
    def reload_from_disk(self, path: str) -> None: ...

    @abc.abstractmethod
    def weight_digests(self, names, algorithm: str) -> dict[str, str]: ...

    @abc.abstractmethod
    def flush_cache(self) -> None: ...

    def set_weight_version(self, version: str) -> None:
        """Name the weights the engine holds now (after a sync); an engine that records it answers each request
        with meta.weight_version, the version it generated with (the asynchronous producer checks it)."""

    # rollout.partial_rollout_kv=keep: the engine holds its running requests, KV cache and all, across a weight
    # update (pause/resume) and names each token's version (meta.weight_versions spans)
    pauses_in_place = False

    def pause(self) -> None:
        """Hold the running requests where they are, their KV cache kept, until resume(); requests sent meanwhile
        wait. A weight update in between reaches them: their next tokens are the new weights'."""
        raise EngineError(f"{type(self).__name__} cannot hold its requests across a weight update "
                          "(rollout.partial_rollout_kv=keep)")

    def resume(self) -> None:
        raise EngineError(f"{type(self).__name__} cannot hold its requests across a weight update "
                          "(rollout.partial_rollout_kv=keep)")

    # continuous episode turns (environment.turns=continuous): a running stream takes more prompts as they come
    # (stream(..., more=Feed)): an episode's next turn is sent as soon as its environment step returns
    takes_more = False

    # colocated (rollout.colocate, training/colocate.py): the engine's accelerator memory given to the learner
    # while it trains, and taken back in SGLang's order (weights, then the KV cache)
    def release_memory(self) -> None:
        """Give up the accelerator memory of the weights and the KV cache (idle: no request running)."""
        raise EngineError(f"{type(self).__name__} cannot share the learner's GPUs (rollout.colocate)")

    def resume_memory(self, what: str) -> None:
        """Take back `what` ("weights" or "kv_cache") after release_memory; nothing when it holds it already."""
        raise EngineError(f"{type(self).__name__} cannot share the learner's GPUs (rollout.colocate)")

    def resident_bytes(self) -> int:
        """Bytes the engine holds on the accelerator now (its weights; a KV cache between calls)."""
        return 0

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the engine can serve; False (never raise) when it is dead or unreachable."""

    def shutdown(self) -> None:
        pass


STOP = object()  # what a `drive` handler returns to end the loop at once (the stream closed: its requests aborted)


class Feed:
    """Prompts a running stream takes as they come (`stream(..., more=feed)` on an engine whose class says
    `takes_more`). The stream asks `take()` after each answer, when woken (`wake()`, from any thread) and at
    least every POLL_S: it returns [(prompt ids, max_new_tokens, affinity, routes_from)] to send now, numbered
    after the prompts sent so far, n samples each; or None: send nothing more (as "stop_sending"). The stream
    ends once nothing it sent runs and `waiting()` (more may come) is false."""
    POLL_S = 0.02

    def __init__(self, take: Callable[[], Optional[list]], waiting: Callable[[], bool]):
        self.take, self.waiting = take, waiting
        self.woken: Optional[Callable[[], None]] = None  # set by the stream that reads this feed

    def wake(self) -> None:
        woken = self.woken
        if woken is not None:
            woken()


def drive(stream, handle: Callable, wait: Optional[Callable] = None):
    """The one loop over an engine's stream (RolloutEngine.stream's protocol): `handle(index, samples)` for each
    group as it completes; what it returns is sent back to the stream -- "finish" (nothing more is sent, the running
    requests end, the groups that complete meanwhile still come), "stop_sending" (a weight update's pause: the
    running requests are left to its abort) or None -- and STOP ends the loop there. `wait()`: a context around
    each wait for the next group (a phase timer). The stream is closed on every exit (a request still running is
    aborted), so every request of the call has ended when this returns."""
    msg = None
    try:
        while True:
            with wait() if wait is not None else nullcontext():
                try:
                    index, samples = stream.send(msg)
                except StopIteration:
                    return
            msg = handle(index, samples)
            if msg is STOP:
                return
    finally:
        stream.close()
