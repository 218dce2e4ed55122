"""Routing traces without processes: format, validation, decoders, alignment, transport cuts, metrics."""
import math

import pytest
import torch

from moe.routing.decoders import (HFRouteCapture, assemble_pieces, decode_sglang, encode_sglang, select_moe_layers,
                                  sglang_trace)
from moe.routing.metrics import RoutingStats, agreement, load_entropy, load_histogram, max_over_mean
from moe.routing.trace import RoutingTraceError, TraceSpec, compact_dtype, validate_batch, validate_trace
from moe.routing.transport import (LIVE, PAD, Recipient, local_routes, pack, packed_placement, padded_placement,
                                   _pieces)

SPEC = TraceSpec(num_experts=8, topk=2, moe_layers=(1, 3))  # 4 hidden layers, 0 and 2 dense
E, K, L = 8, 2, 2


def route_of(tok, layer):
    """A route that is a function of the token id: alignment is checkable position by position."""
    a = (tok * 3 + layer) % E
    return [a, (a + 1 + layer) % E]


def trace_for(tokens):
    """Hand-built trace of a sample: rows for tokens[:-1] (the last token never ran a forward)."""
    return torch.tensor([[route_of(t, l) for l in range(L)] for t in tokens[:-1]], dtype=torch.int32)


def good(n=5):
    return torch.tensor([[route_of(t, l) for l in range(L)] for t in range(n)])


def test_compact_dtype_and_bytes():
    assert compact_dtype(8) == torch.uint8 and compact_dtype(256) == torch.uint8
    assert compact_dtype(257) == torch.int16 and compact_dtype(40000) == torch.int32
    tr = validate_trace(good(), SPEC, 5, "s0")
    assert tr.ids.dtype == torch.uint8 and tr.nbytes() == 5 * L * K and tr.replaced is None
    assert torch.equal(tr.ids.long(), good())


@pytest.mark.parametrize("case,expect", [
    ("shape", "shape (5, 3, 2), expected [tokens, 2 MoE layers, top-2]"),
    ("topk", "shape (5, 2, 3)"),
    ("extra_rows", "6 rows for 5 tokens"),
    ("missing_rows", "missing rows for tokens 3..4"),
    ("range", "token 2, MoE layer 1 (decoder layer 3): expert id out of range [0, 8)"),
    ("negative", "token 1, MoE layer 0 (decoder layer 1): missing route (id -1, no data)"),
    ("duplicate", "token 4, MoE layer 0 (decoder layer 1): duplicate expert ids in the top-2 [5, 5]"),
    ("all_zero", "MoE layer 1 (decoder layer 3): every expert id is 0 (route data missing?)"),
    ("float", "ids must be integers"),
])
def test_bad_traces_are_named_and_fallback_counts(case, expect, caplog):
    t = good()
    if case == "shape":
        t = torch.zeros(5, 3, 2, dtype=torch.long)
    elif case == "topk":
        t = torch.zeros(5, 2, 3, dtype=torch.long)
    elif case == "extra_rows":
        t = good(6)
    elif case == "missing_rows":
        t = good(3)
    elif case == "range":
        t[2, 1, 0] = 8
    elif case == "negative":
        t[1, 0] = -1
    elif case == "duplicate":
        t[4, 0] = torch.tensor([5, 5])
    elif case == "all_zero":
        t[:, 1] = 0
    elif case == "float":
        t = t.float()
    with pytest.raises(RoutingTraceError) as err:
        validate_trace(t, SPEC, 5, "sample-7")
    assert "routing trace of sample sample-7" in str(err.value) and expect in str(err.value), str(err.value)
    caplog.clear()
    tr = validate_trace(t, SPEC, 5, "sample-7", on_error="fallback")
    expected = {"shape": 10, "topk": 10, "extra_rows": 10, "float": 10, "missing_rows": 4, "range": 1,
                "negative": 1, "duplicate": 1, "all_zero": 5}[case]
    assert tr.num_replaced == expected and tr.ids.shape == (5, L, K)
    assert any("fall back to the live router" in r.getMessage() and "sample-7" in r.getMessage()
               for r in caplog.records)
    good_entries = ~tr.replaced
    assert torch.equal(tr.ids.long()[good_entries], good()[good_entries]) or case in ("shape", "topk", "extra_rows",
                                                                                       "float")


