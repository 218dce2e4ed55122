"""The critic's scalar head: V(s_t) = w . h_t + b in place of the GPT output layer.

A value model is the policy's family built by moe.model.build_gpt_model(value_head=True): the same decoder,
with `output_layer` replaced by this head, so GPTModel returns values [b, s, 1] where the policy returns
logits. Its HF form is transformers' *ForTokenClassification with num_labels=1 (`score.weight`
[1, hidden], `score.bias` [1]), so a critic trained elsewhere in that format loads, and the head's forward
is checked against transformers' own.

Parallelism: the head is tiny, so every tensor-parallel rank holds all of it (no vocabulary split). With
sequence parallelism each TP rank holds a slice of the positions: the values are gathered along the
sequence (the loss is computed whole on every TP rank, as the policy's is), the backward takes each rank's
slice back, and the head's gradient -- partial per slice -- is summed over TP by megatron's
finalize_model_grads (the `sequence_parallel` attribute, as for the norms).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from moe.families import VALUE_HEAD_HF  # noqa: F401  (re-exported; defined there so the bridge needs no megatron)


class ValueHead(MegatronModule):
    def __init__(self, config, seed: int = 0):
        super().__init__(config=config)
        h = config.hidden_size
        # drawn from its own generator: identical at every layout and on every rank (no TP/PP RNG streams)
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(1, h, generator=g, dtype=torch.float32) * config.init_method_std
        self.weight = torch.nn.Parameter(w.to(config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        self.sequence_parallel = config.sequence_parallel  # GPTModel reads it (inference path)
        for p in (self.weight, self.bias):
            p.sequence_parallel = config.sequence_parallel  # grads summed over TP under SP

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        """hidden [s (/tp under SP), b, h] -> (values [s, b, 1], None), the output layer's contract."""
        # the bias may be kept in the norms' dtype (moe.model.build_gpt_model): computed in the weight's
        values = torch.nn.functional.linear(hidden, self.weight, self.bias.to(self.weight.dtype))
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            # every TP rank computes the whole loss: the backward keeps this rank's slice (no sum)
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None
