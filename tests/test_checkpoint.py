"""Checkpoints reshard between layouts (model + optimizer) and survive interrupted saves.

Three torchrun launches for everything (8 processes are slow on 2 cores):
  ckpt_reshard.py, 8 processes: TP2/EP2/PP2 (DP2, 2 micro-batches) <-> TP1 (DP8), switching layouts
      inside the launch; saves `big1` (at TP2/EP2/PP2) and `tp1_1` (at TP1) after step 1.
  ckpt_single.py, 1 process: loads `big1` at TP1, a no-optimizer-state control, failure modes.
  ckpt_distopt.py, 2 processes: the distributed optimizer (fp32 and bf16 params) saved at EP2/DP2,
      resumed at the same and other TP/EP/DP layouts, to and from the plain optimizer.
"""
import os
import re

import pytest

from rlpo_mega.platform import cpu_megatron
from tests.dist import torchrun

FAMILIES = ("qwen3_moe", "mixtral")
REL = 1e-5


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def same(a: float, b: float) -> bool:
    return rel(a, b) <= REL


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def reshard(ckpt_dir):
    return torchrun("ckpt_reshard.py", 8, str(ckpt_dir), *FAMILIES)


@pytest.fixture(scope="module")
def single(ckpt_dir, reshard):
    return torchrun("ckpt_single.py", 1, str(ckpt_dir), *FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2ep2pp2_checkpoint_loads_at_tp1(reshard, single, family):
    r, s = reshard[family], single[family]
    assert r["big_layout"] == "TP2/EP2/PP2/DP2 on 8" and r["tp1_layout"] == "TP1/EP1/PP1/DP8 on 8"
    assert s["layout"] == "TP1/EP1/PP1/DP1 on 1"
    assert s["meta"]["layout"] == r["big_layout"] and s["meta"]["step"] == 1
    # TP1 on the same 8 processes (DP8) and on a single process
    assert same(r["tp1_from_big_eval1"], r["big_eval1"]), (r["tp1_from_big_eval1"], r["big_eval1"])
    assert same(s["eval1"], r["big_eval1"]), (s["eval1"], r["big_eval1"])
    # loading changed something: the freshly built model (other seed) evaluates differently
    assert not same(s["fresh_eval"], r["big_eval1"])
    assert not same(r["tp1_eval2"], r["big_eval1"])  # what the TP1 model held before the load


@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_checkpoint_loads_at_tp2ep2pp2(reshard, family):
    r = reshard[family]
    assert r["big_from_tp1_meta"]["layout"] == "TP1/EP1/PP1/DP8 on 8"
    assert not same(r["big_fresh_eval"], r["tp1_eval1"])
    assert same(r["big_from_tp1_eval1"], r["tp1_eval1"]), (r["big_from_tp1_eval1"], r["tp1_eval1"])


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_at_other_layout_matches_continuing(reshard, single, family):
    """Saved after step 1, loaded (model + optimizer) at another layout, step 2 == continuing run."""
    r, s = reshard[family], single[family]
    # TP2/EP2/PP2 -> TP1 (DP8) and -> TP1 (1 process)
    for loss2, eval2 in ((r["tp1_from_big_loss2"], r["tp1_from_big_eval2"]), (s["loss2"], s["eval2"])):
        assert same(loss2, r["big_loss2"]), (loss2, r["big_loss2"])
        assert same(eval2, r["big_eval2"]), (eval2, r["big_eval2"])
    # TP1 -> TP2/EP2/PP2
    assert same(r["big_from_tp1_loss2"], r["tp1_loss2"]), (r["big_from_tp1_loss2"], r["tp1_loss2"])
    assert same(r["big_from_tp1_eval2"], r["tp1_eval2"]), (r["big_from_tp1_eval2"], r["tp1_eval2"])


@pytest.mark.parametrize("family", FAMILIES)
def test_optimizer_state_matters(single, reshard, family):
    """Control: the same weights with a fresh optimizer land elsewhere after step 2, so the resume
    test above really checks the restored Adam state (and step)."""
    s, r = single[family], reshard[family]
    assert same(s["model_only_eval1"], r["big_eval1"])
    assert rel(s["model_only_eval2"], r["big_eval2"]) > 100 * REL, (s["model_only_eval2"], r["big_eval2"])


def test_interrupted_save_is_refused_with_the_fix(single):
    f = single[FAMILIES[0]]["failures"]
    msg = f["interrupted_error"]
    assert msg is not None and "ckpt.tmp" in msg and "rlpo_meta.json missing" in msg
    assert "interrupted" in msg and "checkpoint.load_dir" in msg
    assert "holds the previous complete checkpoint" in msg
    assert "does not exist" in f["missing_error"] and "checkpoint.load_dir" in f["missing_error"]
    assert "holds no optimizer state" in f["no_optimizer_error"]


def test_crash_mid_save_keeps_previous_checkpoint(single):
    f = single[FAMILIES[0]]["failures"]
    # an error during the save (any rank): one CheckpointError, its .tmp removed, the checkpoint untouched
    assert "saving checkpoint" in f["error_raised"] and "simulated failure during save" in f["error_raised"]
    assert f["dirs_after_error"] == ["ckpt"]
    # the process dying mid-save (no clean-up can run):
    assert f["crash_raised"] == "simulated crash during save"
    assert f["tmp_left"] == ["ckpt", "ckpt.tmp"]  # the half-written save stays aside
    assert not same(f["moved_eval"], f["saved_eval"])
    assert f["meta_after_crash"]["step"] == 2  # the previous checkpoint, not the crashed one
    assert same(f["eval_after_crash"], f["saved_eval"])
    # the next save clears the leftover and replaces the checkpoint
    assert f["dirs_after_resave"] == ["ckpt", "model_only"]
    assert f["meta_after_resave"]["step"] == 4


# ---------------------------------------------------------------------------------------------------
# Distributed optimizer (optim.use_distributed_optimizer=true): megatron's fully_reshardable format.
# The reference is the uninterrupted run, saved after step 1 at EP2 (TP1/DP2); resumed runs load that
# checkpoint and take steps 2 and 3.
EP2_DP2 = "TP1/EP2/PP1/DP2 on 2"
TP2_DP1 = "TP2/EP1/PP1/DP1 on 2"


@pytest.fixture(scope="module")
def distopt(distopt_launch):  # tests/conftest.py: one launch, test_gpu_path.py reads it too
    assert FAMILIES[0] == "qwen3_moe"
    return distopt_launch


def same_steps(resumed, ref, tol=REL, prefix=""):
    for n in ("loss2", "loss3"):
        assert rel(resumed[prefix + n], ref[n]) <= tol, (prefix + n, resumed[prefix + n], ref[n])


def test_distributed_optimizer_resumes_exactly_at_the_same_layout(distopt):
    r = distopt["float32"]
    ref, same = r["ref"], r["same"]
    assert ref["layout"] == same["layout"] == same["meta"]["layout"] == EP2_DP2
    assert same["meta"]["distributed_optimizer"] and same["meta"]["step"] == 1
    same_steps(same, ref, tol=0.0)
    # saved before any step (Adam's initial state), loaded, stepped: the uninterrupted step 1
    assert same["eval1"] == ref["eval1"]


def test_distributed_optimizer_resumes_at_other_tp_ep_and_dp(distopt):
    r = distopt["float32"]
    assert r["tp2"]["layout"] == TP2_DP1  # EP2/DP2 -> TP2+SP/DP1
    same_steps(r["tp2"], r["ref"])


def test_plain_and_distributed_optimizer_checkpoints_load_into_each_other(distopt):
    r = distopt["float32"]
    to_plain, from_plain = r["to_plain"], r["from_plain"]
    # dist at EP2/DP2 -> plain at TP2/EP2/DP1, saved there -> dist at TP1/EP1/DP2
    assert to_plain["layout"] == "TP2/EP2/PP1/DP1 on 2" and to_plain["meta"]["distributed_optimizer"]
    assert from_plain["layout"] == "TP1/EP1/PP1/DP2 on 2"
    assert from_plain["meta"]["layout"] == to_plain["layout"] and not from_plain["meta"]["distributed_optimizer"]
    same_steps(to_plain, r["ref"])
    same_steps(from_plain, r["ref"])


def test_bf16_fp32_main_params_are_saved_and_restored(distopt):
    """bf16 weights, fp32 main params inside the distributed optimizer (the recipes' precision)."""
    r = distopt["bfloat16"]
    ref, same, tp2, back = r["ref"], r["same"], r["tp2"], r["back"]
    assert ref["layout"] == back["layout"] == EP2_DP2 and tp2["layout"] == TP2_DP1
    same_steps(same, ref, tol=0.0)
    # Control: main params rebuilt from the bf16 weights land elsewhere after one step.
    assert same["rebuilt_loss2"] == ref["loss2"]
    assert rel(same["rebuilt_loss3"], ref["loss3"]) > 1e-6, (same["rebuilt_loss3"], ref["loss3"])
    # Through TP2+SP/DP1 and back (loaded there, saved there, loaded at EP2/DP2): still exact.
    assert back["meta"]["layout"] == tp2["layout"]
    same_steps(back, ref, tol=0.0)
    # At TP2 itself bf16 matmuls round differently: loss2 differs (1.6e-5 here) with bit-equal weights.
    same_steps(tp2, ref, tol=5e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_distributed_optimizer_state_is_held_in_shares_not_gathered(distopt, dtype):
    """Host memory of a distributed-optimizer save and load (float32 at TP1/DP2, bf16 at EP2 with dense DP2): each
    rank holds the state of the parameters it owns (save) or its range touches (load), as rlpo-mega plan predicts
    it, byte for byte; megatron-core's own fully_reshardable save gathers a DP group's whole state on its DP rank 0,
    and its load reads the whole shard on every rank. The tensors written are megatron's: each checkpoint loads
    through the other reader bit-exactly."""
    m = distopt["memory"][dtype]
    ours = [(save, load) for save, load, _ in m["ours"]]
    assert ours == [tuple(p) for p in m["predicted"]]
    theirs_save = [save for save, _, _ in m["megatron_to_ours"]]
    theirs_load = [load for _, load, _ in m["ours_to_megatron"]]
    # (the counts leave out the main copy of an fp32 parameter: it is the parameter, written with the weights)
    for got, gathered in zip(theirs_save, m["dp0_bytes"]):  # everything on DP rank 0
        assert got == gathered == 0 or 0.6 * gathered < got <= gathered
    for got, shard in zip(theirs_load, m["shard_bytes"]):  # the whole shard, on every rank
        assert 0.6 * shard < got <= shard
    # ours: the state spread over the DP ranks, well under megatron's peak on either side
    assert max(s for s, _ in ours) < 0.75 * max(theirs_save)
    assert max(load for _, load in ours) < 0.8 * max(theirs_load)
    assert sum(s for s, _ in ours) <= sum(theirs_save)  # each state once
    for name in ("ours", "megatron_to_ours", "ours_to_megatron"):
        assert all(exact for _, _, exact in m[name]), name
    if dtype == "float32":
        assert m["straddling"], "no parameter runs over a DP range: the exchange was not exercised"
    print(dtype, "parameters over DP ranges", len(m["straddling"]), "; host bytes of optimizer state per rank: save",
          [s for s, _ in ours], "megatron", theirs_save, "; load", [load for _, load in ours], "megatron", theirs_load)


def test_optimizer_cpu_offload_checkpoints_load_with_and_without_offload_at_another_layout(distopt):
    """optim.cpu_offload (+ precision_aware, overlap: slime's one-node flags): megatron's HybridDeviceOptimizer holds
    the fp32 masters and Adam moments on the host; its checkpoints are the same reshardable tensors. Saved offloaded
    at EP2/DP2 (before any step and after one), loaded offloaded; loaded without offload at TP2+SP/DP1 and saved
    there; loaded offloaded at EP2/DP2 again: bit-equal state and weights, and the same steps after."""
    r = distopt["offload"]
    ref, fresh, plain, back = r["ref"], r["fresh"], r["plain"], r["back"]
    assert r["optimizer"] == ["HybridDeviceOptimizer"] and plain["optimizer"] == ["AdamW"]
    assert fresh["layout"] == back["layout"] == EP2_DP2 and plain["layout"] == TP2_DP1
    # never stepped: loaded without megatron's dummy_step (random gradients), so the weights are the saved ones
    assert fresh["eval0"] == ref["eval0"] and fresh["loss1"] == ref["loss1"]
    assert fresh["weights_equal"] and fresh["state_equal"] and fresh["eval1"] == ref["eval1"]
    assert plain["meta"]["layout"] == EP2_DP2 and back["meta"]["layout"] == TP2_DP1
    assert back["state_equal"] and back["weights_equal"]  # offloaded -> plain at TP2 -> offloaded: unchanged
    same_steps(back, ref, tol=0.0)
    same_steps(plain, ref, tol=5e-4)  # bf16 at TP2 rounds differently (as test_bf16_fp32_main_params...)


def test_optimizer_param_types_patch_is_needed(distopt):
    """CPU patch optimizer_param_types: without it neither the bf16 nor the distributed optimizer
    can be built, failing at a megatron-core line the patch names."""
    patch = next(p for p in cpu_megatron.PATCHES if p.name == "optimizer_param_types")
    sites = set()
    for entry in patch.answers:
        path, lines = entry.split(":")
        sites |= {f"{path}:{n}" for n in lines.split(",")}
    assert set(distopt["ablation"]) == {"Float16OptimizerWithFloat16Params", "DistributedOptimizer"}
    for name, got in distopt["ablation"].items():
        assert got is not None, f"{name} builds without the patch"
        assert re.match(r"Wrapped parameters must be one of .* Received torch\.\w+Tensor", got["error"]), got
        assert got["site"] in sites, (name, got["site"], patch.answers)


def test_sizes_only_and_checksum_meta_files_are_verified(tmp_path):
    """A meta file with sizes only (checksums=False, and saves on SIGTERM before checksums were taken as written)
    still refuses a truncated file by its recorded size; a checksum catches a changed byte."""
    from rlpo_mega.checkpoint import files as cf

    (tmp_path / "a").write_bytes(b"x" * 1000)
    (tmp_path / "b").write_bytes(b"y" * 10)
    sizes = {"a": [1000, None], "b": [10, None]}
    assert cf.verify_files(str(tmp_path), sizes) is None
    (tmp_path / "a").write_bytes(b"x" * 999)
    assert "truncated or changed" in cf.verify_files(str(tmp_path), sizes)
    full = cf.digest_files(str(tmp_path), ["a", "b"])
    (tmp_path / "b").write_bytes(b"z" * 10)
    assert "corrupted" in cf.verify_files(str(tmp_path), full)


def test_writes_hashed_in_a_forked_writer_reach_the_saver(tmp_path):
    """The mechanism megatron's writer processes go through (rlpo_mega.checkpoint.writes.SharedDigests): a process
    forked after the table was made writes a planned file in pieces; this one reads its size and digest, equal to a
    hash of the file. A file not planned passes through unhashed (the save then reads it back, with a warning)."""
    import xxhash

    from rlpo_mega.checkpoint.writes import SharedDigests

    planned, other = str(tmp_path / "__0_0.distcp"), str(tmp_path / "other")
    shared = SharedDigests([planned])
    pid = os.fork()
    if pid == 0:  # the writer: only os._exit leaves it (no pytest teardown in the fork)
        try:
            with open(planned, "wb") as f:
                for i in range(3):  # one stream per item, as torch's _write_item makes them
                    shared.stream(f).write(memoryview(bytes(range(256)) * (i + 1)))
            with open(other, "wb") as f:
                assert shared.stream(f) is f
                f.write(b"not planned")
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    data = (tmp_path / "__0_0.distcp").read_bytes()
    assert shared.get(planned) == (len(data), xxhash.xxh3_64_hexdigest(data)) and len(data) == 6 * 256
    assert shared.get(other) is None


def test_megatrons_false_corrupted_checkpoint_warning_is_left_out_of_our_saves():
    """megatron warns "Overwriting old incomplete / corrupted checkpoint..." when the directory it saves into is
    not empty; ours always holds our PARTIAL marker. Only that record is left out, only while we save, on
    megatron's own logger (tests/test_gpu_path.py checks a real save's stderr)."""
    import logging

    from megatron.core.dist_checkpointing import serialization

    from rlpo_mega.checkpoint.dist import MEGATRON_SAVE_LOGGER, fresh_directory_save

    assert serialization.logger.name == MEGATRON_SAVE_LOGGER
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    keep = Keep()
    serialization.logger.addHandler(keep)
    try:
        with fresh_directory_save():
            serialization.logger.warning("Overwriting old incomplete / corrupted checkpoint...")
            serialization.logger.warning("something else")
        serialization.logger.warning("Overwriting old incomplete / corrupted checkpoint...")
    finally:
        serialization.logger.removeHandler(keep)
    assert seen == ["something else", "Overwriting old incomplete / corrupted checkpoint..."]


# ---------------------------------------------------------------------------------------------------
# Checksums taken as a save writes its files (rlpo_mega.checkpoint.writes): tests/workers/ckpt_digests.py, one
# 2-process launch at EP2 (both ranks write megatron shards), trainer saves through rlpo_mega.checkpoint.run.save.
READ_BACK = ["common.pt", "metadata.json"]  # megatron-core writes them from a path: read once, on rank 0


@pytest.fixture(scope="module")
def digests(tmp_path_factory):
    return torchrun("ckpt_digests.py", 2, str(tmp_path_factory.mktemp("digests")))


def test_recorded_checksums_are_the_files_hashes(digests):
    """Every file of the step but the meta file itself, with its size and the hash of its bytes on disk: both ranks'
    shards (written by megatron's forked writer processes), torch's .metadata, megatron's two files, ours."""
    step = digests["step1"]
    on_disk = {n: v for n, v in step["on_disk"].items() if n != "rlpo_meta.json"}
    assert step["meta_files"] == on_disk
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", *READ_BACK, "trainer_state.pt", "hf/config.json",
            "rank_state/rank_00000.pt", "rank_state/rank_00001.pt"} <= set(on_disk), sorted(on_disk)


def test_a_save_reads_no_checkpoint_file_back(digests):
    """Files of the step being saved opened for reading during the save, per rank (an audit hook on every open):
    megatron's two small files on rank 0, nothing else -- the regular save and the sizes-only one alike."""
    for save, step in (("regular", 1), ("sigterm", 2)):
        name = f"step_{step:08d}"
        read = [[f for f in rank if f.split("/")[0] in (name, name + ".tmp")] for rank in digests[save]["read"]]
        assert read == [[f"{name}.tmp/{n}" for n in READ_BACK], []], (save, digests[save]["read"])
    sizes = digests["step1"]["on_disk"]
    assert sum(sizes[n][0] for n in READ_BACK) < 0.01 * sum(size for size, _ in sizes.values())


def test_a_sizes_only_save_records_the_sizes(digests):
    """checksums=False (the trainer's save on SIGTERM): the sizes of every file, no digest."""
    step = digests["step2"]
    assert step["meta_files"] == {n: [size, None] for n, (size, _) in step["on_disk"].items() if n != "rlpo_meta.json"}


def test_a_corrupted_file_is_refused_at_load_and_older_meta_files_load(digests):
    assert digests["loads"] is None
    msg = digests["corrupted"]  # one byte flipped in a shard, its size kept
    assert msg and "\n" not in msg and f"{digests['shard']} is corrupted" in msg, msg
    # the byte restored, the meta file as older saves wrote it: sizes only, and no file list (before checksums)
    assert digests["sizes_only_loads"] is None and digests["no_files_loads"] is None
