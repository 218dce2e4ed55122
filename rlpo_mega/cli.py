"""`rlpo-mega` command line: train (in-process, or re-exec under torchrun for several processes), check, plan,
plot, convert, export."""
from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

from rlpo_mega.config import ConfigError, load_config
from rlpo_mega.logging import plot as plot_mod
from rlpo_mega.processes import die_with_parent

# Imported inside the commands that use them: rlpo_mega.errors, config_checks, checkpoint, planning, convert,
# the trainer and everything under moe/ import torch (moe/__init__.py) and transformers (seconds), which `--help`
# and `plot` never need.


def _train(args) -> int:
    from rlpo_mega.errors import is_user_error, report

    try:
        if args.nproc_per_node < 1 or args.nnodes < 1:
            raise ConfigError(f"--nnodes={args.nnodes} and --nproc-per-node={args.nproc_per_node} must be >= 1")
        cfg = load_config(args.config, tuple(args.overrides))
        if (args.nproc_per_node > 1 or args.nnodes > 1) and "LOCAL_RANK" not in os.environ:
            # the launcher: everything that can be checked without a process group is checked once, here,
            # before torchrun starts the workers (they check again: direct torchrun / SLURM)
            _check_before_launch(cfg, args)
            return _launch(args)
    except Exception as e:
        if is_user_error(e):
            return report("train", e, args.debug)
        raise
    if "LOCAL_RANK" in os.environ:
        die_with_parent()  # a killed launcher or torchrun takes its workers with it
    try:
        from moe.model import have_transformer_engine
        from rlpo_mega.distributed import bind_device

        bind_device()  # this rank's GPU before TE's import below can touch CUDA (else on GPU 0, in every rank)
        # the trainer's modules import megatron-core, which imports Transformer Engine when it is installed: a
        # broken TE is one error here (TransformerEngineError) instead of an OSError from deep inside megatron
        have_transformer_engine()
        from rlpo_mega.training.trainer import train

        return train(cfg)
    except BaseException as e:
        if is_user_error(e):
            return report("train", e, args.debug)
        raise


def _check_before_launch(cfg, args):
    from moe.families import get_family
    from rlpo_mega.config_checks import check_run_config
    from rlpo_mega.checkpoint.run import plan_checkpoints

    from moe.model import load_hf_config

    hf = load_hf_config(cfg.model.hf_config) if cfg.model.hf_config else None
    check_run_config(cfg, hf, world_size=args.nproc_per_node * args.nnodes, log_warnings=False, nodes=args.nnodes)
    plan_checkpoints(cfg.checkpoint, get_family(hf.model_type).identity(hf) if hf is not None else None)


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


_TORCHRUN_LOGGERS = ("torch.distributed.run", "torch.distributed.launcher.api",
                     "torch.distributed.elastic.agent.server.api",
                     "torch.distributed.elastic.agent.server.local_elastic_agent",
                     "torch.distributed.elastic.multiprocessing.api",
                     "torch.distributed.elastic.multiprocessing.errors",
                     "torch.distributed.elastic.multiprocessing.errors.error_handler")


