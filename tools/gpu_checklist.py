"""`make gpu-smoke`: the GPU checklist in one command, one table -- what a CPU cannot settle, on one GPU.

Rows (each run in its own process, so one failing check cannot hide the others):
  smoke          tools/gpu_smoke.py's runs A-E (CUDA, NCCL at world size 1, bf16 + distributed optimizer, GSPO +
                 R3, the embedded engine on the GPU, digest-checked sync, checkpoint + resume, host syncs per layer)
  set_device     rlpo_mega.distributed.init calls torch.cuda.set_device(LOCAL_RANK) before anything touches CUDA
                 (platform.apply, which may import Transformer Engine): no context is made on another GPU first
  first offload  the colocated hand-over's first offload (training/colocate.py -> residency.Residency): its pinned
                 host allocation (torch rounds each pinned block up to a power of two, CachingHostAllocator.h)
                 against the later offloads that reuse it, and the onload, in GB/s
  plan vs peak   a Qwen3-MoE sized to fill most of this GPU (model_for_gpu), trained 2 RL steps by `rlpo-mega
                 train`; the per-phase peak of torch.cuda.max_memory_allocated (memory/peak_gb/<phase>, logged by
                 the trainer) against `rlpo-mega plan`'s learner GPU row of the same config at all-max lengths
  MFU            that run's update phase: 6 x active parameters x tokens (8 x under recompute) per second over
                 the GPU's dense bf16 peak (--peak-tflops; 989 for an H100/H200 SXM)
  fp8            rollout.weights=fp8's quantiser (moe/bridge/fp8.py) on the GPU bit-equal to the CPU's (the
                 reshard sender quantises each learner GPU's piece there), and its codes and weight_scale_inv fed
                 to Hopper's block-FP8 GEMM (torch's scaled_mm, 1x128 activations x 128x128 weights: the scheme
                 SGLang serves with) against the dequantised product; the GEMM's speed against bf16 at
                 Qwen3-30B-A3B's projection shapes
Exit 0 only when every row passes. Writes under runs/gpu_checklist/<UTC time>/ only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BASE_MODEL = "configs/models/tiny_qwen3_moe.json"
BYTES_PER_PARAM = 18  # bf16 parameter, fp32 main gradient, fp32 main copy + Adam's two moments (distributed optimizer)
FILL = 0.6  # of the GPU for the learner's parameters, gradients and optimizer state; activations take the rest


def model_for_gpu(gpu_gb: float, layers_max: int = 48) -> dict:
    """A Qwen3-MoE config (HF json dict) whose learner state at world size 1 fills about FILL of a `gpu_gb` GPU:
    Qwen3-30B-A3B's layer shape at hidden 2048 (64 experts, top 8, GQA 16/4, its vocabulary), as many layers as
    fit."""
    with open(os.path.join(ROOT, BASE_MODEL)) as f:
        hf = json.load(f)
    hf.update({"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
               "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 64,
               "num_experts_per_tok": 8, "max_position_embeddings": 8192})
    per_layer, fixed = layer_params(hf)
    layers = int((FILL * gpu_gb * 1e9 / BYTES_PER_PARAM - fixed) // per_layer)
    hf["num_hidden_layers"] = max(1, min(layers_max, layers))
    return hf


def layer_params(hf: dict) -> tuple[int, int]:
    """(parameters per decoder layer, parameters outside them): attention, router, experts, norms; embeddings and
    the output layer."""
    h, d = hf["hidden_size"], hf["head_dim"]
    attn = h * hf["num_attention_heads"] * d * 2 + h * hf["num_key_value_heads"] * d * 2 + 2 * d
    experts = hf["num_experts"] * 3 * h * hf["moe_intermediate_size"] + h * hf["num_experts"]
    return attn + experts + 2 * h, 2 * hf["vocab_size"] * h + h


def active_params(hf: dict) -> int:
    """Parameters a token's forward multiplies by: attention, its top-k experts, the output layer."""
    h, d = hf["hidden_size"], hf["head_dim"]
    attn = h * hf["num_attention_heads"] * d * 2 + h * hf["num_key_value_heads"] * d * 2
    experts = hf["num_experts_per_tok"] * 3 * h * hf["moe_intermediate_size"] + h * hf["num_experts"]
    return hf["num_hidden_layers"] * (attn + experts) + hf["vocab_size"] * h


