"""The shard-to-shard refit (rollout.sync_transport=reshard) from megatron learner ranks into real CPU SGLang servers
(tests/test_refit_transport.py). argv: out_dir hf_checkpoint urls(comma) server_tp drivers override...; urls
"colocate": one server launched by rank 0 on the learner's "GPUs" (rollout.colocate; RLPO_SGLANG_{PYTHON,PATH,
SERVER_ARGS} from the test), which takes its pieces packed per rank (the CUDA IPC path; shared memory on a CPU).

Two syncs, the weights moved between them (seeded noise on every parameter, alike on every replica): after each
one every server's weights, digested inside it over its TP ranks (the report hook's full HF tensors, the
independent check every transport shares), equal the learner's own export tensor for tensor, bit for bit (with
rollout.weights=fp8: the export in bf16 with each FP8 weight quantised whole, moe/bridge/fp8.quantize_named, against
the codes and scales the senders made piece by piece); and the
transport's own piece digests passed. Rank 0 reports the bytes each learner rank sent and each server rank
received against the plan's shares, and the receivers' counts (learned at the first sync, replayed at the second).
"""
import json
import os
import sys
import zlib

import torch
import torch.distributed as dist

from moe.bridge.digest import tensor_digests
from moe.bridge.fp8 import Fp8Selection, quantize_named
from moe.bridge.megatron_io import export_hf_state
from moe.model import load_hf_config
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy
from rlpo_mega.rollout.engines import build_engine, make_transport
from tests.dist import write_report


def nudge(chunks, step):
    """Seeded noise on every parameter, by its name: replicas of one parameter move alike."""
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}/{dist.get_rank() if 'experts' in name else 0}".encode()))
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.01)


def main():
    out, ckpt, urls, server_tp, drivers, *overrides = sys.argv[1:]
    if urls == "colocate":
        env = os.environ
        servers = ["rollout.colocate=true", "rollout.sglang.launch=true", "rollout.sglang.num_servers=1",
                   f"rollout.sglang.python={env['RLPO_SGLANG_PYTHON']}", "rollout.sglang.startup_timeout=300",
                   f"rollout.sglang.log_dir={os.path.join(out, 'sglang_logs')}",
                   "rollout.sglang.env.SGLANG_USE_CPU_ENGINE=1", "rollout.sglang.env.TORCHDYNAMO_DISABLE=1",
                   f"rollout.sglang.env.PYTHONPATH={env['RLPO_SGLANG_PATH']}",
                   *(["rollout.sglang.env.SGLANG_CPU_OMP_THREADS_BIND=0|1"] if server_tp == "2" else []),
                   *(f"rollout.sglang.server_args.{k}={str(v).lower() if isinstance(v, bool) else v}"
                     for k, v in json.loads(env["RLPO_SGLANG_SERVER_ARGS"]).items())]
    else:
        servers = [f"rollout.sglang.urls=[{urls}]"]
    cfg = load_config(None, (
        f"model.hf_config={ckpt}/config.json", f"model.init_from_hf={ckpt}", "rollout.engine=sglang", *servers,
        f"rollout.sglang.tp_size={server_tp}", f"rollout.sglang.drivers={drivers}",
        "rollout.sync_transport=reshard", "rollout.sync_bucket_mb=1", "logging.wandb=false", *overrides))
    hf = load_hf_config(cfg.model.hf_config)
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    chunks, _ = build_policy(hf, layout, cfg.model, cfg.optim)
    engine = build_engine(cfg, hf)
    transport = make_transport(cfg, engine, hf)
    report = {"syncs": []}
    for step in range(2):
        nudge(chunks, step)
        result = transport.sync_model(chunks)
        if cfg.rollout.weights == "fp8":  # the learner's weights, whole, on rank 0 (the reference)
            full = dict(quantize_named(export_hf_state(chunks, dst=0, dtype=torch.bfloat16).items(), Fp8Selection(hf)))
        else:
            full = export_hf_state(chunks, dst=0)
        names = sorted(full) if dist.get_rank() == 0 else None
        box = [None if names is None else dict(zip(names, tensor_digests([full[n] for n in names], "xxh3")))]
        dist.broadcast_object_list(box, src=0)
        mine = {}
        if engine is not None:
            held = engine.weight_digests(sorted(box[0]), "xxh3")
            mine = {"equal": held == box[0], "missing": sorted(set(box[0]) - set(held))[:5],
                    "differ": sorted(n for n in held if held[n] != box[0].get(n))[:5],
                    "receivers": engine.receivers()}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, {"result": result, "check": mine})
        report["syncs"].append(every)
    kill = os.environ.get("RLPO_KILL_SERVER_PGID")
    if kill:  # a server SIGKILLed mid-refit: rank 0 kills it once the servers are receiving, then cuts its pieces
        import signal
        import time

        from rlpo_mega.engine_errors import EngineError
        from rlpo_mega.weight_sync.reshard import ReshardTransport

        pieces, killed = ReshardTransport._pieces, []

        def killing(self, *args):
            if dist.get_rank() == 0 and not killed:
                pgid = int(kill) if kill != "launched" else engine.servers[0].launched.proc.pid
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pgid)
            return pieces(self, *args)

        ReshardTransport._pieces = killing
        nudge(chunks, 2)
        t0 = time.monotonic()
        try:
            transport.sync_model(chunks)
            failed = None
        except EngineError as e:
            failed = str(e)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, {"failed": failed, "seconds": time.monotonic() - t0})
        report["killed"] = every
    plan, _ = next(iter(transport._plans.values()))
    report["plan"] = {"sent": plan.sent_bytes(), "received": {f"{s}.{r}": n for (s, r), n in plan.received_bytes().items()},
                      "shard": {f"{s}.{r}": n for (s, r), n in plan.shard_bytes().items()}, "model": plan.model.nbytes}
    transport.close()
    if engine is not None and kill in (None, "launched"):  # (a launched server is stopped by its engine)
        engine.shutdown()
    if dist.get_rank() == 0:
        write_report(report)
    distributed.destroy()


if __name__ == "__main__":
    main()
