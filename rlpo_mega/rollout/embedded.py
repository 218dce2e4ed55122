"""The embedded rollout engine: a transformers causal LM in the learner's process, with our own sampler.

Weights arrive through the weight bridge (it is the receiver of InProcessTransport: begin/load/end
delegate to an HFModelReceiver). Generation is a plain batched loop over a KV cache (DynamicCache):
left-padded prompts with an attention mask and per-row position ids, one forward per new token, finished
rows pruned from the batch. Log-probs are log_softmax(logits / T) of the chosen token in float32, taken
BEFORE top-k/top-p (the SGLang convention, which the learner's log-prob kernel reproduces).

Randomness: every sample draws from its own torch.Generator seeded from (seed, prompt index, sample
index), so a sample never depends on which other samples share its batch, on batch_size or on when
neighbours finish. seed=None draws a fresh base seed per call.

Routing: with a TraceSpec, HFRouteCapture hooks the routers; each forward's top-k ids are assigned to
the rows' samples, giving per sample int32 [prompt_len + response_len - 1, moe_layers, topk] (left
padding stripped; the last sampled token never runs a forward). The KV-cached incremental forward
routes a few tokens differently from a full forward (float reassociation near router ties).
"""
from __future__ import annotations

import hashlib
import secrets
import threading
import uuid
from typing import Optional, Sequence

import torch

from .base import ENGINES, EngineError, RolloutEngine, RolloutSample, SamplingParams


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
    """One sample's running state."""

    __slots__ = ("index", "prompt_index", "rid", "prompt", "response", "logprobs", "routes", "finish", "gen")

    def __init__(self, index, prompt_index, rid, prompt):
        self.index, self.prompt_index, self.rid, self.prompt = index, prompt_index, rid, prompt
        self.response: list[int] = []
        self.logprobs: list[float] = []
        self.routes: list[torch.Tensor] = []
        self.finish: Optional[str] = None
        self.gen: Optional[torch.Generator] = None


