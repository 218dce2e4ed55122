"""Device and collective discipline of the learner, checked on CPU (tests/workers/device_tracker.py).

A CUDA run refuses what a CPU run accepts: a host tensor in the model's inputs or in one op with a device
tensor, a host tensor handed to an NCCL collective. The tracker emulates that split (the accelerator is
`cpu:0`, the host `cpu`) with real arithmetic, and real trainer runs (2 processes: DP2 x EP2 with a KL
reference, R3 and TIS; PP2 with R2; PP2 PPO with a critic) must finish with nothing recorded: every tensor that reaches the
model, the loss, the routers or a collective is on platform.device().
"""
import pytest

from tests.dist import torchrun

pytestmark = pytest.mark.timeout(900)


def test_tracker_flags_what_cuda_refuses(tmp_path):
    """The check itself: a host tensor is caught in each place, a device tensor never (else the trainer
    test below could pass by seeing nothing)."""
    cases = torchrun("device_discipline.py", 1, str(tmp_path), "selfcheck", timeout=300)
    assert cases == {
        "mix_in_learner_code": 1, "same_device_in_learner_code": 0,
        "learner_batch_is_host": 1, "moved_batch_is_device": 1,
        "model_input_host": 1, "model_input_device": 0,
        "collective_host": 1, "collective_device": 0, "collective_host_on_gloo": 0,
        "router_host": 1,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return torchrun("device_discipline.py", 2, str(tmp_path_factory.mktemp("device")), timeout=900)


@pytest.mark.parametrize("run", ["ep2_grpo_kl_r3", "pp2_gspo_r2", "pp2_ppo_gae_r2"])
def test_trainer_keeps_every_tensor_on_the_device(runs, run):
    """Warm-up + 2 RL steps: no host tensor reaches the model, the loss, the routers or a collective."""
    r = runs[run]
    assert r["steps"] == 2
    found = [f"rank {rank}: {v['kind']} {v['what']} at {v['site']} (host tensor made at "
             f"{v['host_tensor_made_at']}) x{v['count']}" for rank, vs in r["violations"].items() for v in vs]
    assert not found, "host tensors where a CUDA run needs device tensors:\n" + "\n".join(found)
