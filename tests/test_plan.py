"""`rlpo-mega plan`: every shipped recipe at its real size (exit 0, the tables), the memory model equal to what
megatron-core allocates, the planner at every recipe's full size over many draws, and the refusals."""
import json
import os
import re
import subprocess
import sys

import pytest

from rlpo_mega.config import load_config
from rlpo_mega.distributed import resolve_layout
from rlpo_mega.planning import plan as planning
from rlpo_mega.planning.memory import Offload, model_bytes
from rlpo_mega.planning import meta_build
from rlpo_mega.planning.meta_build import Request
from tests.dist import ROOT
from tests.layout_runs import LAYOUTS, PLAN_MEMORY_LAYOUTS, layout_run
from tests.recipe_shrink import recipes

RECIPES = [r for r in recipes() if r.startswith("configs/recipes/")]


def _plan_cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "rlpo_mega.cli", "plan", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})


@pytest.mark.parametrize("recipe", RECIPES, ids=[os.path.basename(r)[:-5] for r in RECIPES])
def test_every_recipe_plans_at_its_real_size(recipe):
    """The recipe as shipped (its /path/to placeholders included) at the world size it names
    (cluster.learner_nodes x 8): exit 0 at uniform lengths and at all-max, every budget held."""
    cfg = load_config(os.path.join(ROOT, recipe))
    for lengths in ("uniform", "all-max"):  # one meta build for both (run_cached); the CLI path: the tests below
        plan = planning.make_plan(cfg, recipe, lengths=lengths)
        out = json.loads(json.dumps(plan.to_json()))
        assert out["world_size"] == cfg.cluster.learner_nodes * 8 and out["exceeded"] is None
        for role in ("learner_gpus", "servers", "hosts"):
            assert out[role] and all(r["headroom"] >= 0 for r in out[role]), (role, out[role])
        gpus = out["learner_gpus"]
        phases = ("training", "generation", "sync") if cfg.rollout.colocate else (None,)
        assert len(gpus) == cfg.parallel.pipeline * len(phases)
        parts = ("params", "grads", "optimizer", "activations", "exchange", "sync bucket", "reserved", "logits",
                 "logprob chunk", "routes", "engine (released)", "engine weights", "engine KV pool", "engine runtime",
                 "engine digest")
        for g in gpus:
            assert g["total"] == sum(g[k] for k in parts if k in g)
            if cfg.rollout.colocate and not g["name"].endswith("training"):
                continue
            assert g["parameters"] > 1e9 and g["params"] > 2e9 and g["activations"] > 0
            assert g["optimizer"] > 0 or (cfg.optim.cpu_offload and cfg.optim.precision_aware)
        ck = out["checkpoint"]
        assert ck["sigterm_save_s"] <= ck["window_s"]
        # a save's time is its busiest node's writes, on SIGTERM too: the checksums are taken as it writes
        assert ck["sigterm_save_s"] == ck["save_s"] == ck["largest_node_write_bytes"] / (ck["storage_gb_per_s"] * 1e9)
        assert "checksum_s" not in ck
        if lengths == "all-max":  # every micro-batch holds as many full-length samples as the budget allows
            assert out["steps"]["largest_micro_tokens"] <= cfg.trainer.max_tokens_per_micro_batch


