"""LoRA on the MoE policy (model.lora, moe/lora.py): the adapted model at TP2+SP (expert-TP 2), EP2 and PP2 against
the single process, its merged export against transformers, and the refusals of what is not built. The layouts run
in the policy parity's launches (tests/layout_runs.py, workers/lora_parity.py); the trainer with LoRA (the merged
sync, the KL reference with the adapters off, the resume) is tests/test_trainer.py's
test_lora_run_syncs_merged_weights_keeps_the_base_as_reference_and_resumes_exactly."""
from __future__ import annotations

import json
import os

import pytest
import torch

from moe.lora import LoRAError, LoRASpec, is_lora_param
from rlpo_mega.checkpoint.dist import read_whole
from moe.model import load_hf_config
from rlpo_mega.config import ConfigError, load_config
from rlpo_mega.config_checks import check_run_config
from tests.layout_runs import LORA_LAYOUTS, layout_run, reference_run
from tests.workers.lora_parity import FAMILIES

FROZEN_EMPTY = ("trainable_not_lora", "base_with_grad", "router_adapted", "optimizer_not_lora")


def _read(root, phase, family):
    with open(os.path.join(root, "lora", f"{phase}_{family}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory)


def test_the_reference_trains_only_its_adapters(reference):
    """At TP1: every base parameter frozen and out of the optimizer, no router adapted; the adapted linears of the
    tiny models: qwen3_moe's 2 layers (qkv, proj, 4 experts x (fc1, fc2)) with shared_outer's factors (per layer:
    2 x 2 attention + 2 shared + 4 x 2 the experts' own), glm4_moe's dense layer (qkv, proj, fc1, fc2) and MoE layer
    (qkv, proj, the shared experts' fc1/fc2, 8 experts x (fc1, fc2)) per_expert (A and B each); the loss falls over
    the 3 steps."""
    expected = {"qwen3_moe": (20, 28), "glm4_moe": (4 + 20, 2 * (4 + 20))}
    for family in FAMILIES:
        r = _read(reference, "reference", family)
        assert all(r["frozen"][k] == [] for k in FROZEN_EMPTY), r["frozen"]
        assert (r["frozen"]["adapted"], r["frozen"]["trainable"]) == expected[family], (family, r["frozen"])
        assert r["losses"][2] < r["losses"][0], r["losses"]


@pytest.mark.parametrize("layout", LORA_LAYOUTS)
def test_lora_layout_matches_single_process(layout, reference, tmp_path_factory):
    """From the reference's checkpoint (its adapters' B drawn non-zero, so A's gradient is seen; the factors resharded
    by their own checkpoint entries): the 3 steps' losses and every factor's first gradient equal the single
    process's (rel <= 1e-5, reloaded whole at TP1 from the layout's sharded save), the base frozen at the layout too,
    and the merged export (per shard, gathered by the weight sync's bridge) gives transformers' logits equal to the
    adapted learner's, which the adapters do move; the adapter sync's gather (rollout.lora_sync=adapter) gives every
    factor whole, equal to the checkpoint's. (Run in the policy parity's launch of this layout.)"""
    out = layout_run(layout, tmp_path_factory)
    for family in FAMILIES:
        ref, got = _read(reference, "reference", family), _read(out, "layout", family)
        for a, b in zip(ref["losses"], got["losses"]):
            assert abs(a - b) <= 1e-5 * abs(a), (family, ref["losses"], got["losses"])
        assert all(got["frozen"][k] == [] for k in FROZEN_EMPTY), got["frozen"]
        assert got["merged_logits_rel_err"] < 1e-5 and got["adapters_move_logits"] > 0.1, got
        # the adapter sync's gather (rollout.lora_sync=adapter): every factor whole, bit for bit the checkpoint's
        whole = read_whole(os.path.join(reference, "lora", f"init_{family}"), is_lora_param)
        gathered = torch.load(os.path.join(out, "lora", f"adapter_{family}.pt"))
        assert sorted(gathered) == sorted(whole), sorted(set(gathered) ^ set(whole))
        assert all(torch.equal(gathered[k], whole[k]) for k in whole), [k for k in whole
                                                                         if not torch.equal(gathered[k], whole[k])]
        want = torch.load(os.path.join(reference, "lora", f"grads_{family}.pt"))
        have = torch.load(os.path.join(out, "lora", f"grads_{family}.pt"))
        assert sorted(want) == sorted(have) and all(is_lora_param(n) for n in want), (sorted(want), sorted(have))
        for name, g in want.items():
            assert g.abs().max() > 0, name  # A's gradients too: B starts non-zero here
            err = float((have[name] - g).abs().max() / g.abs().max())
            assert err <= 1e-5, (family, layout, name, err)


def _check(*overrides, model="configs/models/tiny_qwen3_moe.json"):
    cfg = load_config("configs/demo_cpu.yaml", ("model.lora.rank=4", *overrides))
    return check_run_config(cfg, load_hf_config(model), log_warnings=False)


def test_lora_refusals_name_the_cause_and_the_fix():
    _check()  # the demo with adapters
    _check("model.lora.targets=[experts]", "model.lora.expert_layout=per_expert", "parallel.tensor=2")
    for overrides, match in ((("model.lora.dropout=0.1",), "only 0 is built"),
                             (("model.lora.alpha=0",), "must be > 0"),
                             (("model.lora.targets=[attention,router]",), "'router' is not known"),
                             (("model.lora.targets=[]",), "is empty"),
                             (("model.lora.expert_layout=shared", "parallel.tensor=2"), "use shared_outer or per_expert"),
                             (("model.lora.save=adapters",), "save=adapters without model.init_from_hf"),
                             (("critic.lora.rank=4",), "trains no critic: set algorithm.advantage.name=gae"),
                             (("critic.lora.rank=4", "critic.lora.dropout=0.1", "algorithm.advantage.name=gae",
                               "algorithm.loss.name=ppo_clip"), "critic.lora.dropout=0.1: only 0 is built"),
                             (("model.lora.rank=0", "critic.lora.rank=4", "critic.lora.save=adapters",
                               "algorithm.advantage.name=gae", "algorithm.loss.name=ppo_clip"),
                              "critic.lora.save=adapters without critic.init_from_hf, with a policy trained whole")):
        with pytest.raises(ConfigError, match=match):
            _check(*overrides)
    with pytest.raises(ConfigError, match="multi-latent attention"):
        _check(model="configs/models/tiny_deepseek_v3.json")
    with pytest.raises(ConfigError, match="expert_bias_update_rate=0.001 with model.lora.rank=4: LoRA keeps the base "
                                          "frozen, routers included"):
        _check("model.expert_bias_update_rate=0.001", "routing.mode=off", model="configs/models/tiny_glm4_moe.json")
    _check("model.lora.targets=[experts,shared_experts,dense_mlp]", model="configs/models/tiny_deepseek_v3.json")
    with pytest.raises(ConfigError, match="bad value for config key 'model.lora.expert_layout'"):
        load_config(None, ("model.lora.expert_layout=outer",))
    with pytest.raises(ConfigError, match="bad value for config key 'model.lora.save'"):
        load_config(None, ("model.lora.save=base",))
    with pytest.raises(LoRAError, match="rank 0 must be >= 1"):
        LoRASpec(rank=0, alpha=1.0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_peft_export_on_its_base_gives_the_learners_logits(family, reference, tmp_path):
    """`rlpo-mega export --peft-out` (convert.export_peft) of the reference's LoRA checkpoint, read whole from it
    without a model: peft 0.21 loads the adapter onto transformers' model of the HF base the learner was built from,
    every tensor it made is one the export wrote (none dropped, none left at peft's init), and its logits equal the
    adapted learner's (qwen3_moe: attention and the experts, shared_outer, whose shared factors go to every expert;
    glm4_moe: its dense layer, shared experts and experts per_expert); merged by peft, the same. The base alone is
    far from them (the adapters move the logits)."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlpo_mega.convert import export_peft
    from tests.workers.bridge import rel_err

    root = os.path.join(reference, "lora")
    out = tmp_path / "adapter"
    export_peft(os.path.join(root, f"init_{family}"), str(out))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_parameters"][-2:] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], config
    written = load_file(str(out / "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, f"base_{family}"), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(out))
    model.eval()
    held = get_peft_model_state_dict(model)
    assert sorted(held) == sorted(written), sorted(set(held) ^ set(written))[:6]
    assert all(torch.equal(held[k], written[k]) for k in held)
    want = torch.load(os.path.join(root, f"logits_{family}.pt"))
    with torch.no_grad():
        got = model(want["tokens"]).logits.double()
        with model.disable_adapter():
            base = model(want["tokens"]).logits.double()
        merged = model.merge_and_unload()(want["tokens"]).logits.double()
    assert rel_err(got, want["logits"]) < 1e-5 and rel_err(merged, want["logits"]) < 1e-5, \
        (rel_err(got, want["logits"]), rel_err(merged, want["logits"]))
    assert rel_err(base, want["logits"]) > 0.1


def test_a_peft_export_of_a_checkpoint_without_adapters_is_refused(reference, tmp_path):
    """A checkpoint saved without model.lora (here the reference's, its record of it removed): one line, nothing
    written."""
    import shutil

    from rlpo_mega.checkpoint.dist import CheckpointError
    from rlpo_mega.convert import export_peft

    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.join(reference, "lora", "init_qwen3_moe"), ckpt)
    meta = json.loads((ckpt / "rlpo_meta.json").read_text())
    meta["settings"]["model.lora"] = None
    (ckpt / "rlpo_meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="saved without model.lora"):
        export_peft(str(ckpt), str(tmp_path / "adapter"))
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_sglang_adapter_is_the_learners_adapter(family, reference, tmp_path_factory):
    """What rollout.lora_sync=adapter sends SGLang (moe/bridge/peft.sglang_adapter, of the reference's factors read whole
    from its checkpoint), read as SGLang 0.5.23 reads it -- PEFT's per-module keys, a MoE layer's experts as 3-D
    `<experts>.{gate,up,down}_proj` tensors [E or 1, ...] whose expert axis 1 is shared by every expert (lora/mem_pool.py)
    -- and merged into the base (W + alpha/r B A), gives the learner's own merged weights at TP2+SP (the weight sync's
    merged export of tests/workers/lora_parity.py): every adapted weight, and no other (qwen3_moe: attention and the
    experts, shared_outer; glm4_moe: its dense layer, the shared experts and the experts, per_expert)."""
    from safetensors.torch import load_file

    from moe.bridge.peft import sglang_adapter, sglang_adapter_numel, sglang_target_modules
    from rlpo_mega.rollout.sglang_launch import lora_server_args
    from tests.workers.bridge import rel_err

    def read(path):  # every tensor of an HF checkpoint directory
        return {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(path, f)).items()}

    root = os.path.join(reference, "lora")
    merged = read(os.path.join(layout_run("tp2_sp", tmp_path_factory), "lora", f"merged_{family}"))
    base = read(os.path.join(root, f"base_{family}"))
    hf = load_hf_config(FAMILIES[family][0])
    lora = load_config(None, ("model.lora.rank=4", "model.lora.alpha=8",
                              f"model.lora.expert_layout={FAMILIES[family][1]}")).model.lora
    factors = read_whole(os.path.join(root, f"init_{family}"), is_lora_param)
    config, tensors = sglang_adapter(hf, lora.rank, lora.alpha, lora.targets, factors)
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == sglang_target_modules(hf, lora.targets) == \
        lora_server_args(lora, hf)["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"]
    assert lora_server_args(lora, hf).get("experts_shared_outer_loras", False) == (FAMILIES[family][1] != "per_expert")
    # the planner's count of it (`rlpo-mega plan`'s refit line), from the HF shapes alone
    assert sum(t.numel() for t in tensors.values()) == sglang_adapter_numel(hf, 4, lora.targets, lora.expert_layout)
    scale = config["lora_alpha"] / config["r"]
    want = dict(base)
    experts = hf.num_experts if family == "qwen3_moe" else hf.n_routed_experts
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = tensors[key.replace("lora_A", "lora_B")]
        if a.dim() == 2:
            want[f"{module}.weight"] = base[f"{module}.weight"] + scale * b @ a
            continue
        assert a.shape[0] in (1, experts) and b.shape[0] in (1, experts), (key, a.shape, b.shape)
        head, leaf = module.rsplit(".", 1)
        for e in range(experts):
            name = f"{head}.{e}.{leaf}.weight"
            want[name] = base[name] + scale * b[min(e, b.shape[0] - 1)] @ a[min(e, a.shape[0] - 1)]
    assert sorted(want) == sorted(merged)
    changed = [k for k in base if not torch.equal(want[k], base[k])]
    assert changed and all(rel_err(want[k], merged[k]) < 1e-6 for k in want), \
        [(k, rel_err(want[k], merged[k])) for k in want if rel_err(want[k], merged[k]) >= 1e-6][:4]
    assert all(torch.equal(merged[k], base[k]) for k in base if k not in changed)


def _sync_check(*overrides, model="configs/models/tiny_qwen3_moe.json"):
    return _check("model.init_from_hf=hf_base", "rollout.engine=sglang", *overrides, model=model)


def test_the_adapter_sync_refusals_name_the_cause_and_the_fix():
    """rollout.lora_sync=adapter: refused in one line where the adapter has no engine that serves it or no way there;
    a hand-started server without the flags model.lora needs is refused before the first sync, naming them."""
    from types import SimpleNamespace

    from rlpo_mega.rollout import EngineError
    from rlpo_mega.rollout.sglang_engine import SGLangEngine

    _sync_check("rollout.lora_sync=adapter")
    _sync_check("rollout.lora_sync=adapter", "rollout.sync_transport=disk")
    for overrides, match in (
            (("model.lora.rank=0",), "without model.lora"),
            (("rollout.engine=embedded",), "rollout.engine=embedded takes merged weights only"),
            (("rollout.sync_transport=sglang_distributed",), "not over a weight-update group"),
            (("rollout.partial_rollout=true", "rollout.producer=async", "rollout.partial_rollout_kv=keep",
              "rollout.sglang.server_args.disable_radix_cache=true"), "partial_rollout_kv=keep"),
            (("rollout.sglang.launch=true", "rollout.sglang.server_args.max_lora_rank=64", "routing.mode=off"),
             "server_args.max_lora_rank with rollout.lora_sync=adapter"),
            (("rollout.sglang.server_args.lora_backend=csgmv",), "csgmv backend skips MoE layers")):
        with pytest.raises(ConfigError, match=match):
            _sync_check("rollout.lora_sync=adapter", *overrides)
    with pytest.raises(ConfigError, match="adapter beside a block-FP8 base is not built"):
        _sync_check("rollout.lora_sync=adapter", "rollout.weights=fp8", model="configs/models/tiny_qwen3_moe_fp8.json")
    with pytest.raises(ConfigError, match="bad value for config key 'rollout.lora_sync'"):
        load_config(None, ("rollout.lora_sync=delta",))

    hf = load_hf_config("configs/models/tiny_qwen3_moe.json")
    engine = SGLangEngine.__new__(SGLangEngine)
    engine.hf, engine.lora = hf, load_config(None, ("model.lora.rank=4",)).model.lora
    server = SimpleNamespace(url="http://10.0.0.7:30000")
    good = {"enable_lora": True, "max_lora_rank": 8, "experts_shared_outer_loras": True, "lora_backend": "triton",
            "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    engine._check_lora(server, good)
    for change, match in (({"enable_lora": False}, "LoRA is off"),
                          ({"lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]},
                           r"lack \['down_proj'\]"),
                          ({"max_lora_rank": 2}, "max_lora_rank=2 < model.lora.rank=4"),
                          ({"experts_shared_outer_loras": False}, "expert_layout=shared_outer"),
                          ({"lora_backend": "csgmv"}, "csgmv skips MoE layers")):
        with pytest.raises(EngineError, match=match) as e:
            engine._check_lora(server, {**good, **change})
        assert "--enable-lora" in str(e.value) and "--max-lora-rank 4" in str(e.value), e.value


def test_an_adapter_directory_is_replaced_whole_and_nothing_else_is(tmp_path):
    """rollout.lora_sync=adapter over the disk transport (and `export --peft-out`): each PEFT directory written into a
    fresh sibling and swapped in whole over the one rlpo-mega wrote before; a directory of anything else is refused,
    untouched, with nothing left beside it -- at the transport's construction, before any sync."""
    from safetensors.torch import load_file

    from moe.bridge.outputs import MARKER, OutputExistsError
    from moe.bridge.peft import CONFIG, WEIGHTS, write_dir
    from rlpo_mega.weight_sync.transports import DiskTransport

    path = tmp_path / "adapter"
    for value in (1.0, 2.0):
        write_dir(str(path), {"r": 1}, {"x.lora_A.weight": torch.full((1, 2), value)}, overwrite=True)
        assert sorted(os.listdir(path)) == [MARKER, CONFIG, WEIGHTS] and os.listdir(tmp_path) == ["adapter"]
    assert load_file(str(path / WEIGHTS))["x.lora_A.weight"].eq(2.0).all()
    with pytest.raises(OutputExistsError, match="holds an earlier peft_adapter output"):
        write_dir(str(path), {"r": 1}, {"x.lora_A.weight": torch.zeros(1, 2)})
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "adapter_config.json").write_text("{}")
    with pytest.raises(OutputExistsError, match="files rlpo-mega did not write"):
        write_dir(str(mine), {"r": 1}, {"x.lora_A.weight": torch.zeros(1, 2)}, overwrite=True)
    assert os.listdir(mine) == ["adapter_config.json"] and sorted(os.listdir(tmp_path)) == ["adapter", "mine"]
    sync = tmp_path / "sync"
    (tmp_path / "sync-lora_adapter").mkdir()
    (tmp_path / "sync-lora_adapter" / "notes.txt").write_text("mine")
    hf = load_hf_config("configs/models/tiny_qwen3_moe.json")
    with pytest.raises(OutputExistsError, match="sync-lora_adapter is not empty"):
        DiskTransport(None, str(sync), hf, adapters=True)
    assert (tmp_path / "sync-lora_adapter" / "notes.txt").read_text() == "mine"
