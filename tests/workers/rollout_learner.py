"""Embedded engine vs the Megatron learner: weights synced through ExportStream + InProcessTransport
(dst=None: every rank's engine receives), then the engine's sampled log-probs and greedy tokens are
checked against the learner's forward, before and after a training step.

argv: out_dir model_configs(comma-separated) [overrides...]. Rank 0 writes {model_type: report}.
"""
import os

import torch
import torch.distributed as dist

from moe.bridge.megatron_io import ExportStream
from moe.routing.trace import TraceSpec
from rlpo_mega import distributed
from rlpo_mega.config import EmbeddedEngineConfig, load_config
from rlpo_mega.rollout import SamplingParams
from rlpo_mega.rollout.embedded import EmbeddedEngine
from rlpo_mega.model_setup import build_policy
from rlpo_mega.training.warmup import data_parallel_shard, split_micro_batches, train_step
from rlpo_mega.weight_sync.transports import InProcessTransport
from tests.workers.bridge import make_hf_checkpoint, megatron_logits, per_family_main

TEMP = 0.7
PLEN = [2, 6, 4, 3]


def learner_logprobs(chunks, samples, vocab):
    """log_softmax(learner logits / T) of each sample's response tokens, and the learner's argmax there
    (one right-padded batch: causal attention keeps padding out of the real positions)."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(map(len, seqs))
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, q in enumerate(seqs):
        tokens[i, :len(q)] = torch.tensor(q)
    logits = megatron_logits(chunks, tokens, vocab)  # float64 [b, s, V]
    lps, argmaxes = [], []
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        rows = logits[i, p - 1:p + r - 1]
        lps.append(torch.log_softmax(rows / TEMP, -1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0])
        argmaxes.append(rows.argmax(-1))
    return lps, argmaxes


def errors(engine_samples, learner_lps):
    abs_err = max(float((s.logprobs.double() - lp).abs().max()) for s, lp in zip(engine_samples, learner_lps))
    scale = max(float(lp.abs().max()) for lp in learner_lps)
    return abs_err, abs_err / scale


def run_family(out_dir, hf, overrides):
    src = os.path.join(out_dir, f"hf_src_{hf.model_type}")
    cfg = load_config(None, tuple(overrides) + (f"model.init_from_hf={src}", "optim.lr=1e-2"))
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    if dist.get_rank() == 0 and not os.path.isdir(src):
        make_hf_checkpoint(hf, src)
    dist.barrier()
    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim)
    engine = EmbeddedEngine(hf, EmbeddedEngineConfig(batch_size=3), TraceSpec.from_hf(hf))
    transport = InProcessTransport(engine)
    rep = {}

    def sync():
        stream = ExportStream(chunks, bucket_bytes=256 << 10, dst=None)
        stats = transport.sync(stream)  # raises DigestMismatchError unless every digest matches
        got = engine.weight_digests(list(stream.digests), stream.digest_algorithm)
        return stats["tensors"], got == stream.digests and len(got) > 0

    rep["sync_tensors"], rep["digests_equal"] = sync()
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, hf.vocab_size, (n,), generator=g).tolist() for n in PLEN]
    sampled = SamplingParams(temperature=TEMP, max_new_tokens=8, seed=7)
    before = engine.generate(prompts, sampled, n=2)
    lps, _ = learner_logprobs(chunks, before, hf.vocab_size)
    rep["lp_abs_err"], rep["lp_rel_err"] = errors(before, lps)
    greedy = engine.generate(prompts, SamplingParams(temperature=TEMP, top_k=1, max_new_tokens=8))
    _, argmaxes = learner_logprobs(chunks, greedy, hf.vocab_size)
    rep["greedy_tokens"] = sum(len(s.response_ids) for s in greedy)
    rep["greedy_mismatch"] = sum(int((torch.tensor(s.response_ids) != a).sum()) for s, a in zip(greedy, argmaxes))

    # One training step, then a re-sync: the engine follows the learner.
    tokens = torch.randint(0, hf.vocab_size, (4, 17), generator=torch.Generator().manual_seed(5))
    train_step(chunks, opt, split_micro_batches(data_parallel_shard(tokens), cfg.parallel.num_micro_batches))
    rep["sync2_tensors"], rep["digests_equal_after_step"] = sync()
    after = engine.generate(prompts, sampled, n=2)
    lps_after, _ = learner_logprobs(chunks, after, hf.vocab_size)
    rep["lp_abs_err_after_step"], rep["lp_rel_err_after_step"] = errors(after, lps_after)
    # the step moved the policy: the updated learner scores the earlier samples' tokens differently from the
    # engine's log-probs of them before the step (and the engine, re-synced, agrees with the learner above)
    moved_lps, _ = learner_logprobs(chunks, before, hf.vocab_size)
    rep["lp_moved_by_step"] = max(float((s.logprobs.double() - lp).abs().max()) for s, lp in zip(before, moved_lps))
    # every rank's engine received the same weights: identical samples everywhere
    mine = [(s.response_ids, s.logprobs.tolist()) for s in after]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    rep["ranks_identical"] = all(e == every[0] for e in every)
    rep["world"] = dist.get_world_size()
    engine.shutdown()
    return rep


if __name__ == "__main__":
    per_family_main(run_family)