def _launch(args) -> int:
    """torchrun's agent in this process (not a child): a signal to `rlpo-mega` is a signal to the agent, which
    passes it to every worker and waits --stop-timeout seconds for them to save before killing them. A worker's
    user error comes back through RLPO_ERROR_FILE and is printed once, without torchrun's report; a crash names
    the rank whose traceback is above. The dead ranks' process groups (helpers they started) are killed."""
    from rlpo_mega.errors import EXIT_USER_ERROR

    try:
        cmd = torchrun_argv(args)
    except ValueError as e:
        print(f"rlpo-mega train: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return _agent(cmd[3:], "train", args.debug, args.stop_timeout)  # cmd: python -m torch.distributed.run ...


def _frame_method_name(depth: int = 2) -> str:
    """torch's rendezvous names each of its events by the caller's caller, with inspect.stack() twice
    (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:52-55, torch 2.13; evaluated for every event even
    when no event handler is set). inspect.stack() reads every frame's source and walks sys.modules per frame
    (inspect.getmodule), with torch, megatron and transformers imported; most of it while the agent closes the
    rendezvous after the workers have exited. A 2-step demo run, timed: 37.4 -> 34.2 s of CPU, 25.2 -> 23.2 s
    wall. The same name, from the frame: sys._getframe(depth) here is inspect.stack()[depth] there."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def _agent(argv: list[str], command: str, debug: bool, stop_timeout: int) -> int:
    import shutil
    import signal
    import tempfile

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from rlpo_mega.errors import ERROR_FILE_ENV, EXIT_STOPPED, EXIT_USER_ERROR

    dynamic_rendezvous.get_method_name = _frame_method_name
    argv = [f"--shutdown-timeout={stop_timeout}"] + argv
    scratch = tempfile.mkdtemp(prefix="rlpo-launch-")
    error_file = os.path.join(scratch, "error")
    os.environ[ERROR_FILE_ENV] = error_file
    if not debug:
        for name in _TORCHRUN_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        torchrun.run(torchrun.parse_args(argv))
        return 0
    except SignalException as e:
        print(f"rlpo-mega {command}: stopped by {signal.Signals(e.sigval).name}"
              + ("; the workers saved a checkpoint if checkpoint.save_dir is set: run the same command to resume"
                 if command == "train" else ""), file=sys.stderr)
        return EXIT_STOPPED
    except ChildFailedError as e:
        for failure in e.failures.values():  # what a dead rank started lives in its process group
            try:
                os.killpg(failure.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass
        if os.path.isfile(error_file):
            with open(error_file) as f:
                print(f.read().strip(), file=sys.stderr)
            return EXIT_USER_ERROR
        codes = {f.exitcode for f in e.failures.values()}
        if EXIT_STOPPED in codes and codes <= {EXIT_STOPPED, -signal.SIGTERM}:  # a signal sent to the workers
            return EXIT_STOPPED  # themselves (the agent stops the rest with SIGTERM once one has exited)
        rank, first = e.get_first_failure()
        how = f"signal {first.signal_name()}" if first.exitcode < 0 else f"exit code {first.exitcode}"
        print(f"rlpo-mega {command}: rank {rank} failed ({how}); its traceback is above", file=sys.stderr)
        return 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.pop(ERROR_FILE_ENV, None)
        shutil.rmtree(scratch, ignore_errors=True)


def _check(args) -> int:
    from rlpo_mega.config_checks import check_run_config
    from rlpo_mega.errors import is_user_error, report

    try:
        cfg = load_config(args.config, tuple(args.overrides))
        c = cfg.cluster
        world = args.world_size or (c.learner_nodes * c.gpus_per_node if c.learner_nodes else None)
        warns = check_run_config(cfg, None, world_size=world)
        if world is not None:  # what depends on size, at the size: `rlpo-mega plan` (uniform lengths)
            from rlpo_mega.planning.plan import PlanError, make_plan, quiet_megatron

            quiet_megatron()
            exceeded = make_plan(cfg, args.config, world).first_exceeded()
            if exceeded:
                raise PlanError(f"{exceeded} (rlpo-mega plan {args.config} prints the tables)")
        if cfg.checkpoint.save_dir or cfg.checkpoint.load_dir:  # what train would refuse about checkpoints
            from moe.families import get_family
            from moe.model import load_hf_config
            from rlpo_mega.checkpoint.run import plan_checkpoints

            hf = load_hf_config(cfg.model.hf_config)
            plan_checkpoints(cfg.checkpoint, get_family(hf.model_type).identity(hf))
    except Exception as e:
        if is_user_error(e):
            return report("check", e, args.debug)
        raise
    layout = f" at world size {world} (planned)" if world else ""
    print(f"{args.config}: ok{layout} ({len(warns)} warning{'' if len(warns) == 1 else 's'})")
    return 0


def _plan(args) -> int:
    import json

    from rlpo_mega.errors import is_user_error, report
    from rlpo_mega.planning.plan import make_plan, quiet_megatron, render

    quiet_megatron()
    try:
        cfg = load_config(args.config, tuple(args.overrides))
        plan = make_plan(cfg, args.config, args.world_size, args.lengths, args.steps, args.prompt_tokens, args.seed,
                         refit=True)
    except Exception as e:
        if is_user_error(e):
            return report("plan", e, args.debug)
        raise
    print(json.dumps(plan.to_json()) if args.json else render(plan))
    exceeded = plan.first_exceeded()
    if exceeded:
        print(f"rlpo-mega plan: {exceeded}", file=sys.stderr)
        return 2
    return 0


def _plot(args) -> int:
    return plot_mod.run_args(args)


def _convert(args) -> int:
    from rlpo_mega import convert

    if (args.nproc_per_node > 1) and "LOCAL_RANK" not in os.environ:
        from moe.bridge.outputs import check_target

        check_target(args.out, convert.CONVERTED, args.overwrite)  # once, here, before torchrun starts
        return _reexec(args.nproc_per_node, ["convert", "--hf", args.hf, "--out", args.out, "--tp", str(args.tp),
                                              "--pp", str(args.pp), "--ep", str(args.ep)]
                       + (["--overwrite"] if args.overwrite else []), args.debug)
    convert.convert(args.hf, args.out, args.tp, args.pp, args.ep, overwrite=args.overwrite)
    return 0


def _export(args) -> int:
    from rlpo_mega import convert

    if not (args.hf_out or args.peft_out):
        raise ConfigError("export: give --hf-out (the HF model; a LoRA run's with its adapters merged) and/or "
                         "--peft-out (a LoRA run's adapters as a PEFT adapter directory)")
    if args.peft_out:  # first: small, and a checkpoint without adapters is refused before the merged export runs
        convert.export_peft(args.ckpt, args.peft_out, overwrite=args.overwrite)
    if args.hf_out:
        convert.export(args.ckpt, args.hf_out, bucket_mb=args.bucket_mb, overwrite=args.overwrite, base=args.base)
    return 0


def _reexec(nproc: int, argv: list[str], debug: bool = False) -> int:
    return _agent(["--standalone", f"--nproc-per-node={nproc}", "-m", "rlpo_mega.cli", *argv]
                  + (["--debug"] if debug else []), argv[0], debug, stop_timeout=60)


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
    tr.add_argument("--stop-timeout", type=int, default=300,
                    help="on SIGTERM/SIGINT: seconds the workers get to finish the step and save before they are "
                         "killed (default 300)")
    check = sub.add_parser("check", help="validate a config (keys, types, cross-field checks, parallel layout) "
                                         "without running anything")
    check.add_argument("config")
    check.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor=2")
    check.add_argument("--world-size", type=int, default=None,
                       help="total processes (nodes x GPUs per node; default cluster.learner_nodes x gpus_per_node): "
                            "also checks the parallel layout, the data-parallel split of the batch and, through "
                            "`rlpo-mega plan`, the memory budgets and the pre-emption window at that size")
    plan = sub.add_parser("plan", help="the config at its real size on this CPU, without GPUs or weights: memory per "
                                       "learner GPU, server GPU and host against their budgets, the step plan, "
                                       "the checkpoint's save time against the pre-emption window")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.gpu_memory_gb=141")
    plan.add_argument("--world-size", type=int, default=None,
                      help="learner processes (default: cluster.learner_nodes x cluster.gpus_per_node)")
    plan.add_argument("--lengths", default="uniform",
                      help="response lengths: uniform, heavy-tail or all-max (up to rollout.max_new_tokens), or a "
                           "file: a JSON array of lengths or a run's metrics.jsonl (default uniform)")
    plan.add_argument("--steps", type=int, default=20, help="steps of the planner to simulate (default 20)")
    plan.add_argument("--prompt-tokens", type=int, default=512, help="tokens of every prompt (default 512)")
    plan.add_argument("--seed", type=int, default=0, help="seed of the drawn lengths")
    plan.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    plot_mod.build_parser(sub.add_parser("plot", help="plot a run's metrics.jsonl curves to a PNG"))
    conv = sub.add_parser("convert", help="HF checkpoint directory -> megatron dist checkpoint")
    conv.add_argument("--hf", required=True)
    conv.add_argument("--out", required=True)
    conv.add_argument("--tp", type=int, default=1)
    conv.add_argument("--pp", type=int, default=1)
    conv.add_argument("--ep", type=int, default=1)
    conv.add_argument("--overwrite", action="store_true",
                      help="replace --out if an earlier `convert` wrote it (never anything else)")
    exp = sub.add_parser("export", help="megatron dist checkpoint -> HF checkpoint directory (a LoRA run's: merged) "
                                        "and/or a LoRA run's PEFT adapter directory")
    exp.add_argument("--ckpt", required=True)
    exp.add_argument("--hf-out", default=None, help="the HF model (a LoRA run's with its adapters merged into it)")
    exp.add_argument("--peft-out", default=None,
                     help="a LoRA run's adapters: adapter_config.json + adapter_model.safetensors for peft's "
                          "PeftModel.from_pretrained on the base model")
    exp.add_argument("--base", default=None,
                     help="a LoRA run's adapter-only checkpoint: the HF base to merge into (default: the one it "
                          "records; refused if it holds other weights)")
    exp.add_argument("--bucket-mb", type=int, default=256)
    exp.add_argument("--overwrite", action="store_true",
                     help="replace --hf-out / --peft-out if an earlier export wrote it (never a checkpoint, a "
                          "save_dir or other files)")
    agent = sub.add_parser("torchrun", help="torch.distributed.run's own arguments, run by rlpo-mega's agent "
                                            "(launch/torchrun.sh): a stop (SIGTERM/SIGINT, the workers saved) exits 75 "
                                            "where plain torchrun exits 1, and a worker's user error is one line")
    agent.add_argument("argv", nargs="*", help="torchrun's flags, then the entry point (passed on as they are)")
    for p in (train, check, plan, conv, exp):
        p.add_argument("--debug", action="store_true", help="show the traceback of an error, not only its line")
    return parser


def parse(argv=None):
    """argparse, except that dotted overrides may also follow the options (`train C --nproc-per-node 2 a=1`):
    argparse alone stops collecting positionals at the first option."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["torchrun"]:  # torchrun's own flags, passed on untouched (argparse would take them as ours)
        return argparse.Namespace(command="torchrun", argv=argv[1:])
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
    if "LOCAL_RANK" in os.environ and args.command in ("convert", "export"):
        die_with_parent()
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
    if args.command == "plan":
        return _plan(args)
    if args.command == "plot":
        return _plot(args)
    if args.command == "torchrun":  # --shutdown-timeout among the flags wins over the default
        return _agent(args.argv, "train", False, 300)
    return 1


def _guarded(fn, args) -> int:
    from rlpo_mega.errors import is_user_error, report

    try:
        return fn(args)
    except BaseException as e:
        if is_user_error(e):
            return report(args.command, e, args.debug)
        raise


def entry() -> None:
    """The `rlpo-mega` console script and `python -m rlpo_mega.cli` (torchrun's workers): main(), then an exit
    without the interpreter's collections over every object that torch, megatron-core and transformers built at
    import: frozen, the teardown's collections skip them (measured on a 2-rank CPU run: 3.4 s -> 0.7 s from the
    summary to the launcher's exit; 2.2 s of CPU for a process that only imports the trainer). Freezing changes no
    object: atexit handlers, buffered output and modules' teardown run as before."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
