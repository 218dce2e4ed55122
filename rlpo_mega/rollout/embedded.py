"""The embedded rollout engine: a transformers causal LM in the learner's process, with our own sampler.

Weights arrive through the weight bridge (it is the receiver of InProcessTransport: begin/load/end
delegate to an HFModelReceiver). Generation is a plain batched loop over a KV cache (DynamicCache):
left-padded prompts with an attention mask and per-row position ids, one forward per new token, finished
rows pruned from the batch. By default every request of a call is one batch (a step's whole rollout: one
forward per decoding step); rollout.embedded.batch_size / max_batch_tokens cap it. Per decoding step the
Python work is per batch, not per row (tokens, log-probs and routes go into the batch's buffers). Log-probs are log_softmax(logits / T) of the chosen token in float32, taken
BEFORE top-k/top-p (the SGLang convention, which the learner's log-prob kernel reproduces).

Randomness: every sample draws from its own torch.Generator seeded from (seed, prompt index, sample
index), so a sample never depends on which other samples share its batch, on batch_size or on when
neighbours finish. seed=None draws a fresh base seed per call. A token is sampled by inverse CDF: one
uniform per sample and step (not one per vocabulary entry).

Routing: with a TraceSpec, HFRouteCapture hooks the routers; each forward's top-k ids are assigned to
the rows' samples, giving per sample int32 [prompt_len + response_len - 1, moe_layers, topk] (left
padding stripped; the last sampled token never runs a forward). The KV-cached incremental forward
routes a few tokens differently from a full forward (float reassociation near router ties).
"""
from __future__ import annotations

import hashlib
import math
import secrets
import threading
import uuid
from typing import Optional, Sequence

import torch

from moe.model import load_hf_config
from moe.routing.decoders import HFRouteCapture
from moe.routing.trace import TraceSpec
from rlpo_mega import platform
from rlpo_mega.config import ConfigError, EmbeddedEngineConfig, response_budget
from rlpo_mega.model_setup import PARAMS_DTYPES
from rlpo_mega.planning import memory
from rlpo_mega.planning.rows import EnginePlan
from rlpo_mega.residency import Residency, distinct_storages as _distinct_storages
from rlpo_mega.weight_sync.transports import HFModelReceiver

from .base import ENGINES, EngineError, RolloutEngine, Sample, SampleMeta, SamplingParams


def _sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A well-mixed 63-bit seed per (seed, prompt, sample): neighbouring indices get unrelated streams."""
    h = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def filter_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits) restricted to top-k, then to the top-p nucleus of the renormalised rest
    (SGLang's order). Unnormalised probabilities [B, V] with zeros outside the kept set."""
    probs = torch.softmax(logits, dim=-1)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(logits < kth, 0.0)
    if top_p < 1.0:
        p = probs / probs.sum(-1, keepdim=True)
        sorted_p, order = torch.sort(p, dim=-1, descending=True)
        # drop a token when the tokens ranked above it already reach top_p (the first is always kept)
        drop = (torch.cumsum(sorted_p, -1) - sorted_p) >= top_p
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
    return probs


class _Sample:
    """One sample's running state; its tokens, log-probs and routes live in its batch's buffers (`_Rows`)."""

    __slots__ = ("index", "prompt_index", "rid", "prompt", "finish", "gen", "rows", "row", "pad", "n")

    def __init__(self, index, prompt_index, rid, prompt):
        self.index, self.prompt_index, self.rid, self.prompt = index, prompt_index, rid, prompt
        self.finish: Optional[str] = None
        self.gen: Optional[torch.Generator] = None
        self.rows: Optional["_Rows"] = None  # None: its batch never started (aborted before)
        self.row = self.pad = self.n = 0  # its row in the buffers, left padding, tokens generated


