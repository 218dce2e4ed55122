"""Bad input fails early with a message naming the numbers / key / fix: parallel layouts, model types,
config keys and values. Everything here runs in-process except one 2-process torchrun."""
import json
import os
import re
import time

import pytest

from moe.model import load_hf_config
from rlpo_mega.config import ConfigError, ParallelConfig, load_config
from rlpo_mega.distributed import ParallelLayoutError, resolve_layout
from tests.dist import ROOT, torchrun

QWEN = os.path.join(ROOT, "configs/models/tiny_qwen3_moe.json")  # 4 heads, 2 kv, 4 experts, 2 layers
MIXTRAL = os.path.join(ROOT, "configs/models/tiny_mixtral.json")


@pytest.fixture(scope="module")
def qwen():
    return load_hf_config(QWEN)


def layout_error(world, hf=None, **sizes) -> str:
    with pytest.raises(ParallelLayoutError) as e:
        resolve_layout(ParallelConfig(**sizes), world, hf)
    return str(e.value)


# ---- parallel layout -------------------------------------------------------------------------------

def test_good_layouts_resolve(qwen):
    lay = resolve_layout(ParallelConfig(tensor=2, expert=2, pipeline=2), 8, qwen)
    assert (lay.tensor, lay.expert, lay.pipeline, lay.data, lay.expert_data) == (2, 2, 2, 2, 1)
    assert lay.sequence_parallel and lay.expert_tensor == 2  # SP automatic with TP; ETP follows TP
    lay = resolve_layout(ParallelConfig(), 8, qwen)  # TP1 on 8 processes is DP8
    assert (lay.data, lay.sequence_parallel) == (8, False)


def test_world_not_divisible_by_tp_times_pp():
    msg = layout_error(6, tensor=4)
    assert "world size 6 is not divisible by tensor*pipeline = 4*1 = 4" in msg
    msg = layout_error(4, tensor=2, pipeline=3)
    assert "world size 4 is not divisible by tensor*pipeline = 2*3 = 6" in msg


def test_world_not_divisible_by_ep_etp_pp():
    msg = layout_error(4, expert=4, pipeline=2)
    assert "by tensor*pipeline" not in msg  # 1*2 divides 4
    assert "world size 4 is not divisible by expert*expert_tensor*pipeline = 4*1*2 = 8" in msg
    msg = layout_error(4, tensor=2, expert=2, expert_tensor=2, pipeline=2)
    assert "expert*expert_tensor*pipeline = 2*2*2 = 8" in msg


def test_model_shapes_not_divisible(qwen):
    msg = layout_error(3, qwen, tensor=3)
    assert "num_attention_heads=4 is not divisible by tensor=3" in msg
    assert "num_key_value_heads=2 is not divisible by tensor=3" in msg
    msg = layout_error(4, qwen, tensor=4)
    assert "num_key_value_heads=2 is not divisible by tensor=4" in msg
    assert "num_attention_heads" not in msg
    msg = layout_error(3, qwen, expert=3)
    assert "num_experts=4 is not divisible by expert=3" in msg
    msg = layout_error(4, qwen, pipeline=4)
    assert "num_hidden_layers=2 is not divisible by pipeline=4" in msg


def test_mixtral_expert_count_is_read_from_its_own_key():
    msg = layout_error(3, load_hf_config(MIXTRAL), expert=3)  # num_local_experts in HF's Mixtral
    assert "num_experts=4 is not divisible by expert=3" in msg


def test_all_problems_in_one_message(qwen):
    msg = layout_error(2, qwen, tensor=3)
    assert msg.startswith("bad parallel layout: ")
    for part in ("world size 2 is not divisible by tensor*pipeline = 3*1 = 3",
                 "num_attention_heads=4", "num_key_value_heads=2"):
        assert part in msg


def test_moe_tensor_parallel_needs_sequence_parallel(qwen):
    msg = layout_error(2, qwen, tensor=2, sequence_parallel=False)
    assert "tensor=2 with a MoE model requires sequence parallel" in msg
    assert "parallel.sequence_parallel=true" in msg
    msg = layout_error(2, qwen, sequence_parallel=True)
    assert "sequence_parallel=true needs tensor > 1" in msg