def test_validate_batch_counts():
    traces = [good(), good(4)]
    traces[1] = traces[1].clone()
    traces[1][0, 0] = torch.tensor([1, 1])
    out, stats = validate_batch(traces, SPEC, [5, 4], on_error="fallback")
    assert stats["routing/fallback_entries"] == 1 and stats["routing/fallback_tokens"] == 1
    assert stats["routing/trace_bytes"] == 9 * L * K and stats["routing/fallback_samples"] == 1
    with pytest.raises(RoutingTraceError, match="sample 1"):
        validate_batch(traces, SPEC, [5, 4])


def test_validate_batch_one_pass_equals_per_sample():
    """The batch's one vectorised pass (clean traces) gives each sample's validate_trace result; a batch with
    any problem goes sample by sample (the same errors and fallbacks)."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 17, 9]
    traces = [torch.rand(n, L, E, generator=g).argsort(-1)[..., :K].to(dt)
              for n, dt in zip(lengths, (torch.int32, torch.int64, torch.uint8, torch.int16))]
    out, stats = validate_batch(traces, SPEC, lengths)
    for tr, raw, n in zip(out, traces, lengths):
        ref = validate_trace(raw, SPEC, n, "s")
        assert tr.ids.dtype == ref.ids.dtype == torch.uint8 and torch.equal(tr.ids, ref.ids) and tr.replaced is None
    assert stats["routing/fallback_entries"] == 0 and stats["routing/trace_bytes"] == sum(lengths) * L * K
    top1 = TraceSpec(num_experts=8, topk=1, moe_layers=(0,))
    short, long = torch.zeros(3, 1, 1, dtype=torch.int32), torch.zeros(16, 1, 1, dtype=torch.int32)
    assert validate_batch([short], top1, [3])[0][0].replaced is None  # top-1: a short all-0 layer is plausible
    with pytest.raises(RoutingTraceError, match="sample 1: .*every expert id is 0"):
        validate_batch([short, long], top1, [3, 16])
    for bad, what in ((lambda t: t.__setitem__((2, 1, 0), 8), "out of range"),
                      (lambda t: t.__setitem__((2, 1), torch.tensor([3, 3])), "duplicate"),
                      (lambda t: t.__setitem__((2, 1, 0), -1), "missing route")):
        broken = [t.clone() for t in traces]
        bad(broken[3])  # int16: -1 is representable
        with pytest.raises(RoutingTraceError, match=f"sample 3: token 2, .*{what}"):
            validate_batch(broken, SPEC, lengths)
        fell, st = validate_batch(broken, SPEC, lengths, on_error="fallback")
        assert st["routing/fallback_entries"] == 1 and fell[3].replaced[2, 1] and fell[0].replaced is None
    with pytest.raises(RoutingTraceError, match="sample 3: .*rows for"):
        validate_batch(traces, SPEC, [5, 1, 17, 8])


@pytest.mark.parametrize("row", [0, 3, 4, 5, 39])  # first, last and first of a block, one within, the last
def test_clean_trace_finds_a_duplicate_in_any_block(monkeypatch, row):
    """clean_trace checks duplicates block by block (DUPLICATE_BLOCK (token, layer) rows): one in any block,
    at a block's edge too, is found; a clean trace of many blocks passes."""
    import moe.routing.trace as trace

    monkeypatch.setattr(trace, "DUPLICATE_BLOCK", 4)
    ids = torch.rand(20, L, E, generator=torch.Generator().manual_seed(5)).argsort(-1)[..., :K].to(torch.uint8)
    assert trace.clean_trace(ids, SPEC, 20) is not None  # 40 rows: 10 blocks
    bad = ids.clone()
    bad.view(-1, K)[row, K - 1] = bad.view(-1, K)[row, 0]
    assert trace.clean_trace(bad, SPEC, 20) is None
    with pytest.raises(RoutingTraceError, match="duplicate"):
        validate_batch([bad], SPEC, [20])


