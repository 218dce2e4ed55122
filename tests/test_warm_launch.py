"""tests/warm_launch.py, the suite's launcher of worker ranks, against what torchrun gives a rank."""
import subprocess
import time

import pytest

from tests.dist import ROOT, torchrun


def test_ranks_see_torchrun_environment():
    seen = torchrun("launch_probe.py", 3, "ok", env={"RLPO_PROBE": "x"})
    assert [s["env"]["RANK"] for s in seen] == ["0", "1", "2"]
    assert all(s["env"]["WORLD_SIZE"] == s["env"]["LOCAL_WORLD_SIZE"] == "3" for s in seen)
    assert all(s["env"]["RLPO_PROBE"] == "x" and s["cwd"] == ROOT and s["main"] == "__main__" for s in seen)
    assert all(s["argv"][1:] == ["ok"] for s in seen)


def test_one_failed_rank_stops_the_others():
    t0 = time.time()
    proc = torchrun("launch_probe.py", 2, "fail", expect_fail=True, timeout=300)
    assert proc.returncode != 0
    assert "ValueError: rank 1 fails on purpose" in proc.stderr
    assert time.time() - t0 < 120  # rank 0 sleeps 600 s unless stopped


def test_timeout_kills_the_ranks():
    with pytest.raises(subprocess.TimeoutExpired):
        torchrun("launch_probe.py", 2, "hang", timeout=20)
