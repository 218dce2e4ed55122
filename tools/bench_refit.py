"""Benchmark: the refit's receiving side, in a real CPU SGLang server at Qwen3-30B-A3B's tensor count (issue 60).

(a) receiver: a Qwen3-MoE of 48 layers x 128 experts with tiny dimensions (18,867 HF tensors), served
    by one launched CPU SGLang server; whole-model syncs through the engine's in_process transport (the
    colocated path: update_weights_from_tensor), each digest-verified inside the server. Timed inside the server
    by the receiver itself (launch/rlpo_sglang_receiver.py: the seconds spent in the model's load_weights, one
    clock for both): SGLang 0.5.23's own load_weights (what every sync pays today) against the receiver's
    replay, per tensor, and the learning sync (SGLang's load, watched) once. The sync's wall time beside each:
    it also holds the transport's per-tensor costs (a pickle and a shared-memory file per tensor) and the
    digests, which the receiver does not change.

    .venv/bin/python tools/bench_refit.py [--layers 48] [--experts 128] [--reps 3] [--bucket 2048]
Needs the SGLang venv (make venv-sglang). Target (issue 60): <= 10 us per tensor at 18k+ tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from moe.bridge.digest import tensor_digest  # noqa: E402
from rlpo_mega.config import SGLangEngineConfig  # noqa: E402
from rlpo_mega.rollout import ENGINES  # noqa: E402
from rlpo_mega.weight_sync.transports import TRANSPORTS  # noqa: E402

SERVER_ARGS = dict(device="cpu", attention_backend="torch_native", disable_overlap_schedule=True,
                   max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=512,
                   mem_fraction_static=0.15, skip_server_warmup=True, enable_return_routed_experts=True,
                   skip_tokenizer_init=True, dtype="float32", sleep_on_idle=True)


class Stream:
    """What a transport's sync reads (ExportStream's contract) from a list of (HF name, tensor), in buckets."""

    def __init__(self, named, bucket):
        self.named, self.bucket = named, bucket
        self.digests, self.bytes_sent, self.receives, self.digest_algorithm = {}, 0, True, "xxh3"

    def __iter__(self):
        for i in range(0, len(self.named), self.bucket):
            out = self.named[i:i + self.bucket]
            for n, t in out:
                self.digests[n] = tensor_digest(t, self.digest_algorithm)
                self.bytes_sent += t.numel() * t.element_size()
            yield out


def make_checkpoint(path: str, layers: int, experts: int, **sizes):
    """A random Qwen3-MoE of the shipped tiny config's dimensions at `layers` x `experts` (and `sizes` where given),
    saved by transformers (the released checkpoints' names); -> its HF config and {name: tensor} as saved."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from moe.model import load_hf_config

    hf = load_hf_config(os.path.join(ROOT, "configs/models/tiny_qwen3_moe.json"))
    hf.num_hidden_layers, hf.num_experts = layers, experts
    hf.num_experts_per_tok = min(int(hf.num_experts_per_tok), experts)
    for key, value in sizes.items():
        setattr(hf, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf).save_pretrained(path)
    weights = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(path, f)))
    return hf, weights


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bucket", type=int, default=2048, help="tensors per update_weights_from_tensor call")
    p.add_argument("--python", default=os.path.join(ROOT, ".venv-sglang", "bin", "python"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf, weights = make_checkpoint(os.path.join(tmp, "hf"), args.layers, args.experts)
        named = list(weights.items())
        cfg = SGLangEngineConfig(launch=True, base_port=31000 + os.getpid() % 2000, server_args=SERVER_ARGS,
                                 python=args.python, log_dir=os.path.join(tmp, "logs"), startup_timeout=600,
                                 request_timeout=600, control_timeout=600,
                                 env={"SGLANG_USE_CPU_ENGINE": "1",
                                      "PYTHONPATH": os.path.join(ROOT, "tests", "sglang_support", "path")})
        t0 = time.perf_counter()
        engine = ENGINES.get("sglang")(cfg, hf, model_path=os.path.join(tmp, "hf"))
        print(f"{len(named)} tensors ({sum(t.numel() * t.element_size() for _, t in named) / 2**20:.1f} MiB), "
              f"{args.layers} layers x {args.experts} experts; server up in {time.perf_counter() - t0:.0f} s")
        transport = TRANSPORTS.get("in_process")(engine)
        try:
            rows = []

            def sync(label, replay):
                before = next(iter(engine.receivers(replay=replay).values()))
                t = time.perf_counter()
                transport.sync(Stream(named, args.bucket))  # digest-verified: raises on any difference
                wall = time.perf_counter() - t
                after = next(iter(engine.receivers().values()))
                n = (after["replayed"] + after["loaded"] + after["learned"]) - (
                    before["replayed"] + before["loaded"] + before["learned"])
                us = (after["seconds"] - before["seconds"]) / max(n, 1) * 1e6
                rows.append({"sync": label, "tensors": n, "us_per_tensor": round(us, 1), "sync_wall_s": round(wall, 2),
                             "replayed": after["replayed"] - before["replayed"],
                             "not_replayed": after["not_replayed"]})
                print(f"  {label:<22} {n:>6} tensors  {us:8.1f} us/tensor in load_weights   sync {wall:7.2f} s")

            print("receiver time per tensor (inside the server), and each sync's wall time:")
            for _ in range(args.reps):
                sync("sglang load_weights", False)
            sync("receiver: learning", True)
            for _ in range(args.reps):
                sync("receiver: replay", True)
            sglang = min(r["us_per_tensor"] for r in rows if r["sync"] == "sglang load_weights")
            replay = min(r["us_per_tensor"] for r in rows if r["sync"] == "receiver: replay")
            print(f"best of {args.reps}: SGLang {sglang:.1f} us/tensor, receiver {replay:.1f} us/tensor "
                  f"({sglang / replay:.1f}x); target <= 10 us")
            print(json.dumps({"tensors": len(named), "rows": rows}))
        finally:
            engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
