"""Runs the real `rlpo-mega train` entry inside torchrun; reports how it ended on stderr.

Used with a bad layout: every rank must fail in resolve_layout, before a process group exists.
Usage: validate_layout.py CONFIG.yaml OVERRIDE...
"""
import os
import sys
import time


def main():
    t0 = time.time()
    import torch.distributed as dist

    from rlpo_mega import cli

    rc = cli.main(["train", *sys.argv[1:]])
    print(f"VALIDATE rank={os.environ.get('RANK')} rc={rc} process_group={dist.is_initialized()} "
          f"seconds={time.time() - t0:.1f}", file=sys.stderr, flush=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
