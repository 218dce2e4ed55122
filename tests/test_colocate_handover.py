"""rollout.colocate's hand-over across ranks (training/colocate.HandOver): each transition agreed by every rank before
the other side moves in, with one rank's offload and onload made slow (tests/workers/handover_order.py)."""
import pytest

from tests.dist import torchrun


@pytest.fixture(scope="module")
def order():
    return torchrun("handover_order.py", 2)


def _index(events, rank, what):
    return next(i for i, e in enumerate(events) if e == [rank, what])


def _before(events, first: list, then: list):
    """Every event in `first` comes before every event in `then` (each a [rank, what])."""
    return max(_index(events, *f) for f in first) < min(_index(events, *t) for t in then)


OFF = [[0, "offloaded"], [1, "offloaded"]]
ON = [[0, "onload"], [1, "onload"]]


def test_servers_launch_only_once_every_rank_is_off_the_gpus(order):
    """The launch (by the node's rank 0) waits for the slow rank's offload: the servers size their KV pool with no
    learner state on any of their GPUs; it returns once they are released, before the warm-up and the first sync."""
    assert _before(order["launch"], OFF, [[0, "launch"]]), order["launch"]
    assert _before(order["learner_in"], [[0, "release"]], ON), order["learner_in"]


def test_the_engine_resumes_after_every_rank_offloaded_and_is_released_before_any_onloads(order):
    gen = order["generation"]
    assert _before(gen, OFF, [[0, "resume weights"], [0, "resume kv_cache"]]), gen
    assert _before(gen, [[0, "release"]], ON), gen
    assert [w for r, w in gen if r == 0] == ["offloaded", "resume weights", "resume kv_cache", "generate", "release",
                                             "onload"], gen


def test_a_resync_in_the_middle_of_generation_onloads_after_the_release_and_resumes_after_the_offload(order):
    """A rebuild's re-sync while the learner is off: the servers released before any rank's state returns for the
    sync; after it, every rank off again before the KV cache is resumed and generation goes on."""
    ev = order["resync"]
    first_sync = [i for i, e in enumerate(ev) if e[1] == "sync"]
    assert len(first_sync) == 2, ev
    mid = ev[_index(ev, 0, "resume kv_cache") + 1:]  # after generation's own resume: the re-sync
    assert _before(mid, [[0, "release"]], ON), mid
    resume = _index(mid, 0, "resume kv_cache")
    last = {w: max(i for i, e in enumerate(mid) if e[1] == w) for w in ("sync", "offloaded")}
    assert last["sync"] < last["offloaded"] < resume, mid  # the sync done on every rank, every rank off, then the KV
    assert [e for e in mid[:resume] if e[1] == "offloaded"] == [[0, "offloaded"], [1, "offloaded"]], mid
    assert _before(mid, [[0, "resume kv_cache"]], [[0, "generate"], [1, "generate"]]), mid


def test_a_stop_during_generation_releases_the_servers_before_any_rank_onloads(order):
    ev = order["stop"]
    assert _before(ev, [[0, "release"]], ON), ev
    assert [w for r, w in ev if r == 1][-2:] == ["onload", "stopped"], ev
