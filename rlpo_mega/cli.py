"""`rlpo-mega` command line: train (in-process, or re-exec under torchrun for several processes)."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def _train(args) -> int:
    from rlpo_mega.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, tuple(args.overrides))
    except (ConfigError, FileNotFoundError) as e:
        print(f"rlpo-mega: config error: {e}", file=sys.stderr)
        return 2
    nproc, nnodes = args.nproc_per_node, args.nnodes
    if (nproc > 1 or nnodes > 1) and "LOCAL_RANK" not in os.environ:
        return _reexec_under_torchrun(args)
    from rlpo_mega.distributed import ParallelLayoutError
    from rlpo_mega.training import lm_demo

    try:
        lm_demo.run(cfg)
    except ParallelLayoutError as e:
        print(f"rlpo-mega: {e}", file=sys.stderr)
        return 2
    return 0


def _reexec_under_torchrun(args) -> int:
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}",
           f"--nnodes={args.nnodes}"]
    if args.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--node-rank={os.environ.get('NODE_RANK', '0')}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29500')}"]
    cmd += ["-m", "rlpo_mega.cli", "train", args.config, *args.overrides]
    return subprocess.call(cmd)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(prog="rlpo-mega")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a YAML config with key=value overrides")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor=2")
    train.add_argument("--nproc-per-node", type=int, default=1)
    train.add_argument("--nnodes", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "train":
        return _train(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
