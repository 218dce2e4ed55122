"""Weight sync to an engine through every transport, digest-verified; corruption in transit is caught."""
import pytest

from tests.dist import torchrun


@pytest.fixture(scope="module")
def sync_report(tmp_path_factory):
    return torchrun("sync.py", 2, str(tmp_path_factory.mktemp("sync")), "configs/models/tiny_qwen3_moe.json")


@pytest.mark.parametrize("transport", ["in_process", "in_process_sums", "disk", "distributed"])
def test_sync_takes_effect_and_verifies(sync_report, transport):
    r = sync_report[transport]
    assert r["ok"], r
    assert r["stats_tensors"] > 0
    # a CPU learner's stream digests with xxh3 unless told otherwise; every receiver followed it
    assert r["algorithms"] == ["sums" if transport.endswith("sums") else "xxh3"], r
    # The engine now computes what the learner computes: the weights really arrived.
    assert r["logits_rel_err"] <= 1e-4, r


@pytest.mark.parametrize("transport", ["in_process_corrupted", "in_process_sums_corrupted", "distributed_corrupted"])
def test_corruption_in_transit_is_caught(sync_report, transport):
    r = sync_report[transport]
    assert not r["ok"]
    assert "digest mismatch" in r["error"] and "refusing to roll out" in r["error"], r["error"]


def test_stream_buffers_are_reused_across_syncs(sync_report):
    """The in-process and distributed transports let the stream recycle its CPU buffers: a second sync
    allocates nothing new, and two recycling streams of one model at once are refused."""
    r = sync_report["pool"]
    assert r["held_bytes"] > 0 and r["same_buffers"], r
    assert "two recycling export streams" in r["second_stream_error"], r
    assert r["busy_after_syncs"] is False
    assert sync_report["bf16_export_exact"]  # a dtype cast on export lands in recycled buffers too


def test_export_to_several_destinations(sync_report):
    """ExportStream(dst=[ranks]) (rollout.sglang.drivers > 1): at EP2 each rank leads half the experts and sends
    them to the other; every destination receives every tensor, bit-identical to dst=None's broadcast, and
    digests them alike; a rank outside dst receives nothing."""
    r = sync_report["multi_dst"]
    assert r["tensors"] > 0
    for rank, got in enumerate(r["ranks"]):
        both = got["[0, 1]"]
        assert both["receives"] and both["equal"] and both["names"] == r["tensors"] and both["digests"], (rank, got)
        one = got["[1]"]
        assert one["receives"] == (rank == 1), (rank, got)
        assert (one["equal"] and one["digests"]) if rank == 1 else one["names"] == 0, (rank, got)


def test_disk_sync_to_two_drivers(sync_report):
    """rollout.sglang.drivers=2 with the disk transport: each driver writes and reloads its own subdirectory of
    sync_dir (one shared directory would be swapped out under the other's reload), digest-verified, and its
    engine then computes the learner's logits."""
    r = sync_report["disk_drivers"]
    assert [x["path"] for x in r["ranks"]] == ["sync_drivers/driver_0", "sync_drivers/driver_1"], r
    assert r["sync_dir"] == ["driver_0", "driver_1"], r  # nothing else left there (temporary siblings renamed)
    assert all(x["tensors"] > 0 and x["logits_rel_err"] <= 1e-4 for x in r["ranks"]), r


def test_buffer_pool_reuses_by_shape_and_keeps_at_most_a_bucket():
    import torch

    from moe.bridge.megatron_io import _BufferPool

    pool = _BufferPool()
    a, b = pool.empty((256, 256), torch.float32, "cpu"), pool.empty((256, 256), torch.float32, "cpu")
    pool.release(keep_bytes=1 << 20)  # two 256 KiB buffers fit
    assert pool.held_bytes == 2 * (256 << 10)
    again = [pool.empty((256, 256), torch.float32, "cpu") for _ in range(2)]
    assert {t.data_ptr() for t in again} == {a.data_ptr(), b.data_ptr()}  # reused, not reallocated
    other = pool.empty((512, 256), torch.float32, "cpu")  # a shape this bucket adds
    pool.release(keep_bytes=600 << 10)  # 1 MiB lent, 600 KiB kept: whole buffers, at most the limit
    assert pool.held_bytes <= 600 << 10 and pool.held_bytes > 0 and not pool.lent
    assert pool.empty((2,), torch.float32, "meta").device.type == "meta" and not pool.lent  # only CPU is pooled
    del other
