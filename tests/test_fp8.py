"""FP8 rollout (rollout.weights=fp8, moe/bridge/fp8.py): the block quantiser against SGLang 0.5.23's own functions
(bit for bit), its edge cases, shard-then-quantise, the family's selection, the server layouts that can hold it,
the config it implies, the shard-to-shard refit plan's FP8 pieces, and a real CPU SGLang server generating from FP8
weights synced and digest-verified (through every transport: reshard from megatron learner ranks' own shards), its
log-probs against the learner's (the mismatch FP8 costs, beside a bf16 server's on the same model).

On this CPU (no AMX) the FP8 server's two kernels are stood in for in torch (tests/sglang_support/path: sgl_kernel's
fp8_scaled_mm_cpu and fused_experts_cpu, and the plugin's _fp8_without_amx); the server's FP8 parameters, loaders,
quantisation config and post-load processing are SGLang's own.
"""
import json
import os
import subprocess

import pytest
import torch

from moe.bridge import fp8
from moe.bridge.digest import DigestMismatchError
from moe.bridge.fp8 import (BLOCK, Fp8Selection, QuantizedStream, dequantize_block, quantize_block,
                            server_alignment_problem, sglang_quantization_config)
from moe.families import UnsupportedModelError
from moe.model import load_hf_config
from rlpo_mega.config import ConfigError, load_config
from rlpo_mega.config_checks import check_run_config
from tests.dist import ROOT, free_port, torchrun
from tests.test_sglang import PROMPTS, SERVER_ARGS, SUPPORT, ListStream, sglang_python  # noqa: F401 (fixture)
from tests.workers.bridge import make_hf_checkpoint

TINY = os.path.join(ROOT, "configs/models/tiny_qwen3_moe_fp8.json")  # every projection whole 128-blocks
QWEN3_30B = os.path.join(ROOT, "configs/models/qwen3_30b_a3b.json")


def test_quantiser_bit_equal_to_sglang(sglang_python, tmp_path):
    """Ours and SGLang's on the same tensors (bf16 and fp32; 128-multiples, ragged shapes, an all-zero tile, a
    tile far beyond e4m3's range, values below the amax floor): codes, scales and the dequantised weights equal
    bit for bit, for fp32 scales (Hopper) and UE8M0 ones (Blackwell's DeepGEMM)."""
    out = tmp_path / "ref.pt"
    proc = subprocess.run([sglang_python, os.path.join(SUPPORT, "fp8_reference.py"), str(out)],
                          env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.path.join(SUPPORT, "path"),
                               "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(out)
    assert len(results) == 28
    for case, r in results.items():
        assert torch.equal(r["q"], r["tq"]), case
        assert torch.equal(r["s"], r["ts"]), case
        assert torch.equal(r["dq"], r["tdq"]), case


def test_zero_tiles_ragged_shapes_and_error_bound():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 200, generator=g)
    x[128:256, :128] = 0
    for fmt in ("fp32", "ue8m0"):
        q, s = quantize_block(x, fmt)
        assert q.shape == (300, 200) and q.dtype == torch.float8_e4m3fn and s.shape == (3, 2) and s.dtype == torch.float32
        assert bool(torch.isfinite(s).all()) and bool((s > 0).all())
        assert bool((q[128:256, :128].float() == 0).all())  # the zero tile: zero codes, a finite scale
        dq = dequantize_block(q, s)
        # e4m3 keeps 3 mantissa bits: within half a step (2^-4 relative) of each value, or of the tile's smallest
        # normal step where a value is subnormal after scaling
        full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:300, :200]
        assert bool(((dq - x).abs() <= x.abs() / 16 + full * 2 ** -9).all())
    with pytest.raises(ValueError, match="2-D"):
        quantize_block(torch.zeros(2, 2, 2))


