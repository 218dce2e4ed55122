"""Benchmark: weight-bridge export (ExportStream) + in-process sync into a transformers model, vs memcpy.

A random qwen3_moe model of a few hundred MB (fp32) is built as a megatron learner (TP1 in one process;
EP2 in two), and a transformers model of the same config is the engine. Measured on the receiving rank:

  memcpy   torch copy_ of every exported tensor into a preallocated tensor of the same size (same bytes)
  digest/A tensor_digest with algorithm A of the same tensors (one read; what each side of a non-fused
           sync pays): xxh3 (the CPU default) and sums (the accelerators' algorithm), for reference
  export   iterating ExportStream alone (gather + full_to_hf + sender digests), buckets dropped
  sync     InProcessTransport: export + load into the transformers model + digest verification (the
           receiver digests the streamed bytes and its own copy in the same cache-blocked pass); the
           stream's digest algorithm is the CPU default (xxh3), sync-sums@B the same with sums
  p2p      (multi-rank layouts) only the point-to-point part of the export: every tensor another rank
           leads, sent as is to the receiving rank with gloo (its GB/s are over the bytes it moves). On
           the CPU this transport, not our code, bounds the multi-rank sync.

Throughput is exported bytes / best-of-N wall time (other jobs share this machine: the minimum is the
least disturbed run); passes are interleaved and ratios are to memcpy measured in the same process.
Peak extra memory, as a multiple of the bucket size (on the receiving rank / the maximum over ranks; max of
3 runs, each starting without the buffers a sync keeps for reuse, so allocating them counts; "held" is
what stays allocated between syncs): the larger of the peak RSS above the RSS just before the pass (VmHWM, reset through
/proc/self/clear_refs) and the peak of glibc's bytes in use above their value before the pass (mallinfo2,
sampled every 0.5 ms; the RSS alone proved unreliable here: the kernel's accounting sometimes hides
whole buckets). Measured after the timings, with glibc switched to mmap-only (its free heap trimmed) so
freed buffers leave the RSS. Timings use glibc's default malloc.
Targets (export+sync): >= 0.5x memcpy throughput, peak extra <= 1.5 buckets.

    .venv/bin/python tools/bench_weight_sync.py [--layouts tp1,ep2] [--buckets 64,256] [--reps 5]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYOUTS = {"tp1": (1, []), "ep2": (2, ["parallel.expert=2"])}


def model_config(args) -> dict:
    with open(os.path.join(ROOT, "configs/models/tiny_qwen3_moe.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=args.hidden, num_hidden_layers=args.layers, num_experts=args.experts,
               num_experts_per_tok=2, moe_intermediate_size=args.moe_ffn, intermediate_size=4 * args.moe_ffn,
               vocab_size=args.vocab, num_attention_heads=args.hidden // 64, num_key_value_heads=4, head_dim=64)
    return cfg


_LIBC = ctypes.CDLL("libc.so.6")


def _malloc_mmap_only():
    """glibc serves every allocation >= 64 KiB by mmap from now on, so freed memory leaves the RSS at once;
    its free heap pages are returned first, so memory freed earlier cannot hide new allocations."""
    _LIBC.mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    _LIBC.malloc_trim(0)


def _rss(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC.mallinfo2.restype = _MallInfo2


def _malloc_in_use() -> int:
    """Bytes glibc has handed out and not taken back (mmapped chunks + arena chunks in use)."""
    m = _LIBC.mallinfo2()
    return m.hblkhd + m.uordblks


class PeakMemory:
    """Peak extra memory of the block: the larger of two lower bounds, the RSS high-water mark above the
    RSS at entry (VmHWM, reset through /proc/self/clear_refs) and the peak of glibc's bytes in use above
    the entry value, sampled every 0.5 ms (immune to the kernel's RSS accounting)."""

    def __enter__(self):
        gc.collect()
        self.base_rss, self.base_malloc = _rss("VmRSS"), _malloc_in_use()
        self.peak_malloc = self.base_malloc
        self.done = threading.Event()
        self.switch = sys.getswitchinterval()
        sys.setswitchinterval(2e-4)  # let the sampler in while the block runs Python code
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.sampler.start()
        return self

    def _sample(self):
        while not self.done.wait(5e-4):
            self.peak_malloc = max(self.peak_malloc, _malloc_in_use())

    def __exit__(self, *exc):
        hwm = _rss("VmHWM")
        self.done.set()
        self.sampler.join()
        sys.setswitchinterval(self.switch)
        self.rss_extra, self.malloc_extra = hwm - self.base_rss, self.peak_malloc - self.base_malloc
        self.extra = max(self.rss_extra, self.malloc_extra, 0)


# ---- worker (under torchrun) ----------------------------------------------------------------------
def worker(args):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from moe.bridge.megatron_io import ExportStream, _export_plan, _inner
    from moe.model import load_hf_config
    from rlpo_mega import distributed
    from rlpo_mega.config import load_config
    from rlpo_mega.model_setup import build_policy
    from moe.bridge.digest import tensor_digest
    from rlpo_mega.weight_sync.transports import HFModelReceiver, InProcessTransport

    hf = load_hf_config(args.config)
    cfg = load_config(None, tuple(LAYOUTS[args.layout][1]))
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    rank = dist.get_rank()
    chunks, _ = build_policy(hf, layout, cfg.model, None, with_ddp=False)  # megatron's random init
    engine = AutoModelForCausalLM.from_config(hf) if rank == 0 else None
    receiver = HFModelReceiver(engine) if rank == 0 else None
    buckets = [int(b) << 20 for b in args.buckets.split(",")]

    def export_only(bucket_bytes):
        stream = ExportStream(chunks, bucket_bytes=bucket_bytes, dst=0)
        for bucket in stream:
            del bucket  # a consumer that is done with a bucket before asking for the next one
        return stream

    def sync(bucket_bytes, algorithm=None):
        stream = ExportStream(chunks, bucket_bytes=bucket_bytes, dst=0, digest_algorithm=algorithm)
        InProcessTransport(receiver).sync(stream)  # raises on any digest mismatch
        return stream

    # Warm-up (lazy inits, first touch of the engine's pages) and the exported tensors for memcpy.
    stream = sync(buckets[0])
    total = stream.bytes_sent
    if rank == 0:
        srcs = [receiver.weights.read(n) for n in stream.digests]
        dsts = [torch.empty_like(s) for s in srcs]
        assert sum(s.numel() * s.element_size() for s in srcs) == total

    def memcpy():
        if rank == 0:
            for s, d in zip(srcs, dsts):
                d.copy_(s)

    def digest(algorithm):
        if rank == 0:
            for s in srcs:
                tensor_digest(s, algorithm)

    passes = {"memcpy": memcpy, "digest/xxh3": lambda: digest("xxh3"), "digest/sums": lambda: digest("sums")}
    for b in buckets:
        passes[f"export@{b >> 20}"] = lambda b=b: export_only(b)
        passes[f"sync@{b >> 20}"] = lambda b=b: sync(b)
    passes[f"sync-sums@{buckets[0] >> 20}"] = lambda: sync(buckets[0], "sums")
    mine, owners, full_meta, order = _export_plan(chunks[0])
    remote = [pm.megatron for pm, _ in order if owners[pm.megatron][0] != 0]
    p2p_bytes = sum(math.prod(full_meta[n][0]) * full_meta[n][1].itemsize for n in remote)
    if remote:
        assert all(len(owners[n]) == 1 for n in remote), "p2p pass: layouts without TP/replicas only"
        bufs = {n: torch.empty(full_meta[n][0], dtype=full_meta[n][1]) for n in remote} if rank == 0 else {}

        def p2p():
            for n in remote:
                if rank == owners[n][0]:
                    dist.send(mine[n].param.detach(), dst=0)
                elif rank == 0:
                    dist.recv(bufs[n], src=owners[n][0])

        passes["p2p"] = p2p
    for p in passes.values():
        p()
    times = {k: [] for k in passes}
    for _ in range(args.reps):  # interleaved, so load drifts on the machine hit every pass alike
        for k, p in passes.items():
            dist.barrier()
            t0 = time.perf_counter()
            p()
            dist.barrier()
            times[k].append(time.perf_counter() - t0)
    if rank == 0:
        del srcs, dsts
    _malloc_mmap_only()
    peaks, parts, held = {}, {}, {}  # parts: the two lower bounds (RSS, malloc), for the JSON report
    inner = _inner(chunks[0])
    for k, p in passes.items():
        if k in ("memcpy", "p2p") or k.startswith("digest"):
            continue
        peaks[k], parts[k], held[k] = 0, [0, 0], 0
        for _ in range(3):
            # A sync keeps its reusable CPU buffers between syncs (ExportStream.recycle): start each measured
            # pass without them, so its peak includes allocating them; what stays allocated is `held`.
            inner.__dict__.pop("_rlpo_export_pool", None)
            dist.barrier()
            with PeakMemory() as m:
                p()
            peaks[k] = max(peaks[k], m.extra)
            parts[k] = [max(parts[k][0], m.rss_extra), max(parts[k][1], m.malloc_extra)]
            pool = inner.__dict__.get("_rlpo_export_pool")
            held[k] = max(held[k], pool.held_bytes if pool is not None else 0)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (peaks, held))
    if rank == 0:
        report = {"layout": args.layout, "world": dist.get_world_size(), "bytes": total,
                  "tensors": len(stream.digests), "threads": torch.get_num_threads(), "p2p_bytes": p2p_bytes,
                  "time": {k: min(v) for k, v in times.items()}, "peak_dst": peaks,
                  "peak_dst_rss_malloc": parts, "peak_max": {k: max(e[0][k] for e in every) for k in peaks},
                  "held_max": {k: max(e[1][k] for e in every) for k in peaks}}
        with open(args.out, "w") as f:
            json.dump(report, f)
    distributed.destroy()


