"""`rlpo-mega` command line: train (in-process, or re-exec under torchrun for several processes), check,
plot, convert, export."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def _config_error(e) -> int:
    print(f"rlpo-mega: config error: {e}", file=sys.stderr)
    return 2


def _train(args) -> int:
    from rlpo_mega.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, tuple(args.overrides))
    except (ConfigError, FileNotFoundError) as e:
        return _config_error(e)
    nproc, nnodes = args.nproc_per_node, args.nnodes
    from rlpo_mega.checkpoint import CheckpointError

    if (nproc > 1 or nnodes > 1) and "LOCAL_RANK" not in os.environ:
        from rlpo_mega.training.state import plan_checkpoints

        try:  # once, here, before torchrun starts the workers (they check again: direct torchrun / SLURM)
            plan_checkpoints(cfg.checkpoint)
        except CheckpointError as e:
            print(f"rlpo-mega: {e}", file=sys.stderr)
            return 2
        return _reexec_under_torchrun(args)
    from moe.families import UnsupportedModelError
    from rlpo_mega.distributed import ParallelLayoutError

    try:
        from rlpo_mega.training.trainer import train

        return train(cfg)
    except ConfigError as e:  # the trainer runs check_run_config before building anything
        return _config_error(e)
    except (ParallelLayoutError, UnsupportedModelError, CheckpointError) as e:
        print(f"rlpo-mega: {e}", file=sys.stderr)
        return 2


def torchrun_argv(args, env=None) -> list[str]:
    """The `python -m torch.distributed.run ... -m rlpo_mega.cli train CONFIG OVERRIDES` command of `args`.

    One node: --standalone unless --master-addr is given. Several nodes: static rendezvous as
    launch/torchrun.sh does it (--node-rank, --master-addr, --master-port, --rdzv-id), with the flags
    defaulting to the NODE_RANK, MASTER_ADDR and MASTER_PORT environment variables.
    """
    env = os.environ if env is None else env
    master_addr = args.master_addr or env.get("MASTER_ADDR")
    node_rank = args.node_rank if args.node_rank is not None else int(env.get("NODE_RANK", "0"))
    master_port = args.master_port if args.master_port is not None else int(env.get("MASTER_PORT", "29500"))
    if args.nnodes < 1 or args.nproc_per_node < 1:
        raise ValueError(f"--nnodes={args.nnodes} and --nproc-per-node={args.nproc_per_node} must be >= 1")
    if not 0 <= node_rank < args.nnodes:
        raise ValueError(f"--node-rank={node_rank} must be in [0, --nnodes={args.nnodes})")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nnodes}",
           f"--nproc-per-node={args.nproc_per_node}"]
    if args.nnodes == 1 and not master_addr:
        cmd.append("--standalone")
    else:
        if not master_addr:
            raise ValueError(f"--nnodes={args.nnodes} needs the rendezvous host: pass --master-addr (node rank 0's "
                             "hostname) or set MASTER_ADDR")
        cmd += [f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}",
                f"--rdzv-id={args.rdzv_id or env.get('SLURM_JOB_ID', 'rlpo')}"]
    cmd.append(f"--max-restarts={args.max_restarts}")
    if args.log_dir:
        cmd += [f"--log-dir={args.log_dir}", "--tee=3"]
    cmd += ["-m", "rlpo_mega.cli", "train", args.config, *args.overrides]
    return cmd


def _reexec_under_torchrun(args) -> int:
    import subprocess

    try:
        cmd = torchrun_argv(args)
    except ValueError as e:
        print(f"rlpo-mega train: {e}", file=sys.stderr)
        return 2
    return subprocess.call(cmd)


def _check(args) -> int:
    from rlpo_mega.config import ConfigError, load_config
    from rlpo_mega.config_checks import check_run_config

    try:
        cfg = load_config(args.config, tuple(args.overrides))
        warns = check_run_config(cfg, None, world_size=args.world_size)
    except (ConfigError, FileNotFoundError) as e:
        return _config_error(e)
    layout = f" at world size {args.world_size}" if args.world_size else ""
    print(f"{args.config}: ok{layout} ({len(warns)} warning{'' if len(warns) == 1 else 's'})")
    return 0


def _plot(args) -> int:
    from rlpo_mega.logging import plot as plot_mod

    return plot_mod.run_args(args)


def _convert(args) -> int:
    from rlpo_mega import convert

    if (args.nproc_per_node > 1) and "LOCAL_RANK" not in os.environ:
        from moe.bridge.outputs import check_target

        check_target(args.out, convert.CONVERTED, args.overwrite)  # once, here, before torchrun starts
        return _reexec(args.nproc_per_node, ["convert", "--hf", args.hf, "--out", args.out, "--tp", str(args.tp),
                                              "--pp", str(args.pp), "--ep", str(args.ep)]
                       + (["--overwrite"] if args.overwrite else []))
    convert.convert(args.hf, args.out, args.tp, args.pp, args.ep, overwrite=args.overwrite)
    return 0


def _export(args) -> int:
    from rlpo_mega import convert

    convert.export(args.ckpt, args.hf_out, bucket_mb=args.bucket_mb, overwrite=args.overwrite)
    return 0


def _reexec(nproc: int, argv: list[str]) -> int:
    import subprocess

    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={nproc}", "-m", "rlpo_mega.cli", *argv])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpo-mega")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a YAML config with key=value overrides")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor=2")
    tr = train.add_argument_group("torchrun (re-executes under torch.distributed.run when nproc-per-node or "
                                  "nnodes > 1)")
    tr.add_argument("--nproc-per-node", type=int, default=1, help="processes (GPUs) per node")
    tr.add_argument("--nnodes", type=int, default=1)
    tr.add_argument("--node-rank", type=int, default=None, help="this node's rank (default: $NODE_RANK, else 0)")
    tr.add_argument("--master-addr", default=None, help="rendezvous host, node rank 0 (default: $MASTER_ADDR)")
    tr.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: $MASTER_PORT, else 29500)")
    tr.add_argument("--rdzv-id", default=None, help="rendezvous id, the same on every node (default: "
                                                    "$SLURM_JOB_ID, else rlpo)")
    tr.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of failed workers (default 0)")
    tr.add_argument("--log-dir", default=None, help="torchrun's per-rank stdout/stderr files (with --tee)")
    check = sub.add_parser("check", help="validate a config (keys, types, cross-field checks, parallel layout) "
                                         "without running anything")
    check.add_argument("config")
    check.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor=2")
    check.add_argument("--world-size", type=int, default=None,
                       help="total processes (nodes x GPUs per node): also checks the parallel layout and the "
                            "data-parallel split of the batch")
    from rlpo_mega.logging import plot as plot_mod

    plot_mod.build_parser(sub.add_parser("plot", help="plot a run's metrics.jsonl curves to a PNG"))
    conv = sub.add_parser("convert", help="HF checkpoint directory -> megatron dist checkpoint")
    conv.add_argument("--hf", required=True)
    conv.add_argument("--out", required=True)
    conv.add_argument("--tp", type=int, default=1)
    conv.add_argument("--pp", type=int, default=1)
    conv.add_argument("--ep", type=int, default=1)
    conv.add_argument("--overwrite", action="store_true",
                      help="replace --out if an earlier `convert` wrote it (never anything else)")
    exp = sub.add_parser("export", help="megatron dist checkpoint -> HF checkpoint directory")
    exp.add_argument("--ckpt", required=True)
    exp.add_argument("--hf-out", required=True)
    exp.add_argument("--bucket-mb", type=int, default=256)
    exp.add_argument("--overwrite", action="store_true",
                     help="replace --hf-out if an earlier export wrote it (never a checkpoint, a save_dir or "
                          "other files)")
    return parser


def parse(argv=None):
    """argparse, except that dotted overrides may also follow the options (`train C --nproc-per-node 2 a=1`):
    argparse alone stops collecting positionals at the first option."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse(argv)
    if args.command == "convert":
        # One process per shard of the requested layout (expert-tensor parallel 1).
        import math

        args.nproc_per_node = math.lcm(args.tp, args.ep) * args.pp
        return _guarded(_convert, args)
    if args.command == "export":
        return _guarded(_export, args)
    if args.command == "train":
        return _train(args)
    if args.command == "check":
        return _check(args)
    if args.command == "plot":
        return _plot(args)
    return 1


def _guarded(fn, args) -> int:
    from moe.bridge.hf_checkpoint import CheckpointFormatError
    from moe.bridge.outputs import OutputExistsError
    from moe.families import UnsupportedModelError
    from rlpo_mega.checkpoint import CheckpointError
    from rlpo_mega.distributed import ParallelLayoutError

    try:
        return fn(args)
    except (CheckpointFormatError, UnsupportedModelError, CheckpointError, ParallelLayoutError,
            FileNotFoundError, OutputExistsError) as e:
        print(f"rlpo-mega {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
