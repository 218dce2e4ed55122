"""The learner's step and what it runs (trainer.py maps it). `moe` first: it settles how megatron-core is imported on
this platform (moe/__init__.py) before batches, critic, update, warmup and old_logprobs import megatron-core."""
import moe  # noqa: F401
