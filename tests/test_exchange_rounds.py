"""The exchange of a step's samples in bounded rounds (rlpo_mega.training.exchange): the same payloads as one
round, on 2 ranks and four layouts (DP2, PP2, SP2, CP2), with each round's bytes per rank under the budget; the
samples' named states
(Sample.state: answered, owned, remote, received) along the way."""
from moe.routing.trace import TraceSpec
from moe.routing.transport import Recipient
from rlpo_mega.rollout import Sample
from rlpo_mega.training.exchange import _blocks, rounds
from tests.dist import torchrun


def test_rounds_deliver_what_one_round_does():
    every = torchrun("exchange_rounds.py", 2)
    for rank, report in enumerate(every):
        for name, r in report.items():
            assert r["same"] and r["covered"], (rank, name, r)
            assert r["rounds"][0] == 1 and r["rounds"][1] > 3, (rank, name, r)
            # the same payloads; each round pads each block to 4 bytes (at most 3 bytes x 4 blocks x 2 senders)
            assert 0 < r["bytes"][0] <= r["bytes"][1] <= r["bytes"][0] + 24 * r["rounds"][1], (rank, name, r)
    # the sequence-parallel pair: each rank got its shard's route rows, together every row once
    assert every[0]["sp2"]["route_rows"] + every[1]["sp2"]["route_rows"] == every[0]["pp2"]["route_rows"]
    assert 0 < every[0]["sp2"]["route_rows"] < every[0]["pp2"]["route_rows"]
    # the context-parallel pair likewise: its chunks' rows (two ranges a sample), together every row once
    assert every[0]["cp2"]["route_rows"] + every[1]["cp2"]["route_rows"] == every[0]["pp2"]["route_rows"]
    assert 0 < every[0]["cp2"]["route_rows"] < every[0]["pp2"]["route_rows"]


def test_each_round_is_under_the_budget_for_every_rank():
    spec = TraceSpec(64, 4, (0, 1, 2, 3))
    samples = []
    for i in range(30):
        s = Sample.from_scalars((4 + i % 3, 10 + i, 0.0, False, False, "stop", 0, 0, True), owner=i % 3)
        samples.append(s)
    recipients = [Recipient(r, r // 2, 2, 0, 1, (0, 1) if r % 2 == 0 else (2, 3)) for r in range(4)]
    dp_of = {i: i % 2 for i in range(30)}
    budget = 500
    plan = rounds(samples, dp_of, recipients, spec, budget)
    assert [i for r in plan for i in r] == list(range(30))
    for r in plan:
        sent, got = {}, {}
        for i in r:
            for rc in recipients:
                if rc.dp_rank == dp_of[i] and rc.rank != samples[i].owner:  # (own samples: taken in place)
                    b = sum(_blocks([samples[i]], len(rc.layer_cols), 4, 1, True))
                    sent[samples[i].owner] = sent.get(samples[i].owner, 0) + b
                    got[rc.rank] = got.get(rc.rank, 0) + b
        assert len(r) == 1 or (max(sent.values(), default=0) <= budget and max(got.values(), default=0) <= budget), \
            (r, sent, got)
