"""Weight-sync worker: an EP2 learner syncs to an HF engine through each transport, clean and corrupted."""
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from moe.bridge.megatron_io import ExportStream, _inner, export_hf_state
from moe.model import load_hf_config
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy
from rlpo_mega.rollout.sglang_engine import SGLangEngine
from rlpo_mega.training.warmup import data_parallel_shard, split_micro_batches, train_step
from moe.bridge import digest
from moe.bridge.digest import DigestMismatchError
from rlpo_mega.weight_sync.transports import DiskTransport, HFModelReceiver, InProcessTransport
from tests.dist import free_port, write_report
from tests.weight_sync_support import DistributedTransport, WeightUpdateGroup
from tests.workers.bridge import make_hf_checkpoint, megatron_logits, rel_err


class DriverReceiver(HFModelReceiver):
    """An HF model receiving as an SGLang driver does: the engine ranks are SGLang's (rollout.sglang.drivers)."""
    ranks = SGLangEngine.ranks


def main():
    out_dir, model_cfg = sys.argv[1], sys.argv[2]
    hf = load_hf_config(model_cfg)
    src = os.path.join(out_dir, "hf_src")
    cfg = load_config(None, ("parallel.expert=2", f"model.init_from_hf={src}", "optim.lr=1e-2"))
    dist_env = distributed.init(cfg.parallel, hf, cfg.seed)
    rank = dist.get_rank()
    if rank == 0:
        make_hf_checkpoint(hf, src)
    dist.barrier()
    chunks, opt = build_policy(hf, dist_env, cfg.model, cfg.optim)
    tokens = torch.randint(0, hf.vocab_size, (4, 17), generator=torch.Generator().manual_seed(5))
    train_step(chunks, opt, split_micro_batches(data_parallel_shard(tokens), 1))
    probe = tokens[:2, :12]
    learner_logits = megatron_logits(chunks, probe, hf.vocab_size)
    engine = AutoModelForCausalLM.from_config(hf) if rank == 0 else None
    receiver = HFModelReceiver(engine) if rank == 0 else None
    report = {}

    def engine_logits():
        with torch.no_grad():
            return engine(probe).logits.double()

    def run(name, transport, corrupt=False, logits_fn=None, algorithm=None):
        if corrupt and receiver is not None:
            # In process, transit is the copy into the engine's memory: one word of one block arrives wrong.
            original = digest._copy_block
            state = {"armed": True}

            def corrupting(dst, src):
                original(dst, src)
                if state.pop("armed", False):
                    dst.reshape(-1).view(torch.uint8)[0] ^= 1

            digest._copy_block = corrupting
        stream = ExportStream(chunks, bucket_bytes=64 << 10, dst=0, digest_algorithm=algorithm)
        try:
            stats = transport.sync(stream)
            report[name] = {"ok": True, "stats_tensors": stats.get("tensors"),
                            "algorithms": sorted({digest.algorithm_of(d) for d in stream.digests.values()})}
            if rank == 0:
                report[name]["logits_rel_err"] = rel_err((logits_fn or engine_logits)(), learner_logits)
        except DigestMismatchError as e:
            report[name] = {"ok": False, "error": str(e)}
        finally:
            if corrupt and receiver is not None:
                digest._copy_block = original

    def pool_buffers():
        pool = _inner(chunks[0])._rlpo_export_pool
        return sorted(t.data_ptr() for ts in pool.free.values() for t in ts), pool.held_bytes

    run("in_process", InProcessTransport(receiver))
    first = pool_buffers()
    run("in_process_corrupted", InProcessTransport(receiver), corrupt=True)
    run("in_process_sums", InProcessTransport(receiver), algorithm="sums")  # the accelerators' algorithm
    # the in-process syncs reused one set of buffers for what they received (EP2: the other rank's experts)
    report["pool"] = {"held_bytes": first[1], "same_buffers": pool_buffers() == first}
    run("in_process_sums_corrupted", InProcessTransport(receiver), corrupt=True, algorithm="sums")
    run("disk", DiskTransport(receiver, os.path.join(out_dir, "sync_disk"), hf))
    for label, corrupt in (("distributed", "0"), ("distributed_corrupted", "1")):
        port = [free_port() if rank == 0 else None]
        dist.broadcast_object_list(port, src=0)
        proc, group = None, None
        probe_file = os.path.join(out_dir, f"probe_{label}.pt")
        if rank == 0:
            torch.save(probe, probe_file)
            proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "engine_receiver.py"),
                                     str(port[0]), model_cfg, corrupt, probe_file], env={**os.environ})
            group = WeightUpdateGroup("127.0.0.1", port[0], rank=0, world_size=2)

        def remote_logits():
            proc.wait(timeout=120)
            return torch.load(probe_file + ".logits")

        run(label, DistributedTransport(group), logits_fn=remote_logits)
        if proc is not None:
            report[label]["engine_rc"] = proc.wait(timeout=120)
    # A cast on export (an fp32 learner feeding a bf16 engine), through the recycled buffers.
    full32 = export_hf_state(chunks, dst=0)
    stream16 = ExportStream(chunks, bucket_bytes=64 << 10, dst=0, dtype=torch.bfloat16)
    stream16.recycle = True
    got16 = {}
    for bucket in stream16:
        got16.update((n, t.clone()) for n, t in bucket)
    # two drivers with the disk transport (rollout.sglang.drivers=2): each writes its own subdirectory of the one
    # sync_dir, reloads its engine from it and verifies the digests
    drivers_cfg = load_config(None, ("rollout.engine=sglang", "rollout.sglang.drivers=2",
                                     f"rollout.sync_dir={os.path.join(out_dir, 'sync_drivers')}"))
    mine = engine if rank == 0 else AutoModelForCausalLM.from_config(hf)
    stats = DiskTransport.from_config(drivers_cfg, DriverReceiver(mine), hf).sync(
        ExportStream(chunks, bucket_bytes=64 << 10, dst=[0, 1]))
    with torch.no_grad():
        err = rel_err(mine(probe).logits.double(), learner_logits)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"path": os.path.relpath(stats["path"], out_dir), "tensors": stats["tensors"],
                                   "logits_rel_err": err})
    report["disk_drivers"] = {"ranks": every, "sync_dir": sorted(os.listdir(os.path.join(out_dir, "sync_drivers")))}
    # several destinations (rollout drivers): each expert's leader (EP2: rank 0 or 1) sends it to every other
    # destination; every destination holds every tensor, bit-identical to the broadcast export to every rank
    broadcast = export_hf_state(chunks, dst=None)
    mine = {}
    for dst in ([0, 1], [1]):
        stream = ExportStream(chunks, bucket_bytes=64 << 10, dst=dst)
        got = {n: t.clone() for bucket in stream for n, t in bucket}
        mine[str(dst)] = {"receives": stream.receives, "names": len(got), "digests": stream.digests,
                          "equal": sorted(got) == sorted(broadcast) and all(
                              got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in broadcast.items())}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    report["multi_dst"] = {"tensors": len(broadcast), "ranks": [
        {k: {**v, "digests": v["digests"] == every[0]["[0, 1]"]["digests"]} for k, v in r.items()} for r in every]}
    if rank == 0:
        report["bf16_export_exact"] = sorted(got16) == sorted(full32) and all(
            got16[n].dtype == torch.bfloat16 and torch.equal(got16[n], full32[n].to(torch.bfloat16)) for n in full32)
        pool = _inner(chunks[0])._rlpo_export_pool
        report["pool"]["busy_after_syncs"] = pool.busy
        pool.busy = True  # as while another recycling stream is being iterated (the check precedes any collective)
        stream = ExportStream(chunks, bucket_bytes=64 << 10, dst=0)
        stream.recycle = True
        try:
            next(iter(stream))
        except RuntimeError as e:
            report["pool"]["second_stream_error"] = str(e)
        pool.busy = False
        write_report(report)
    distributed.destroy()


if __name__ == "__main__":
    main()