def test_sizes_below_one():
    msg = layout_error(2, tensor=0, expert=-1)
    assert "parallel.tensor=0 must be >= 1" in msg and "parallel.expert=-1 must be >= 1" in msg


def test_bad_layout_exits_before_any_process_group():
    """The real `rlpo-mega train` entry under torchrun, 2 processes, tensor=3: non-zero exit with the
    message on every rank and no process group (no hang on a collective)."""
    t0 = time.time()
    proc = torchrun("validate_layout.py", 2, "configs/demo_cpu.yaml", "parallel.tensor=3", expect_fail=True,
                    timeout=300, fresh=True)
    elapsed = time.time() - t0
    assert proc.returncode != 0
    err = proc.stderr
    # torchrun stops the other worker as soon as one fails, so it may not get to print: every rank
    # that did report must have refused before creating a process group.
    assert err.count("rlpo-mega train: config error: bad parallel layout: world size 2 is not divisible by "
                     "tensor*pipeline = 3*1 = 3") >= 1
    ends = re.findall(r"VALIDATE rank=(\d) rc=(\d+) process_group=(\w+)", err)
    assert ends and all(rc == "2" and pg == "False" for _, rc, pg in ends), err[-3000:]
    assert elapsed < 180  # imports only (slow on a loaded 2-core machine); a hang would hit the timeout


# ---- model type ------------------------------------------------------------------------------------

def test_unsupported_model_type_lists_supported(tmp_path):
    from moe.families import UnsupportedModelError

    cfg = json.load(open(QWEN))
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        load_hf_config(str(tmp_path))
    msg = str(e.value)
    assert "'llama' is not supported" in msg and "mixtral, qwen3_moe" in msg


# ---- config ----------------------------------------------------------------------------------------

def config_error(*overrides, path=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def test_config_overrides_apply():
    cfg = load_config(os.path.join(ROOT, "configs/demo_cpu.yaml"),
                      ("parallel.tensor=2", "parallel.expert_tensor=null", "optim.lr=1e-3"))
    assert (cfg.parallel.tensor, cfg.parallel.expert_tensor, cfg.optim.lr) == (2, None, 1e-3)
    assert cfg.parallel.expert == 2 and cfg.routing.mode == "r3"  # from the file


def test_unknown_key_suggests_the_close_one():
    msg = config_error("parallel.tensr=2")
    assert "unknown config key 'parallel.tensr'" in msg and "Did you mean 'parallel.tensor'?" in msg
    assert "Did you mean 'parallel'?" in config_error("paralel.tensor=2")
    msg = config_error("bogus=1")
    assert "unknown config key 'bogus'" in msg and "Known keys: " in msg and "parallel, " in msg


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("parallel:\n  tensr: 2\n")
    msg = config_error(path=str(path))
    assert str(path) in msg and "Did you mean 'parallel.tensor'?" in msg


def test_wrong_type_names_key_expected_type_and_value():
    msg = config_error("parallel.tensor=abc")
    assert msg.startswith("override 'parallel.tensor=abc': bad value for config key 'parallel.tensor' "
                          "(expected int)")
    assert "'abc'" in msg and "\n" not in msg  # no OmegaConf object dump
    assert "(expected bool or null)" in config_error("parallel.sequence_parallel=maybe")
    assert "(expected float)" in config_error("optim.lr=fast")


def test_malformed_overrides():
    for bad in ("parallel.tensor", "=2"):
        assert "is not of the form key=value (e.g. parallel.tensor=2)" in config_error(bad)
    msg = config_error("parallel=3")
    assert "'parallel' is a config section, not a value" in msg and "parallel.tensor" in msg


def test_missing_or_broken_config_file(tmp_path):
    assert "does not exist" in config_error(path=str(tmp_path / "nope.yaml"))
    path = tmp_path / "broken.yaml"
    path.write_text("parallel:\n  tensor: [2\n")
    assert "could not be parsed" in config_error(path=str(path))
