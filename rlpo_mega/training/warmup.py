"""A phase of the run before RL: the optional supervised warm-up (next-token loss on `answer + eos` after the
rendered prompt), and the next-token step it takes (also the foundation's step: the model parity tests use it).

The CPU demo uses it to teach a random tiny model the answer *format* only (its warm-up file pairs each
prompt with a random answer), so RL starts near zero reward and has to learn the task itself.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch
from megatron.core import parallel_state

from rlpo_mega import platform
from rlpo_mega.data import load_prompts, render_prompt
from rlpo_mega.environments import environment_tools
from rlpo_mega.training.batches import MicroBatch
from rlpo_mega.training.update import forward_only, reduce_report, update

log = logging.getLogger("rlpo_mega")


def _examples(cfg, tokenizer, records):
    c, tok = cfg, tokenizer
    if records is None:  # the warm-up was switched on after the trainer was built (tests)
        records = load_prompts(c.trainer.warmup.path, "auto", c.prompts.prompt_key, c.prompts.answer_key)
    out = []
    for r in records:
        prompt = render_prompt(tok, r.prompt, c.prompts.chat_template, c.prompts.system_prompt,
                               environment_tools(c.environment))  # as the RL prompts render
        answer = list(tok(str(r.reference), add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
        out.append((prompt, answer))
    return out


def _batch(examples, rows, tp: int, pad: int) -> MicroBatch:
    width = max(len(examples[i][0]) + len(examples[i][1]) for i in rows)
    seq = -(-(width - 1) // tp) * tp
    tokens = torch.full((len(rows), seq + 1), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), seq + 1)
    for j, i in enumerate(rows):
        p, a = examples[i]
        tokens[j, :len(p) + len(a)] = torch.tensor(p + a)
        mask[j, len(p):len(p) + len(a)] = 1.0
    return MicroBatch(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(), loss_mask=mask[:, 1:])


def supervised_warmup(cfg, chunks, optimizer, tokenizer, records, tp: int, stop, rank: int):
    """cfg.trainer.warmup.steps optimizer steps of batch_size examples (seeded order, cycling) on the policy
    (`chunks`, `optimizer`). records: the warm-up file's, read and validated before the model was built.
    Returns the last loss, or None when a signal stopped it (`stop`, polled after every step)."""
    w = cfg.trainer.warmup
    examples = _examples(cfg, tokenizer, records)
    order = np.random.default_rng([cfg.seed, 7]).permutation(len(examples))
    groups = optimizer.param_groups
    lrs = [g["lr"] for g in groups]
    if w.lr is not None:
        for g in groups:
            g["lr"] = w.lr
    pos, loss = 0, float("nan")
    try:
        for step in range(w.steps):
            rows = [int(order[(pos + j) % len(order)]) for j in range(w.batch_size)]
            pos += w.batch_size
            batch = _batch(examples, rows, tp, tokenizer.pad_token_id or 0)
            micro = shard_and_split(batch, cfg.parallel.num_micro_batches)
            loss = train_step(chunks, optimizer, micro)["loss"]
            if stop.any_rank(platform.device()):  # the warm-up is not saved: it reruns on the next start
                if rank == 0:
                    log.warning("stopped by signal at warm-up step %d/%d; nothing saved (a warm-up is not "
                                "checkpointed: the next start runs it again)", step + 1, w.steps)
                return None
            if rank == 0 and (step % 20 == 0 or step == w.steps - 1):
                log.info("warm-up step %d/%d: answer-token loss %.4f", step + 1, w.steps, loss)
    finally:
        for g, lr in zip(groups, lrs):
            g["lr"] = lr
    return loss


# --- the next-token step -------------------------------------------------------------------------------

def make_lm_batch(tokens: torch.Tensor) -> MicroBatch:
    """tokens [b, s+1] -> inputs [b, s], next-token labels and a full loss mask."""
    return MicroBatch(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                      loss_mask=torch.ones_like(tokens[:, 1:], dtype=torch.float))


def train_step(model_chunks, optimizer, micro_batches, forward_step=None):
    """One next-token optimizer step over the given micro-batches (this rank's share of the global batch)."""
    out = update(model_chunks, optimizer, micro_batches, forward_step, "lm_loss", strict=True)
    return {"loss": out["lm_loss"], "grad_norm": out["grad_norm"]}


def eval_loss(model_chunks, micro_batches, forward_step=None) -> float:
    return reduce_report(forward_only(model_chunks, micro_batches, forward_step))["lm_loss"]


def split_micro_batches(tokens: torch.Tensor, num_micro_batches: int) -> list[MicroBatch]:
    """This rank's tokens [b, s+1] -> micro-batches on platform.device() (one copy of the tokens)."""
    if tokens.shape[0] % num_micro_batches:
        raise ValueError(f"batch of {tokens.shape[0]} is not divisible into {num_micro_batches} micro-batches")
    tokens = tokens.to(platform.device())
    return [make_lm_batch(t) for t in tokens.chunk(num_micro_batches)]


def data_parallel_shard(tokens: torch.Tensor) -> torch.Tensor:
    """This DP rank's contiguous share of a global batch."""
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    if tokens.shape[0] % dp:
        raise ValueError(f"global batch {tokens.shape[0]} is not divisible by data-parallel size {dp}")
    return tokens.chunk(dp)[rank]


def split_rows(batch: MicroBatch, parts: int) -> list[MicroBatch]:
    """A padded batch (one sample per row) cut into `parts` contiguous row blocks."""
    tensors = batch.tensors()
    n = next(iter(tensors.values())).shape[0]
    if any(v.shape[0] != n for v in tensors.values()):
        raise ValueError(f"batch tensors disagree in their number of rows: "
                         f"{ {k: tuple(v.shape) for k, v in tensors.items()} }")
    if n % parts:
        raise ValueError(f"batch of {n} sequences is not divisible into {parts} parts")
    chunks = {k: v.chunk(parts) for k, v in tensors.items()}
    return [replace(batch, **{k: c[i] for k, c in chunks.items()}) for i in range(parts)]


def shard_and_split(batch: MicroBatch, num_micro_batches: int) -> list[MicroBatch]:
    """This DP rank's contiguous share of the global (host) batch, as micro-batches on platform.device():
    the one host-to-device copy of the step's data (only this rank's rows travel)."""
    share = split_rows(batch, parallel_state.get_data_parallel_world_size())
    return split_rows(share[parallel_state.get_data_parallel_rank()].to(), num_micro_batches)
