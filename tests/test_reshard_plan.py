"""The refit plan (moe/bridge/reshard.py) over learner TP 1/2/4/8 x EP 1/4/8 (with PP and expert-TP) into SGLang
servers of TP 1/2/4/8 x EP 1/4/8, checked against both sides' layouts written out here from their own sources --
megatron's rank order tp-cp-ep-dp-pp, SGLang 0.5.23's weight loaders -- rather than read from the module:
every byte of every server rank's shard arrives exactly once, from a learner rank that holds it, and nothing else
arrives; then the plan applied to real tensors (learner shards cut by megatron's rules) rebuilds each server rank's
shard bit for bit."""
import itertools
import math
from collections import defaultdict

import pytest
import torch
from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

from moe.bridge.mapping import Dims, full_to_hf, full_to_shard, hf_row_ranges, hf_to_full, param_maps
from moe.bridge.reshard import (BROADCAST_TRANSPORT, CannotPlan, LearnerLayout, ModelSpec, ServerLayout,
                                reshard_plan)
from moe.families import get_family
from moe.model import load_hf_config, padded_vocab_size

COMMON = dict(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=4,
              num_experts_per_tok=2, tie_word_embeddings=False, vocab_size=300)
MODELS = {
    # 8 KV heads (learner TP up to 8), a dense first layer, a vocabulary neither side's padding divides
    "qwen3_moe": Qwen3MoeConfig(**COMMON, num_attention_heads=16, num_key_value_heads=8, head_dim=4, num_experts=16,
                                mlp_only_layers=[0], decoder_sparse_step=1),
    # MLA (column-parallel projections SGLang keeps whole), a shared expert, an fp32 expert bias, a dense layer
    "deepseek_v3": DeepseekV3Config(**COMMON, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16,
                                    n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1),
    # 2 KV heads (replicated on SGLang ranks past TP 2), tied embeddings, 8 experts
    "mixtral": MixtralConfig(**{**COMMON, "tie_word_embeddings": True, "vocab_size": 250}, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=4, num_local_experts=8),
}
SERVERS = [ServerLayout(tp, ep) for tp in (1, 2, 4, 8) for ep in (1, 4, 8) if tp % ep == 0]  # SGLang: EP inside TP


def learner_layouts(name):
    """TP 1/2/4/8 x EP 1/4/8 as the model allows, each twice: data-parallel replicas (PP1, ETP1), and PP2 with
    expert-TP = TP (megatron's default); DeepSeek's second keeps MLA's down-projections whole on every TP rank
    (Transformer Engine's spec)."""
    hf = MODELS[name]
    family = get_family(hf.model_type)
    out = []
    for tp, ep in itertools.product((1, 2, 4, 8), (1, 4, 8)):
        if hf.num_key_value_heads % tp or family.num_experts(hf) % ep:
            continue
        out.append(LearnerLayout(2 * math.lcm(tp, ep), tp, 1, ep, 1))
        te_whole = {m.megatron for m in param_maps(hf) if "down_proj" in m.megatron} if name == "deepseek_v3" else ()
        out.append(LearnerLayout(2 * math.lcm(tp, ep * tp), tp, 2, ep, tp, whole_on_tp=frozenset(te_whole)))
    return out


CASES = [(name, layout) for name in MODELS for layout in learner_layouts(name)]


def _id(case):
    name, lay = case
    return f"{name}-w{lay.world_size}tp{lay.tensor}pp{lay.pipeline}ep{lay.expert}etp{lay.expert_tensor}"


