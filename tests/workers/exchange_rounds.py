"""2 ranks (gloo): the exchange in bounded rounds delivers exactly what one round does. Each rank owns every
other sample (tokens, log-probs, uint8 routes, some with fallback flags); three layouts: DP 2 (each sample to one
rank, every MoE layer), one replica over two pipeline stages (every sample to both, each its own layers) and one
replica over a sequence-parallel pair (every sample to both, each only the route rows of its sequence shard of
the packed micro-batches)."""
import torch
import torch.distributed as dist

from moe.routing.trace import TraceSpec
from moe.routing.transport import Recipient
from rlpo_mega.data.packing import plan_step
from rlpo_mega.rollout import Sample
from rlpo_mega.training.exchange import exchange, rounds
from tests.dist import write_report

dist.init_process_group("gloo")
me = dist.get_rank()
spec = TraceSpec(64, 4, (0, 1, 2, 3))


def full(i):
    g = torch.Generator().manual_seed(i)
    p, r = 3 + i % 5, 2 + (7 * i) % 11
    ids = torch.randint(0, 256, (p + r,), generator=g)
    routes = torch.randint(0, 64, (p + r - 1, 4, 4), generator=g).to(torch.uint8)
    flagged = i % 3 == 0
    replaced = (torch.rand(p + r - 1, 4, generator=g) < 0.3) if flagged else None
    s = Sample(ids[:p].tolist(), ids[p:].tolist(), torch.randn(r, generator=g), "stop", routes=routes,
               replaced=replaced, replaced_entries=int(replaced.sum()) if flagged else 0)
    assert s.state == "answered"
    s.owner = i % 2  # what the scalars' gather sets
    return s


n = 40
truth = [full(i) for i in range(n)]
samples = [t if t.owner == me else Sample.from_scalars(t.scalars(), t.owner) for t in truth]
layouts = {
    # half the samples trained where they were made (taken in place), half sent to the other rank
    "dp2": ([Recipient(0, 0, 2, 0, 1, (0, 1, 2, 3)), Recipient(1, 1, 2, 0, 1, (0, 1, 2, 3))],
            {i: (i // 2) % 2 for i in range(n)}),
    "pp2": ([Recipient(0, 0, 1, 0, 1, (0, 1)), Recipient(1, 0, 1, 0, 1, (2, 3))], {i: 0 for i in range(n)}),
    "sp2": ([Recipient(0, 0, 1, 0, 2, (0, 1, 2, 3)), Recipient(1, 0, 1, 1, 2, (0, 1, 2, 3))], {i: 0 for i in range(n)}),
    # a context-parallel pair: each rank its chunks r and 3 - r of every sample (two ranges of trace rows)
    "cp2": ([Recipient(0, 0, 1, 0, 1, (0, 1, 2, 3), 0, 2), Recipient(1, 0, 1, 0, 1, (0, 1, 2, 3), 1, 2)],
            {i: 0 for i in range(n)}),
}
# the sequence-parallel pair trains packed micro-batches of about 60 positions
spans = [t.span for t in truth]
plan = plan_step(spans, 1, 1, max_tokens=60, layout="packed", align=2)
shards = {"sp2": plan.shards(spans, 2, 2), "cp2": plan.shards(spans, 1, 1, cp_size=2)}
report = {}
for name, (recipients, dp_of) in layouts.items():
    sh = shards.get(name)
    one, s1 = exchange(samples, dp_of, recipients, spec, round_bytes=1 << 30, shards=sh)
    many, s2 = exchange(samples, dp_of, recipients, spec, round_bytes=600, shards=sh)
    cols = list(recipients[me].layer_cols)
    same = sorted(one) == sorted(many) == sorted(i for i in range(n) if dp_of[i] == recipients[me].dp_rank)
    rows = 0
    for i in one:
        a, b, t = one[i], many[i], truth[i]
        ranges = sh[i][me] if sh else ((0, t.span),)
        rows += sum(hi - lo for lo, hi in ranges)
        same &= a.routes_rows == b.routes_rows == tuple(ranges)
        same &= a.state == b.state == "received"
        same &= torch.equal(a.ids, b.ids) and torch.equal(a.ids, t.ids) and torch.equal(a.logprobs, b.logprobs)
        want = torch.cat([t.routes[lo:hi] for lo, hi in ranges] or [t.routes[:0]])[:, cols]
        same &= torch.equal(a.routes, b.routes) and torch.equal(a.routes, want)
        same &= (a.replaced is None) == (t.replaced is None)
        if a.replaced is not None:
            rep = torch.cat([t.replaced[lo:hi] for lo, hi in ranges] or [t.replaced[:0]])[:, cols]
            same &= torch.equal(a.replaced, b.replaced) and torch.equal(a.replaced, rep)
    cut = rounds(samples, dp_of, recipients, spec, 600, sh)
    same &= [s.state for s in samples] == ["owned" if t.owner == me else "remote" for t in truth]
    report[name] = {"same": bool(same), "rounds": [s1["rounds"], s2["rounds"]],
                    "covered": sorted(sum(cut, [])) == list(range(n)), "route_rows": rows,
                    "bytes": [s1["bytes_received"], s2["bytes_received"]]}
every = [None, None]
dist.all_gather_object(every, report)
if me == 0:
    write_report(every)
dist.destroy_process_group()
