"""Colocated SGLang weight payloads (rlpo_mega/weight_sync/sglang_payloads.py): who makes each server TP rank's entry,
the flattened_bucket format, the UUID reduction's place in torch's CUDA reduction, and the relay under torchrun.
A real CPU SGLang server loading these payloads: tests/test_sglang.py::test_colocated_flattened_bucket_update."""
import base64
import inspect
import json
import os
import pickle
import pickletools
import subprocess
import sys
import textwrap

import pytest
import torch

from rlpo_mega.config import load_config
from rlpo_mega.planning import plan as planning
from rlpo_mega.weight_sync import sglang_payloads as sp
from tests.dist import ROOT, torchrun


def _producers(*args):
    return [(s.index, s.driver, s.producers) for s in sp.placements(*args)]


def test_each_server_rank_is_made_on_its_gpu_and_gathered_by_its_driver():
    # one node of 8 GPUs, 2 servers x TP4 (the 1-node recipe), one driver: GPU g's rank makes TP rank g % 4's entry
    assert _producers(8, 8, 2, 4, [0]) == [(0, 0, (0, 1, 2, 3)), (1, 0, (4, 5, 6, 7))]
    # 2 nodes, one driver per node: each node's servers on its own ranks, driven by its first rank
    assert _producers(16, 8, 2, 4, [0, 8]) == [(0, 0, (0, 1, 2, 3)), (1, 0, (4, 5, 6, 7)),
                                               (2, 8, (8, 9, 10, 11)), (3, 8, (12, 13, 14, 15))]
    # fewer learner ranks than server GPUs on a node: the node's first rank makes the entries without a rank
    assert _producers(2, 2, 1, 4, [0]) == [(0, 0, (0, 1, 0, 0))]
    relay = sp.PayloadRelay(sp.placements(16, 8, 2, 4, [0, 8]), rank=9, group=None)
    assert relay.entries == [(2, 1, 8)] and relay.to_drivers == [8] and not relay.drives
    relay = sp.PayloadRelay(sp.placements(16, 8, 2, 4, [0, 8]), rank=8, group=None)
    assert [s.index for s in relay.drives] == [2, 3] and relay.from_producers == [9, 10, 11, 12, 13, 14, 15]


def test_flattened_bucket_rebuilds_every_tensor_as_sglang_does():
    """One uint8 tensor per bucket, metadata in the fields SGLang's loader reads (weight_updater.py:383-413), each
    range viewed as its dtype (tensor_bucket.py:118-135): odd byte counts, mixed dtypes, a scalar and an empty
    tensor come back equal; an alias (a tied head) names the embedding's bytes without a second copy."""
    named = [("a", torch.arange(3, dtype=torch.bfloat16)), ("b", torch.randn(2, 3)),
             ("c", torch.tensor(7, dtype=torch.int64)), ("d", torch.empty(0, 4)),
             ("embed", torch.randn(5, 2).t())]  # not contiguous
    payload = sp.flatten(named, {"head": "embed", "b": "a"})  # "b" is in the bucket: its own bytes
    flat = payload["flattened_tensor"]
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    got = pickle.loads(base64.b64decode(sp.serialize(payload)))
    flat = got["flattened_tensor"]
    rebuilt = {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape) for m in got["metadata"]}
    assert sorted(rebuilt) == ["a", "b", "c", "d", "embed", "head"]
    for name, t in named + [("head", named[-1][1])]:
        assert rebuilt[name].dtype == t.dtype and torch.equal(rebuilt[name], t), name
    meta = {m.name: m for m in got["metadata"]}
    assert (meta["head"].start_idx, meta["head"].end_idx) == (meta["embed"].start_idx, meta["embed"].end_idx)
    assert all(m.start_idx % 16 == 0 and m.numel == m.end_idx - m.start_idx for m in got["metadata"])


def test_the_uuid_takes_the_device_argument_of_torchs_cuda_reduction(monkeypatch):
    """sglang's patch (srt/utils/patch_torch.py:_REDUCE_TENSOR_ARG_DEVICE_INDEX) and ours replace argument 6 of
    torch's rebuild_cuda_tensor, the storage's device: this torch still has it there. The replacement itself, on a
    CUDA tensor's reduction (this machine has none: torch's reduction stood in by its CUDA shape)."""
    from torch.multiprocessing import reductions

    assert list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)[sp._DEVICE_ARG] == "storage_device"

    class Props:
        uuid = "GPU-0b4c-uuid"

    args = tuple(range(15))
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, args))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props if d == 6 else None)

    class Cuda:
        is_cuda = True

    rebuild, out = sp._reduce_tensor(Cuda())
    assert rebuild is reductions.rebuild_cuda_tensor and out == (*args[:6], "GPU-0b4c-uuid", *args[7:])


