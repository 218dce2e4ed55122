"""Every shipped recipe runs end to end on this CPU, shrunk (tests/recipe_shrink.py): the real `rlpo-mega train`
command under torchrun, with the recipe's loss, routing replay, engine, weight transport, distributed optimizer,
bf16 parameters, sequence parallelism and EP. Each: 2 RL steps with a checkpoint after each, then a resume from
step 1 that runs step 2. With the embedded engine the resumed step 2 equals the uninterrupted one; with SGLang
(servers attached by URL, as launch/slurm/train_disaggregated.sbatch does, at the recipe's server TP size, 2 at
most here) every
sync of both runs is digest-verified inside the servers, the resumed run's first sync included.
A new YAML in configs/recipes/ is covered with no new test code. Recipes whose shrinks are the same run (the
2- and 4-node variants differ only in batch size, which the shrink sets) share one run; a run that other runs make
between them, each differing from it in one part (RUN_SHOWN_BY, checked key by key), is not run again (CI time).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from moe.model import load_hf_config
from rlpo_mega.config import load_config, to_dict
from tests.dist import ROOT
from rlpo_mega.rollout.sglang_launch import fp8_server_args
from tests.recipe_shrink import changeable, distinct_runs, recipes, shrink, shrunk_config, tiny_for_recipe
from tests.test_sglang import SERVER_ARGS, SUPPORT, free_port, sglang_python  # noqa: F401  (fixture)

RECIPES = recipes()
RUNS = distinct_runs()  # recipes whose shrinks are one and the same run share it
MATH_PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
NOT_COMPARED = ("time", "perf/")  # wall-clock figures (the row's "time" stamp, time/*, perf/*)


def _leaves(d: dict, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Tiny HF checkpoints (with the tiny tokenizer, for chat_template: auto) and a math prompt file."""
    from tests.workers.bridge import make_hf_checkpoint

    root = tmp_path_factory.mktemp("recipe_assets")
    hf_dirs = {}
    for tiny in ("configs/models/tiny_qwen3_moe.json", "configs/models/tiny_mixtral.json",
                 "configs/models/tiny_glm4_moe.json", "configs/models/tiny_qwen3_moe_fp8.json"):
        out = root / os.path.basename(tiny)[:-5]
        make_hf_checkpoint(load_hf_config(os.path.join(ROOT, tiny)), str(out))
        for f in os.listdir(os.path.join(ROOT, "configs", "tokenizers", "tiny_char")):
            shutil.copy(os.path.join(ROOT, "configs", "tokenizers", "tiny_char", f), out / f)
        hf_dirs[tiny] = str(out)
    prompts = root / "math.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in MATH_PROMPTS))
    return hf_dirs, str(prompts)


class _Servers:
    """SGLang servers started on demand, one per (tiny model, dtype, TP size), shared by every recipe."""

    def __init__(self, python, log_dir):
        self.python, self.log_dir, self.running = python, log_dir, {}

    def url(self, hf_dir: str, dtype: str, tp: int, fp8: bool = False) -> str:
        """fp8: started as rollout.weights=fp8 needs (SGLang's fp8 quantization, serving in bf16)."""
        key = (hf_dir, dtype, tp, fp8)
        for other in [k for k in self.running if k != key]:  # one at a time: an idle SGLang server on this
            self.running.pop(other).stop()                    # CPU still spins its scheduler processes
        if key not in self.running:
            sys.path.insert(0, os.path.join(ROOT, "launch"))
            from sglang_server import SGLangServer

            env = {"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": os.path.join(SUPPORT, "path")}
            if tp == 2:
                env["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"  # shared/notes/sglang.md: TP=2 on this CPU
            extra = fp8_server_args(load_hf_config(hf_dir)) if fp8 else {}
            server = SGLangServer(hf_dir, port=free_port(), tp_size=tp, python=self.python, log_dir=self.log_dir,
                                  server_args={**SERVER_ARGS, "dtype": dtype, **extra}, env=env)
            self.running[key] = server.start(timeout=300)
        return self.running[key].url

    def stop(self):
        for s in self.running.values():
            s.stop()
        self.running = {}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, request):
    made = {}

    def get():
        if "s" not in made:
            made["s"] = _Servers(request.getfixturevalue("sglang_python"), str(tmp_path_factory.mktemp("sgl_logs")))
        return made["s"]

    yield get
    if "s" in made:
        made["s"].stop()


