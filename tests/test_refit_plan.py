"""`rlpo-mega plan`'s refit table (rlpo_mega/planning/refit.py) at the recipes' real size: what each weight-sync
transport moves through the busiest learner GPU and into the busiest server GPU, and its link-bound time, against
what the transports do (the export's funnel through the drivers, the broadcast to the servers, the colocated
broadcast + CUDA IPC) and against the shard-to-shard plan (moe/bridge/reshard.py)."""
import os

import pytest
import torch

from moe.bridge.reshard import ModelSpec
from moe.model import load_hf_config
from rlpo_mega.config import load_config
from rlpo_mega.distributed import resolve_layout
from rlpo_mega.planning.refit import Links, placement, refit_plan
from rlpo_mega.planning.rows import GB
from rlpo_mega.rollout.sglang_engine import SGLangEngine
from tests.dist import ROOT

TWO_NODES = "configs/recipes/qwen3_30b_a3b_gspo_r3_2nodes.yaml"
ONE_NODE = "configs/recipes/qwen3_30b_a3b_gspo_r3_1node.yaml"
GLM = "configs/recipes/glm45_air_gspo_r3_8nodes.yaml"


def _refit(recipe, *over):
    cfg = load_config(os.path.join(ROOT, recipe), over)
    world = cfg.cluster.learner_nodes * cfg.cluster.gpus_per_node
    hf = load_hf_config(os.path.join(ROOT, cfg.model.hf_config))
    layout = resolve_layout(cfg.parallel, world, hf)
    refit = refit_plan(cfg, hf, layout, world, SGLangEngine.ranks(cfg, world))
    return cfg, world, refit, {r.transport: r for r in refit.rows}


@pytest.mark.parametrize("recipe", [TWO_NODES, GLM, "configs/recipes/qwen3_30b_a3b_gspo_r3_4nodes.yaml"],
                         ids=["qwen3_2nodes", "glm45_air_8nodes", "qwen3_4nodes"])
def test_disaggregated_recipes_refit(recipe):
    """Servers on nodes of their own: in_process cannot reach them; the recipe's sglang_distributed hands every server
    rank the whole model, the shard-to-shard plan each its own shard (no more), with the busiest learner GPU within
    1.25 x its even share of what all servers receive; every planned byte crosses a NIC, so the plan's time is its
    busiest GPU's bytes at the NIC's speed."""
    cfg, world, refit, rows = _refit(recipe)
    model = ModelSpec.of(load_hf_config(os.path.join(ROOT, cfg.model.hf_config)), torch.bfloat16).nbytes
    assert refit.model_bytes == model
    assert rows["in_process"].unavailable.startswith("servers on another node")
    dist, plan = rows["sglang_distributed"], rows["reshard"]
    assert dist.configured and not plan.configured and dist.unavailable is None and plan.unavailable is None
    assert dist.server_received == model  # the broadcast: whole tensors on every TP rank
    assert plan.server_received == plan.server_shard < model  # its own shard, every byte once
    servers = len(placement(cfg, world, SGLangEngine.ranks(cfg, world)).servers)
    assert plan.learner_sent <= 1.25 * servers * model / world
    nic = cfg.cluster.nic_gb_per_s * GB
    assert plan.seconds == pytest.approx(max(plan.learner_sent, plan.server_received) / nic)
    assert dist.seconds > 2 * plan.seconds and rows["disk"].seconds > dist.seconds


def test_qwen3_30b_a3b_two_nodes_refits_under_nemo_rls_figure():
    """The issue's mark: Qwen3-30B-A3B on the 2-node recipe under NeMo-RL's 0.74 s shard to shard at 50 GB/s per GPU
    NIC (4 servers x TP2 on the rollout node: each server GPU takes half of every expert, 30.5 GB, 0.61 s). Halving
    the NIC doubles it: the figure is the link's."""
    cfg, _, refit, rows = _refit(TWO_NODES)
    assert cfg.cluster.nic_gb_per_s == 50.0
    assert rows["reshard"].seconds < 0.74 and round(rows["reshard"].server_received / GB, 1) == 30.5
    _, _, _, slow = _refit(TWO_NODES, "cluster.nic_gb_per_s=25")
    assert slow["reshard"].seconds == pytest.approx(2 * rows["reshard"].seconds)
    assert slow["sglang_distributed"].seconds == pytest.approx(2 * rows["sglang_distributed"].seconds)


def test_colocated_recipe_refit():
    """One node, servers on the learner's GPUs: NCCL cannot join a server rank to the learner rank on its GPU, so no
    sglang_distributed; the recipe's in_process broadcasts every tensor to every learner rank (a ring over the node's
    8 GPUs: each GPU passes on 7/8 of the model, within the leaders' share) and hands it over by CUDA IPC; the plan
    moves only what the learner rank on a server GPU does not hold itself (same-GPU pieces are IPC), over NVLink."""
    cfg, world, refit, rows = _refit(ONE_NODE)
    assert rows["sglang_distributed"].unavailable.startswith("servers on the learner's GPUs")
    ipc, plan = rows["in_process"], rows["reshard"]
    assert ipc.configured and ipc.unavailable is None and plan.unavailable is None
    model = refit.model_bytes
    assert 7 / 8 * model <= ipc.server_received <= model and ipc.learner_sent <= model
    assert plan.server_received < plan.server_shard  # part of its shard is on its own GPU already
    nvlink = cfg.cluster.nvlink_gb_per_s * GB
    assert ipc.seconds == pytest.approx(max(ipc.learner_sent, ipc.server_received) / nvlink)
    assert plan.seconds < ipc.seconds


def test_links_count_each_direction_and_storage_after():
    """The link model itself: a copy on one GPU is free (CUDA IPC), one within a node is NVLink, across nodes the NIC;
    each direction is its own link; a checkpoint is written whole, then read (storage after the links)."""
    c = load_config(None, ("cluster.nvlink_gb_per_s=100", "cluster.nic_gb_per_s=10", "cluster.storage_gb_per_s=1",
                           "cluster.host_device_gb_per_s=20")).cluster
    links = Links()
    links.move((0, 0), (0, 0), 10 * GB)
    assert links.seconds(c) == 0 and not links.sent
    links.move((0, 0), (0, 1), 100 * GB)  # 1 s of NVLink
    links.move((0, 1), (0, 0), 100 * GB)  # the other direction: at the same time
    assert links.seconds(c) == pytest.approx(1.0)
    links.move((0, 0), (1, 0), 20 * GB)  # 2 s of NIC, beside the NVLink
    assert links.seconds(c) == pytest.approx(2.0)
    links.to_host((1, 0), 60 * GB)  # 3 s of PCIe
    assert links.seconds(c) == pytest.approx(3.0)
    links.storage[0][0] += 2 * GB
    links.storage[1][1] += 1 * GB
    assert links.seconds(c) == pytest.approx(3.0 + 2.0 + 1.0)
    assert links.sent[(0, 0)] == 120 * GB and links.received[(1, 0)] == 20 * GB
