"""Optional supervised warm-up before RL: next-token loss on `answer + eos` after the rendered prompt.

The CPU demo uses it to teach a random tiny model the answer *format* only (its warm-up file pairs each
prompt with a random answer), so RL starts near zero reward and has to learn the task itself.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from rlpo_mega.data import load_prompts, render_prompt

log = logging.getLogger("rlpo_mega")


def _examples(trainer):
    c, tok = trainer.cfg, trainer.tokenizer
    records = trainer.records.get("warmup")  # read and validated before the model was built
    if records is None:  # the warm-up was switched on after the trainer was built (tests)
        records = load_prompts(c.trainer.warmup.path, "auto", c.prompts.prompt_key, c.prompts.answer_key)
    out = []
    for r in records:
        prompt = render_prompt(tok, r.prompt, c.prompts.chat_template, c.prompts.system_prompt)
        answer = list(tok(str(r.reference), add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
        out.append((prompt, answer))
    return out


def _batch(examples, rows, tp: int, pad: int) -> dict:
    width = max(len(examples[i][0]) + len(examples[i][1]) for i in rows)
    seq = -(-(width - 1) // tp) * tp
    tokens = torch.full((len(rows), seq + 1), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), seq + 1)
    for j, i in enumerate(rows):
        p, a = examples[i]
        tokens[j, :len(p) + len(a)] = torch.tensor(p + a)
        mask[j, len(p):len(p) + len(a)] = 1.0
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": mask[:, 1:]}


def supervised_warmup(trainer):
    """trainer.cfg.trainer.warmup.steps optimizer steps of batch_size examples (seeded order, cycling).
    Returns the last loss, or None when a signal stopped it (polled after every step)."""
    from rlpo_mega.training.policy_step import shard_and_split
    from rlpo_mega.training.step import train_step

    w = trainer.cfg.trainer.warmup
    examples = _examples(trainer)
    order = np.random.default_rng([trainer.cfg.seed, 7]).permutation(len(examples))
    groups = trainer.optimizer.param_groups
    lrs = [g["lr"] for g in groups]
    if w.lr is not None:
        for g in groups:
            g["lr"] = w.lr
    pos, loss = 0, float("nan")
    try:
        for step in range(w.steps):
            rows = [int(order[(pos + j) % len(order)]) for j in range(w.batch_size)]
            pos += w.batch_size
            batch = _batch(examples, rows, trainer.layout.tensor, trainer.tokenizer.pad_token_id or 0)
            micro = shard_and_split(batch, trainer.cfg.parallel.num_micro_batches)
            loss = train_step(trainer.chunks, trainer.optimizer, micro)["loss"]
            if trainer.stop.any_rank(trainer.device):  # the warm-up is not saved: it reruns on the next start
                if trainer.rank == 0:
                    log.warning("stopped by signal at warm-up step %d/%d; nothing saved (a warm-up is not "
                                "checkpointed: the next start runs it again)", step + 1, w.steps)
                return None
            if trainer.rank == 0 and (step % 20 == 0 or step == w.steps - 1):
                log.info("warm-up step %d/%d: answer-token loss %.4f", step + 1, w.steps, loss)
    finally:
        for g, lr in zip(groups, lrs):
            g["lr"] = lr
    return loss