def _shrunk(recipe, work, assets, servers):
    hf_dirs, prompts = assets
    raw = OmegaConf.to_container(OmegaConf.load(os.path.join(ROOT, recipe)), resolve=True)
    urls = launch = None
    if raw.get("rollout", {}).get("engine") == "sglang":
        s = raw["rollout"].get("sglang", {})
        dtype = raw.get("model", {}).get("params_dtype", "float32")
        tiny = tiny_for_recipe(raw)  # the server of the recipe's family only
        tp = min(s.get("tp_size", 1), 2)
        fp8 = raw["rollout"].get("weights") == "fp8"
        if s.get("launch"):  # the trainer starts its own (the colocated recipe): the shared ones stop first
            servers().stop()
            launch = {"rollout.sglang.python": servers().python, "rollout.sglang.base_port": free_port(),
                      "rollout.sglang.log_dir": str(work / "sglang_logs"),
                      "rollout.sglang.env.SGLANG_USE_CPU_ENGINE": "1", "rollout.sglang.env.TORCHDYNAMO_DISABLE": "1",
                      "rollout.sglang.env.PYTHONPATH": os.path.join(SUPPORT, "path"),
                      **({"rollout.sglang.env.SGLANG_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {}),
                      **{f"rollout.sglang.server_args.{k}": v for k, v in {**SERVER_ARGS, "dtype": dtype}.items()}}
        else:
            urls = {tiny: [servers().url(hf_dirs[tiny], dtype, tp, fp8)]}
    return shrink(recipe, work=str(work), hf_dirs=hf_dirs, prompts=prompts, sglang_urls=urls, sglang_launch=launch)


def _train(recipe, shrunk, *extra, timeout=900):
    cmd = [sys.executable, "-m", "rlpo_mega.cli", "train", recipe, "--nproc-per-node", str(shrunk.nproc),
           *shrunk.argv(), "logging.plot=false", *extra]  # curves.png: test_trainer's demo run and test_logging
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    with open(os.path.join(os.path.dirname(shrunk.overrides["logging.dir"]), "train.log"), "a") as f:
        f.write(proc.stdout + proc.stderr)  # kept with the run (pytest's tmp dir) for a look at its timeline
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "[rank0]" in line or "Error" in line]
        raise AssertionError(f"{shrunk.describe()}\n{proc.stdout[-3000:]}\nrank 0 / errors:\n"
                             + "\n".join(errors[-60:]) + f"\n...\n{proc.stderr[-3000:]}")
    return proc


def _history(logdir):
    """The RL steps' rows (an eval before step 1 logs its own row at step 0)."""
    with open(os.path.join(logdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "reward/mean" in r]


def test_tp2_digest_hook_memory_is_bounded_by_the_largest_tensor(assets, servers, tmp_path_factory):
    """The in-server digest hook at TP2 (bf16) on a model with 50M expert parameters (100 MB): its measured peak
    extra memory (the server's TP-rank-0 RSS high-water mark during the hook, reset before it) stays within a
    few of its largest tensors, far below the model -- it gathers and digests one parameter or one expert at a
    time. (The hook that kept every gathered tensor until the dict was complete: 187.7 MiB here, 1.9x the model;
    this one: 4.1 MiB.)"""
    import torch
    from safetensors.torch import load_file

    from rlpo_mega.config import SGLangEngineConfig
    from rlpo_mega.rollout.sglang_engine import SGLangEngine
    from rlpo_mega.weight_sync.transports import TRANSPORTS
    from tests.test_sglang import ListStream
    from tests.workers.bridge import make_hf_checkpoint

    hf_dirs, _ = assets
    with open(os.path.join(ROOT, "configs/models/tiny_qwen3_moe.json")) as f:
        raw = json.load(f)
    raw.update(hidden_size=256, moe_intermediate_size=512, num_experts=32, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    cfg_path = tmp_path_factory.mktemp("digest_sized") / "config.json"
    cfg_path.write_text(json.dumps(raw))
    hf = load_hf_config(str(cfg_path))
    hf_dir = str(cfg_path.parent / "hf")
    make_hf_checkpoint(hf, hf_dir)
    for name in os.listdir(hf_dirs["configs/models/tiny_qwen3_moe.json"]):  # the tiny tokenizer
        if name.startswith(("tokenizer", "special", "vocab")):
            shutil.copy(os.path.join(hf_dirs["configs/models/tiny_qwen3_moe.json"], name), hf_dir)
    engine = SGLangEngine(SGLangEngineConfig(urls=[servers().url(hf_dir, "bfloat16", 2)], tp_size=2), hf)
    weights = [(n, t.to(torch.bfloat16)) for n, t in load_file(os.path.join(hf_dir, "model.safetensors")).items()]
    model_bytes = sum(t.numel() * 2 for _, t in weights)
    largest = max(t.numel() * 2 for _, t in weights)
    transport = TRANSPORTS.get("sglang_distributed").from_config(None, engine, engine.hf)
    try:
        stats = transport.sync(ListStream(weights, bucket=64))  # every tensor digest-verified
        assert stats["tensors"] == len(weights)
    finally:
        transport.close()
    peak = engine.digest_peak_bytes[engine.servers[0].url]
    print(f"digest hook at TP2: peak extra {peak / 2**20:.1f} MiB; model {model_bytes / 2**20:.1f} MiB, "
          f"largest tensor {largest / 2**20:.2f} MiB")
    assert model_bytes > 90e6 and largest < 2e6
    assert peak is not None and peak <= 4 * largest + (8 << 20), (peak, largest, model_bytes)


@pytest.mark.parametrize("recipe", RECIPES)
def test_shrink_keeps_every_knob(recipe, assets, tmp_path):
    """Only CHANGEABLE keys differ between the recipe and its shrink; every other value is the recipe's."""
    hf_dirs, prompts = assets
    urls = {t: ["http://127.0.0.1:1"] for t in hf_dirs}
    s = shrink(recipe, work=str(tmp_path), hf_dirs=hf_dirs, prompts=prompts, sglang_urls=urls)
    full = dict(_leaves(to_dict(load_config(os.path.join(ROOT, recipe)))))
    small = dict(_leaves(to_dict(load_config(os.path.join(ROOT, recipe), tuple(s.argv())))))
    changed = {k for k in full if full[k] != small[k]}
    assert all(map(changeable, changed)), {k for k in changed if not changeable(k)}
    assert all(map(changeable, s.overrides)) and 2 <= s.nproc <= 4
    print(s.describe())


def test_every_recipe_is_run():
    """Each recipe is in exactly one run, and every recipe of a run shrinks to the same config."""
    assert sorted(r for run in RUNS for r in run) == sorted(RECIPES)
    for run in RUNS:
        assert all(shrunk_config(r) == shrunk_config(run[0]) for r in run), run


# A run whose every part other runs make (CI time): recipe -> {the recipe of a run: the keys of the shrunk config
# that differ from it}. test_run_shown_by_others checks that each differs in exactly those keys, so that each of this
# run's values is run by one of them.
RUN_SHOWN_BY = {
    "configs/recipes/qwen3_30b_a3b_gspo_r3_2nodes.yaml": {
        # the same run with SAPO's loss: its bf16 rollout at this shape (EP, bf16, SGLang apart at TP2, 2 drivers)
        "configs/recipes/qwen3_30b_a3b_sapo_r3_2nodes.yaml": {"algorithm.loss.name", "algorithm.loss.eps_low",
                                                              "algorithm.loss.eps_high"},
        # the same run with FP8 servers (on the tiny model FP8 needs): its GSPO loss and clip range
        "configs/recipes/qwen3_30b_a3b_gspo_r3_fp8_2nodes.yaml": {"rollout.weights", "model.hf_config",
                                                                  "model.init_from_hf"}},
}


def test_run_shown_by_others():
    for recipe, others in RUN_SHOWN_BY.items():
        mine = shrunk_config(recipe)
        for other, keys in others.items():
            theirs = shrunk_config(other)
            assert {k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)} == keys, (recipe, other)
            assert other not in RUN_SHOWN_BY  # shown by runs that are run
        # every key that differs from one of them is the same in another
        for key in set().union(*others.values()):
            assert any(key not in keys for keys in others.values()), key


# Recipes whose resume is shown by other tests (CI time): recipe -> where.
RESUME_SHOWN_ELSEWHERE = {
    "configs/recipes/qwen3_30b_a3b_gspo_r3_2nodes.yaml":
        "the resume with SGLang servers apart: the learner's log-probs equal to the resumed servers' (the first sync "
        "gave them the checkpoint's weights) by test_sglang_trainer's launched-servers stop and resume, exact "
        "resumes at TP/EP/PP layouts with the distributed optimizer by test_checkpoint; the runs at this shape (EP, "
        "bf16, SGLang apart, 2 drivers: the SAPO and FP8 recipes', RUN_SHOWN_BY) train and save at its shrunk "
        "layout; the 1-node recipe's run resumes with SGLang (CI time)",
    "configs/recipes/qwen3_30b_a3b_gspo_r3_fp8_2nodes.yaml":
        "the resume with SGLang servers apart: the learner's log-probs equal to the resumed servers' (the first sync "
        "gave them the checkpoint's weights) by test_sglang_trainer's launched-servers stop and resume, exact "
        "resumes at TP/EP/PP layouts with the distributed optimizer by test_checkpoint (a resume restores the "
        "learner, whose weights the first sync after it quantises like any other: tests/test_fp8.py's syncs); this "
        "run (EP, a bf16 learner, FP8 servers apart at TP2, sglang_distributed) trains and saves at its shrunk "
        "layout; the 1-node recipe's run resumes with SGLang (CI time)",
    "configs/gpu_smoke.yaml":
        "its own resume through the CLI, as `make gpu-smoke` runs it (test_gpu_path's runs C and D: the checkpoint of "
        "a never-stepped distributed optimizer, resumed to step 1); exact resumes in bf16 with the distributed "
        "optimizer at TP/EP/PP by test_checkpoint and test_platform's pp2_glm_bf16_distopt: this run (embedded engine "
        "on one process, bf16, the distributed optimizer, GSPO + R3, in_process sync) trains and saves (CI time)",
    "configs/recipes/qwen3_30b_a3b_gspo_r3_32k_cp2_2nodes.yaml":
        "a checkpoint resumed at context parallelism 2 by test_trainer's test_resume_at_another_layout (the schedule "
        "where it left off, R3 agreement 1.0), CP's parity with the checkpoint's layout by test_context_parallel, and "
        "the resume with SGLang servers apart by test_sglang_trainer: this run (CP2 with packing and R3 on SGLang "
        "apart) trains and saves at its shrunk layout (CI time)",
    "configs/recipes/qwen3_30b_a3b_gspo_r3_lora_1node.yaml":
        "the resume of a LoRA run's adapter-only checkpoint onto its HF base, exact (test_trainer's "
        "test_lora_run_syncs_merged_weights_keeps_the_base_as_reference_and_resumes_exactly), and the colocated "
        "SGLang resume by the full-weight 1-node recipe's run: this run (LoRA on the colocated shape, the optimizer on "
        "the learner, merged weights to the launched server in process) trains and saves its adapters (CI time)",
    "configs/recipes/glm45_air_gspo_r3_8nodes.yaml":
        "the trainer's resume with SGLang, GSPO and R3 by the qwen3 GSPO recipe's run; this recipe's checkpoint "
        "(glm4_moe on two pipeline stages, one of them dense only, EP2, bf16, the distributed optimizer) saved, "
        "loaded into a fresh model and optimizer and continued exactly by test_platform.py's pp2_glm_bf16_distopt",
}


def _resume_shown_by(run) -> str | None:
    """An earlier run whose shrunk config equals this one's but for algorithm.*: its resume test covers this
    run's (a resume restores weights, optimizer, LR schedule, RNG and data position, none of which depends on
    the loss), so this run trains and checkpoints without a second launch (CI time). Or RESUME_SHOWN_ELSEWHERE."""
    if run[0] in RESUME_SHOWN_ELSEWHERE:
        return RESUME_SHOWN_ELSEWHERE[run[0]]

    def rest(r):
        return {k: v for k, v in shrunk_config(r).items() if not k.startswith("algorithm.")}

    mine = rest(run[0])
    for other in RUNS[:RUNS.index(run)]:
        if rest(other[0]) == mine:
            return _resume_shown_by(other) or other[0]  # what shows the other run's resume shows this one's
    return None


def test_tp2_server_digests_catch_corruption(assets, servers):
    """The recipes' SGLang layout (server tp_size 2, bf16): the digests computed inside the server (its two TP
    shards gathered and unfused to HF names) equal the sender's for every tensor -- fused q/k/v and expert w13
    included -- and a tensor altered in transit is caught, by name."""
    import torch
    from safetensors.torch import load_file

    from rlpo_mega.config import SGLangEngineConfig
    from rlpo_mega.rollout.sglang_engine import SGLangEngine
    from moe.bridge.digest import DigestMismatchError
    from rlpo_mega.weight_sync.transports import TRANSPORTS
    from tests.test_sglang import ListStream

    hf_dirs, _ = assets
    hf_dir = hf_dirs["configs/models/tiny_qwen3_moe.json"]
    engine = SGLangEngine(SGLangEngineConfig(urls=[servers().url(hf_dir, "bfloat16", 2)], tp_size=2),
                          load_hf_config(hf_dir))
    weights = [(n, t.to(torch.bfloat16)) for n, t in load_file(os.path.join(hf_dir, "model.safetensors")).items()]
    transport = TRANSPORTS.get("sglang_distributed").from_config(None, engine, engine.hf)
    try:
        stats = transport.sync(ListStream(weights, bucket=16))  # every tensor verified
        assert stats["tensors"] == len(weights) > 20
        for victim in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"):
            bad = ListStream(weights, bucket=16,
                             corrupt=lambda n, t, v=victim: t.clone().index_fill_(0, torch.tensor([0]), 0.5)
                             if n == v else t)
            with pytest.raises(DigestMismatchError, match="1 tensors") as e:
                transport.sync(bad)
            assert victim in str(e.value)
        transport.sync(ListStream(weights, bucket=16))  # restored for the recipes that share the server (next)
    finally:
        transport.close()


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("run", RUNS, ids=["+".join(os.path.basename(r)[:-5] for r in run) for run in RUNS])
def test_recipe_runs_checkpoints_and_resumes(run, assets, servers, tmp_path):
    recipe = run[0]  # the others of `run` shrink to this very config (test_every_recipe_is_run)
    if recipe in RUN_SHOWN_BY:
        print(f"run by: {', '.join(RUN_SHOWN_BY[recipe])} (test_run_shown_by_others)")
        return
    shrunk = _shrunk(recipe, tmp_path / "full", assets, servers)
    print(shrunk.describe())
    _train(recipe, shrunk)
    full = _history(shrunk.overrides["logging.dir"])
    assert [h["step"] for h in full] == [1, 2]
    save_dir = shrunk.overrides["checkpoint.save_dir"]
    step1 = os.path.join(save_dir, "step_00000001")
    assert os.path.isdir(step1) and os.path.isdir(os.path.join(save_dir, "step_00000002"))
    cfg = load_config(os.path.join(ROOT, recipe), tuple(shrunk.argv()))
    if cfg.model.lora.rank:  # on an HF base its checkpoints hold the adapters alone (model.lora.save=auto)
        from rlpo_mega.checkpoint.dist import read_meta

        meta = read_meta(step1)
        assert meta["adapters_only"] == cfg.model.adapters_only() is True, meta.get("adapters_only")
        assert meta["base"]["path"] == os.path.abspath(cfg.model.init_from_hf), meta["base"]
    if _resume_shown_by(run):
        print(f"resume shown by: {_resume_shown_by(run)}")
        return

    resumed_dir = tmp_path / "resumed"
    _train(recipe, shrunk, f"checkpoint.load_dir={step1}", f"logging.dir={resumed_dir / 'logs'}",
           f"checkpoint.save_dir={resumed_dir / 'ckpt'}")
    resumed = _history(resumed_dir / "logs")
    assert [h["step"] for h in resumed] == [2], resumed  # continued at step 2 from the saved state
    a, b = full[-1], resumed[-1]
    if cfg.rollout.engine == "embedded":  # same engine state, same RNG: the same step 2
        keys = sorted(k for k in a if not k.startswith(NOT_COMPARED) and isinstance(a[k], (int, float)))
        assert keys and {k: b.get(k) for k in keys} == {k: a[k] for k in keys}
    else:  # SGLang samples differently; the resumed weights reached the servers (the first sync verified)
        assert b["reward/mean"] == b["reward/mean"] and b["loss/policy"] == b["loss/policy"]  # not NaN
