"""rollout.sync_transport=reshard on real CPU SGLang 0.5.23 servers (TP2 and TP1; colocated on the learner ranks'
"GPUs" too): megatron learner ranks (EP2, TP2, PP2) each send their own shards to the server ranks that hold them
(rlpo_mega/weight_sync/reshard.py; the plan: moe/bridge/reshard.py, tests/test_reshard_plan.py). After every sync each server's weights, digested inside it, equal the learner's export
bit for bit (the check every transport shares), the per-piece digests of the transport itself passed, each
learner rank sent its plan share and each server rank received its own shard and nothing else; the second sync
is replayed by the in-server receiver (no SGLang loader call).

The models' expert intermediate sizes are 64 here: SGLang's CPU path pads an intermediate size that is not a
multiple of TP x 32 and splits the padded rows, which a GPU server does not do and the plan does not model
(moe/bridge/reshard.server_region). The colocated cell serves block FP8 (rollout.weights=fp8, the FP8 tiny model:
every projection whole 128-blocks): codes, scales and bf16 tensors exchanged between the learner ranks and packed
together; the FP8 server apart is tests/test_fp8.py's."""
import json
import os
import sys

import pytest

from tests.dist import ROOT, free_port, torchrun
from tests.test_sglang import SERVER_ARGS, SUPPORT, sglang_python  # noqa: F401  (a fixture)
from tests.workers.bridge import make_hf_checkpoint

pytestmark = pytest.mark.timeout(900)

CONFIGS = {"qwen3_moe": ("configs/models/tiny_qwen3_moe.json", "moe_intermediate_size"),
           "mixtral": ("configs/models/tiny_mixtral.json", "intermediate_size")}


def _checkpoint(family, path, fp8=False):
    from moe.model import load_hf_config

    src, key = CONFIGS[family]
    with open(os.path.join(ROOT, "configs/models/tiny_qwen3_moe_fp8.json" if fp8 else src)) as f:
        raw = json.load(f)
    raw[key] = 256 if fp8 else 64
    raw["tie_word_embeddings"] = False  # SGLang 0.5.23's Mixtral ignores a tied head (the engine's tied_aliases)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "model.json"), "w") as f:
        json.dump(raw, f)
    hf = load_hf_config(os.path.join(path, "model.json"))
    make_hf_checkpoint(hf, path)
    return path


def _server(python, ckpt, tp, log_dir):
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    from sglang_server import SGLangServer

    env = {"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": os.path.join(SUPPORT, "path")}
    if tp == 2:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"  # shared/notes/sglang.md: TP=2 on this CPU
    return SGLangServer(ckpt, port=free_port(), tp_size=tp, python=python, log_dir=log_dir,
                        server_args=SERVER_ARGS, env=env).start(timeout=300)


def _check(r, learners, servers):
    plan = r["plan"]
    for step, every in enumerate(r["syncs"]):
        drivers = [e for e in every if e["check"]]
        assert drivers and all(d["check"]["equal"] for d in drivers), (step, drivers)
        for rank, e in enumerate(every):  # each learner rank sent what the plan gives it
            assert e["result"]["bytes"] == plan["sent"][rank] > 0, (step, rank, e["result"])
        got = {k: v["bytes"] for d in drivers for k, v in d["result"]["server_ranks"].items()}
        assert sorted(got.values()) == sorted(plan["received"].values()), (got, plan["received"])
        for d in drivers:
            for stats in d["check"]["receivers"].values():
                assert stats["not_replayed"] == {}, stats
    # the plan's shares: the busiest learner rank within 1.25 x its share, each server rank no more than its shard
    assert max(plan["sent"]) <= 1.25 * plan["model"] / learners, plan
    assert all(plan["received"][k] <= 1.1 * plan["shard"][k] for k in plan["shard"]), plan
    # the first sync learned every tensor, the second replayed them: no SGLang loader call
    first = [d["check"]["receivers"] for d in r["syncs"][0] if d["check"]]
    second = [d["check"]["receivers"] for d in r["syncs"][1] if d["check"]]
    for a, b in zip(first, second):
        for url in a:
            assert b[url]["loaded"] == a[url]["loaded"] and b[url]["replayed"] > a[url]["replayed"], (a, b)


@pytest.mark.parametrize("family,server_tp,layout,kill,colocate", [
    # experts shard to shard: EP2 learners into a TP2 server (moe-TP 2); then the server SIGKILLed mid-refit
    ("qwen3_moe", 2, ["parallel.expert=2"], True, False),
    # TP2 learners into a TP1 server: its one rank takes each tensor's halves from both learner ranks
    ("mixtral", 1, ["parallel.tensor=2"], False, False),
    # colocated, pipeline-parallel learners (each rank its own layers): the server's TP ranks on the learner ranks'
    # "GPUs", each rank's pieces exchanged between the learner ranks and packed by the rank on its GPU (CUDA IPC
    # there, shared memory here), in block FP8; then SIGKILLed
    ("qwen3_moe", 2, ["parallel.pipeline=2"], True, True),
], ids=["qwen3_moe-ep2-tp2server-kill", "mixtral-tp2-tp1server", "qwen3_moe-pp2-colocated-tp2-fp8-kill"])
def test_reshard_sync_is_bit_exact_and_sends_only_shards(family, server_tp, layout, kill, colocate, sglang_python,
                                                         tmp_path):
    """Two syncs, bit-exact (module docstring). kill: a third sync with the server SIGKILLed as the learner ranks
    start sending: every rank raises the failure (EngineError, agreed) within seconds, none waits out a timeout."""
    ckpt = _checkpoint(family, str(tmp_path / "hf"), fp8=colocate)
    if colocate:  # rank 0 launches it (rollout.sglang.launch), in block FP8 (SGLang's fp8 serves in bf16)
        env = {"RLPO_SGLANG_PYTHON": sglang_python, "RLPO_SGLANG_PATH": os.path.join(SUPPORT, "path"),
               "RLPO_SGLANG_SERVER_ARGS": json.dumps({**SERVER_ARGS, "dtype": "bfloat16"}),
               "RLPO_KILL_SERVER_PGID": "launched"}
        r = torchrun("reshard_sync.py", 2, str(tmp_path / "run"), ckpt, "colocate", str(server_tp), "1", *layout,
                     "rollout.weights=fp8", f"rollout.sglang.base_port={free_port()}", timeout=600, env=env)
    else:
        server = _server(sglang_python, ckpt, server_tp, str(tmp_path / "logs"))
        env = {"RLPO_KILL_SERVER_PGID": str(server.proc.pid)} if kill else None
        try:
            r = torchrun("reshard_sync.py", 2, str(tmp_path / "run"), ckpt, server.url, str(server_tp), "1", *layout,
                         timeout=600, env=env)
        finally:
            server.stop()
    _check(r, 2, 1)
    drivers = [e["result"] for every in r["syncs"] for e in every if e["check"]]
    # colocated: no refit group (the packed buckets went by the relay); apart: the group
    assert all((d["group"] is None) == colocate for d in drivers), drivers
    if kill:
        assert all(k["failed"] and "refit" in k["failed"] for k in r["killed"]), r["killed"]
        # failed at once, not held for control_timeout (300 s): 20-79 s here, the sync's own work included, by load
        assert max(k["seconds"] for k in r["killed"]) < 150, r["killed"]