def test_sglang_decode_selects_moe_layers():
    full = torch.randint(0, E, (6, 4, K), dtype=torch.int32)
    full[:, :, 1] = (full[:, :, 0] + 1) % E
    full[:, 0] = 999  # dense layer rows hold garbage: dropped
    dec = decode_sglang(encode_sglang(full), 4, K)
    assert torch.equal(dec, full)
    assert torch.equal(select_moe_layers(dec, SPEC, 4), full[:, [1, 3]])
    with pytest.raises(RoutingTraceError, match="not a multiple"):
        decode_sglang(encode_sglang(full.reshape(-1)[:-2]), 4, K)
    tr = sglang_trace(encode_sglang(full), SPEC, 4, num_tokens=6, sample=0)
    assert torch.equal(tr.ids.long(), full[:, [1, 3]].long())


def all_layers(rows_moe):
    """[T, L, k] MoE rows -> SGLang's all-hidden-layer rows (dense layers garbage)."""
    out = torch.full((rows_moe.shape[0], 4, K), 77, dtype=torch.int32)
    out[:, [1, 3]] = rows_moe.to(torch.int32)
    return out


def test_multi_turn_trace_from_start_len_pieces():
    # turn 1: prompt p1 + completion c1; turn 2 appends user text u2 and completion c2.
    p1, c1, u2, c2 = [5, 6, 7], [8, 9], [10, 11], [12, 13, 14]
    full_tokens = p1 + c1 + u2 + c2
    expected = trace_for(full_tokens)  # hand-built: rows for tokens 0..len-2
    n1 = len(p1 + c1) - 1  # SGLang rows of turn 1
    start2 = n1  # turn 2 request: routed_experts_start_len = rows already held
    piece1 = encode_sglang(all_layers(expected[:n1]))
    piece2 = encode_sglang(all_layers(expected[start2:]))
    tr = sglang_trace([(0, piece1), (start2, piece2)], SPEC, 4, len(full_tokens) - 1, "mt")
    assert torch.equal(tr.ids.long(), expected.long())
    # the pieces in either order; a gap is missing data named by its token
    tr = sglang_trace([(start2, piece2), (0, piece1)], SPEC, 4, len(full_tokens) - 1, "mt")
    assert torch.equal(tr.ids.long(), expected.long())
    with pytest.raises(RoutingTraceError, match=f"token {n1 - 1}, .*missing route"):
        sglang_trace([(0, encode_sglang(all_layers(expected[:n1 - 1]))), (start2, piece2)], SPEC, 4,
                     len(full_tokens) - 1, "mt")
    rows, info = assemble_pieces([(0, expected[:n1 + 1]), (start2, expected[start2:])])
    assert info == {"gap_rows": 0, "overlap_rows": 1} and torch.equal(rows, expected)


def whole(n_rows_dp=1, dp=0, cols=(0, 1)):
    return Recipient(0, dp, n_rows_dp, 0, 1, tuple(cols))


def check_aligned(tokens, routes, covered):
    """Every covered input position carries the route of its own token; the rest are PAD."""
    for r in range(tokens.shape[0]):
        for p in range(tokens.shape[1]):
            if covered[r, p]:
                want = torch.tensor([route_of(int(tokens[r, p]), l) for l in range(L)])
                assert torch.equal(routes[r, p].long(), want), (r, p)
            else:
                assert (routes[r, p] == PAD).all(), (r, p)


def test_padded_batch_alignment_with_assemble_batch():
    from tools.batch_support import assemble_batch
    from rlpo_mega.config import AlgorithmConfig

    prompts = [[3, 4, 5], [6, 7], [9, 10, 11, 12]]
    responses = [[20, 21], [22, 23, 24, 25, 26], [27]]
    batch, _ = assemble_batch(prompts, responses, torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 0]),
                              AlgorithmConfig(), seq_length=9, pad_id=0)
    samples = [p + r for p, r in zip(prompts, responses)]
    traces, _ = validate_batch([trace_for(s) for s in samples], SPEC, [len(s) - 1 for s in samples])
    routes = local_routes(traces, padded_placement([len(s) - 1 for s in samples]), whole(), 3, 9, K)
    assert routes.shape == (3, 9, L, K) and routes.dtype == torch.int16
    covered = torch.zeros(3, 9, dtype=torch.bool)
    for i, s in enumerate(samples):
        covered[i, :len(s) - 1] = True
    check_aligned(batch.tokens, routes, covered)


