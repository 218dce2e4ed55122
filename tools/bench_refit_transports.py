"""Benchmark (issue 60 item 6(b); part (a), the receiver, is tools/bench_refit.py): 4 megatron learner ranks (EP4,
2 rollout drivers) into two real CPU SGLang servers at TP2, the old transport (sglang_distributed: each parameter's
leader sends it whole to both drivers, each driver broadcasts it to its server's TP ranks) against the new one
(reshard: every rank sends its own shards to the server ranks holding them), side by side in one run: the wall
time of each sync (after one untimed sync each: the receivers learn), the bytes each learner rank sends and each
server rank receives against its own share (the plan's, and the old protocol's by its definition: a driver receives
the model and sends it once per TP rank of its server), and both syncs digest-verified.

    .venv/bin/python tools/bench_refit_transports.py [--layers 8] [--experts 16] [--reps 3]
Needs the SGLang venv (make venv-sglang); ~3 minutes on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

SERVER_ARGS = dict(device="cpu", attention_backend="torch_native", disable_overlap_schedule=True,
                   max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=512,
                   mem_fraction_static=0.15, skip_server_warmup=True, enable_return_routed_experts=True,
                   skip_tokenizer_init=True, dtype="float32", sleep_on_idle=True)


def worker(ckpt: str, urls: str, reps: int) -> dict:
    """Under torchrun: both transports, alternately, on one model and two servers."""
    import torch.distributed as dist

    from moe.model import load_hf_config
    from rlpo_mega import distributed
    from rlpo_mega.config import load_config
    from rlpo_mega.model_setup import build_policy
    from rlpo_mega.rollout.engines import build_engine, make_transport
    from rlpo_mega.training.sync import sync_weights

    cfg = load_config(None, (f"model.hf_config={ckpt}/config.json", f"model.init_from_hf={ckpt}",
                             "rollout.engine=sglang", f"rollout.sglang.urls=[{urls}]", "rollout.sglang.tp_size=2",
                             "rollout.sglang.drivers=2", "rollout.sync_transport=reshard", "parallel.expert=4",
                             "rollout.sync_bucket_mb=4", "logging.wandb=false"))
    old_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, sync_transport="sglang_distributed"))
    hf = load_hf_config(cfg.model.hf_config)
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    chunks, _ = build_policy(hf, layout, cfg.model, cfg.optim)
    engine = build_engine(cfg, hf)
    new = make_transport(cfg, engine, hf)
    old = types.SimpleNamespace(transport=make_transport(old_cfg, engine, hf) if engine is not None else None,
                                group=None)
    times = {"reshard": [], "sglang_distributed": []}
    receivers = []  # each reshard sync's server-rank reports (the receivers' cumulative counts), this driver's
    results = {}
    for rep in range(reps + 1):
        for name, run in (("reshard", lambda: new.sync_model(chunks)),
                          ("sglang_distributed", lambda: sync_weights(chunks, old_cfg, old))):
            dist.barrier()
            t0 = time.perf_counter()
            results[name] = run()
            if name == "reshard":
                receivers.append(results[name].get("server_ranks", {}))
            dist.barrier()
            if rep:  # the first of each: the receivers learn, the groups form
                times[name].append(time.perf_counter() - t0)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, results["reshard"])
    # the receivers' time per tensor in the timed syncs (the first one learned): this driver's server ranks
    spans = []
    for key, last in receivers[-1].items():
        first = receivers[0][key]["receiver"]
        n = last["receiver"]["region_replayed"] - first["region_replayed"]
        spans.append((last["receiver"]["region_seconds"] - first["region_seconds"]) / max(1, n) * 1e6)
    receiver_us = [None] * dist.get_world_size()
    dist.all_gather_object(receiver_us, spans)
    # the old protocol's bytes by its definition (moe/bridge/megatron_io.ExportStream, dst=the drivers): each
    # parameter's leader (its lowest holding rank) sends it whole to every driver but itself (a tensor every rank
    # holds whole: each driver's own copy); a driver then broadcasts the model to its server's TP ranks
    import math

    from moe.bridge.megatron_io import _export_plan, _inner

    _, owners, meta, _ = _export_plan(chunks[0])
    everywhere = _inner(chunks[0])._rlpo_everywhere
    drivers = [0, 2]
    old_sent = [0] * dist.get_world_size()
    for name, ranks in owners.items():
        if name in everywhere:
            continue
        nbytes = math.prod(meta[name][0]) * 4  # float32: the engine's dtype here
        old_sent[ranks[0]] += nbytes * sum(d != ranks[0] for d in drivers)
    plan, _ = next(iter(new._plans.values()))
    out = {"times": times, "reshard": every, "old_sent": old_sent, "receiver_us": receiver_us, "plan_sent": plan.sent_bytes(), "model_bytes": plan.model.nbytes,
           "shard": {f"{s}.{r}": n for (s, r), n in plan.shard_bytes().items()}, "urls": urls.split(","),
           "tensors": len(plan.model.tensors)}
    new.close()
    if old.transport is not None:
        old.transport.close()
        engine.shutdown()
    distributed.destroy()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--python", default=os.path.join(ROOT, ".venv-sglang", "bin", "python"))
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        out = worker(args.worker[0], args.worker[1], int(args.worker[2]))
        if int(os.environ.get("RANK", "0")) == 0:
            with open(os.environ["RLPO_BENCH_OUT"], "w") as f:
                json.dump(out, f)
        return 0
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    from sglang_server import SGLangServer

    from bench_refit import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        # a moe-TP split SGLang's CPU path does not pad (a multiple of TP x 32)
        ckpt = os.path.join(tmp, "hf")
        make_checkpoint(ckpt, args.layers, args.experts, moe_intermediate_size=64)
        env = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.path.join(ROOT, "tests", "sglang_support", "path"),
               "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
        servers = []
        try:
            for _ in range(2):
                servers.append(SGLangServer(ckpt, port=free_port(), tp_size=2, python=args.python, log_dir=tmp,
                                            server_args=SERVER_ARGS, env=env).start(timeout=300))
            report = os.path.join(tmp, "out.json")
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                 str(free_port()), os.path.abspath(__file__), "--worker", ckpt, ",".join(s.url for s in servers),
                 str(args.reps)], env={**os.environ, "RLPO_BENCH_OUT": report, "PYTHONPATH": ROOT,
                                       "OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stdout[-3000:], proc.stderr[-6000:])
                return 1
            with open(report) as f:
                r = json.load(f)
        finally:
            for s in servers:
                s.stop()
    model = r["model_bytes"]
    print(f"Qwen3-MoE {args.layers} layers x {args.experts} experts: {r['tensors']} HF tensors, {model / 2**20:.2f} MiB; "
          "4 learner ranks (EP4), 2 drivers, 2 SGLang servers x TP2 (CPU, gloo)")
    print("bytes sent by each learner rank (MiB); its share = what the 2 servers need (2 x model) / 4 ranks:")
    print(f"  {'rank':<6}{'reshard':>10}{'share':>10}{'ratio':>8}{'sglang_distributed':>22}")
    for rank, res in enumerate(r["reshard"]):
        old = r["old_sent"][rank] + (2 * model if rank in (0, 2) else 0)  # + a driver's broadcast to 2 TP ranks
        print(f"  {rank:<6}{res['bytes'] / 2**20:>10.3f}{model / 2 / 2**20:>10.3f}{res['bytes'] / (model / 2):>8.3f}"
              f"{old / 2**20:>22.3f}")
    print("bytes received by each server rank (MiB); its own shard:")
    print(f"  {'server.rank':<12}{'reshard':>10}{'shard':>10}{'ratio':>8}{'sglang_distributed':>22}")
    got = {}
    for res in r["reshard"]:
        for key, rep in res.get("server_ranks", {}).items():
            url, rank = key.split("#")
            got[f"{r['urls'].index(url)}.{rank}"] = rep["bytes"]
    for key in sorted(r["shard"]):
        print(f"  {key:<12}{got[key] / 2**20:>10.3f}{r['shard'][key] / 2**20:>10.3f}{got[key] / r['shard'][key]:>8.3f}"
              f"{model / 2**20:>22.3f}")
    us = [x for xs in r["receiver_us"] for x in xs]
    print(f"the receivers' time per tensor in the timed reshard syncs (load_regions, replayed): "
          f"{', '.join(f'{x:.1f}' for x in us)} us per server rank")
    t = {k: min(v) for k, v in r["times"].items()}
    print(f"sync wall time, best of {args.reps}: reshard {t['reshard']:.2f} s, sglang_distributed "
          f"{t['sglang_distributed']:.2f} s ({t['sglang_distributed'] / t['reshard']:.2f}x); all: {r['times']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