def test_plan_tables_name_each_role():
    proc = _plan_cli("configs/recipes/glm45_air_gspo_r3_8nodes.yaml")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    for head in ("learner GPU (GB)", "server GPU (GB)", "host (GB)", "stage 0", "stage 1", "node 7", "4 x TP4",
                 "checkpoint:", "pre-emption window"):
        assert head in text, head
    # the save's time is its writes alone, no re-read for checksums (GLM: the busiest node's 221.6 GB at 2 GB/s)
    save = re.search(r"a save needs (\d+) s \(([\d.]+) GB from the busiest node at ([\d.]+) GB/s, checksums taken "
                     r"as it writes\); pre-emption window", text)
    assert save and abs(int(save[1]) - float(save[2]) / float(save[3])) <= 1, text[-600:]
    # the refit table (planning/refit.py; tests/test_refit_plan.py checks its figures): every transport, this
    # recipe's marked, the one that cannot reach servers on other nodes saying why
    refit = text[text.index("\nrefit (one weight sync, 213.7 GB in bf16"):]
    assert re.search(r"\nsglang_distributed \*\s+[\d.]+\s+213\.7\s+53\.5\s+[\d.]+\n", refit), refit
    assert re.search(r"\nreshard\s+[\d.]+\s+53\.5\s+53\.5\s+[\d.]+\n", refit), refit
    assert re.search(r"\nin_process\s+n/a: servers on another node", refit), refit


def test_planner_at_every_recipe_full_size_over_many_draws():
    """The real planner (data/packing.plan_step) at each recipe's batch, DP and micro-batch settings, on 50 steps
    of each length distribution: no refusal, every micro-batch within the token budget."""
    for recipe in RECIPES + ["configs/gpu_smoke.yaml"]:
        cfg = load_config(os.path.join(ROOT, recipe))
        world = (cfg.cluster.learner_nodes or 1) * cfg.cluster.gpus_per_node
        from moe.model import load_hf_config

        layout = resolve_layout(cfg.parallel, world, load_hf_config(os.path.join(ROOT, cfg.model.hf_config)))
        n = cfg.prompts.prompts_per_step * cfg.prompts.n_samples
        for dist in planning.LENGTH_DISTS:
            drawn = planning.response_lengths(dist, cfg.rollout.max_new_tokens, n, 50, seed=7)
            s = planning.simulate_steps(cfg, layout.data, layout.tensor, drawn, 512)
            assert s.steps == 50
            if cfg.trainer.max_tokens_per_micro_batch:
                assert s.largest_micro_tokens <= cfg.trainer.max_tokens_per_micro_batch, (recipe, dist)


def test_the_fixed_count_refusal_is_gone():
    """The issue's call through the plan: a fixed count of 16 micro-batches, 512 samples of 300..8500 tokens at DP8
    (TP2), uneven samples per rank -- it used to raise at step 1."""
    import random

    cfg = load_config(os.path.join(ROOT, RECIPES[1]), ("parallel.num_micro_batches=16",
                                                       "trainer.max_tokens_per_micro_batch=null"))
    rng = random.Random(1)
    drawn = [[rng.randint(300, 8500) for _ in range(512)] for _ in range(20)]
    s = planning.simulate_steps(cfg, 8, 2, drawn, prompt_tokens=1)  # spans = the drawn lengths
    assert s.steps == 20 and s.most_micro_batches == 16


@pytest.mark.parametrize("layout", PLAN_MEMORY_LAYOUTS)
def test_memory_model_equals_megatron_allocations(layout, tmp_path_factory):
    """Per rank: parameter count and the bytes of parameters, gradients and optimizer state (Adam's moments and
    fp32 main copies) that the plan computes from the meta-device build equal, byte for byte, the distinct
    storages of the tensors megatron-core allocated in a real launch (tiny glm4_moe in bf16: 16-bit and fp32
    buffers, a dense first layer, a shared expert), with and without the distributed optimizer, and with optimizer
    CPU offload (with and without precision_aware): the optimizer state left on the accelerator and the host's."""
    out = os.path.join(layout_run(layout, tmp_path_factory), "plan_memory")
    nproc, overrides, _, _ = LAYOUTS[layout]
    cfg = load_config(None, tuple(overrides))
    from moe.model import load_hf_config

    hf = load_hf_config(os.path.join(ROOT, "configs/models/tiny_glm4_moe.json"))
    lay = resolve_layout(cfg.parallel, nproc, hf)
    offload = {"offload": Offload(1.0, precision_aware=True), "offload_main": Offload(1.0, precision_aware=False)}
    for kind in ("plain", "distopt", *offload):
        measured = [json.load(open(os.path.join(out, f"memory_{kind}_{r}.json"))) for r in range(nproc)]
        distopt = kind != "plain"
        built = meta_build.run(Request("configs/models/tiny_glm4_moe.json", lay, "bfloat16", 128, distopt,
                                       ranks=tuple(range(nproc))))
        for m, b in zip(measured, built):
            predicted = model_bytes(b, distopt, m["dp_rank"], m["expert_dp_rank"], offload.get(kind))
            got = (m["params"], m["param_bytes"], m["grad_bytes"], m["optimizer_bytes"], m["host_optimizer_bytes"])
            want = (predicted.params, predicted.param_bytes, predicted.grad_bytes, predicted.optimizer_bytes,
                    predicted.host_optimizer_bytes)
            assert got == want, (layout, kind, m["rank"], got, want)
            assert (m["host_optimizer_bytes"] > 0) == (kind in offload)
            # the table's figure (the largest over DP ranks) bounds every rank's
            assert model_bytes(b, distopt, offload=offload.get(kind)).optimizer_bytes >= predicted.optimizer_bytes