def test_each_tp_ranks_entry_comes_from_the_rank_on_its_gpu(tmp_path):
    """2 gloo ranks (EP2), one colocated TP2 server driven by rank 0 (a stub: tests/workers/colocated_payloads.py):
    every bucket goes as one flattened_bucket post whose entry k lives in rank k's shared memory (its pid in the
    file name), both TP ranks load the same weights, and the clean syncs pass the digest check. A load that fails
    mid-sync and a payload rank 1 cannot make fail the driver's sync (EngineError, the guard's to handle) while
    every rank leaves the sync; the next sync is clean."""
    r = torchrun("colocated_payloads.py", 2, str(tmp_path), "configs/models/tiny_qwen3_moe.json", timeout=600)
    assert r["formats"] == ["flattened_bucket", "rlpo_sglang_hooks.report_digests"], r["formats"]
    pids = r["pids"]
    assert len(set(pids)) == 2
    driver, producer = r["attempts"]
    assert producer == [{"ok": {}}] * 4, producer  # rank 1 drives nothing: it made its entries and left each sync
    clean = [driver[0]["ok"], driver[3]["ok"]]  # verified: InProcessTransport's digest check
    assert clean[0]["tensors"] == clean[1]["tensors"] > 10, clean
    assert "answered 500: test: load failed" in driver[1]["error"], driver[1]
    assert "rank 1: RuntimeError: test: out of memory" in driver[2]["error"], driver[2]
    posts = r["posts"]
    for a in (0, 3):  # one post per bucket, every tensor once
        start, end = r["spans"][a]
        assert sum(len(p["names"]) for p in posts[start:end]) == clean[0]["tensors"] < 2 * (end - start)
    assert posts[r["spans"][1][1] - 1].get("failed") and r["spans"][2][1] - r["spans"][2][0] == 2
    assert all(p["pids"] == [[pids[0]], [pids[1]]] for p in posts), posts[:3]
    assert r["tp_ranks_equal"]


def test_the_plan_counts_every_gpus_sync_buffers():
    """The 1-node colocated recipe: every learner GPU holds, at a sync, the bucket the export broadcasts to it and
    its flattened copy (its server rank's payload), not only the driver's GPU; the budgets still hold."""
    recipe = "configs/recipes/qwen3_30b_a3b_gspo_r3_1node.yaml"
    cfg = load_config(os.path.join(ROOT, recipe))
    plan = planning.make_plan(cfg, recipe)
    bucket = cfg.rollout.sync_bucket_mb << 20
    rows = {r.name: r for r in plan.rows if r.role == "learner GPU"}
    assert {n: r.parts.get("sync bucket") for n, r in rows.items()} == {
        "every rank, training": 2 * bucket, "every rank, generation": None, "every rank, sync": 2 * bucket}
    assert plan.first_exceeded() is None


