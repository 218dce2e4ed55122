"""Runs the trainer in-process under torchrun: argv = config overrides... (tests register extra reward
functions / engines by importing tests.workers.train_hooks first when RLPO_TEST_HOOKS=1)."""
import os
import sys

from rlpo_mega.config import load_config

if os.environ.get("RLPO_TEST_HOOKS"):
    import tests.workers.train_hooks  # noqa: F401

from rlpo_mega.training.trainer import train

if __name__ == "__main__":
    config, *overrides = sys.argv[1:]
    sys.exit(train(load_config(config, tuple(overrides))))