def test_plan_refusals_are_one_line(tmp_path, capsys, monkeypatch):
    """A budget exceeded (through the CLI process, as users run it), then the input errors in-process (they stop
    before the meta build): exit 2 and one line naming the cause."""
    from rlpo_mega import cli

    recipe = "configs/recipes/qwen3_30b_a3b_gspo_r3_2nodes.yaml"
    proc = _plan_cli(recipe, "cluster.gpu_memory_gb=40")
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("rlpo-mega plan: learner GPU") and "40 GB budget" in line, proc.stderr
    monkeypatch.chdir(ROOT)
    bad = tmp_path / "lengths.json"
    bad.write_text('{"not": "a list"}')
    for argv, needle in (([recipe, "--lengths", str(bad)], "response/length_mean"),
                         ([recipe, "--lengths", "normal"], "neither a distribution"),
                         (["configs/demo_cpu.yaml"], "--world-size"),
                         ([recipe, "--world-size", "24"], "config error"),
                         ([recipe, "rollout.sglang.drivers=8"], "drivers=8 but the plan has 4 SGLang server(s)")):
        assert cli.main(["plan", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rlpo-mega plan: ") and needle in err[0], (argv, err)


def test_rollout_drivers_split_the_driver_rows():
    """rollout.sglang.drivers: each driver's host row and exchange hold its share of a step, and each learner
    stage with a driver holds a sync bucket (the full weights arrive there, a bucket at a time)."""
    recipe = "configs/recipes/qwen3_30b_a3b_gspo_r3_2nodes.yaml"  # 2 nodes, 4 servers
    one, two = (planning.make_plan(load_config(os.path.join(ROOT, recipe), (f"rollout.sglang.drivers={d}",)), recipe)
                for d in (1, 2))
    assert one.steps.driver_tokens == one.steps.step_tokens
    assert 0.4 < two.steps.driver_tokens / two.steps.step_tokens < 0.6  # half the prompts (uniform lengths)
    hosts = {d: [r.parts.get("rollout driver", 0) for r in p.rows if r.role == "host"] for d, p in ((1, one), (2, two))}
    assert hosts[1][1] == 0 and hosts[2][0] == hosts[2][1] and 0 < hosts[2][0] < hosts[1][0], hosts
    gpu = {d: next(r for r in p.rows if r.role == "learner GPU").parts for d, p in ((1, one), (2, two))}
    # the exchange runs in rounds of trainer.exchange_round_mb (256) sent and received: the whole step's send of
    # one driver is capped there, as is the half step of each of two
    assert gpu[2]["exchange"] <= gpu[1]["exchange"] == 2 * (256 << 20) and gpu[2]["sync bucket"] == 512 << 20


def test_async_holds_the_samples_of_the_steps_ahead():
    """rollout.producer=async: each driver holds the samples of 1 + trainer.max_staleness steps (the one trained
    and those generating ahead, rollout/producers/asynchronous.py): its host row grows by one step's samples per step of
    staleness, the rest (decoding and exchange buffers) stays."""
    recipe = "configs/recipes/qwen3_30b_a3b_gspo_r3_2nodes.yaml"
    driver = {}
    for k in (0, 1, 2):
        over = ("rollout.producer=async", f"trainer.max_staleness={k}")
        plan = planning.make_plan(load_config(os.path.join(ROOT, recipe), over), recipe)
        driver[k] = next(r for r in plan.rows if r.role == "host").parts["rollout driver"]
    sync = planning.make_plan(load_config(os.path.join(ROOT, recipe)), recipe)
    assert next(r for r in sync.rows if r.role == "host").parts["rollout driver"] == driver[0]
    one_step = driver[1] - driver[0]
    assert one_step > 0 and driver[2] - driver[0] == 2 * one_step, driver


def test_lengths_from_a_file(tmp_path):
    arr = tmp_path / "lengths.json"
    arr.write_text(json.dumps([100, 200, 9000]))
    drawn = planning.response_lengths(str(arr), 8192, 64, 3, seed=0)
    assert len(drawn) == 3 and set(x for s in drawn for x in s) <= {100, 200, 8192}
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"step": i, "response/length_mean": 3000.0, "response/length_max": 8192,
                                             "response/truncated_frac": 0.25}) for i in range(1, 6)))
    drawn = planning.response_lengths(str(metrics), 8192, 400, 4, seed=0)
    for step in drawn:
        assert sum(x == 8192 for x in step) >= 100 and max(step) <= 8192
        assert 2000 < sum(step) / len(step) < 4000