def test_shard_then_quantise_equals_quantise_then_shard():
    """Where a shard's edges are 128-aligned (rows for a column-parallel weight, columns for a row-parallel one),
    quantising each shard gives exactly the full tensor's codes and scales for that shard; unaligned, it does not
    (why the servers' layouts are checked)."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(512, 384, generator=g) * 0.03).bfloat16()
    q, s = quantize_block(x)
    for rows in ((0, 256), (256, 512), (128, 384)):
        qs, ss = quantize_block(x[rows[0]:rows[1]])
        assert torch.equal(qs.view(torch.uint8), q[rows[0]:rows[1]].view(torch.uint8))
        assert torch.equal(ss, s[rows[0] // BLOCK:rows[1] // BLOCK])
    for cols in ((0, 128), (128, 384)):
        qs, ss = quantize_block(x[:, cols[0]:cols[1]])
        assert torch.equal(qs.view(torch.uint8), q[:, cols[0]:cols[1]].view(torch.uint8))
        assert torch.equal(ss, s[:, cols[0] // BLOCK:cols[1] // BLOCK])
    qs, ss = quantize_block(x[:192])  # an edge inside a tile: that tile's scale is of other values
    assert not torch.equal(ss[1], s[1])


def test_family_selection_and_hook_constants():
    from launch import rlpo_sglang_hooks

    assert (rlpo_sglang_hooks.FP8_SCALE, rlpo_sglang_hooks.FP8_BLOCK) == (fp8.SCALE_SUFFIX, fp8.BLOCK)
    hf = load_hf_config(TINY)
    sel = Fp8Selection(hf)
    quantised = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.0.down_proj.weight"]
    kept = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight",
            "model.layers.0.self_attn.q_norm.weight", "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.k_norm.weight"]
    assert all(sel(n) for n in quantised) and not any(sel(n) for n in kept)
    mixtral = Fp8Selection(load_hf_config(os.path.join(ROOT, "configs/models/tiny_mixtral.json")))
    assert mixtral("model.layers.0.block_sparse_moe.experts.1.w2.weight")
    assert not mixtral("model.layers.0.block_sparse_moe.gate.weight")
    with pytest.raises(UnsupportedModelError, match="deepseek_v3"):
        Fp8Selection(load_hf_config(os.path.join(ROOT, "configs/models/tiny_deepseek_v3.json")))
    qc = sglang_quantization_config(hf)
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                  "ignored_layers": []}
    # a stream's selected weights leave as codes + scales, digested as sent
    named = [("model.layers.0.self_attn.q_proj.weight", torch.randn(256, 128)), ("model.norm.weight", torch.ones(128))]
    stream = QuantizedStream(ListStream(named), sel)
    (bucket,) = list(stream)
    assert [(n, t.dtype) for n, t in bucket] == [
        ("model.layers.0.self_attn.q_proj.weight", torch.float8_e4m3fn),
        ("model.layers.0.self_attn.q_proj.weight_scale_inv", torch.float32), ("model.norm.weight", torch.float32)]
    assert set(stream.digests) == {n for n, _ in bucket} and stream.bytes_sent == 256 * 128 + 2 * 4 + 128 * 4


def test_server_layouts_that_hold_fp8():
    """Qwen3-30B-A3B's 768-wide experts: MoE-TP 4 or 8 splits them into 192 or 96 (refused, naming EP as the fix);
    EP = TP holds whole experts; its attention (32 x 128 query, 4 x 128 key/value) splits into whole blocks."""
    hf = load_hf_config(QWEN3_30B)
    assert server_alignment_problem(hf, 1) is None
    assert server_alignment_problem(hf, 2) is None  # 384 per rank
    for tp in (4, 8):
        problem = server_alignment_problem(hf, tp)
        assert "experts' intermediate size (768)" in problem and "ep_size" in problem, problem
        assert server_alignment_problem(hf, tp, ep=tp) is None
    tiny = load_hf_config(os.path.join(ROOT, "configs/models/tiny_qwen3_moe.json"))
    assert "query heads (64) is not a multiple" in server_alignment_problem(tiny, 1)


def test_reshard_plan_sends_fp8_pieces_that_rebuild_the_whole_tensors_quantisation():
    """rollout.sync_transport=reshard with FP8 (moe/bridge/reshard.py): each FP8 weight is planned as codes, each
    codes piece followed by its scales' piece from the same sender; a sender quantising only its piece (as
    weight_sync/reshard.py does) gives every server rank exactly its region of the whole tensor's codes and scales,
    bit for bit, at learner and server layouts that split the weights in whole blocks; the buckets never separate
    scales from their codes; a learner layout whose shards are not whole blocks is refused in one line."""
    from moe.bridge.reshard import (CannotPlan, LearnerLayout, ModelSpec, ServerLayout, plan_buckets, reshard_plan,
                                    server_region)

    hf = load_hf_config(TINY)
    model = ModelSpec.of(hf, torch.bfloat16, fp8=True)
    specs = {t.name: t for t in model.tensors}
    sel = Fp8Selection(hf)
    assert sum(t.block_of is not None for t in model.tensors) == sum(map(sel, specs)) == 2 * (4 + 4 * 3)
    g = torch.Generator().manual_seed(0)
    whole = {t.name: torch.randn(t.shape, generator=g).bfloat16() for t in model.tensors if t.block_of is None}
    quantised = {}
    for n, w in whole.items():
        if sel(n):
            quantised[n], quantised[fp8.scale_name(n)] = quantize_block(w)
        else:
            quantised[n] = w
    servers = (ServerLayout(2, 1), ServerLayout(2, 2), ServerLayout(1))
    for learner in (LearnerLayout(2, tensor=2, expert=2), LearnerLayout(4, pipeline=2, expert=2)):
        plan = reshard_plan(model, learner, servers)
        assert plan.received_bytes() == plan.shard_bytes()
        held, scales = {}, {}
        for i, t in enumerate(plan.transfers):
            spec = specs[t.name]
            if spec.block_of is not None:  # made by the sender of its codes
                piece = scales.pop((t.src, t.server, t.rank, t.name, t.region))
            elif spec.dtype == fp8.FP8_DTYPE:
                piece, s = quantize_block(whole[t.name][tuple(slice(a, b) for a, b in t.region)])
                blocks = tuple((a // BLOCK, -(-b // BLOCK)) for a, b in t.region)
                scales[(t.src, t.server, t.rank, fp8.scale_name(t.name), blocks)] = s
            else:
                piece = whole[t.name][tuple(slice(a, b) for a, b in t.region)]
            key = (t.server, t.rank, t.name)
            if key not in held:
                box = server_region(spec, model, plan.servers[t.server], t.rank)
                held[key] = torch.zeros([b - a for a, b in box], dtype=spec.dtype)
            held[key][tuple(slice(a, b) for a, b in t.dst_box)] = piece
        assert not scales
        for (s, rank, name), got in held.items():
            box = server_region(specs[name], model, plan.servers[s], rank)
            want = quantised[name][tuple(slice(a, b) for a, b in box)]
            assert torch.equal(got.view(torch.uint8) if got.dtype == fp8.FP8_DTYPE else got,
                               want.view(torch.uint8) if want.dtype == fp8.FP8_DTYPE else want), (s, rank, name)
        for start, _ in plan_buckets(plan, 1 << 16):
            assert specs[plan.transfers[start].name].block_of is None
    with pytest.raises(CannotPlan, match="not whole 128-blocks") as e:  # experts' 256 rows over 4 learner ranks
        reshard_plan(model, LearnerLayout(4, expert_tensor=4), (ServerLayout(1),))
    assert "sglang_distributed" in str(e.value) and len(str(e.value).splitlines()) == 1


def _fp8_overrides(*extra):
    return ("rollout.engine=sglang", "rollout.weights=fp8", "rollout.sglang.urls=[http://127.0.0.1:1]",
            "model.hf_config=" + TINY, *extra)


def test_config_with_fp8():
    cfg = load_config(os.path.join(ROOT, "configs/demo_cpu.yaml"), _fp8_overrides())
    assert cfg.algorithm.mismatch.mode == "tis" and cfg.algorithm.mismatch.level == "token"  # the default with FP8
    check_run_config(cfg, files=False, log_warnings=False)
    chosen = load_config(os.path.join(ROOT, "configs/demo_cpu.yaml"), _fp8_overrides("algorithm.mismatch.mode=none"))
    assert chosen.algorithm.mismatch.mode == "none"
    assert any("mismatch.mode=none" in w for w in check_run_config(chosen, files=False, log_warnings=False))
    assert load_config(os.path.join(ROOT, "configs/demo_cpu.yaml")).algorithm.mismatch.mode == "none"
    for extra, match in ((("rollout.engine=embedded",), "rollout.engine=embedded"),
                         (("rollout.sglang.server_args.dtype=float32",), "dtype=float32"),
                         (("model.hf_config=configs/models/tiny_qwen3_moe.json",), "query heads"),
                         (("model.hf_config=configs/models/tiny_deepseek_v3.json",), "deepseek_v3")):
        cfg = load_config(os.path.join(ROOT, "configs/demo_cpu.yaml"), _fp8_overrides(*extra))
        with pytest.raises(ConfigError, match=match):
            check_run_config(cfg, files=False, log_warnings=False)


# ------------------------------------------------------------------ a real FP8 server


def _engine(sglang_python, tmp_path_factory, ckpt, weights, tp=1):
    from rlpo_mega.config import SGLangEngineConfig
    from rlpo_mega.rollout.sglang_engine import SGLangEngine

    hf = load_hf_config(ckpt)
    cfg = SGLangEngineConfig(launch=True, base_port=free_port(), tp_size=tp,
                             server_args={**SERVER_ARGS, "dtype": "bfloat16"},
                             python=sglang_python, log_dir=str(tmp_path_factory.mktemp("sglang_logs")),
                             startup_timeout=240, request_timeout=120, max_restarts=0,
                             env={"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": os.path.join(SUPPORT, "path"),
                                  # shared/notes/sglang.md: TP=2 on this CPU, a core per rank
                                  **({"SGLANG_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {})})
    return SGLangEngine(cfg, hf, model_path=ckpt, weights=weights)


@pytest.fixture(scope="module")
def servers(sglang_python, tmp_path_factory):
    from safetensors.torch import load_file

    hf = load_hf_config(TINY)
    ckpt = str(tmp_path_factory.mktemp("fp8") / "hf")
    make_hf_checkpoint(hf, ckpt)
    weights = load_file(os.path.join(ckpt, "model.safetensors"))
    engines = {}
    try:
        # the FP8 server at TP2, the 2-node recipe's servers' layout: every quantised weight split over its ranks in
        # whole 128-blocks (experts by MoE-TP), scales with them; the digest read-back gathers both
        for kind, tp in (("fp8", 2), ("bf16", 1)):
            engines[kind] = _engine(sglang_python, tmp_path_factory, ckpt, kind, tp)
        yield engines, hf, ckpt, weights
    finally:
        for e in engines.values():
            e.shutdown()


class _InTransit:
    """A stream whose `victim` tensor is altered after the sender digested it (a byte of codes, or a scale)."""

    def __init__(self, stream, victim):
        self.stream, self.victim = stream, victim

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def __iter__(self):
        for bucket in self.stream:
            yield [(n, _altered(t) if n == self.victim else t) for n, t in bucket]


def _altered(t):
    out = t.clone()
    out.view(torch.uint8).view(-1)[0] ^= 1  # one bit of the first element
    return out


def _sync(engine, weights, hf, kind, victim=None):
    from rlpo_mega.weight_sync.transports import TRANSPORTS

    stream = ListStream([(n, t.bfloat16()) for n, t in weights.items()], bucket=16)
    if kind == "fp8":
        stream = QuantizedStream(stream, Fp8Selection(hf))
    if victim:
        stream = _InTransit(stream, victim)
    return TRANSPORTS.get("in_process")(engine).sync(stream), stream


def _learner(ckpt, seqs, tmp_path, tag):
    inp, res = tmp_path / f"{tag}.json", tmp_path / f"{tag}.pt"
    inp.write_text(json.dumps({"seqs": seqs}))
    torchrun(os.path.join(SUPPORT, "learner_routes.py"), 1, ckpt, str(inp), str(res), timeout=600)
    return torch.load(res)


def test_fp8_reshard_sync_from_the_learners_own_shards(servers, tmp_path):
    """rollout.sync_transport=reshard into the FP8 server at TP2 (weight_sync/reshard.py): megatron learner ranks at
    TP2 x EP2 quantise their own pieces and send each its server rank's codes and scales; twice, bit-exact against
    the learner's export quantised whole (digested inside the server, gathered over its ranks), per-piece digests
    passed, each learner rank's bytes the plan's FP8 share, each server rank its own FP8 shard, the second sync
    replayed by the in-server receiver (tests/test_refit_transport.py's checks)."""
    from tests.test_refit_transport import _check

    engines, hf, ckpt, _ = servers
    engine = engines["fp8"]
    r = torchrun("reshard_sync.py", 2, str(tmp_path / "run"), ckpt, engine.servers[0].url, "2", "1",
                 "parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=1", "rollout.weights=fp8",
                 "rollout.sglang.server_args.dtype=bfloat16", timeout=600,
                 env={engine.cfg.api_key_env: engine._api_key})
    _check(r, 2, 1)
    bf16 = sum(t.numel() for t in servers[3].values()) * 2
    assert r["plan"]["model"] < 0.6 * bf16, (r["plan"]["model"], bf16)  # codes and scales: about half the bytes


def test_fp8_server_generates_from_synced_weights(servers, tmp_path):
    """Both servers take the sync (digest-verified: the FP8 one, at TP2, holds the codes and scales that were sent,
    gathered from its ranks inside it and unfused into HF names), twice, the FP8 one also as colocated servers'
    flattened payloads and from disk (the second sync reloads into the parameters SGLang's
    post-load processing left), then generate with log-probs and routes. Against the learner (Megatron, fp32):
    the FP8 server's log-probs equal the learner's on the *dequantised* weights as closely as the bf16 server's
    equal the learner's own (what is left is bf16 activations), and differ from the learner's own weights by
    what FP8 costs -- the mismatch the correction weighs, printed beside bf16's."""
    from safetensors.torch import save_file

    from rlpo_mega.rollout import SamplingParams

    engines, hf, ckpt, weights = servers
    for kind, engine in engines.items():
        for _ in range(2):
            stats, stream = _sync(engine, weights, hf, kind)
            assert stats["tensors"] == len(stream.digests)
        if kind == "fp8":
            assert stats["tensors"] == len(weights) + 2 * (4 + 4 * 3)  # + a scale per quantised weight (2 layers)
    # a server that does not hold what is sent is refused before any weight goes, in one line: bf16 weights into the
    # FP8 server (cast into its FP8 parameters without scales) or FP8 weights into a server started without the flags
    from rlpo_mega.config import SGLangEngineConfig
    from rlpo_mega.engine_errors import EngineError
    from rlpo_mega.rollout.sglang_engine import SGLangEngine

    for kind, other in (("fp8", "bf16"), ("bf16", "fp8")):
        tp = engines[kind].cfg.tp_size
        wrong = SGLangEngine(SGLangEngineConfig(urls=[engines[kind].servers[0].url], tp_size=tp), hf, weights=other,
                             api_key=engines[kind]._api_key)
        with pytest.raises(EngineError, match="--quantization fp8" if other == "fp8" else "quantization=fp8") as e:
            wrong.begin_weight_update()
        assert len(str(e.value).splitlines()) == 1
        wrong.shutdown()
    # colocated servers' payloads (rollout.colocate: each bucket flattened into one uint8 tensor at 16-byte aligned
    # offsets, sglang_payloads.flatten, loaded as SGLang's flattened_bucket): codes, scales and bf16 tensors together
    engines["fp8"].colocate = True
    try:
        assert _sync(engines["fp8"], weights, hf, "fp8")[0]["tensors"] == len(weights) + 2 * (4 + 4 * 3)
    finally:
        engines["fp8"].colocate = False
    # the disk transport: an FP8 HF checkpoint (codes, scales, config.json with its quantization_config), which
    # the server reloads in place (SGLang's own update_weights_from_disk: restore, load, post-load processing)
    from rlpo_mega.weight_sync.transports import DiskTransport

    disk = DiskTransport(engines["fp8"], str(tmp_path / "sync_dir"), hf)
    stream = QuantizedStream(ListStream([(n, t.bfloat16()) for n, t in weights.items()], bucket=16), Fp8Selection(hf),
                             quantization_config=sglang_quantization_config(hf))
    assert disk.sync(stream)["tensors"] == len(weights) + 2 * (4 + 4 * 3)  # digest-verified
    with open(tmp_path / "sync_dir" / "config.json") as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [128, 128]
    # an FP8 code or scale altered after the sender's digest (in transit) is caught, by name
    for victim in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"):
        with pytest.raises(DigestMismatchError, match="1 tensors") as e:
            _sync(engines["fp8"], weights, hf, "fp8", victim)
        assert victim in str(e.value)
    sent = {k: _sync(e, weights, hf, k)[1].bytes_sent for k, e in engines.items()}
    assert sent["fp8"] < 0.6 * sent["bf16"], sent  # about half the bytes on the wire
    # the dequantised checkpoint: what the FP8 server computes with, in fp32 (bf16 where it keeps bf16)
    sel = Fp8Selection(hf)
    deq = {n: (dequantize_block(*quantize_block(t.bfloat16())) if sel(n) else t.bfloat16().float()).contiguous()
           for n, t in weights.items()}
    deq_dir = tmp_path / "dequantised"
    deq_dir.mkdir()
    save_file(deq, str(deq_dir / "model.safetensors"))
    for f in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(ckpt, f)):
            with open(os.path.join(ckpt, f)) as src, open(deq_dir / f, "w") as dst:
                dst.write(src.read())
    samples = {k: e.generate(PROMPTS, SamplingParams(max_new_tokens=16), n=4) for k, e in engines.items()}
    seqs = {k: [s.prompt_ids + s.response_ids for s in out] for k, out in samples.items()}
    own = _learner(ckpt, seqs["fp8"] + seqs["bf16"], tmp_path, "own")
    on_deq = _learner(str(deq_dir), seqs["fp8"], tmp_path, "deq")
    n = len(seqs["fp8"])

    def gap(out, learner):
        d = [(s.logprobs - logp[len(s.prompt_ids) - 1:].float()).abs() for s, logp in zip(out, learner)]
        return torch.cat(d).mean().item(), torch.cat(d).max().item()

    for s in samples["fp8"]:
        assert s.routes.shape == (s.num_tokens - 1, 2, 2) and bool((s.logprobs < 0).all())
    fp8_own, bf16_own = gap(samples["fp8"], own["logp"][:n]), gap(samples["bf16"], own["logp"][n:])
    fp8_deq = gap(samples["fp8"], on_deq["logp"])
    print(f"|logp server - learner| mean/max: fp8 {fp8_own[0]:.4f}/{fp8_own[1]:.4f}, bf16 {bf16_own[0]:.4f}/"
          f"{bf16_own[1]:.4f}; fp8 vs the learner on the dequantised weights {fp8_deq[0]:.4f}/{fp8_deq[1]:.4f}")
    assert fp8_deq[0] < 2 * bf16_own[0] + 1e-3, (fp8_deq, bf16_own)  # the FP8 weights landed as sent
    assert fp8_own[0] > 2 * fp8_deq[0], (fp8_own, fp8_deq)  # FP8's own cost, seen

