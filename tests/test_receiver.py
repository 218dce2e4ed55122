"""The in-server receiver (launch/rlpo_sglang_receiver.py) on a plain module whose load_weights does what SGLang's
loaders do (copies into views of its parameters, a transposed source, a padded tail filled, arithmetic, an
in-place op): replayed where every write is a copy of the incoming tensor, bit for bit what the loader writes;
the loader's wherever it is not. On a real CPU SGLang server: tests/test_sglang.py
(test_receiver_replays_every_tensor_bit_exactly), and tools/bench_refit.py for its time per tensor."""
import os
import re

import torch

from launch import rlpo_sglang_receiver as receiver
from moe.model import load_hf_config
from tests.dist import ROOT


QWEN = load_hf_config(os.path.join(ROOT, "configs/models/tiny_qwen3_moe.json"))


class Loader(torch.nn.Module):
    """A model with SGLang's loader shapes: fused parameters filled by views, a padded embedding."""

    def __init__(self):
        super().__init__()
        self.config = QWEN  # (the family's loader-only names: none for qwen3_moe)
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4))
        self.experts = torch.nn.Parameter(torch.zeros(3, 4, 2))  # [expert, rows, cols]
        self.embed = torch.nn.Parameter(torch.zeros(5, 2))
        self.register_buffer("bias", torch.zeros(4))
        self.loads = []

    def load_weights(self, weights):
        batch = list(weights)
        self.loads.append([n for n, _ in batch])
        for name, t in batch:
            if name in ("q", "k"):  # a shard of a fused parameter
                self.qkv.data.narrow(0, 0 if name == "q" else 3, 3).copy_(t)
            elif name.startswith("expert."):  # one expert of a fused expert weight, stored transposed
                self.experts.data[int(name.split(".")[1])].copy_(t.t())
            elif name == "embed":  # a vocabulary padded to 5 rows
                self.embed.data[:t.shape[0]].copy_(t)
                self.embed.data[t.shape[0]:].fill_(0)
            elif name == "bias":
                self.bias.copy_(t)
            elif name == "scaled":  # arithmetic on the tensor: not a copy of it
                self.qkv.data[:, :1].copy_(t * 2)
            elif name == "in_place":  # an in-place op on a parameter
                self.qkv.data.add_(t.sum())
            # anything else: skipped, as SGLang skips a name it does not hold (rotary inv_freq)


def weights(seed):
    g = torch.Generator().manual_seed(seed)
    return [("q", torch.randn(3, 4, generator=g)), ("k", torch.randn(3, 4, generator=g)),
            *[(f"expert.{e}", torch.randn(2, 4, generator=g)) for e in range(3)],
            ("embed", torch.randn(4, 2, generator=g)), ("bias", torch.randn(4, generator=g)),
            ("inv_freq", torch.randn(2, generator=g))]


def state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_replays_what_the_loader_writes_bit_for_bit():
    model, ref = Loader(), Loader()
    rec = receiver.install(model)
    assert receiver.install(model) is rec and model.load_weights == rec.load_weights  # once per model
    for step in range(4):
        w = weights(step)
        model.embed.data[4:].fill_(7.0)  # the padded row written between syncs: the replay fills it again
        model.load_weights(iter(w))  # a generator, as the disk path passes
        ref.load_weights(w)
        assert all(torch.equal(a, b) for a, b in zip(state(model).values(), state(ref).values())), step
    n = len(weights(0))
    assert rec.stats["learned"] == n and rec.stats["replayed"] == 3 * n and rec.stats["loaded"] == 0, rec.stats
    assert rec.stats["not_replayed"] == {}
    # the loader ran once, on the first sync's whole batch, watched (each write attributed to the tensor it reads)
    assert model.loads == [[name for name, _ in weights(0)]]


def test_what_is_not_a_copy_stays_the_loaders():
    model = Loader()
    rec = receiver.install(model)
    t = torch.ones(6, 1)
    for _ in range(3):
        model.load_weights([("scaled", t), ("in_place", torch.ones(2))])
    assert rec.stats["not_replayed"] == {"copy_ from another tensor": 1, "add_": 1}, rec.stats
    assert rec.stats["replayed"] == 0 and rec.stats["loaded"] == 2, rec.stats
    # learned together (an opaque write in the call: the culprit unknown), then one by one at the next sync (each
    # found opaque), then one loader call per sync for both, in order
    assert model.loads == [["scaled", "in_place"], ["scaled"], ["in_place"], ["scaled", "in_place"]]


def test_a_flattened_bucket_is_attributed_by_byte_range():
    """SGLang's flattened_bucket path: every tensor of a bucket is a view of one storage; each copy is attributed
    to the tensor whose bytes it reads, and the replay writes what the loader writes."""
    model, ref = Loader(), Loader()
    rec = receiver.install(model)
    for step in range(3):
        w = weights(step)
        flat = torch.cat([t.reshape(-1) for _, t in w])
        views, at = [], 0
        for name, t in w:
            views.append((name, flat[at:at + t.numel()].view(t.shape)))
            at += t.numel()
        model.load_weights(views)
        ref.load_weights(w)
        assert all(torch.equal(a, b) for a, b in zip(state(model).values(), state(ref).values())), step
    assert rec.stats["replayed"] == 2 * len(w) and rec.stats["not_replayed"] == {} and len(model.loads) == 1