def test_colocated_servers_kv_pool_is_what_sglang_sizes_at_launch():
    """SGLang sizes its KV pool as mem_fraction_static x the GPU memory free when it starts, less its weights
    (sglang/srt/mem_cache/kv_cache_configurator.py:2990-3007). Colocated servers start with the learner's state off
    the GPUs (training/colocate.HandOver.before_launch): free = the GPU less the learner's reserved share; the plan
    prints that pool, not one sized from the whole GPU (or from a GPU the learner still filled)."""
    from rlpo_mega.planning.rows import GB

    recipe = "configs/recipes/qwen3_30b_a3b_gspo_r3_1node.yaml"
    cfg = load_config(os.path.join(ROOT, recipe))
    server = planning.make_plan(cfg, recipe).to_json()["servers"][0]
    free = int(cfg.cluster.gpu_memory_gb * GB) - int(cfg.cluster.gpu_reserved_gb * GB)
    fraction = float(cfg.rollout.sglang.server_args["mem_fraction_static"])
    assert server["KV pool"] == int(fraction * free) - server["weights"], server


def test_fp8_servers_hold_half_the_weights_and_the_pool_grows_by_it():
    """rollout.weights=fp8 (the FP8 recipe against the same recipe in bf16): the servers' weights are the FP8
    model's bytes (codes of every projection, fp32 scales per 128-tile, the rest bf16) over their TP, the KV pool
    grows by exactly what that frees, and one sync sends the servers the FP8 model (about half the bytes)."""
    from moe.bridge.fp8 import served_bytes
    from moe.model import load_hf_config

    recipe = "configs/recipes/qwen3_30b_a3b_gspo_r3_fp8_2nodes.yaml"
    fp8 = planning.make_plan(load_config(os.path.join(ROOT, recipe)), recipe, refit=True).to_json()
    bf16 = planning.make_plan(load_config(os.path.join(ROOT, recipe), ("rollout.weights=bf16",)), recipe,
                              refit=True).to_json()
    hf = load_hf_config(os.path.join(ROOT, "configs/models/qwen3_30b_a3b.json"))
    fp8_bytes, bf16_bytes = served_bytes(hf)
    assert 0.50 < fp8_bytes / bf16_bytes < 0.52  # 31.2 of 61.1 GB
    (s8,), (s16,) = fp8["servers"], bf16["servers"]
    assert s8["weights"] == fp8_bytes // 2 and s16["weights"] == pytest.approx(bf16_bytes / 2, rel=1e-3)  # TP2
    assert s8["KV pool"] - s16["KV pool"] == s16["weights"] - s8["weights"]
    assert s8["KV_tokens"] > 1.3 * s16["KV_tokens"] and s8["KV_tokens_in_bf16"] == s16["KV_tokens"]
    assert fp8["refit"]["fp8_bytes"] == fp8_bytes and bf16["refit"]["fp8_bytes"] is None
    rows8 = {r["transport"]: r for r in fp8["refit"]["transports"]}
    rows16 = {r["transport"]: r for r in bf16["refit"]["transports"]}
    assert rows8["sglang_distributed"]["server_received"] == fp8_bytes  # every TP rank of a server gets it whole
    assert rows16["sglang_distributed"]["server_received"] == bf16["refit"]["model_bytes"]
    assert rows8["sglang_distributed"]["seconds"] < rows16["sglang_distributed"]["seconds"]
    # reshard: each server rank receives its own shard of the FP8 model (codes and scales) and no more
    assert rows8["reshard"]["unavailable"] is None and rows16["reshard"]["unavailable"] is None
    assert rows8["reshard"]["server_received"] == rows8["reshard"]["server_shard"]
    assert rows8["reshard"]["server_shard"] == pytest.approx(s8["weights"], rel=1e-3)  # (+ what each rank holds whole)
    assert rows8["reshard"]["learner_sent"] < 0.52 * rows16["reshard"]["learner_sent"]
    # a driver holds a bucket's codes and scales too, and sglang_distributed's packed copy of them
    bucket = 512 << 20
    assert fp8["learner_gpus"][0]["sync bucket"] == bucket + bucket // 2 + bucket
    assert bf16["learner_gpus"][0]["sync bucket"] == bucket