def test_packed_batch_alignment():
    samples = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13], [14, 15, 16]]
    seq_len = 8
    placement = packed_placement([len(s) for s in samples], seq_len)
    assert [(g.row, g.offset) for g in placement] == [(0, 0), (0, 4), (1, 0), (1, 5)]
    tokens = torch.zeros(2, seq_len, dtype=torch.long)
    covered = torch.zeros(2, seq_len, dtype=torch.bool)
    for g, s in zip(placement, samples):
        tokens[g.row, g.offset:g.offset + len(s)] = torch.tensor(s)
        covered[g.row, g.offset:g.offset + len(s) - 1] = True  # the sample's last token: no route
    traces, _ = validate_batch([trace_for(s) for s in samples], SPEC, [len(s) - 1 for s in samples])
    routes = local_routes(traces, placement, whole(), 2, seq_len, K)
    check_aligned(tokens, routes, covered)


def test_transport_cuts_reassemble_and_cost_layers_x_topk_bytes():
    """DP2 x SP2 x PP2 (one MoE layer per stage): each rank gets only its rows, shard and layers; together
    they rebuild the whole batch, and every route is sent exactly once."""
    lengths = [7, 3, 8, 5]
    g = torch.Generator().manual_seed(0)
    traces = []
    for n in lengths:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n * L)]).reshape(n, L, K)
        traces.append(ids)
    traces, _ = validate_batch(traces, SPEC, lengths)
    traces[2].replaced = torch.zeros(8, L, dtype=torch.bool)
    traces[2].replaced[6, 1] = True  # a fallback entry travels as LIVE
    placement, n_rows, seq = padded_placement(lengths), 4, 8
    full = local_routes(traces, placement, whole(), n_rows, seq, K)
    rebuilt = torch.full_like(full, 99)
    sent = 0
    for dp in range(2):
        for sp in range(2):
            for stage in range(2):
                rc = Recipient(0, dp, 2, sp, 2, (stage,))
                part = local_routes(traces, placement, rc, n_rows, seq, K)
                assert part.shape == (2, 4, 1, K)
                rebuilt[dp * 2:dp * 2 + 2, sp * 4:sp * 4 + 4, stage:stage + 1] = part
                flat, rep = pack(traces, _pieces(placement, rc, n_rows, seq), rc.layer_cols)
                sent += flat.numel() * flat.element_size()
    assert torch.equal(rebuilt, full)
    assert full[2, 6, 1].tolist() == [LIVE, LIVE]
    assert sent == sum(lengths) * L * K  # uint8: layers x topk bytes per token


def test_metrics_functions():
    live = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    ref = torch.tensor([[1, 0], [2, 1], [1, 0], [0, 1]])
    assert agreement(live, ref) == 0.5
    assert agreement(live, ref, torch.tensor([True, False, True, False])) == 1.0
    h = load_histogram(live, 4)
    assert h.tolist() == [2, 2, 2, 2] and abs(load_entropy(h) - math.log(4)) < 1e-12 and max_over_mean(h) == 1.0
    h = load_histogram(torch.tensor([[0, 1], [0, 2]]), 4)
    assert max_over_mean(h) == 2.0
    st = RoutingStats(1, 4, (3,))
    target = torch.tensor([[1, 0], [2, 1], [-1, -1], [-2, -2]])
    st.update("update", 0, used=live, live=live, target=target)
    m = st.reduce()
    assert m["routing/update/agreement/layer3"] == 0.5 and m["routing/update/fallback_entries"] == 1
    assert m["routing/update/tokens"] == 3  # the PAD position is not a token


def test_hf_capture_under_generate_gives_tokens_minus_one_rows():
    from transformers import AutoModelForCausalLM

    from moe.model import load_hf_config

    hf = load_hf_config("configs/models/tiny_qwen3_moe.json")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf).eval()
    spec = TraceSpec.from_hf(hf)
    prompt = torch.tensor([[5, 9, 17, 33]])
    with HFRouteCapture(model, spec) as cap:
        out = model.generate(prompt, max_new_tokens=5, do_sample=False, min_new_tokens=5)
        rows = cap.sample(0)
        cap.clear()
        model(out)  # one full forward over the whole sample: rows for every token
        full = cap.sample(0)
    assert rows.shape == (out.shape[1] - 1, spec.num_layers, spec.topk)
    assert torch.equal(rows[:4], full[:4])  # the prefill is the same computation
    validate_trace(rows, spec, out.shape[1] - 1, 0)
