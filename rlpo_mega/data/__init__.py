"""Prompt data: validated JSONL / Parquet prompt files, seeded resumable sampling with chat templates,
n samples per prompt and DAPO dynamic sampling's refill loop."""
from .dataset import DataError, PromptRecord, load_prompts
from .sampling import (DynamicSamplingReport, GroupBatch, PromptItem, PromptSampler, collect_groups, group_ids,
                       render_prompt)

__all__ = ["DataError", "DynamicSamplingReport", "GroupBatch", "PromptItem", "PromptRecord", "PromptSampler",
           "collect_groups", "group_ids", "load_prompts", "render_prompt"]