def test_a_replaced_parameter_or_another_tensor_shape_goes_back_to_the_loader():
    model, ref = Loader(), Loader()
    rec = receiver.install(model)
    w = weights(0)
    model.load_weights(w)
    model.qkv = torch.nn.Parameter(torch.zeros(6, 4))  # SGLang replaced it after loading: a replay would write the old
    model.load_weights(w)
    ref.load_weights(w)
    assert torch.equal(model.qkv, ref.qkv) and rec.stats["loaded"] == 2, rec.stats  # q and k: the loader's
    model.load_weights(w)  # ... and learned again
    assert rec.stats["learned"] == len(w) + 2 and rec.stats["replayed"] == 2 * (len(w) - 2), rec.stats
    model.load_weights([("bias", torch.ones(4, dtype=torch.float64))])  # another dtype than learned: the loader's
    assert torch.equal(model.bias, torch.ones(4)) and rec.stats["loaded"] == 3, rec.stats


def test_a_family_s_post_processed_names_are_always_sglangs():
    """deepseek_v3: SGLang derives w_kc/w_vc from kv_b after loading it and fuses q_a with kv_a on their first
    load together: never learned, loaded by SGLang in one call per sync (MoEFamily.sglang_loader_keys)."""
    hf = load_hf_config(os.path.join(ROOT, "configs/models/tiny_deepseek_v3.json"))
    patterns = receiver._loader_only_patterns(hf)
    names = {"model.layers.3.self_attn.kv_b_proj.weight": True, "model.layers.0.self_attn.q_a_proj.weight": True,
             "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": True,
             "model.layers.0.self_attn.q_b_proj.weight": False, "model.layers.1.mlp.experts.7.up_proj.weight": False}
    assert {n: any(re.search(p, n) for p in patterns) for n in names} == names
    assert receiver._loader_only_patterns(QWEN) == []


class RankLoader(torch.nn.Module):
    """TP rank 1 of 2 as SGLang's loaders hold it: a column-parallel weight narrowed to its rows, a row-parallel
    one to its columns, a fused expert stored transposed with its half of the intermediate rows, a replicated
    norm; `wide` reads rows outside the rank's half (what the plan's region would not cover)."""

    def __init__(self, rank=1):
        super().__init__()
        self.config, self.rank = QWEN, rank
        self.col = torch.nn.Parameter(torch.zeros(3, 4))
        self.row = torch.nn.Parameter(torch.zeros(4, 2))
        self.w13 = torch.nn.Parameter(torch.zeros(2, 4, 2))  # [expert, hidden, rows of this rank], transposed
        self.norm = torch.nn.Parameter(torch.zeros(4))
        self.wide = torch.nn.Parameter(torch.zeros(4, 4))
        self.loads = []

    def load_weights(self, weights):
        batch = list(weights)
        self.loads.append([n for n, _ in batch])
        for name, t in batch:
            if name == "col":
                self.col.data.copy_(t.narrow(0, 3 * self.rank, 3))
            elif name == "row":
                self.row.data.copy_(t.narrow(1, 2 * self.rank, 2))
            elif name.startswith("expert."):
                self.w13.data[int(name.split(".")[1])].copy_(t.narrow(0, 2 * self.rank, 2).t())
            elif name == "norm":
                self.norm.data.copy_(t)
            elif name == "wide":
                self.wide.data.copy_(t.narrow(0, 0, 4))


REGIONS = {"col": ((6, 4), ((3, 6), (0, 4))), "row": ((4, 4), ((0, 4), (2, 4))),
           "expert.0": ((4, 4), ((2, 4), (0, 4))), "expert.1": ((4, 4), ((2, 4), (0, 4))),
           "norm": ((4,), ((0, 4),)), "wide": ((8, 4), ((4, 8), (0, 4)))}


def test_regions_replay_what_the_loader_writes_from_the_whole_tensor():
    """The shard-to-shard transport's load (Receiver.load_regions): each name's region alone -> the parameters the
    loader writes from the whole tensor, bit for bit, learned once and replayed; read_region gives the region back
    from the parameters. A loader reading outside the region is not replayed (SGLang's, given a whole-shaped
    tensor holding the region: wrong only where the plan is, which the digests then catch)."""
    model, ref = RankLoader(), RankLoader()
    rec = receiver.install(model)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        whole = {n: torch.randn(shape, generator=g) for n, (shape, _) in REGIONS.items()}
        regions = {n: whole[n][tuple(slice(a, b) for a, b in box)].contiguous() for n, (_, box) in REGIONS.items()}
        rec.load_regions([(n, shape, box, regions[n]) for n, (shape, box) in REGIONS.items()])
        ref.load_weights(list(whole.items()))
        for name in ("col", "row", "w13", "norm"):
            assert torch.equal(getattr(model, name), getattr(ref, name)), (step, name)
        for n, (_, box) in REGIONS.items():
            back = rec.read_region(n, box, torch.full_like(regions[n], float("nan")))
            assert (back is None) == (n == "wide") and (back is None or torch.equal(back, regions[n])), (step, n)
    assert rec.stats["replayed"] == 2 * 5 and rec.stats["not_replayed"] == {"reads outside its region": 1}, rec.stats
    assert model.loads == [list(REGIONS)] + [["wide"]] * 2  # learned in one call, then only `wide`


def test_into_region_moves_views_or_refuses():
    full = torch.arange(48.).view(6, 8)
    region = ((2, 5), (4, 8))
    part = full[2:5, 4:8].contiguous()
    for view in (full[3:5, 4:6], full[2:5, 4:8].t(), full[4, 5:8], full[2:5:2, 4:8:3]):
        size, stride, offset = tuple(view.shape), view.stride(), view.storage_offset()
        g = receiver._into_region(size, stride, offset, (6, 8), region)
        assert torch.equal(torch.as_strided(part, *g), view), view
    for view in (full[1:3, 4:6], full[2:5, 3:8], full.view(-1)[20:30]):  # outside it, or across rows
        assert receiver._into_region(tuple(view.shape), view.stride(), view.storage_offset(), (6, 8), region) is None
