"""Checkpointing, in one place: what a save writes and what a load trusts.

dist.py      megatron distributed checkpoints: model (+ optimizer) at one layout, loadable at any other; written
             to `<dir>.tmp` and swapped in, the meta file last
layer_spec.py checkpoints across megatron's local and Transformer Engine layer specs: the spec recorded at save, the
             norms' keys mapped and TE's extra state left to the module at load
distopt.py   the distributed optimizer's state, each rank its own share (no gathers on one host)
files.py     what a checkpoint promises about itself: every file's checksum, the model it was written for
writes.py    those checksums taken as a save writes its files (megatron's writer processes included): no read back
run.py       a run's timeline under checkpoint.save_dir: step directories, `latest`, keep-last-K, RNG states,
             the trainer state, SIGTERM
"""
import moe  # noqa: F401  (first: it settles how megatron-core is imported on this platform, moe/__init__.py)
