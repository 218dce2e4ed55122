"""Metrics and logging of the RL trainer: W&B, metrics.jsonl, console lines, progress bars, plots."""
from .metrics import (CONFIG_FILE, METRICS_FILE, REQUIRED_METRICS, LoggingConfig, Metric, MetricsLogger,
                      PhaseTimer, format_console_line, missing_metrics, progress_bar, reduce_metrics,
                      required_metrics)
from .wandb_reader import OfflineRun, find_wandb_file, read_wandb_offline_run

__all__ = ["CONFIG_FILE", "METRICS_FILE", "REQUIRED_METRICS", "LoggingConfig", "Metric", "MetricsLogger",
           "OfflineRun", "PhaseTimer", "find_wandb_file", "format_console_line", "missing_metrics",
           "progress_bar", "read_wandb_offline_run", "reduce_metrics", "required_metrics"]
