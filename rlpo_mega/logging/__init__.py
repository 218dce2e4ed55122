"""Metrics and logging of the RL trainer: W&B, metrics.jsonl, console lines, progress bars, plots."""
from .metrics import (CONFIG_FILE, METRICS_FILE, LoggingConfig, MetricsLogger, PhaseTimer, format_console_line,
                      progress_bar, reduce_metrics)

__all__ = ["CONFIG_FILE", "METRICS_FILE", "LoggingConfig", "MetricsLogger", "PhaseTimer", "format_console_line",
           "progress_bar", "reduce_metrics"]