class _Rows:
    """A batch's outputs, written one decoding step at a time for the rows still running (on the host):
    tokens and log-probs [B, max_new], routes [B, positions, moe_layers, topk]. Each sample's results are
    views of its row (no per-sample copies)."""

    def __init__(self, b: int, width: int, max_new: int, spec):
        self.tokens = torch.zeros(b, max_new, dtype=torch.long)
        self.logprobs = torch.zeros(b, max_new, dtype=torch.float32)
        self.routes = None if spec is None else torch.zeros(b, width + max_new - 1, spec.num_layers, spec.topk,
                                                            dtype=torch.int32)


class _Uniforms:
    """One uniform draw per sample and decoding step, from the sample's own generator, all drawn when its
    batch starts (max_new_tokens numbers a sample): a step costs one column of a [rows, max_new] tensor."""

    def __init__(self, batch, max_new: int):
        self.u = torch.stack([torch.rand(max_new, generator=s.gen, dtype=torch.float64) for s in batch])

    def select(self, keep: torch.Tensor):
        self.u = self.u[keep]


@ENGINES.register("embedded")
class EmbeddedEngine(RolloutEngine):
    """HF transformers model + batched KV-cache sampler + router hooks, living in the learner's process.

    hf_config: a transformers config object, or a config.json path / directory. cfg:
    EmbeddedEngineConfig (None = defaults). trace_spec: routing capture spec (None = no capture).
    """

    def __init__(self, hf_config, cfg=None, trace_spec=None, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        if isinstance(hf_config, str):
            hf_config = load_hf_config(hf_config)
        self.hf = hf_config
        self.cfg = cfg if cfg is not None else EmbeddedEngineConfig()
        for key in ("batch_size", "max_batch_tokens"):
            v = getattr(self.cfg, key)
            if v is not None and v < 1:
                raise ValueError(f"rollout.embedded.{key}={v} must be >= 1 (or null: no limit)")
        # the learner's device (one GPU per rank on a cluster): generation next to the weights it receives
        self.device = platform.device()
        # the learner's parameter dtype: the engine holds exactly the synced bytes (bf16 learner -> bf16 here;
        # its log-probs are still computed in fp32 from the logits)
        self.model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype,
                                                      attn_implementation=self.cfg.attn_implementation)
        self.model.to(self.device).eval().requires_grad_(False)
        self.receiver = HFModelReceiver(self.model)
        if hasattr(self.receiver, "load_weights_verified"):  # optional fused load+digest (InProcessTransport)
            self.load_weights_verified = self.receiver.load_weights_verified
        self.spec = trace_spec
        self.capture = None
        if trace_spec is not None:
            self.capture = HFRouteCapture(self.model, trace_spec)
        self.vocab_size = int(hf_config.vocab_size)
        self.max_positions = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or None
        pad = getattr(hf_config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None and 0 <= pad < self.vocab_size else 0
        self._lock = threading.Lock()
        self._active: Optional[set] = None  # request ids of the running generate() call
        self._aborted: set = set()
        self._abort_all = False
        self._updating = False
        self._dead = False
        # colocated (rollout.colocate): the weights leave the accelerator while the learner trains. They are copied
        # to the host (not dropped as SGLang's are without a CPU backup): a generate() between a resume and the
        # next sync then still runs on the last synced weights. The KV cache lives only inside a generate() call.
        self.memory = Residency(lambda: list(self.model.parameters()) + list(self.model.buffers()))
        self.decode_steps = 0  # decoding steps of the running (or last) generate() call: progress to watch
        self.weight_version: Optional[str] = None  # set_weight_version: named in each answer's meta

    @classmethod
    def check_config(cls, cfg, warns: list, world_size: Optional[int] = None, nodes: Optional[int] = None) -> None:
        ro = cfg.rollout
        if ro.sync_transport not in ("in_process", "disk"):
            raise ConfigError(f"rollout.sync_transport={ro.sync_transport} with rollout.engine=embedded: the "
                              "embedded engine lives in the learner's process; use in_process (or disk)")
        if cfg.routing.mode == "r3" and not ro.embedded.capture_routes:
            raise ConfigError("routing.mode=r3 replays the rollout's routes, but rollout.embedded.capture_routes="
                              "false records none; set rollout.embedded.capture_routes=true (or routing.mode=r2/off)")
        if ro.embedded.batch_size is not None and ro.embedded.batch_size < 1:
            raise ConfigError(f"rollout.embedded.batch_size={ro.embedded.batch_size} must be >= 1 (or null: every "
                              "request of a step in one batch)")
        response, key = response_budget(cfg)
        if ro.embedded.max_batch_tokens is not None and ro.embedded.max_batch_tokens < response + 1:
            raise ConfigError(f"rollout.embedded.max_batch_tokens={ro.embedded.max_batch_tokens} cannot hold one "
                              f"prompt + {key}={response}; raise it (or null: no cap)")

    @classmethod
    def plan(cls, run_cfg, hf, world_size: int, n_params: int, gpu_bytes: int, prompt_tokens: int) -> EnginePlan:
        """No servers: it generates on the learner's GPUs. Colocated, its weights (copied to the host while the
        learner trains) and its KV cache while it generates (`kv_bytes`)."""
        if not run_cfg.rollout.colocate:
            return EnginePlan()
        weights = memory.hf_model_bytes(hf, run_cfg.model.params_dtype)
        return EnginePlan(colocated={"weights": weights, "KV cache": kv_bytes(run_cfg, hf, world_size, prompt_tokens)},
                          host_copy=weights)

    @classmethod
    def from_config(cls, run_cfg, hf_config=None) -> "EmbeddedEngine":
        """From a RunConfig: rollout.embedded settings, routing capture when capture_routes is on."""
        if hf_config is None or isinstance(hf_config, str):
            hf_config = load_hf_config(hf_config or run_cfg.model.hf_config)
        ecfg = run_cfg.rollout.embedded
        dtype = PARAMS_DTYPES[run_cfg.model.params_dtype]
        return cls(hf_config, ecfg, TraceSpec.from_hf(hf_config) if ecfg.capture_routes else None, dtype=dtype)

    # ---- generation --------------------------------------------------------------------------------
    def _check(self, prompts, params, n, request_ids) -> tuple[list[list[int]], list[str]]:
        if self._dead:
            raise EngineError("embedded engine: generate() after shutdown(); build a new engine")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if n < 1:
            raise ValueError(f"n={n} samples per prompt must be >= 1")
        if prompts is None or len(prompts) == 0:
            raise ValueError("generate() got no prompts; pass a list of token-id lists")
        out = []
        for i, p in enumerate(prompts):
            ids = [int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)]
            if not ids:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, "
                                 f"{self.vocab_size}); was it tokenised for another model?")
            if self.max_positions and len(ids) + params.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; with max_new_tokens={params.max_new_tokens} it needs "
                    f"{len(ids) + params.max_new_tokens} positions but the model has max_position_embeddings="
                    f"{self.max_positions}: truncate the prompt or lower max_new_tokens")
            out.append(ids)
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop} are outside the vocabulary [0, {self.vocab_size})")
        call = uuid.uuid4().hex[:8]
        if request_ids is None:
            rids = [f"{call}-{i}" for i in range(len(out)) for _ in range(n)]
        elif len(request_ids) == len(out):  # one id per prompt: shared by its n samples
            rids = [str(r) for r in request_ids for _ in range(n)]
        elif len(request_ids) == len(out) * n:  # one id per sample (prompt-major)
            rids = [str(r) for r in request_ids]
        else:
            raise ValueError(f"{len(request_ids)} request_ids for {len(out)} prompts x n={n}: give one per "
                             "prompt or one per sample")
        return out, rids

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1,
                 request_ids: Optional[Sequence[str]] = None) -> list[Sample]:
        """len(prompts) * n samples, prompt-major. request_ids: one per prompt (its n samples share it, and
        abort() stops all of them) or one per sample; None = generated ids. meta.request_id is the
        sample's id; with seed=None meta.seed is the drawn seed (SamplingParams(seed=it) replays)."""
        prompts, rids = self._check(prompts, params, n, request_ids)
        with self._lock:
            if self._updating:
                raise EngineError("embedded engine: generate() during a weight update; finish the sync first")
            if self._active is not None:
                raise EngineError("embedded engine: generate() is already running (one call at a time)")
            if self.memory.offloaded:
                raise EngineError("embedded engine: generate() while its memory is released (rollout.colocate): "
                                  "resume_memory('weights') first")
            self._active, self._aborted, self._abort_all = set(rids), set(), False
            self.decode_steps = 0
        base_seed = params.seed if params.seed is not None else secrets.randbits(62)
        samples = [_Sample(i * n + j, i, rids[i * n + j], p) for i, p in enumerate(prompts) for j in range(n)]
        for s in samples:
            s.gen = torch.Generator().manual_seed(_sample_seed(base_seed, s.prompt_index, s.index % n))
        try:
            for batch in self._batches(samples, params.max_new_tokens):
                self._run_batch(batch, params)
        finally:
            if self.capture is not None:
                self.capture.clear()
            with self._lock:
                self._active = None
        return [self._result(s, base_seed, params.seed is None) for s in samples]

    def _batches(self, samples, max_new: int):
        """Every sample of the call in one batch (a step's whole rollout: one forward per decoding step), or
        cut at rollout.embedded.batch_size rows / max_batch_tokens (rows x (longest prompt + max_new))."""
        rows, budget = self.cfg.batch_size, self.cfg.max_batch_tokens
        start = 0
        while start < len(samples):
            end, longest = start, 0
            while end < len(samples) and (rows is None or end - start < rows):
                longest = max(longest, len(samples[end].prompt))
                if budget is not None and end > start and (end - start + 1) * (longest + max_new) > budget:
                    break
                end += 1
            yield samples[start:end]
            start = end

    def _aborted_rows(self, batch) -> Optional[torch.Tensor]:
        """bool [rows] of the samples aborted so far, None when none is (the common case: no per-row work)."""
        with self._lock:
            if self._abort_all:
                return torch.ones(len(batch), dtype=torch.bool)
            if not self._aborted:
                return None
            return torch.tensor([s.rid in self._aborted for s in batch], dtype=torch.bool)

    def _collect_routes(self, out: _Rows, rows: torch.Tensor, position: slice):
        """This forward's router ids -> the running rows' route buffer at these positions."""
        if self.capture is None:
            return
        r = self.capture.routes().cpu()  # [B, positions, moe_layers, topk]
        if rows.numel() == out.routes.shape[0]:
            out.routes[:, position] = r  # every row (the prefill, a step before any finished): a plain copy
        else:
            out.routes[rows, position] = r
        self.capture.clear()

    def _run_batch(self, batch: list[_Sample], params: SamplingParams):
        from transformers import DynamicCache

        aborted = self._aborted_rows(batch)
        for s, ab in zip(batch, [] if aborted is None else aborted.tolist()):
            if ab:
                s.finish = "abort"  # aborted before its batch started: no tokens, no routes
        batch = [s for s in batch if s.finish is None]
        if not batch:
            return
        lens = [len(s.prompt) for s in batch]
        width = max(lens)
        out_rows = _Rows(len(batch), width, params.max_new_tokens, self.spec if self.capture is not None else None)
        for b, s in enumerate(batch):
            s.rows, s.row, s.pad = out_rows, b, width - lens[b]
        ids = torch.tensor([[self.pad_id] * s.pad + s.prompt for s in batch], dtype=torch.long)
        mask = torch.tensor([[0] * s.pad + [1] * len(s.prompt) for s in batch], dtype=torch.long)
        # per-row positions: a left-padded prompt starts at position 0 like an unpadded one
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        cache = DynamicCache(config=self.hf)
        if self.capture is not None:
            self.capture.clear()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        alive = torch.arange(len(batch))  # rows of the buffers still decoding
        self._collect_routes(out_rows, alive, slice(0, width))
        last_pos = pos[:, -1]
        stop = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long)
        uniforms = None if params.top_k == 1 else _Uniforms(batch, params.max_new_tokens)
        for t in range(params.max_new_tokens):
            logits = out.logits[:, -1].float() / params.temperature
            logp = torch.log_softmax(logits, dim=-1)  # before top-k/top-p: the SGLang convention
            tokens = self._choose(logits, params, uniforms, t)
            chosen = logp.gather(1, tokens[:, None])[:, 0]
            self.decode_steps += 1
            host_tokens, aborted = tokens.cpu(), self._aborted_rows(batch)
            aborted = None if aborted is None else aborted[alive]
            kept = alive if aborted is None else alive[~aborted]  # an aborted row's token is not handed out
            appended = host_tokens if aborted is None else host_tokens[~aborted]
            out_rows.tokens[kept, t] = appended
            out_rows.logprobs[kept, t] = (chosen.cpu() if aborted is None else chosen.cpu()[~aborted])
            stopped = torch.isin(host_tokens, stop)
            done = stopped | (t + 1 >= params.max_new_tokens)
            if aborted is not None:
                done |= aborted
            finished = done.nonzero()[:, 0]
            rows, why = alive[finished].tolist(), stopped[finished].tolist()
            ab = [False] * len(rows) if aborted is None else aborted[finished].tolist()
            for b, st, a in zip(rows, why, ab):
                s = batch[b]
                s.n, s.finish = (t, "abort") if a else (t + 1, "stop" if st else "length")
            if len(rows) == len(alive):
                return
            if rows:  # prune finished rows: the cache, mask and positions shrink with them
                keep = (~done).nonzero()[:, 0]
                sel = keep.to(self.device)
                cache.batch_select_indices(sel)
                tokens, mask, last_pos, alive = tokens[sel], mask[sel], last_pos[sel], alive[keep]
                if uniforms is not None:
                    uniforms.select(keep)
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                             past_key_values=cache, use_cache=True)
            self._collect_routes(out_rows, alive, slice(width + t, width + t + 1))
        for k in alive.tolist():  # max_new_tokens == 0 is refused by SamplingParams; kept for safety
            batch[k].finish, batch[k].n = "length", params.max_new_tokens

    def _choose(self, logits: torch.Tensor, params: SamplingParams, uniforms: Optional[_Uniforms], t: int
                ) -> torch.Tensor:
        if params.top_k == 1:  # greedy: exactly the argmax, no randomness consumed
            return logits.argmax(-1)
        probs = filter_probs(logits, params.top_k, params.top_p)
        # Inverse CDF: the first token whose cumulative probability exceeds u * total, u ~ U[0, 1) from the
        # row's own generator (on the host: a sample's draws do not depend on the device it runs on). Float64
        # sums keep the tail's tokens their probability; a token outside top-k/top-p (probability 0) adds
        # nothing to the sum and is never the first to exceed it.
        cdf = torch.cumsum(probs.double(), dim=-1)
        total = cdf[:, -1]
        # strictly below the total even where u * total rounds up to it: the pick is a token of positive mass
        x = torch.minimum(uniforms.u[:, t].to(cdf.device) * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, x[:, None], right=True)[:, 0]

    def _result(self, s: _Sample, base_seed: int, fresh: bool) -> Sample:
        routes, n = None, s.n
        if s.rows is not None and s.rows.routes is not None:
            routes = s.rows.routes[s.row, s.pad:s.pad + len(s.prompt) + n - 1]
        response = s.rows.tokens[s.row, :n].tolist() if s.rows is not None else []
        lp = s.rows.logprobs[s.row, :n] if s.rows is not None else torch.zeros(0, dtype=torch.float32)
        # a fresh call's seed replays it with SamplingParams(seed=...)
        meta = SampleMeta(request_id=s.rid, weight_version=self.weight_version, seed=base_seed if fresh else None)
        return Sample(prompt_ids=list(s.prompt), response_ids=response, logprobs=lp,
                      finish_reason=s.finish or "length", routes=routes, prompt_index=s.prompt_index, meta=meta)

    def abort(self, request_ids: Optional[Sequence[str]] = None) -> None:
        """Thread-safe: the running generate() finishes these samples (None: all) with reason "abort" at
        its next decoding step; samples of the call not started yet finish with no tokens. Ids not in
        flight are ignored (like SGLang's abort)."""
        with self._lock:
            if self._active is None:
                return
            if request_ids is None:
                self._abort_all = True
            else:
                self._aborted |= {str(r) for r in request_ids} & self._active

    def in_flight(self) -> set:
        """Request ids of the running generate() call (empty when idle)."""
        with self._lock:
            return set(self._active or ())

    # ---- weight receiver ---------------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        with self._lock:
            if self._active is not None:
                raise EngineError("embedded engine: weight update while generate() runs; abort() or wait "
                                  "for it to return first")
            if self.memory.offloaded:
                raise EngineError("embedded engine: weight update while its memory is released (rollout.colocate): "
                                  "resume_memory('weights') first")
            self._updating = True
        self.receiver.begin_weight_update()

    def load_weights(self, named_tensors) -> None:
        self.receiver.load_weights(named_tensors)

    def end_weight_update(self) -> None:
        self.receiver.end_weight_update()
        with self._lock:
            self._updating = False

    def reload_from_disk(self, path: str) -> None:
        self.begin_weight_update()
        try:
            self.receiver.reload_from_disk(path)
        finally:
            self.end_weight_update()

    def weight_digests(self, names, algorithm: str) -> dict[str, str]:
        return self.receiver.weight_digests(names, algorithm)

    def set_weight_version(self, version: str) -> None:
        self.weight_version = str(version)

    def flush_cache(self) -> None:
        """Nothing to flush: KV caches exist only inside one generate() batch (a fresh DynamicCache each),
        there is no prefix cache across calls, so no stale KV can outlive a weight update."""

    def release_memory(self) -> None:
        with self._lock:
            if self._active is not None:
                raise EngineError("release_memory while a generate() call runs: the engine must be idle")
            self.memory.offload()

    def resume_memory(self, what: str) -> None:
        if what not in ("weights", "kv_cache"):
            raise ValueError(f"resume_memory({what!r}): weights or kv_cache")
        if what == "weights":
            self.memory.onload()
        elif self.memory.offloaded:  # as SGLang: the KV cache after the weights
            raise EngineError("resume_memory('kv_cache') before the weights: resume 'weights' first")

    def resident_bytes(self) -> int:
        return 0 if self.memory.offloaded else sum(s.nbytes() for s in _distinct_storages(
            list(self.model.parameters()) + list(self.model.buffers())))

    def health(self) -> bool:
        return not self._dead

    def shutdown(self) -> None:
        self.abort()
        self._dead = True
        if self.capture is not None:
            self.capture.close()


__all__ = ["EmbeddedEngine", "filter_probs"]


def kv_bytes(cfg, hf, world_size: int, prompt_tokens: int) -> int:
    """The embedded engine's KV cache at its longest: a rank's share of the step's samples in one batch (or
    rollout.embedded.batch_size), every layer's keys and values for prompt + response, in the parameters' dtype."""
    shape = memory.Shape.of(hf, 1, 1)
    rows = math.ceil(cfg.prompts.prompts_per_step * cfg.prompts.n_samples / world_size)
    if cfg.rollout.embedded.batch_size:
        rows = min(rows, cfg.rollout.embedded.batch_size)
    tokens = prompt_tokens + response_budget(cfg)[0]
    return rows * tokens * hf.num_hidden_layers * 2 * shape.kv_heads * shape.head_dim * \
        memory.ITEMSIZE[cfg.model.params_dtype]
