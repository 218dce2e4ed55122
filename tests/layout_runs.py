"""One launch per layout for both layout parities: the policy's (tests/test_parity.py, workers/parity.py) and the
critic's (tests/test_critic.py, workers/critic_parity.py, run in the same processes after the policy families).

Both compare the same megatron layouts with the single process, and on this 2-core CPU a launch (N processes
importing torch, transformers and megatron-core) costs more than either comparison inside it (CI time). Results
are cached for the test session; each test reads its own files.
"""
from __future__ import annotations

import os

from tests.dist import torchrun

CONFIGS = {"qwen3_moe": "configs/models/tiny_qwen3_moe.json", "mixtral": "configs/models/tiny_mixtral.json",
           "glm4_moe": "configs/models/tiny_glm4_moe.json", "deepseek_v3": "configs/models/tiny_deepseek_v3.json"}
BASE = ("qwen3_moe", "mixtral")
ALL = tuple(CONFIGS)  # the sigmoid-router families at the layouts their issue names (TP2+SP, EP2, PP2)

LAYOUTS = {  # name: (processes, overrides, policy families, the critic too)
    "tp2_sp": (2, ["parallel.tensor=2"], ALL, True),
    "ep2": (2, ["parallel.expert=2"], ALL, True),
    "pp2_mb2": (2, ["parallel.pipeline=2", "parallel.num_micro_batches=2"], ALL, True),
    "tp2_ep2_etp1": (2, ["parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=1"], BASE, False),
    "tp2_ep2_etp2": (4, ["parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=2"], BASE, False),
    "tp2_ep2_pp2": (8, ["parallel.tensor=2", "parallel.expert=2", "parallel.pipeline=2",
                        "parallel.num_micro_batches=2"], BASE, True),
}
CRITIC_LAYOUTS = [name for name, (_, _, _, critic) in LAYOUTS.items() if critic]
# tests/test_lora.py: LoRA's parity (workers/lora_parity.py), at these
LORA_LAYOUTS = ("tp2_sp", "ep2", "pp2_mb2")
# tests/test_plan.py: the memory model against megatron-core's allocations (workers/plan_memory.py), at these
PLAN_MEMORY_LAYOUTS = ("tp2_sp", "ep2", "pp2_mb2", "tp2_ep2_pp2")

_RUNS: dict[str, str] = {}


def _models(families) -> str:
    return ",".join(CONFIGS[f] for f in families)


def reference_run(tmp_path_factory) -> str:
    """The single process (TP1): every family, then the critic and LoRA. Its directory: reference_<family>/...,
    critic/, lora/."""
    if "reference" not in _RUNS:
        root = str(tmp_path_factory.mktemp("parity_reference"))
        critic, lora = os.path.join(root, "critic"), os.path.join(root, "lora")
        os.makedirs(critic)
        os.makedirs(lora)
        torchrun("parity.py", 1, "reference", root, root, _models(ALL), json_report=False,
                 env={"RLPO_CRITIC_DIRS": f"{critic},{critic}", "RLPO_LORA_DIRS": f"{lora},{lora}"})
        _RUNS["reference"] = root
    return _RUNS["reference"]


def layout_run(name: str, tmp_path_factory) -> str:
    """Layout `name` (LAYOUTS) from the reference's initial weights. Its directory: layout_<family>.json,
    grads_<family>.pt, for CRITIC_LAYOUTS critic/, for LORA_LAYOUTS lora/ and for PLAN_MEMORY_LAYOUTS
    plan_memory/."""
    if name not in _RUNS:
        ref = reference_run(tmp_path_factory)
        nproc, overrides, families, critic = LAYOUTS[name]
        out = str(tmp_path_factory.mktemp(f"layout_{name}"))
        env = {}
        if critic:
            os.makedirs(os.path.join(out, "critic"))
            env["RLPO_CRITIC_DIRS"] = f"{os.path.join(ref, 'critic')},{os.path.join(out, 'critic')}"
        if name in LORA_LAYOUTS:
            os.makedirs(os.path.join(out, "lora"))
            env["RLPO_LORA_DIRS"] = f"{os.path.join(ref, 'lora')},{os.path.join(out, 'lora')}"
        if name in PLAN_MEMORY_LAYOUTS:
            os.makedirs(os.path.join(out, "plan_memory"))
            env["RLPO_PLAN_MEMORY_DIR"] = os.path.join(out, "plan_memory")
        torchrun("parity.py", nproc, "layout", ref, out, _models(families), *overrides, json_report=False, env=env)
        _RUNS[name] = out
    return _RUNS[name]


# The bridge (tests/test_bridge.py, workers/bridge.py) and the value model's bridge (tests/test_critic.py,
# workers/critic_bridge.py, after the policy families in the same processes), likewise.
BRIDGE_MODELS = ",".join(CONFIGS[f] for f in ALL)
CRITIC_BRIDGE_MODELS = ",".join(CONFIGS[f] for f in BASE)
BRIDGE_LAYOUTS = {  # name: (processes, overrides, the critic too)
    "tp1": (1, [], True),
    "tp2_ep2_etp2": (4, ["parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=2"], False),
    "tp2_ep2_pp2": (8, ["parallel.tensor=2", "parallel.expert=2", "parallel.pipeline=2",
                        "parallel.num_micro_batches=2"], True),
}
CRITIC_BRIDGE_LAYOUTS = [name for name, (_, _, critic) in BRIDGE_LAYOUTS.items() if critic]
_BRIDGE: dict[str, dict] = {}


def bridge_run(name: str, tmp_path_factory) -> dict:
    """{model_type: policy report, "critic:" + model_type: value-model report} at bridge layout `name`."""
    if name not in _BRIDGE:
        nproc, overrides, critic = BRIDGE_LAYOUTS[name]
        env = {"RLPO_CRITIC_MODELS": CRITIC_BRIDGE_MODELS} if critic else {}
        _BRIDGE[name] = torchrun("bridge.py", nproc, str(tmp_path_factory.mktemp(f"bridge_{name}")), BRIDGE_MODELS,
                                 *overrides, env=env)
    return _BRIDGE[name]
