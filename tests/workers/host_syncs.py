"""Host syncs of the learner's hot path, counted on CPU (tests/test_host_syncs.py).

Real trainer steps under DeviceTracker (tests/workers/device_tracker.py: the accelerator is `cpu:0`, and a
value read from it into Python, a copy of it to the host or an op sized by its values is a host sync on
CUDA). Each run builds the Trainer of the CPU demo (GSPO, R3 routes replayed, packed batches, TIS on the
rollout log-probs) at a number of layers and micro-batches, runs one RL step and counts the syncs of the
old-log-prob pass, the update (forward/backward, log-prob kernel, objective, finite-gradient check,
optimizer step, metrics) and the weight sync (digests). argv: out_dir run... (runs: name=layers:micro[:context]).
"""
import json
import os
import sys

import torch.distributed as dist

import tests.workers.train_hooks  # noqa: F401  (registers the test_parity reward)
from rlpo_mega import distributed
from rlpo_mega.config import load_config
import rlpo_mega.training.trainer as trainer_module
from rlpo_mega.training.trainer import Trainer
from tests.dist import write_report
from tests.workers.device_tracker import DeviceTracker

BASE = (
    "train_iters=1", "prompts.prompts_per_step=4", "prompts.n_samples=4", "reward.function=test_parity",
    "rollout.max_new_tokens=6", "logging.progress_bar=false", "logging.console_every=0", "logging.wandb=false",
    "logging.plot=false", "trainer.eval_every=0", "trainer.warmup.steps=0", "checkpoint.save_dir=null",
    "rollout.temperature=1.0", "algorithm.temperature=1.0", "routing.mode=r3", "algorithm.loss.name=gspo",
    "algorithm.mismatch.mode=tis", "trainer.old_logprobs=recompute", "trainer.layout=packed",
)


def model_json(out, layers):
    with open("configs/models/tiny_qwen3_moe.json") as f:
        hf = json.load(f)
    hf["num_hidden_layers"] = layers
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"model_{layers}l.json")
    # every rank writes it: through a file of its own renamed into place, or one rank read another's truncated
    # file (a CI run, once load_config got fast enough for rank 1 to read while rank 0 wrote)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(hf, f)
    os.replace(tmp, path)
    return path


def run(out, name, layers, micro, context=1):
    # micro-batches: the packed planner cuts each rank's samples into pieces of at most this many tokens (under
    # context parallelism the CP group's padded row, its DP rank holding twice the samples)
    tokens = {1: 10_000, 3: 36 if context == 1 else 72}[micro]
    cfg = load_config("configs/demo_cpu.yaml", BASE + (
        f"model.hf_config={model_json(out, layers)}", f"trainer.max_tokens_per_micro_batch={tokens}",
        f"logging.dir={os.path.join(out, name)}", f"logging.run_name={name}", f"parallel.context={context}"))
    counts, shape = {}, {}
    with DeviceTracker() as tracker:
        t = Trainer(cfg)
        ok = False
        # the step's phases (rlpo_mega.training.trainer's names), counted under the test's keys
        phases = (("_old_logprobs", trainer_module, "old_logprobs"), ("_update", trainer_module, "update_phase"),
                  ("sync", t, "sync"))
        originals = [(owner, name, getattr(owner, name)) for _, owner, name in phases]
        try:
            for phase, owner, name in phases:
                real = getattr(owner, name)

                def counted(*args, _real=real, _phase=phase, **kwargs):
                    if _phase == "_old_logprobs":
                        shape["micro_batches"] = [len(mini) for mini in args[1]]
                    with tracker.counting():
                        before = dict(tracker.syncs)
                        result = _real(*args, **kwargs)
                    counts[_phase] = {f"{w} @ {s}": n - before.get((w, s), 0)
                                      for (w, s), n in tracker.syncs.items() if n != before.get((w, s), 0)}
                    return result

                setattr(owner, name, counted)
            history = t.run()
            ok = True
        finally:
            for owner, name, real in originals:
                setattr(owner, name, real)
            t.close(ok)
            distributed.destroy(keep_world=True)
    return {"steps": len(history), "syncs": counts, **shape}


def digests():
    """Syncs of a weight sync's sender-side digests ("sums", the accelerator's algorithm) for buckets of 2
    and 8 tensors of odd sizes (row sums, column sums and tail bytes all present): batched per bucket, and
    per tensor for comparison."""
    import torch

    from moe.bridge.digest import tensor_digest, tensor_digests
    from rlpo_mega import platform

    out = {}
    with DeviceTracker() as tracker:
        dev = platform.device()
        for k in (2, 8):
            bucket = [torch.randn(4096 + 3 * i + 1, device=dev) for i in range(k)]
            with tracker.counting():
                before = sum(tracker.syncs.values())
                batched = tensor_digests(bucket, "sums")
                mid = sum(tracker.syncs.values())
                single = [tensor_digest(t, "sums") for t in bucket]
                after = sum(tracker.syncs.values())
            out[f"bucket_of_{k}"] = {"batched": mid - before, "per_tensor": after - mid, "same": batched == single}
    return out


if __name__ == "__main__":
    out = sys.argv[1]
    result = {}
    if sys.argv[2:] == ["digests"]:
        write_report(digests())
        sys.exit(0)
    for spec in sys.argv[2:]:
        name, shape = spec.split("=")
        result[name] = run(out, name, *(int(x) for x in shape.split(":")))  # layers:micro[:context]
    if dist.get_rank() == 0:
        write_report(result)