def train_overrides(out: str, model_path: str, max_new_tokens: int = 2048) -> list[str]:
    """configs/gpu_smoke.yaml (embedded engine, GSPO + R3, bf16, distributed optimizer) on the big model: 2 steps of
    16 answers of up to 2048 tokens, micro-batches of up to 8192 tokens, no warm-up, no checkpoint; colocated (the
    engine's weights on the host while the learner trains, the learner's state there while the engine generates:
    training/colocate.py), so each phase has its own planned row."""
    return [f"model.hf_config={model_path}", f"logging.dir={out}/run", "train_iters=2", "trainer.warmup.steps=0",
            "checkpoint.save_dir=null", "checkpoint.save_every=0", "prompts.prompts_per_step=4", "prompts.n_samples=4",
            f"rollout.max_new_tokens={max_new_tokens}", "trainer.max_tokens_per_micro_batch=8192", "trainer.layout=packed",
            "logging.host_syncs=false", "rollout.colocate=true"]


def _row(name, ok, measured, expected, note=""):
    return {"check": name, "ok": ok, "measured": measured, "expected": expected, "note": note}


def _pythonpath() -> str:
    """The repository first, then what the caller's PYTHONPATH already holds (a GPU machine's carried wheels are
    installed into a folder named there)."""
    return os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)


def check_smoke(out: str) -> dict:
    # the log is written as the runs go: a lease that ends mid-run still brings back what they printed
    with open(f"{out}/smoke.log", "w") as f:
        p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_smoke.py"), "--out", f"{out}/smoke"],
                           cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
    with open(f"{out}/smoke.log") as f:
        tail = [line for line in f.read().splitlines() if line.startswith(("steps A", "checkpoint before", "our host"))]
    return _row("smoke (runs A-E)", p.returncode == 0, f"exit {p.returncode}", "exit 0", "; ".join(tail)[:160])


SET_DEVICE_PROBE = r"""
import json, os, sys
import torch
import rlpo_mega.distributed as d
import rlpo_mega.platform as platform
from rlpo_mega.config import load_config
from moe.model import load_hf_config
order = []
set_device, apply = torch.cuda.set_device, platform.apply
def recording_set_device(dev):
    order.append(("set_device", torch.cuda.is_initialized()))
    return set_device(dev)
def recording_apply(*a, **k):
    order.append(("platform.apply", torch.cuda.is_initialized()))
    return apply(*a, **k)
torch.cuda.set_device, platform.apply = recording_set_device, recording_apply
cfg = load_config("configs/gpu_smoke.yaml")
d.init(cfg.parallel, load_hf_config(cfg.model.hf_config), 0)
print(json.dumps({"order": order, "device": torch.cuda.current_device()}))
"""


def check_set_device(out: str) -> dict:
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
    p = subprocess.run([sys.executable, "-c", SET_DEVICE_PROBE], cwd=ROOT, env=env, capture_output=True, text=True)
    try:
        got = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return _row("set_device first", False, f"exit {p.returncode}", "set_device, then platform.apply",
                    p.stderr.strip().splitlines()[-1][:160] if p.stderr.strip() else "")
    names = [n for n, _ in got["order"]]
    first = names[:1] == ["set_device"] and not got["order"][0][1]
    return _row("set_device first", first and "platform.apply" in names, " -> ".join(names),
                "set_device (CUDA untouched), then platform.apply", f"current device {got['device']}")


