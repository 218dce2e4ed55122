"""Rollout engines (one registry, ENGINES): the embedded HF engine and the SGLang client."""
from .base import ENGINES, EngineError, FINISH_REASONS, RolloutInterrupted, RolloutEngine, Sample, SamplingParams
from . import embedded  # noqa: F401  registers ENGINES "embedded"
from . import sglang_engine  # noqa: F401  registers ENGINES "sglang" (plain HTTP: needs no sglang here)

__all__ = ["ENGINES", "EngineError", "FINISH_REASONS", "RolloutInterrupted", "RolloutEngine", "Sample", "SamplingParams"]
