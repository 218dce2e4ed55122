"""No host sync per layer or micro-batch in the learner's hot path (issue 27 item 2), counted on CPU.

tests/workers/host_syncs.py runs one RL step of the CPU demo's trainer (GSPO, R3 replayed routes, packed
batches, TIS, the old-log-prob pass) under DeviceTracker, which splits this CPU into an emulated accelerator and
the host and counts what would stop a CUDA host: a value read into Python, a copy to the host, an op sized by
the values (tests/workers/device_tracker.py). Two shapes: 2 layers x 1 micro-batch and 4 layers x 3
micro-batches (2 processes, EP2: megatron's all-to-all dispatcher, as the recipes run).

What counts as ours: every site outside megatron's MoE layer code. megatron-core 0.16.1's dropless MoE layer
reads its token counts on the host in every layer (permute's masked_select, SequentialMLP's split sizes,
sort_chunks_by_idxs): inherent to megatron's local spec (TE's permute fusion and grouped GEMM remove most),
asserted to scale exactly with layers x micro-batches so that nothing else hides among them. The CPU patches'
gloo all-to-all (rlpo_mega/platform/cpu_megatron.py) does not run on CUDA and is left out.
"""
import pytest

from tests.dist import torchrun

pytestmark = pytest.mark.timeout(900)

MEGATRON_MOE = "megatron/core/transformer/moe/"
CPU_ONLY = "rlpo_mega/platform/cpu_megatron.py"
SHAPES = {"l2m1": (2, 1), "l4m3": (4, 3)}
CP_SHAPES = {"cp_l2m1": (2, 1), "cp_l4m3": (4, 3)}  # the same at context parallelism 2 (CP group = EP group)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("syncs"))
    return torchrun("host_syncs.py", 2, out, *(f"{n}={l}:{m}" for n, (l, m) in SHAPES.items()),
                    *(f"{n}={l}:{m}:2" for n, (l, m) in CP_SHAPES.items()), timeout=900)


def _split(counts: dict):
    ours, megatron_moe = {}, {}
    for key, n in counts.items():
        site = key.split(" @ ", 1)[1]
        if site.startswith(CPU_ONLY):
            continue
        (megatron_moe if site.startswith(MEGATRON_MOE) else ours)[key] = n
    return ours, megatron_moe


@pytest.mark.parametrize("shapes", ["plain", "context_parallel"])
@pytest.mark.parametrize("phase", ["_old_logprobs", "_update"])
def test_hot_path_syncs_do_not_grow_with_layers_or_micro_batches(runs, phase, shapes):
    """The old-log-prob pass and the update (forward/backward with R3, log-prob kernel, objective, the
    finite-gradient check, the optimizer step, the metrics): the same few syncs at 2 layers x 1 micro-batch
    and at 4 layers x 3 micro-batches. Before issue 27: old pass 20 -> 56, update 37 -> 83 (RoPE, packed
    attention, routing replay, label range, objective checks, drift metrics, one per gradient buffer). Under
    context parallelism too: its RoPE positions, all-gather-KV attention and log-prob gather read nothing."""
    names = SHAPES if shapes == "plain" else CP_SHAPES
    assert [runs[n]["micro_batches"] for n in names] == [[1], [3]], "the shapes did not come out as planned"
    small, large = (_split(runs[n]["syncs"][phase]) for n in names)
    assert small[0] == large[0], f"{phase}: our syncs differ between the shapes:\n{small[0]}\n{large[0]}"
    assert sum(small[0].values()) <= {"_old_logprobs": 1, "_update": 10}[phase], small[0]
    # megatron's own per-layer reads, and nothing else of theirs: each grows 6x (2x layers, 3x micro-batches)
    assert small[1] and set(small[1]) == set(large[1]), (small[1], large[1])
    assert all(large[1][k] == 6 * small[1][k] for k in small[1]), (small[1], large[1])


def test_weight_sync_digests_read_the_host_once_per_bucket():
    """The sender's "sums" digests (the accelerator's algorithm) of a bucket: one copy to the host for the
    whole bucket, equal to the per-tensor digests (which copy twice per tensor)."""
    r = torchrun("host_syncs.py", 1, "unused", "digests", timeout=300)
    assert r == {"bucket_of_2": {"batched": 1, "per_tensor": 4, "same": True},
                 "bucket_of_8": {"batched": 1, "per_tensor": 16, "same": True}}