@ENGINES.register("embedded")
class EmbeddedEngine(RolloutEngine):
    """HF transformers model + batched KV-cache sampler + router hooks, living in the learner's process.

    hf_config: a transformers config object, or a config.json path / directory. cfg:
    EmbeddedEngineConfig (None = defaults). trace_spec: routing capture spec (None = no capture).
    """

    def __init__(self, hf_config, cfg=None, trace_spec=None, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        from rlpo_mega.config import EmbeddedEngineConfig
        from rlpo_mega.weight_sync.transports import HFModelReceiver

        if isinstance(hf_config, str):
            from moe.model import load_hf_config

            hf_config = load_hf_config(hf_config)
        self.hf = hf_config
        self.cfg = cfg if cfg is not None else EmbeddedEngineConfig()
        if self.cfg.batch_size < 1:
            raise ValueError(f"rollout.embedded.batch_size={self.cfg.batch_size} must be >= 1")
        from rlpo_mega import platform

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
            from moe.routing.decoders import HFRouteCapture

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
        self.decode_steps = 0  # decoding steps of the running (or last) generate() call: progress to watch

    @classmethod
    def from_config(cls, run_cfg, hf_config=None) -> "EmbeddedEngine":
        """From a RunConfig: rollout.embedded settings, routing capture when capture_routes is on."""
        from moe.routing.trace import TraceSpec

        if hf_config is None or isinstance(hf_config, str):
            from moe.model import load_hf_config

            hf_config = load_hf_config(hf_config or run_cfg.model.hf_config)
        ecfg = run_cfg.rollout.embedded
        from rlpo_mega.training.model_setup import PARAMS_DTYPES

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
                 request_ids: Optional[Sequence[str]] = None) -> list[RolloutSample]:
        """len(prompts) * n samples, prompt-major. request_ids: one per prompt (its n samples share it, and
        abort() stops all of them) or one per sample; None = generated ids. meta["request_id"] is the
        sample's id; with seed=None meta["seed"] is the drawn seed (SamplingParams(seed=it) replays)."""
        prompts, rids = self._check(prompts, params, n, request_ids)
        with self._lock:
            if self._updating:
                raise EngineError("embedded engine: generate() during a weight update; finish the sync first")
            if self._active is not None:
                raise EngineError("embedded engine: generate() is already running (one call at a time)")
            self._active, self._aborted, self._abort_all = set(rids), set(), False
            self.decode_steps = 0
        base_seed = params.seed if params.seed is not None else secrets.randbits(62)
        samples = [_Sample(i * n + j, i, rids[i * n + j], p) for i, p in enumerate(prompts) for j in range(n)]
        for s in samples:
            s.gen = torch.Generator().manual_seed(_sample_seed(base_seed, s.prompt_index, s.index % n))
        try:
            for start in range(0, len(samples), self.cfg.batch_size):
                self._run_batch(samples[start:start + self.cfg.batch_size], params)
        finally:
            if self.capture is not None:
                self.capture.clear()
            with self._lock:
                self._active = None
        return [self._result(s, base_seed, params.seed is None) for s in samples]

    def _aborted_rows(self, batch) -> list[bool]:
        with self._lock:
            return [self._abort_all or s.rid in self._aborted for s in batch]

    def _collect_routes(self, batch, skip):
        """This forward's router ids -> each row's sample (`skip[b]`: left-padding rows to drop)."""
        if self.capture is None:
            return
        r = self.capture.routes().cpu()  # [B, positions, moe_layers, topk]: sample data lives on the host
        self.capture.clear()
        for s, rows, k in zip(batch, r.unbind(0), skip):  # one unbind: views, no per-row indexing
            s.routes.append(rows[k:] if k else rows)

    def _run_batch(self, batch: list[_Sample], params: SamplingParams):
        from transformers import DynamicCache

        for s, ab in zip(batch, self._aborted_rows(batch)):
            if ab:
                s.finish = "abort"  # aborted before its batch started: no tokens, no routes
        batch = [s for s in batch if s.finish is None]
        if not batch:
            return
        lens = [len(s.prompt) for s in batch]
        width = max(lens)
        pads = [width - n for n in lens]
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, s in enumerate(batch):
            ids[b, pads[b]:] = torch.tensor(s.prompt)
            mask[b, pads[b]:] = 1
        # per-row positions: a left-padded prompt starts at position 0 like an unpadded one
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        cache = DynamicCache(config=self.hf)
        if self.capture is not None:
            self.capture.clear()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        self._collect_routes(batch, pads)
        last_pos = pos[:, -1]
        stop = set(params.stop_token_ids)
        for _ in range(params.max_new_tokens):
            logits = out.logits[:, -1].float() / params.temperature
            logp = torch.log_softmax(logits, dim=-1)  # before top-k/top-p: the SGLang convention
            tokens = self._choose(logits, params, batch)
            chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()  # fp32 -> float -> fp32 is exact
            self.decode_steps += 1
            keep = []
            for b, (s, ab, t) in enumerate(zip(batch, self._aborted_rows(batch), tokens.tolist())):
                if ab:
                    s.finish = "abort"  # this step's token is not handed out
                    continue
                s.response.append(t)
                s.logprobs.append(chosen[b])
                if t in stop:
                    s.finish = "stop"
                elif len(s.response) >= params.max_new_tokens:
                    s.finish = "length"
                else:
                    keep.append(b)
            if not keep:
                return
            if len(keep) < len(batch):  # prune finished rows: the cache, mask and positions shrink with them
                sel = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(sel)
                batch, tokens, mask, last_pos = [batch[b] for b in keep], tokens[sel], mask[sel], last_pos[sel]
            mask = torch.cat([mask, mask.new_ones(len(batch), 1)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                             past_key_values=cache, use_cache=True)
            self._collect_routes(batch, [0] * len(batch))

    def _choose(self, logits: torch.Tensor, params: SamplingParams, batch) -> torch.Tensor:
        if params.top_k == 1:  # greedy: exactly the argmax, no randomness consumed
            return logits.argmax(-1)
        probs = filter_probs(logits, params.top_k, params.top_p)
        # Exponential race per row with the row's own generator: argmax p_i / E_i ~ Categorical(p).
        # the generators live on the host: a sample's draws do not depend on the device it runs on
        race = torch.stack([torch.empty(logits.shape[-1]).exponential_(generator=s.gen) for s in batch])
        return (probs / race.to(probs.device)).argmax(-1)

    def _result(self, s: _Sample, base_seed: int, fresh: bool) -> RolloutSample:
        routes = None
        if self.capture is not None and s.routes:
            rows = len(s.prompt) + len(s.response) - 1
            routes = torch.cat(s.routes)[:rows].to(torch.int32).contiguous()
        meta = {"request_id": s.rid}
        if fresh:
            meta["seed"] = base_seed  # replays the call with SamplingParams(seed=...)
        lp = torch.tensor(s.logprobs, dtype=torch.float32)
        return RolloutSample(prompt_ids=list(s.prompt), response_ids=s.response, logprobs=lp,
                             finish_reason=s.finish or "length", routes=routes, prompt_index=s.prompt_index,
                             meta=meta)

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

    def flush_cache(self) -> None:
        """Nothing to flush: KV caches exist only inside one generate() batch (a fresh DynamicCache each),
        there is no prefix cache across calls, so no stale KV can outlive a weight update."""

    def health(self) -> bool:
        return not self._dead

    def shutdown(self) -> None:
        self.abort()
        self._dead = True
        if self.capture is not None:
            self.capture.close()


__all__ = ["EmbeddedEngine", "filter_probs"]