def test_plan_of_a_critic_with_its_own_adapters():
    """critic.lora (`make demo-ppo`'s config, 2 ranks): the critic megatron builds on the meta device holds its
    adapters and its scalar head as trainable, so its gradients are theirs alone, while its parameters are the whole
    trunk's and the adapters'. Its checkpoints hold the frozen trunk too where no resume could rebuild it (its trunk
    copied from a policy trained whole), and not where critic.init_from_hf gives it (critic.lora.save=auto): the
    difference is the trunk's fp32 bytes."""
    plans, ck = {}, {}
    for name, extra in (("0", ("critic.lora.rank=0",)), ("4", ("critic.lora.rank=4",)),
                        ("4_from_hf", ("critic.lora.rank=4", "critic.init_from_hf=/the/critics/base"))):
        cfg = load_config(os.path.join(ROOT, "configs/demo_ppo_cpu.yaml"), extra)
        plan = planning.make_plan(cfg, "configs/demo_ppo_cpu.yaml", 2).to_json()
        plans[name], ck[name] = plan["learner_gpus"][0], plan["checkpoint"]["checkpoint_bytes"]
    whole, adapted = plans["0"], plans["4"]
    assert adapted["critic grads"] < whole["critic grads"] / 4, (adapted, whole)
    assert adapted["critic_parameters"] > whole["critic_parameters"], (adapted, whole)
    trunk = ck["4"] - ck["4_from_hf"]
    assert trunk > 0.9 * 4 * whole["critic_parameters"], (ck, whole["critic_parameters"])


