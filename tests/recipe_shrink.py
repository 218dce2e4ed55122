"""Shrink a shipped recipe (configs/recipes/*.yaml, configs/demo_cpu.yaml, configs/gpu_smoke.yaml) to run on
this 2-core CPU, keeping every knob that decides *how* it trains.

What a shrink may change, and nothing else (`CHANGEABLE`; tests/test_recipes.py checks it):
  model size   model.hf_config -> the tiny config of the same family (configs/models/tiny_<family>.json; with
               rollout.weights=fp8, one whose projections are whole 128-blocks, tiny_<family>_fp8.json),
               model.init_from_hf -> a tiny HF checkpoint of it (made by the test, tokenizer inside)
  world size   parallel.tensor / pipeline / expert / context: every dimension > 1 becomes 2 (the tiny models have 4
               heads, 2 layers, 4 experts); data parallel 2 where the world allows (4 processes at most)
  batch        prompts.prompts_per_step, prompts.n_samples (<= 4), trainer.eval_size, trainer.warmup.steps
               (<= 2). Never the planner's knobs (parallel.num_micro_batches, trainer.max_tokens_per_micro_batch,
               trainer.layout): a shrink may not turn a refusal into a pass, and the planner's behaviour at the
               recipe's real size is tests/test_plan.py's (`rlpo-mega plan`)
  lengths      rollout.max_new_tokens
  run length   train_iters = 2 and checkpoint.save_every = 1 (a checkpoint at step 1, then a resume)
  host-only    paths (prompts, eval, save_dir, logging.dir), reward.num_workers, SGLang server URLs, the
               SGLang server's TP size above 2 becomes 2 (this CPU has 2 cores; the weight-update group is
               1 + servers x TP ranks either way), and rollout.sglang.drivers becomes 1 (the shrunk run is one
               node with one server; tests/test_sglang_trainer.py runs the trainer with 2 drivers). Servers the
               trainer launches (rollout.sglang.launch: the colocated recipe): one per node, started from the
               SGLang venv (rollout.sglang.python, base_port, log_dir, env.*) with the CPU server's arguments
               (server_args.*: device=cpu, the torch_native backend, a CPU-sized mem_fraction_static)
Everything else stays the recipe's: loss and its clip/gate settings, advantage, KL, mismatch correction,
routing mode, engine, weight transport and bucket size, optimizer kind (distributed optimizer) and
hyper-parameters, params dtype, sequence parallelism, expert-tensor size, recompute, token dispatcher,
checkpoint keep_last, mini-batches and epochs, temperatures, the SGLang server's timeouts (and TP size up to 2).
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHANGEABLE = {
    "model.hf_config", "model.init_from_hf",
    "parallel.tensor", "parallel.pipeline", "parallel.expert", "parallel.context",
    "prompts.prompts_per_step", "prompts.n_samples",
    "trainer.eval_size", "trainer.warmup.steps",
    "rollout.max_new_tokens",
    "train_iters", "checkpoint.save_every",
    "prompts.path", "trainer.eval_path", "checkpoint.save_dir", "checkpoint.resume", "logging.dir",
    "reward.num_workers", "rollout.sglang.urls", "rollout.sglang.tp_size", "rollout.sglang.drivers",
    "rollout.sglang.num_servers", "rollout.sglang.python", "rollout.sglang.base_port", "rollout.sglang.log_dir",
}
CHANGEABLE_PREFIXES = ("rollout.sglang.server_args.", "rollout.sglang.env.")  # a launched server's, host-only


def changeable(key: str) -> bool:
    return key in CHANGEABLE or key.startswith(CHANGEABLE_PREFIXES)
MAX_WORLD = 4


def tiny_config_for(hf_config: str, fp8_tp: int | None = None) -> str:
    """The repository's tiny config of the same model family (model_type) as `hf_config`; fp8_tp: one that SGLang
    servers at that TP size can hold in block FP8 (rollout.weights=fp8: every projection whole 128-blocks per rank,
    configs/models/tiny_qwen3_moe_fp8.json)."""
    from moe.bridge.fp8 import server_alignment_problem
    from moe.model import load_hf_config

    with open(os.path.join(ROOT, hf_config)) as f:
        model_type = json.load(f)["model_type"]
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "models", "tiny_*.json"))):
        with open(path) as f:
            if json.load(f)["model_type"] != model_type:
                continue
        if fp8_tp is None or server_alignment_problem(load_hf_config(path), fp8_tp) is None:
            return os.path.relpath(path, ROOT)
    raise LookupError(f"no configs/models/tiny_*.json of model_type {model_type!r} to shrink {hf_config} to"
                      + (f" that FP8 servers at TP{fp8_tp} can hold" if fp8_tp else ""))


def tiny_for_recipe(cfg: dict) -> str:
    """tiny_config_for the recipe's model and, with FP8 rollout, its shrunk servers' TP size (2 at most)."""
    fp8 = _get(cfg, "rollout.weights", "bf16") == "fp8"
    server_tp = min(_get(cfg, "rollout.sglang.tp_size", 1), 2)
    return tiny_config_for(_get(cfg, "model.hf_config"), server_tp if fp8 else None)


@dataclass
class Shrunk:
    recipe: str
    nproc: int
    overrides: dict = field(default_factory=dict)  # dotted key -> value
    why: dict = field(default_factory=dict)  # dotted key -> which allowance

    def set(self, key: str, value, why: str):
        assert changeable(key), f"the shrink may not change {key}"
        self.overrides[key] = value
        self.why[key] = why

    def argv(self) -> list[str]:
        out = []
        for k, v in self.overrides.items():
            if isinstance(v, list):
                v = "[" + ",".join(map(str, v)) + "]"
            elif isinstance(v, bool):
                v = str(v).lower()
            out.append(f"{k}={'null' if v is None else v}")
        return out

    def describe(self) -> str:
        return f"{self.recipe} on {self.nproc} processes: " + ", ".join(
            f"{k}={v} ({self.why[k]})" for k, v in self.overrides.items())


def _get(cfg: dict, key: str, default=None):
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def shrink(recipe: str, *, work: str, hf_dirs: dict, prompts: str, sglang_urls: dict | None = None,
           sglang_launch: dict | None = None) -> Shrunk:
    """`recipe` relative to the repository root. hf_dirs: tiny config path -> a tiny HF checkpoint directory;
    prompts: a JSONL the recipe's reward can score; sglang_urls: tiny config path -> server URLs; sglang_launch:
    dotted key -> value of a CPU server the trainer launches (python, base_port, log_dir, env.*, server_args.*)."""
    cfg = OmegaConf.to_container(OmegaConf.load(os.path.join(ROOT, recipe)), resolve=True)
    tp = _get(cfg, "parallel.tensor", 1)
    pp = _get(cfg, "parallel.pipeline", 1)
    ep = _get(cfg, "parallel.expert", 1)
    cp = _get(cfg, "parallel.context", 1)
    etp = _get(cfg, "parallel.expert_tensor", None) or tp
    tp2, pp2, ep2, cp2 = (2 if d > 1 else 1 for d in (tp, pp, ep, cp))
    etp2 = 2 if etp > 1 else 1
    dp = 2 if tp2 * pp2 * cp2 * 2 <= MAX_WORLD else 1
    world = tp2 * pp2 * cp2 * dp
    assert world % (ep2 * etp2 * pp2) == 0, (recipe, world, ep2, etp2, pp2)
    s = Shrunk(recipe, world)
    for key, old, new in (("parallel.tensor", tp, tp2), ("parallel.pipeline", pp, pp2), ("parallel.expert", ep, ep2),
                          ("parallel.context", cp, cp2)):
        if old != new:
            s.set(key, new, "world size")

    tiny = tiny_for_recipe(cfg)
    if _get(cfg, "model.hf_config") != tiny:
        s.set("model.hf_config", tiny, "model size")
    if _get(cfg, "model.init_from_hf"):
        s.set("model.init_from_hf", hf_dirs[tiny], "model size")

    # batch: n_samples <= 4, the fewest prompts that divide evenly over the recipe's mini-batches x data-parallel
    # ranks (x micro-batches for the padded layout, which splits rows evenly)
    n = min(_get(cfg, "prompts.n_samples", 4), 4)
    nmb = _get(cfg, "parallel.num_micro_batches", 1) if _get(cfg, "trainer.layout", "packed") == "padded" else 1
    unit = _get(cfg, "trainer.mini_batches", 1) * dp * nmb
    per_step = next(p for p in range(2, 1 << 12) if p * n % unit == 0)
    for key, old, new in (("prompts.n_samples", _get(cfg, "prompts.n_samples", 4), n),
                          ("prompts.prompts_per_step", _get(cfg, "prompts.prompts_per_step", 8), per_step)):
        if old != new:
            s.set(key, new, "batch size")
    if _get(cfg, "trainer.warmup.steps", 0) > 2:
        s.set("trainer.warmup.steps", 2, "batch size")
    if _get(cfg, "trainer.eval_every", 0):
        s.set("trainer.eval_size", 8, "batch size")
    if _get(cfg, "rollout.max_new_tokens", 16) > 4:
        s.set("rollout.max_new_tokens", 4, "lengths")

    s.set("train_iters", 2, "run length")
    s.set("checkpoint.save_every", 1, "run length")
    s.set("checkpoint.save_dir", os.path.join(work, "ckpt"), "host-only")
    s.set("checkpoint.resume", False, "host-only")
    s.set("logging.dir", os.path.join(work, "logs"), "host-only")
    if not os.path.exists(os.path.join(ROOT, str(_get(cfg, "prompts.path")))):
        s.set("prompts.path", prompts, "host-only")
    eval_path = _get(cfg, "trainer.eval_path")
    if eval_path and not os.path.exists(os.path.join(ROOT, eval_path)):
        s.set("trainer.eval_path", prompts, "host-only")
    if _get(cfg, "reward.num_workers", 1) > 1:
        s.set("reward.num_workers", 1, "host-only")
    if _get(cfg, "rollout.engine") == "sglang" and not _get(cfg, "rollout.sglang.launch", False):
        s.set("rollout.sglang.urls", list(sglang_urls[tiny]), "host-only")
    elif _get(cfg, "rollout.engine") == "sglang":
        for key, value in (sglang_launch or {}).items():
            s.set(key, value, "host-only")
        if _get(cfg, "rollout.sglang.num_servers", 1) > 1:
            s.set("rollout.sglang.num_servers", 1, "host-only")
    if _get(cfg, "rollout.sglang.tp_size", 1) > 2:
        s.set("rollout.sglang.tp_size", 2, "host-only")
    if _get(cfg, "rollout.sglang.drivers", 1) > 1:
        s.set("rollout.sglang.drivers", 1, "host-only")
    return s


def recipes() -> list[str]:
    """Every shipped recipe: a new YAML in configs/recipes/ is covered with no new test code. Also
    configs/gpu_smoke.yaml; configs/demo_cpu.yaml is not here, tests/test_trainer.py runs it as shipped (the demo
    learns; a resume equals the uninterrupted run) and most trainer tests start from it."""
    found = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "recipes", "*.yaml")))
    extra = [p for p in ("configs/gpu_smoke.yaml",) if os.path.exists(os.path.join(ROOT, p))]
    return extra + found


# What two recipes that train identically may still differ in: where they write, what the run is called, and the
# cluster they are sized for (cluster.*: read by `rlpo-mega plan` and `check`, never by the trainer).
NAMES = ("checkpoint.save_dir", "logging.dir", "logging.run_name")
SIZED_FOR = "cluster."


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def shrunk_config(recipe: str) -> dict:
    """The full config a recipe's shrink trains with (placeholder paths and URLs), minus NAMES."""
    from rlpo_mega.config import load_config, to_dict

    hf_dirs = {t: f"tiny/{os.path.basename(t)}" for t in glob.glob("configs/models/tiny_*.json", root_dir=ROOT)}
    urls = {t: ["http://sglang-server"] for t in hf_dirs}
    s = shrink(recipe, work="shrunk", hf_dirs=hf_dirs, prompts="prompts.jsonl", sglang_urls=urls,
               sglang_launch={"rollout.sglang.python": "sglang-python"})
    cfg = dict(_flat(to_dict(load_config(os.path.join(ROOT, recipe), tuple(s.argv())))))
    return {"nproc": s.nproc, **{k: v for k, v in cfg.items() if k not in NAMES and not k.startswith(SIZED_FOR)}}


def distinct_runs() -> list[list[str]]:
    """recipes() grouped by their shrunk config: recipes whose shrinks are the same run (e.g. the 2- and
    4-node variants of one recipe differ only in batch size, which the shrink sets) run once for all."""
    groups: list[tuple[dict, list[str]]] = []
    for r in recipes():
        cfg = shrunk_config(r)
        for seen, members in groups:
            if seen == cfg:
                members.append(r)
                break
        else:
            groups.append((cfg, [r]))
    return [members for _, members in groups]
