"""RL algorithms: vocab-parallel log-probs, advantage / policy-loss / KL registries, aggregation,
mismatch corrections, reward shaping and dynamic sampling, as the papers define them
(the specification: shared/notes/algorithms.md, beside the repository)."""
from .advantages import ADVANTAGES, compute_advantages
from .aggregation import MODES as AGGREGATIONS
from .aggregation import aggregate
from .dynamic_sampling import filter_groups
from .kl import KL_ESTIMATORS
from .logprobs import vocab_parallel_logprobs
from .losses import LOSSES
from .objective import policy_objective, resolve_loss, validate

__all__ = ["ADVANTAGES", "AGGREGATIONS", "KL_ESTIMATORS", "LOSSES", "aggregate", "compute_advantages",
           "filter_groups", "policy_objective", "resolve_loss", "validate", "vocab_parallel_logprobs"]