# ---- driver ---------------------------------------------------------------------------------------
def run_layout(args, layout, config_path, tmp):
    nproc = LAYOUTS[layout][0]
    out = os.path.join(tmp, f"{layout}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
           os.path.abspath(__file__), "--worker", "--layout", layout, "--config", config_path, "--out", out,
           "--buckets", args.buckets, "--reps", str(args.reps)]
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{layout} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="tp1,ep2")
    ap.add_argument("--buckets", default="64,256", help="bucket sizes in MiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-ffn", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--json", default=None, help="also write the raw per-layout reports here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    cfg = model_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w") as f:
            json.dump(cfg, f)
        reports = [run_layout(args, layout, config_path, tmp) for layout in args.layouts.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    gb = reports[0]["bytes"] / 1e9
    print(f"qwen3_moe hidden={args.hidden} layers={args.layers} experts={args.experts} moe_ffn={args.moe_ffn} "
          f"vocab={args.vocab} fp32: {gb * 1e3:.0f} MB in {reports[0]['tensors']} HF tensors; "
          f"{args.threads} torch thread(s)/process, best of {args.reps}")
    print(f"{'layout':6s} {'pass':13s} {'GB/s':>6s} {'x memcpy':>8s} {'peak extra (dst/max rank)':>26s}  "
          "(held: reused buffers kept between syncs, part of the peak)")
    verdicts = []
    for r in reports:
        mem = r["bytes"] / 1e9 / r["time"]["memcpy"]
        for k, t in r["time"].items():
            gbs = (r["p2p_bytes"] if k == "p2p" else r["bytes"]) / 1e9 / t
            peak = f"{r['p2p_bytes'] / 1e6:.0f} MB sent" if k == "p2p" else ""
            if "@" in k:
                b = int(k.split("@")[1]) << 20
                pd, pm = r["peak_dst"][k] / b, r["peak_max"][k] / b
                peak = f"{pd:5.2f} / {pm:5.2f} buckets"
                if r["held_max"][k]:
                    peak += f" (held {r['held_max'][k] / b:4.2f})"
                if k.startswith("sync@"):
                    verdicts.append(f"{r['layout']} {k}: {gbs / mem:.2f}x memcpy (target >= 0.5): "
                                    f"{'OK' if gbs / mem >= 0.5 else 'MISSED'}; peak {pm:.2f} buckets "
                                    f"(target <= 1.5): {'OK' if pm <= 1.5 else 'MISSED'}")
            print(f"{r['layout']:6s} {k:13s} {gbs:6.2f} {gbs / mem:8.2f} {peak:>39s}")
        if "p2p" in r["time"]:
            b = r["time"]["sync@" + args.buckets.split(",")[0]]
            verdicts.append(f"{r['layout']}: gloo p2p of the {r['p2p_bytes'] / 1e6:.0f} MB other ranks lead takes "
                            f"{r['time']['p2p'] * 1e3:.0f} ms of the sync's {b * 1e3:.0f} ms; the sync time less the p2p time "
                            f"is {r['bytes'] / 1e9 / (b - r['time']['p2p']) / mem:.2f}x memcpy")
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