# a server rank's side, as SGLang 0.5.23 does it (tp_worker.py:198 patches torch's rebuild_cuda_tensor to map a GPU
# UUID back to this process's device index, patch_torch.py:41-99; weight_updater.py:383-413 rebuilds the views), with
# the device order reversed where there are several GPUs
_BY_UUID = textwrap.dedent("""
    import base64, json, pickle, sys, torch
    from torch.multiprocessing import reductions
    original = reductions.rebuild_cuda_tensor

    def by_uuid(*args):
        uuid = args[6]
        index = next(i for i in range(torch.cuda.device_count())
                     if str(torch.cuda.get_device_properties(i).uuid) == uuid)
        return original(*args[:6], index, *args[7:])

    reductions.rebuild_cuda_tensor = by_uuid
""")
_SERVER_RANK = _BY_UUID + textwrap.dedent("""
    bucket = pickle.loads(base64.b64decode(sys.stdin.read()))
    flat = bucket["flattened_tensor"]
    out = {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape).double().sum().item()
           for m in bucket["metadata"]}
    print(json.dumps({"sums": out, "uuid": str(torch.cuda.get_device_properties(flat.device).uuid)}))
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_a_gpu_payload_opens_in_another_process_by_its_uuid():
    """On a GPU: the payload names its GPU by UUID, not by index (the pickle holds the UUID string where torch puts
    the device), and another process whose device numbering differs opens it there and reads the bucket's
    tensors, while this process keeps the tensor alive."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    named = [("w", torch.randn(33, 17, device=device)), ("b", torch.randn(5, device=device).to(torch.bfloat16))]
    payload = sp.flatten(named)
    entry = sp.serialize(payload)
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    assert uuid in [a for _, a, _ in pickletools.genops(base64.b64decode(entry)) if isinstance(a, str)]
    order = ",".join(str(i) for i in reversed(range(torch.cuda.device_count())))
    proc = subprocess.run([sys.executable, "-c", _SERVER_RANK], input=entry, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": order})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["uuid"] == uuid
    for name, t in named:
        assert got["sums"][name] == pytest.approx(t.double().sum().item(), rel=1e-6), name
    del payload


# the colocated refit's server rank (launch/rlpo_sglang_hooks._reshard_local): the packed bucket opened by its
# handle (a GPU's by UUID, as SGLang's patched rebuild does; a CPU's shared-memory file by name) and unpacked by the
# plan's offsets (moe/bridge/reshard.unpack)
_PACKED_RANK = _BY_UUID + textwrap.dedent("""
    from moe.bridge import reshard as rs
    entry, spec = sys.stdin.read().split("\\n", 1)
    flat = pickle.loads(base64.b64decode(entry))
    spec = json.loads(spec)
    transfers = [rs.Transfer(0, 0, 0, f"t{i}", tuple(map(tuple, r)), (), (), n) for i, (r, n, _) in enumerate(spec)]
    views = rs.unpack(flat, transfers, [getattr(torch, d) for _, _, d in spec])
    print(json.dumps({"sums": [v.double().sum().item() for v in views], "device": str(flat.device)}))
""")


def test_a_packed_refit_bucket_opens_in_another_process():
    """rollout.sync_transport=reshard, colocated: one server rank's pieces packed into one byte tensor on the GPU it
    shares with the learner rank (moe.bridge.reshard.pack; pieces of different dtypes and sizes, each at a 16-byte
    offset), serialized as the relay does (sglang_payloads.serialize: the GPU named by UUID), open in another
    process, where each piece unpacks to its values. On a CPU the same path through a shared-memory file."""
    from moe.bridge import reshard as rs

    device = torch.device("cuda", torch.cuda.device_count() - 1) if torch.cuda.is_available() else torch.device("cpu")
    shapes = [((3, 17), torch.float32), ((5,), torch.bfloat16), ((2, 4, 3), torch.float32), ((7,), torch.bfloat16)]
    pieces = [torch.randn(s, device=device).to(d) for s, d in shapes]
    spec = [[[[0, n] for n in s], p.numel() * p.element_size(), str(d).split(".")[-1]]
            for (s, d), p in zip(shapes, pieces)]
    transfers = [rs.Transfer(0, 0, 0, f"t{i}", tuple(map(tuple, r)), (), (), n) for i, (r, n, _) in enumerate(spec)]
    flat = rs.pack(transfers, pieces, device)
    offsets, size = rs.packed_offsets(transfers)
    assert flat.numel() == size and all(a % rs.PACK_ALIGN == 0 for a in offsets) and offsets == sorted(set(offsets))
    assert all(torch.equal(v, p) for v, p in zip(rs.unpack(flat, transfers, [d for _, d in shapes]), pieces))
    with pytest.raises(ValueError, match="packs"):
        rs.unpack(flat[:-16], transfers, [d for _, d in shapes])
    entry = sp.serialize(flat)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    if device.type == "cuda":
        assert str(torch.cuda.get_device_properties(device).uuid) in [
            a for _, a, _ in pickletools.genops(base64.b64decode(entry)) if isinstance(a, str)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in reversed(range(torch.cuda.device_count())))
    proc = subprocess.run([sys.executable, "-c", _PACKED_RANK], input=entry + "\n" + json.dumps(spec),
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["device"].startswith(device.type)
    assert got["sums"] == pytest.approx([p.double().sum().item() for p in pieces], rel=1e-6)
    del flat
