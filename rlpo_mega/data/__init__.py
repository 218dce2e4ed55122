"""Prompt data: validated JSONL / Parquet prompt files, seeded resumable sampling with chat templates,
n samples per prompt."""
from .dataset import DataError, PromptRecord, load_prompts
from .sampling import PromptItem, PromptSampler, group_ids, render_prompt

__all__ = ["DataError", "PromptItem", "PromptRecord", "PromptSampler", "group_ids", "load_prompts", "render_prompt"]
