"""Prompt data: validated JSONL / Parquet prompt files, seeded resumable sampling with chat templates,
n samples per prompt and DAPO dynamic sampling, streamed (GroupCollector)."""
from .dataset import DataError, PromptRecord, load_prompts
from .sampling import (DynamicSamplingReport, Group, GroupCollector, PromptItem, PromptSampler, group_ids,
                       render_prompt)

__all__ = ["DataError", "DynamicSamplingReport", "Group", "GroupCollector", "PromptItem", "PromptRecord",
           "PromptSampler", "group_ids", "load_prompts", "render_prompt"]
