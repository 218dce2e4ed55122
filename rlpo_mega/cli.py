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
    from moe.families import UnsupportedModelError
    from rlpo_mega.distributed import ParallelLayoutError
    from rlpo_mega.training import lm_demo

    try:
        lm_demo.run(cfg)
    except (ParallelLayoutError, UnsupportedModelError) as e:
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


def _convert(args) -> int:
    from rlpo_mega import convert

    if (args.nproc_per_node > 1) and "LOCAL_RANK" not in os.environ:
        return _reexec(args.nproc_per_node, ["convert", "--hf", args.hf, "--out", args.out, "--tp", str(args.tp),
                                              "--pp", str(args.pp), "--ep", str(args.ep)])
    convert.convert(args.hf, args.out, args.tp, args.pp, args.ep)
    return 0


def _export(args) -> int:
    from rlpo_mega import convert

    convert.export(args.ckpt, args.hf_out, bucket_mb=args.bucket_mb)
    return 0


def _reexec(nproc: int, argv: list[str]) -> int:
    import subprocess

    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={nproc}", "-m", "rlpo_mega.cli", *argv])


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(prog="rlpo-mega")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a YAML config with key=value overrides")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor=2")
    train.add_argument("--nproc-per-node", type=int, default=1)
    train.add_argument("--nnodes", type=int, default=1)
    conv = sub.add_parser("convert", help="HF checkpoint directory -> megatron dist checkpoint")
    conv.add_argument("--hf", required=True)
    conv.add_argument("--out", required=True)
    conv.add_argument("--tp", type=int, default=1)
    conv.add_argument("--pp", type=int, default=1)
    conv.add_argument("--ep", type=int, default=1)
    exp = sub.add_parser("export", help="megatron dist checkpoint -> HF checkpoint directory")
    exp.add_argument("--ckpt", required=True)
    exp.add_argument("--hf-out", required=True)
    exp.add_argument("--bucket-mb", type=int, default=256)
    args = parser.parse_args(argv)
    if args.command == "convert":
        # One process per shard of the requested layout (expert-tensor parallel 1).
        import math

        args.nproc_per_node = math.lcm(args.tp, args.ep) * args.pp
        return _guarded(_convert, args)
    if args.command == "export":
        return _guarded(_export, args)
    if args.command == "train":
        return _train(args)
    return 1


def _guarded(fn, args) -> int:
    from moe.bridge.hf_checkpoint import CheckpointFormatError
    from moe.families import UnsupportedModelError
    from rlpo_mega.checkpoint import CheckpointError
    from rlpo_mega.distributed import ParallelLayoutError

    try:
        return fn(args)
    except (CheckpointFormatError, UnsupportedModelError, CheckpointError, ParallelLayoutError,
            FileNotFoundError) as e:
        print(f"rlpo-mega {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