def check_first_offload(gib: int) -> dict:
    import torch

    from rlpo_mega.residency import Residency

    state = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(gib)]
    residency, times = Residency(lambda: state), {}
    for what in ("offload_1", "onload_1", "offload_2", "onload_2"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        (residency.offload if what.startswith("off") else residency.onload)()
        times[what] = time.perf_counter() - t0
    gb = gib * (1 << 30) / 1e9
    rates = {k: gb / v for k, v in times.items()}
    note = ", ".join(f"{k} {v:.2f} s ({rates[k]:.1f} GB/s)" for k, v in times.items())
    # the first offload pays the pinned allocation once; every later one runs at the link's speed
    return _row(f"first offload ({gib} GiB)", rates["offload_2"] > 5 and rates["onload_2"] > 5,
                f"{times['offload_1']:.2f} s first, {times['offload_2']:.2f} s after", "later ones > 5 GB/s", note)


def check_plan_and_mfu(out: str, peak_tflops: float, layers_max: int = 48, max_new_tokens: int = 2048) -> list[dict]:
    import torch

    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    hf = model_for_gpu(gpu_gb, layers_max)
    model_path = f"{out}/model/config.json"
    os.makedirs(os.path.dirname(model_path), exist_ok=True)
    with open(model_path, "w") as f:
        json.dump(hf, f, indent=1)
    over = train_overrides(out, model_path, max_new_tokens)
    cli = [sys.executable, "-m", "rlpo_mega.cli"]
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "WANDB_MODE": "disabled"}
    plan = subprocess.run([*cli, "plan", "configs/gpu_smoke.yaml", *over, f"cluster.gpu_memory_gb={gpu_gb:.1f}",
                           "--world-size", "1", "--lengths", "all-max", "--prompt-tokens", "16", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    t0 = time.monotonic()
    with open(f"{out}/plan_run.log", "w") as f:
        f.write(plan.stdout + plan.stderr)
        f.flush()
        run = subprocess.run([*cli, "train", "configs/gpu_smoke.yaml", *over], cwd=ROOT, env=env, stdout=f,
                             stderr=subprocess.STDOUT, text=True)
    if plan.returncode or run.returncode:
        with open(f"{out}/plan_run.log") as f:
            why = (plan.stderr or f.read()).strip().splitlines()
        return [_row("plan vs peak", False, f"plan exit {plan.returncode}, train exit {run.returncode}", "0, 0",
                     why[-1][:160] if why else "")]
    planned = {r["name"].rsplit(", ", 1)[-1]: r for r in json.loads(plan.stdout)["learner_gpus"]}
    with open(metrics_path(out)) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    peak = {k.rsplit("/", 1)[1]: max(h.get(k, 0) for h in steps) for k in steps[-1] if k.startswith("memory/peak_gb/")}
    gb, rows = 1e9, []
    # allocated memory: each phase's planned row less what the allocator does not report (the reserved share: CUDA
    # context, NCCL's buffers, fragmentation)
    for phase, measured_in in (("training", ("update", "old_logprob")), ("generation", ("rollout",)),
                               ("sync", ("sync",))):
        row = planned.get(phase)
        if row is None:
            continue
        predicted = (row["total"] - row.get("reserved", 0)) / gb
        measured = max(peak.get(k, 0) for k in measured_in)
        lower = 0.6 * predicted if phase == "training" else 0.0  # the plan at all-max is an upper bound, not loose
        note = ""
        if phase == "training":
            acts = sum(row.get(k, 0) for k in ("activations", "logits", "logprob chunk")) / gb
            note = (f"{hf['num_hidden_layers']} layers, {gpu_gb:.0f} GB GPU; planned activations+logits+chunk "
                    f"{acts:.1f} GB; wall {time.monotonic() - t0:.0f} s")
        rows.append(_row(f"plan vs peak: {phase}", lower <= measured <= predicted,
                         f"{measured:.1f} GB ({'/'.join(measured_in)})", f"<= {predicted:.1f} GB planned", note))
    last = steps[-1]
    tokens = last.get("response/length_mean", 0) * 16 + 16 * 16  # answers and their (16-token) prompts
    factor = 8 if "recompute=true" in " ".join(over) else 6
    update_s = last.get("time/update", float("nan"))
    tflops = factor * active_params(hf) * tokens / update_s / 1e12
    rows.append(_row("learner MFU (update)", tflops > 0, f"{100 * tflops / peak_tflops:.1f}% ({tflops:.0f} TFLOP/s)",
                     f"of {peak_tflops:.0f} TFLOP/s bf16 dense",
                     f"{tokens:.0f} tokens in {update_s:.2f} s, {active_params(hf) / 1e9:.2f} B active parameters"))
    return rows


# Qwen3-30B-A3B's projections as [N, K] weights (hidden 2048): an expert's gate and up together, the attention's
# q, k and v together; K/128 a multiple of 4, so b's 128x128 scales need no padding (torch's blockwise GEMM takes
# them as [L4, N/128] with L4 = K/128 rounded up to 4: pytorch test/test_scaled_matmul_cuda.py). The quantiser alone
# also sees an expert's down projection (K 768) and a shape whose edges are not whole blocks.
FP8_GEMM_SHAPES = {"experts gate_up": (1536, 2048), "attention qkv": (5120, 2048)}
FP8_QUANT_SHAPES = {**FP8_GEMM_SHAPES, "experts down": (2048, 768), "ragged": (1000, 2000)}
FP8_TOKENS = 8192  # rows of activations: a prefill's batch of tokens


def quantize_activations(x):
    """[M, K] -> (e4m3 codes [M, K], fp32 scales [M, K/128]): one scale per token per 128 columns, the 1x128
    scheme SGLang's block-FP8 linear quantises activations with (per_token_group_quant_fp8); K a multiple of 128."""
    import torch

    from moe.bridge.fp8 import AMAX_FLOOR, BLOCK, FP8_DTYPE, FP8_MAX

    m, k = x.shape
    groups = x.float().view(m, k // BLOCK, BLOCK)
    scales = groups.abs().amax(-1).clamp(min=AMAX_FLOOR) / FP8_MAX
    return (groups / scales[..., None]).to(FP8_DTYPE).view(m, k), scales


def block_fp8_mm(xq, xs, wq, ws):
    """x @ w.T by torch's block-FP8 GEMM from x's 1x128 codes and scales and w's 128x128 codes and
    weight_scale_inv (the dequantising multipliers, as rollout.weights=fp8 sends them), in bf16. a is row-major,
    b = w.T column-major; a's scales outer-dim major ([M, K/128], stride (1, M)); b's the weight's [N/128, K/128]
    transposed, K/128 a multiple of 4 (FP8_GEMM_SHAPES)."""
    import torch
    import torch.nn.functional as F

    if ws.shape[1] % 4:
        raise ValueError(f"K/128 = {ws.shape[1]} is not a multiple of 4 (FP8_GEMM_SHAPES)")
    a_scale, b_scale = xs.t().contiguous().t(), ws.t()
    if hasattr(F, "scaled_mm"):  # torch >= 2.10
        return F.scaled_mm(xq, wq.t(), a_scale, F.ScalingType.BlockWise1x128, b_scale, F.ScalingType.BlockWise128x128,
                           output_dtype=torch.bfloat16)
    return torch._scaled_mm(xq, wq.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)


def _gemm_tflops(fn, flops: float, reps: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return flops * reps / (start.elapsed_time(end) / 1e3) / 1e12


def check_fp8() -> list[dict]:
    import torch

    from moe.bridge.fp8 import dequantize_block, quantize_block

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, unequal = [], []
    for name, shape in FP8_QUANT_SHAPES.items():
        w = (torch.randn(shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        w[:128, :128] = 0  # an all-zero tile: a finite scale, zero codes
        q, s = quantize_block(w)
        qc, sc = quantize_block(w.cpu())
        if not (torch.equal(q.cpu().view(torch.uint8), qc.view(torch.uint8)) and torch.equal(s.cpu(), sc)):
            unequal.append(name)
    rows.append(_row("fp8 quantiser: GPU = CPU", not unequal, f"{len(FP8_QUANT_SHAPES) - len(unequal)} of "
                     f"{len(FP8_QUANT_SHAPES)} shapes bit-equal", "codes and scales bit-equal",
                     f"unequal: {', '.join(unequal)}" if unequal else ", ".join(
                         f"{k} {v[0]}x{v[1]}" for k, v in FP8_QUANT_SHAPES.items())))
    errors, speed = [], []
    for name, (n, k) in FP8_GEMM_SHAPES.items():
        x = torch.randn(FP8_TOKENS, k, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        xq, xs = quantize_activations(x)
        wq, ws = quantize_block(w)
        out = block_fp8_mm(xq, xs, wq, ws).float()
        # the same codes and scales dequantised, multiplied in fp32: what the kernel must compute
        ref = (xq.float() * xs.repeat_interleave(128, 1)) @ dequantize_block(wq, ws).t()
        exact = x.float() @ w.float().t()
        rel = ((out - ref).norm() / ref.norm()).item()
        fp8_cost = ((ref - exact).norm() / exact.norm()).item()
        errors.append((name, rel, fp8_cost))
        flops = 2 * FP8_TOKENS * n * k
        bf16 = _gemm_tflops(lambda: x @ w.t(), flops)
        fp8 = _gemm_tflops(lambda: block_fp8_mm(xq, xs, wq, ws), flops)
        speed.append((name, bf16, fp8))
    worst = max(e[1] for e in errors)
    rows.append(_row("fp8 block GEMM = dequantised", worst < 1e-2, f"rel error {worst:.1e} (worst shape)",
                     "< 1e-2 (bf16 output)", "; ".join(f"{k}: {r:.1e}, FP8 vs exact {c:.1e}" for k, r, c in errors)))
    rows.append(_row("fp8 GEMM speed", True, ", ".join(f"{f / b:.2f}x" for _, b, f in speed), "FP8 / bf16 TFLOP/s, the GEMM alone",
                     "; ".join(f"{k} {FP8_TOKENS}x{n}x{k2}: bf16 {b:.0f}, fp8 {f:.0f} TFLOP/s"
                               for (k, b, f), (n, k2) in zip(speed, FP8_GEMM_SHAPES.values()))))
    return rows


def metrics_path(out: str) -> str:
    """Where the plan row's run writes its metrics: logging.dir (train_overrides) holds metrics.jsonl itself
    (rlpo_mega/logging/metrics.py: the run directory is logging.dir where set; on the first GPU run this read
    <dir>/<run_name>/metrics.jsonl and the row failed after the training had run)."""
    return os.path.join(out, "run", "metrics.jsonl")


def table(rows: list[dict]) -> str:
    cols = ("check", "ok", "measured", "expected", "note")
    cells = [[str(r[c]) if c != "ok" else ("PASS" if r["ok"] else "FAIL") for c in cols] for r in rows]
    width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols[:-1])]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols[:-1], width)) + "  note"]
    lines += ["  ".join(x.ljust(w) for x, w in zip(cell[:-1], width)) + "  " + cell[-1] for cell in cells]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output directory (default runs/gpu_checklist/<UTC time>)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100/H200 SXM: 989)")
    p.add_argument("--offload-gib", type=int, default=16, help="GiB the first-offload check moves (default 16)")
    # a short lease: fewer layers and shorter answers keep the plan row's run in minutes (the plan is compared at
    # the same config, so the row still tests the planner, at a model filling less of the GPU)
    p.add_argument("--layers-max", type=int, default=48, help="the plan row's model: at most this many layers")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="the plan row's answers: at most this long")
    p.add_argument("--skip", nargs="*", default=[], choices=["smoke", "set_device", "offload", "plan", "fp8"])
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu-checklist: no CUDA device visible (torch.cuda.is_available() is False): run it on a GPU node, in "
              "an environment with a CUDA build of torch and `pip install -e .`", file=sys.stderr)
        return 2
    out = os.path.abspath(a.out or os.path.join(ROOT, "runs", "gpu_checklist",
                                                time.strftime("%Y%m%d-%H%M%S", time.gmtime())))
    if os.path.exists(out) and os.listdir(out):
        print(f"gpu-checklist: {out} is not empty; give another --out", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    print(f"gpu-checklist on {torch.cuda.get_device_name(0)}, torch {torch.__version__}: {out}", flush=True)
    rows = []
    checks = [("smoke", lambda: [check_smoke(out)]), ("set_device", lambda: [check_set_device(out)]),
              ("offload", lambda: [check_first_offload(a.offload_gib)]),
              ("plan", lambda: check_plan_and_mfu(out, a.peak_tflops, a.layers_max, a.max_new_tokens)),
              ("fp8", check_fp8)]
    for name, fn in checks:
        if name in a.skip:
            continue
        t0 = time.monotonic()
        try:
            rows += fn()
        except Exception as e:  # one broken check is a failed row, the others still run
            rows.append(_row(name, False, f"{type(e).__name__}", "", str(e).splitlines()[0][:160] if str(e) else ""))
        print(f"  {name}: {time.monotonic() - t0:.0f} s", flush=True)
    text = table(rows)
    print("\n" + text)
    with open(f"{out}/checklist.txt", "w") as f:
        f.write(text + "\n")
    ok = all(r["ok"] for r in rows)
    print("gpu-checklist:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