# ---- megatron's side, from megatron's rules ----------------------------------------------------------------------
def megatron_coordinates(learner):
    """{rank: (stage, tp rank)} and {rank: (stage, ep rank, etp rank)}: megatron's order tp-cp-ep-dp-pp, innermost first
    (parallel_state.RankGenerator; context parallelism counted with DP)."""
    w, tp, pp, ep, etp = learner.world_size, learner.tensor, learner.pipeline, learner.expert, learner.expert_tensor
    dense = {r: (s, t) for r, (s, _, t) in enumerate(itertools.product(range(pp), range(w // (tp * pp)), range(tp)))}
    expert = {r: (s, e, u) for r, (s, _, e, u) in
              enumerate(itertools.product(range(pp), range(w // (ep * etp * pp)), range(ep), range(etp)))}
    return dense, expert


def stage_of(spec, hf, learner):
    if spec.layer is not None:
        return spec.layer // (hf.num_hidden_layers // learner.pipeline)
    return 0 if spec.megatron.startswith("embedding.") else learner.pipeline - 1


def megatron_dims(hf, learner):
    return Dims(hf.num_attention_heads, hf.num_key_value_heads, get_family(hf.model_type).head_dim(hf), hf.vocab_size,
                padded_vocab_size(hf.vocab_size, learner.vocab_divisible_by, learner.tensor))


def megatron_box(spec, hf, learner, rank, coords):
    """The HF box `rank` holds of `spec` (megatron's shard rows/columns, the bridge's hf_row_ranges), or None."""
    dense, expert = coords
    if spec.expert is None:
        stage, index = dense[rank]
        size = 1 if spec.megatron in learner.whole_on_tp else learner.tensor
    else:
        stage, ep, index = expert[rank]
        if spec.expert // (get_family(hf.model_type).num_experts(hf) // learner.expert) != ep:
            return None
        size = learner.expert_tensor
    if stage != stage_of(spec, hf, learner):
        return None
    (dim, start, stop), = hf_row_ranges(spec.kind, megatron_dims(hf, learner), [spec.shape], index % size, size)
    return along(spec.shape, dim, start, stop - start) if stop > start else None


# ---- SGLang's side, from SGLang 0.5.23's weight loaders ----------------------------------------------------------
def along(shape, dim, start, size):
    return tuple((start, start + size) if d == dim else (0, n) for d, n in enumerate(shape))


def sglang_box(spec, hf, server, rank):
    """The HF box a TP rank narrows `spec` to, transcribed from SGLang 0.5.23 (variable names as there), or None."""
    tp = server.tensor
    whole = tuple((0, n) for n in spec.shape)
    # RMSNorm; ReplicatedLinear: MoE gate, DeepSeek's fused_qkv_a_proj_with_mqa (q_a_proj + kv_a_proj_with_mqa)
    if spec.kind == "replicated" or "q_a_proj." in spec.name or "kv_a_proj_with_mqa." in spec.name:
        return whole
    if spec.expert is not None:  # fused_moe_triton/layer.py: _map_global_expert_id_to_local_expert_id, _load_w13/_w2
        moe_tp_size = tp // server.expert
        moe_ep_rank, moe_tp_rank = rank // moe_tp_size, rank % moe_tp_size
        num_local_routed = get_family(hf.model_type).num_experts(hf) // server.expert
        start_idx = moe_ep_rank * num_local_routed
        if not start_idx <= spec.expert < start_idx + num_local_routed:
            return None
        shard_dim = 0 if spec.kind == "glu" else 1
        shard_size = spec.shape[shard_dim] // moe_tp_size
        return along(spec.shape, shard_dim, shard_size * moe_tp_rank, shard_size)
    if spec.kind == "vocab":  # vocab_parallel_embedding.py: pad_vocab_size, _get_indices, weight_loader
        org_vocab_size, padding_size = hf.vocab_size, 64
        pad = lambda v, p: (v + p - 1) // p * p  # noqa: E731
        if pad(org_vocab_size, padding_size) % tp != 0:
            padding_size *= tp
        per_partition = pad(org_vocab_size, padding_size) // tp
        start_idx = min(rank * per_partition, org_vocab_size)
        end_idx = min((rank + 1) * per_partition, org_vocab_size)
        return along(spec.shape, 0, start_idx, end_idx - start_idx) if end_idx > start_idx else None
    if spec.kind == "qkv":  # linear.py QKVParallelLinear
        total_num_heads, total_num_kv_heads = hf.num_attention_heads, hf.num_key_value_heads
        if spec.part == 0:
            head_size = spec.shape[0] // total_num_heads
            shard_size, shard_id = total_num_heads // tp * head_size, rank
        else:
            head_size = spec.shape[0] // total_num_kv_heads
            if tp >= total_num_kv_heads:
                num_kv_heads, num_kv_head_replicas = 1, tp // total_num_kv_heads
            else:
                num_kv_heads, num_kv_head_replicas = total_num_kv_heads // tp, 1
            shard_size, shard_id = num_kv_heads * head_size, rank // num_kv_head_replicas
        return along(spec.shape, 0, shard_id * shard_size, shard_size)
    if spec.kind in ("glu", "column"):  # MergedColumnParallelLinear (gate_up_proj), ColumnParallelLinear
        shard_size = spec.shape[0] // tp
        return along(spec.shape, 0, rank * shard_size, shard_size)
    assert spec.kind == "row"  # RowParallelLinear
    shard_size = spec.shape[1] // tp
    return along(spec.shape, 1, rank * shard_size, shard_size)


# ---- boxes -------------------------------------------------------------------------------------------------------
def numel(box):
    return math.prod(e - s for s, e in box)


def shifted(box, origin):
    return tuple((s - o, e - o) for (s, e), (o, _) in zip(box, origin))


def inside(box, outer):
    return all(o0 <= s < e <= o1 for (s, e), (o0, o1) in zip(box, outer))


def overlap(a, b):
    return all(max(s0, s1) < min(e0, e1) for (s0, e0), (s1, e1) in zip(a, b))


_plans = {}


def planned(name, learner):
    key = (name, learner)
    if key not in _plans:
        model = ModelSpec.of(MODELS[name], torch.bfloat16)
        _plans[key] = (model, reshard_plan(model, learner, SERVERS))
    return _plans[key]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_every_server_byte_arrives_once_from_a_holder(case):
    name, learner = case
    hf = MODELS[name]
    model, plan = planned(name, learner)
    coords = megatron_coordinates(learner)
    specs = {s.name: s for s in model.tensors}
    held_by = {}  # (name, learner rank) -> its box
    received = defaultdict(list)
    for t in plan.transfers:
        # the sender holds the slice, and src_box is the slice in its own shard's coordinates
        if (t.name, t.src) not in held_by:
            held_by[t.name, t.src] = megatron_box(specs[t.name], hf, learner, t.src, coords)
        box = held_by[t.name, t.src]
        assert box is not None and inside(t.region, box), (t, box)
        assert t.src_box == shifted(t.region, box), t
        assert t.nbytes == numel(t.region) * specs[t.name].dtype.itemsize
        received[t.server, t.rank, t.name].append(t)
    for s, server in enumerate(SERVERS):
        for rank in range(server.tensor):
            for spec in model.tensors:
                held = sglang_box(spec, hf, server, rank)
                pieces = received.pop((s, rank, spec.name), [])
                if held is None:
                    assert not pieces, (server, rank, spec.name)
                    continue
                for t in pieces:
                    assert inside(t.region, held) and t.dst_box == shifted(t.region, held), (t, held)
                assert sum(numel(t.region) for t in pieces) == numel(held), (server, rank, spec.name)
                for a, b in itertools.combinations(pieces, 2):
                    assert not overlap(a.region, b.region), (a, b)
    assert not received, "transfers to tensors or ranks outside every server's layout"

    # each server rank receives exactly its own shard; the busiest learner rank sends at most 1.25 x its share:
    # of all bytes, or of its pipeline stage's where a stage holds more than its share (the embedding's)
    shard, got = plan.shard_bytes(), plan.received_bytes()
    assert got == shard
    sent = plan.sent_bytes()
    assert sum(sent) == sum(shard.values())
    stage = [0] * learner.pipeline
    for t in plan.transfers:
        stage[stage_of(specs[t.name], hf, learner)] += t.nbytes
    share = max(sum(sent) / learner.world_size, max(stage) / learner.stage_size)
    assert max(sent) <= 1.25 * share, max(sent) / share


# ---- the plan moves real tensors --------------------------------------------------------------------------------
def megatron_holdings(hf, learner, full):
    """{rank: {HF name: the HF-coordinate slice the rank holds}}, cut from each parameter's megatron shard as megatron
    holds it (mapping.full_to_shard over the fused full tensor), then split back into its HF tensors."""
    dims = megatron_dims(hf, learner)
    dense, expert = megatron_coordinates(learner)
    out = defaultdict(dict)
    spec = {s.name: s for s in ModelSpec.of(hf, torch.bfloat16).tensors}
    for m in param_maps(hf):
        stage = stage_of(spec[m.hf[0]], hf, learner)
        size = learner.expert_tensor if m.expert is not None else learner.tensor
        if m.megatron in learner.whole_on_tp:
            size = 1
        fused = hf_to_full(m.kind, [full[n] for n in m.hf], dims)
        for index in range(size):
            shard = full_to_shard(m.kind, fused, index, size)
            if m.kind == "qkv":
                local = Dims(dims.heads // size, dims.groups // size, dims.head_dim, dims.vocab, dims.padded_vocab)
                parts = full_to_hf("qkv", shard, local)
            elif m.kind == "glu":
                parts = list(shard.chunk(2))
            elif m.kind == "vocab":  # the shard's rows past the vocabulary are megatron's padding
                parts = [shard[: max(0, min(shard.shape[0], dims.vocab - index * shard.shape[0]))]]
            else:
                parts = [shard]
            if m.expert is None:
                ranks = [r for r, (s, t) in dense.items() if s == stage and t % size == index]
            else:
                ep = m.expert // (get_family(hf.model_type).num_experts(hf) // learner.expert)
                ranks = [r for r, (s, e, u) in expert.items() if (s, e, u) == (stage, ep, index)]
            for r in ranks:
                out[r].update(zip(m.hf, parts))
    return out


# a spread of the grid (each model, both learner variants; EP inside TP, EP across TP, TP across both): the box
# test above covers all of it, this one applies each plan to tensors
TENSOR_CASES = [(name, lay) for name, lay in CASES
                if (lay.tensor, lay.expert) in {(1, 1), (2, 4), (4, 1), (8, 8)} and lay.world_size <= 64]


@pytest.mark.parametrize("case", TENSOR_CASES, ids=_id)
def test_plan_rebuilds_every_server_shard_bit_exactly(case):
    name, learner = case
    hf = MODELS[name]
    model, plan = planned(name, learner)
    g = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=g).to(s.dtype) for s in model.tensors}
    holding = megatron_holdings(hf, learner, full)
    received, count, want = {}, {}, {}  # per (server, TP rank, HF name)
    for s, server in enumerate(SERVERS):
        for rank in range(server.tensor):
            for spec in model.tensors:
                box = sglang_box(spec, hf, server, rank)
                if box is not None:
                    want[s, rank, spec.name] = full[spec.name][tuple(slice(a, b) for a, b in box)]
                    received[s, rank, spec.name] = torch.full_like(want[s, rank, spec.name], float("nan"))
                    count[s, rank, spec.name] = torch.zeros(want[s, rank, spec.name].shape, dtype=torch.int32)
    for t in plan.transfers:
        piece = holding[t.src][t.name][tuple(slice(a, b) for a, b in t.src_box)]
        dst = tuple(slice(a, b) for a, b in t.dst_box)
        received[t.server, t.rank, t.name][dst] = piece
        count[t.server, t.rank, t.name][dst] += 1
    bits = lambda t: t.view({2: torch.int16, 4: torch.int32}[t.element_size()])  # noqa: E731
    for key, got in received.items():
        assert torch.equal(bits(got), bits(want[key])), key
        assert bool((count[key] == 1).all()), key


# ---- layouts, refusals, real sizes ------------------------------------------------------------------------------
def test_learner_rank_order_is_megatrons():
    rank_generator = pytest.importorskip("megatron.core.parallel_state").RankGenerator
    for learner in (LearnerLayout(16, 2, 2, 4, 1), LearnerLayout(32, 4, 2, 4, 2), LearnerLayout(8, 1, 1, 8, 1)):
        w, tp, pp, ep, etp = learner.world_size, learner.tensor, learner.pipeline, learner.expert, learner.expert_tensor
        dense = rank_generator(tp=tp, ep=1, dp=w // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        experts = rank_generator(tp=etp, ep=ep, dp=w // (ep * etp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        stage_of_rank = {r: s for s, group in enumerate(zip(*dense.get_ranks("pp"))) for r in group}
        for group in dense.get_ranks("tp"):
            for t, r in enumerate(group):
                assert r in learner.dense_holders(stage_of_rank[r], t)
        for ep_group in experts.get_ranks("ep"):
            for e, r in enumerate(ep_group):
                assert r in learner.expert_holders(stage_of_rank[r], e, r % etp)
        assert megatron_coordinates(learner)[0] == {r: (stage_of_rank[r], g.index(r)) for g in dense.get_ranks("tp")
                                                    for r in g}


def test_refused_layouts_say_what_in_one_line():
    model = ModelSpec.of(MODELS["qwen3_moe"], torch.bfloat16)
    with pytest.raises(CannotPlan) as e:
        reshard_plan(model, LearnerLayout(2), [ServerLayout(4, 1, attention_dp=2)])
    assert e.value.fallback == BROADCAST_TRANSPORT and "DP attention" in str(e.value) and "\n" not in str(e.value)
    assert f"rollout.sync_transport={BROADCAST_TRANSPORT}" in str(e.value)
    # heads SGLang cannot split: refused, not mis-planned
    odd = Qwen3MoeConfig(**{**MODELS["qwen3_moe"].to_dict(), "num_attention_heads": 12, "num_key_value_heads": 6})
    with pytest.raises(CannotPlan, match="attention heads"):
        reshard_plan(ModelSpec.of(odd, torch.bfloat16), LearnerLayout(2), [ServerLayout(8)])

    info = {"tp_size": 4, "ep_size": 2, "dp_size": 1, "pp_size": 1, "attn_dp_size": 1, "moe_a2a_backend": "none",
            "moe_dense_tp_size": None, "ep_num_redundant_experts": 0, "enable_eplb": False,
            "init_expert_location": "trivial", "enable_dp_attention": False}
    assert ServerLayout.from_server_info(info) == ServerLayout(4, 2, 1)
    assert ServerLayout.from_server_info({**info, "attn_dp_size": 2, "enable_dp_attention": True}).attention_dp == 2
    assert ServerLayout.from_server_info({**info, "attn_dp_size": None, "dp_size": 2,
                                          "enable_dp_attention": True}).attention_dp == 2
    for knob, value, fallback in (("pp_size", 2, None), ("dp_size", 2, None), ("moe_a2a_backend", "deepep", "x"),
                                  ("ep_num_redundant_experts", 8, "x"), ("enable_eplb", True, "x"),
                                  ("moe_dense_tp_size", 1, "x"), ("moe_dp_size", 2, "x"), ("attn_cp_size", 2, "x")):
        with pytest.raises(CannotPlan) as e:
            ServerLayout.from_server_info({**info, knob: value})
        assert (e.value.fallback is None) == (fallback is None), knob
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("recipe", ["qwen3_30b_a3b_2nodes", "glm45_air_8nodes"])
def test_real_sizes_balance(recipe):
    """At the recipes' own sizes (configs/recipes/: learner layout, servers x SGLang TP): the busiest learner rank
    sends at most 1.25 x its share of what the servers hold, and every server rank receives its shard only."""
    hf_path, learner, servers = {  # 16 learner GPUs into 8 rollout GPUs; 64 into 16
        "qwen3_30b_a3b_2nodes": ("qwen3_30b_a3b.json", LearnerLayout(16, 2, 1, 8, 1), [ServerLayout(2)] * 4),
        "glm45_air_8nodes": ("glm45_air.json", LearnerLayout(64, 2, 2, 16, 1), [ServerLayout(4)] * 4),
    }[recipe]
    model = ModelSpec.of(load_hf_config(f"configs/models/{hf_path}"), torch.bfloat16)
    plan = reshard_plan(model, learner, servers)
    sent, shard = plan.sent_bytes(), plan.shard_bytes()
    assert plan.received_bytes() == shard
    assert sum(sent) == sum(shard.values()) >= len(servers) * model.nbytes
    assert max(sent) <= 1.25 * sum(sent) / learner.world_size, max(sent) * learner.world_size / sum(sent)


def test_a_server_whose_plan_differs_is_refused_naming_the_cause(monkeypatch):
    """The in-server hook (launch/rlpo_sglang_hooks._reshard_plan) makes the plan from its own served config and
    refuses the learner's request where the transfer count or bytes differ; on a CPU server it also names SGLang's
    CPU padding of an intermediate size (which rewrites the served config: the plan models GPU servers)."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))
    try:
        import rlpo_sglang_hooks as hooks
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(hooks, "_PLANS", {})
    hf = load_hf_config("configs/models/tiny_qwen3_moe.json")
    learner = LearnerLayout(2, 1, 1, 2, 1, 128)
    plan = reshard_plan(ModelSpec.of(hf, torch.bfloat16), learner, [ServerLayout(2, 1)])
    req = {"learner": {"world_size": 2, "tensor": 1, "pipeline": 1, "expert": 2, "expert_tensor": 1,
                       "vocab_divisible_by": 128, "whole_on_tp": []}, "servers": [[2, 1, 1]], "dtype": "bfloat16",
           "bucket_bytes": 1 << 20, "check": [len(plan.transfers), sum(t.nbytes for t in plan.transfers)]}
    assert hooks._reshard_plan(hf, req, "cpu")[0].transfers == plan.transfers  # the same plan: accepted
    served = load_hf_config("configs/models/tiny_qwen3_moe.json")
    served.moe_intermediate_size = 64 * (-(-served.moe_intermediate_size // 64))  # as SGLang's CPU path pads it
    if served.moe_intermediate_size == hf.moe_intermediate_size:
        served.moe_intermediate_size += 64
    for device, cpu in (("cuda", False), ("cpu", True)):
        with pytest.raises(ValueError) as e:
            hooks._reshard_plan(served, json.loads(json.dumps(req)), device)
        line = str(e.value)
        assert "is not the learner's" in line and "config.json differs" in line and "\n" not in line, line
        assert ("SGLang padded an intermediate size" in line) == cpu and (
            "TP x 32 = 64" in line) == cpu, line