def test_plan_with_lora_holds_the_base_frozen_and_only_the_adapters_gradients_and_optimizer():
    """The one-node Qwen3-30B-A3B LoRA recipe (TP2, EP8, ETP1; rank 32 on attention and experts, shared_outer; the
    optimizer on the GPU): the model megatron builds with the adapters attached (moe/lora.py on the meta device)
    holds, per rank, exactly the adapters' parameters as trainable -- per layer the attention's qkv (A 32 x 2048,
    B 2560 x 32: its TP half of 4096 + 2 x 512 rows) and output projection (A 32 x 2048: its TP half of 4096 columns,
    B 2048 x 32), the experts' shared fc1 A and fc2 B, and each of the 16 local experts' fc1 B (1536 x 32) and fc2 A
    (32 x 768) -- with their fp32 gradients and the distributed optimizer's state alone; the frozen base stays in the
    parameters, and the engines serve (and the sync sends) the merged model at its base size. Trained whole (the
    full-weight one-node recipe without its optimizer offload) it does not fit an 80 GB GPU; with the adapters every
    phase fits one, training under 80% of it. Its checkpoints hold the adapters alone (model.lora.save=auto on an
    HF base); model.lora.save=full adds the bf16 base (61 GB)."""
    recipe = "configs/recipes/qwen3_30b_a3b_gspo_r3_lora_1node.yaml"
    whole = "configs/recipes/qwen3_30b_a3b_gspo_r3_1node.yaml"
    no_offload = ("optim.cpu_offload=false", "optim.overlap_cpu_optimizer_d2h_h2d=false", "optim.precision_aware=false")
    plans = {}
    # in this process: the meta builds are the ones test_every_recipe_plans_at_its_real_size made (whole: the base
    # model's, at an H200's memory so that its numbers come out; the LoRA recipe's)
    for name, path, extra in (("whole", whole, (*no_offload, "cluster.gpu_memory_gb=141")), ("lora", recipe, ()),
                              ("lora_full_save", recipe, ("model.lora.save=full",))):
        plans[name] = json.loads(json.dumps(planning.make_plan(load_config(os.path.join(ROOT, path), extra),
                                                               path).to_json()))
    full, lora = (plans[k]["learner_gpus"][0] for k in ("whole", "lora"))
    per_layer = (32 * 2048 + 2560 * 32) + (32 * 2048 + 2048 * 32) + 2 * 32 * 2048 + 16 * (1536 * 32 + 32 * 768)
    assert lora["trainable"] == 48 * per_layer == 76_283_904, lora
    assert lora["grads"] == pytest.approx(4 * lora["trainable"], rel=0.01) and full["grads"] > 50 * lora["grads"]
    assert lora["optimizer"] < full["optimizer"] / 50
    assert lora["params"] - full["params"] == pytest.approx(2 * lora["trainable"], rel=0.01)  # bf16 factors
    assert lora["total"] <= 0.8 * 80e9 and full["total"] > 80e9, (lora, full)
    assert all(r["total"] <= r["budget"] == 80e9 for r in plans["lora"]["learner_gpus"]), plans["lora"]["learner_gpus"]
    assert plans["lora"]["servers"][0]["weights"] == plans["whole"]["servers"][0]["weights"]
    adapters, both = plans["lora"]["checkpoint"], plans["lora_full_save"]["checkpoint"]
    assert adapters["checkpoint_bytes"] < 8e9 and 60e9 < both["checkpoint_bytes"] - adapters["checkpoint_bytes"] < 62e9
    # the sync in each mode (the refit line): merged, the whole model in bf16; rollout.lora_sync=adapter, the adapter
    # as SGLang receives it -- per layer q/k/v/o's A and B, the experts' gate/up A and down B once (shared_outer) and
    # each expert's gate/up B and down A, in bf16
    refit = planning.make_plan(load_config(os.path.join(ROOT, recipe)), recipe, refit=True).refit
    attention = 3 * 32 * 2048 + 32 * (4096 + 512 + 512) + 32 * 4096 + 2048 * 32
    experts = 2 * 32 * 2048 + 2048 * 32 + 128 * (2 * 768 * 32 + 32 * 768)
    assert refit.adapter_bytes == 2 * 48 * (attention + experts) == 978_321_408, refit.adapter_bytes
    assert refit.model_bytes > 60 * refit.adapter_bytes
    assert "the LoRA adapter alone 0.98 GB (rollout.lora_sync=adapter)" in "\n".join(planning.render_refit(refit))
