"""Environments of multi-turn episodes (registry), the runner that isolates their failures, and the shipped ones."""
from .base import ENVIRONMENTS, Action, Environment, Feedback, environment_tools
from .runner import EnvRunner
from . import lookup, python_tool  # noqa: F401,E402  (register "lookup", "python")

__all__ = ["ENVIRONMENTS", "Action", "EnvRunner", "Environment", "Feedback", "environment_tools"]
