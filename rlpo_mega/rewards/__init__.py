"""Reward functions (registry) and the async batched scorer that isolates their failures."""
from .functions import REWARDS, RemoteRewardError, RewardInput, batched
from .scorer import RewardResult, RewardScorer

__all__ = ["REWARDS", "RemoteRewardError", "RewardInput", "RewardResult", "RewardScorer", "batched"]
