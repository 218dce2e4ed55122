"""What a GPU run's processes start with, checked on the CPU (issue 59 item 7):

- SGLang servers started by launch/sglang_server.py (the trainer's `rollout.sglang.launch` and colocated servers,
  and the CLI in the sbatch server steps) do not inherit the learner's CUDA_DEVICE_MAX_CONNECTIONS=1
  (launch/slurm/common.sh exports it to the learners; one hardware queue per GPU serializes the streams SGLang
  overlaps) unless the server's own env sets it (rollout.sglang.env; SGLANG_ENV for the sbatch steps). Checked in
  the environment a started child process really has.
- A rank makes its GPU current (torch.cuda.set_device(LOCAL_RANK)) before anything may touch CUDA: before
  platform.apply() in rlpo_mega.distributed.init (it imports Transformer Engine) and, in `rlpo-mega train`,
  before the TE probe and the trainer's modules (megatron-core imports TE). The CUDA switch
  (torch.cuda.is_available) is patched to True and the calls recorded; the code under test runs as it is.
"""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from launch import sglang_server
from launch.sglang_server import SGLangServer, server_environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the servers' environment -------------------------------------------------------------------------------

def test_server_environment_drops_the_learners_max_connections():
    env = server_environment({"CUDA_DEVICE_MAX_CONNECTIONS": "1", "LOCAL_RANK": "3", "NCCL_DEBUG": "WARN",
                              "PATH": "/bin"})
    assert env == {"NCCL_DEBUG": "WARN", "PATH": "/bin"}


@pytest.fixture
def child_env(monkeypatch, tmp_path):
    """SGLangServer.start with a child that writes its environment to a file instead of running sglang (the real
    Popen, session, log and stop); no health wait. Returns a reader of the last child's environment."""
    out = tmp_path / "env.json"
    real_popen = subprocess.Popen

    def popen(cmd, **kw):
        assert cmd[1:4] == ["-m", "rlpo_sglang_keys", "sglang.launch_server"], cmd  # the key shim first
        dump = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
        return real_popen([sys.executable, "-c", dump], **kw)

    monkeypatch.setattr(sglang_server.subprocess, "Popen", popen)
    monkeypatch.setattr(SGLangServer, "wait_healthy", lambda self, timeout: self.proc.wait(30))
    monkeypatch.setattr(SGLangServer, "freeze_gc", lambda self: None)

    def read():
        return json.loads(out.read_text())

    return read


@pytest.mark.parametrize("own", [None, "1", 8])
def test_a_launched_server_starts_without_the_learners_max_connections(monkeypatch, tmp_path, child_env, own):
    """The trainer's launch (rlpo_mega/rollout/sglang_launch.py passes rollout.sglang.env as `env`): the learner's
    CUDA_DEVICE_MAX_CONNECTIONS=1 and torchrun's variables stay behind; the config's value (YAML may give a
    number) reaches the server."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("RLPO_TEST_KEPT", "yes")
    env = {} if own is None else {"CUDA_DEVICE_MAX_CONNECTIONS": own}
    server = SGLangServer("/m", port=1, log_dir=str(tmp_path), env=env)
    try:
        server.start(timeout=30)
    finally:
        server.stop(grace=5)
    got = child_env()
    assert got.get("CUDA_DEVICE_MAX_CONNECTIONS") == (None if own is None else str(own))
    assert "LOCAL_RANK" not in got and got["RLPO_TEST_KEPT"] == "yes"
    assert got["PYTHONPATH"].split(os.pathsep)[:2] == [os.path.join(ROOT, "launch"), ROOT]


@pytest.mark.parametrize("step_value", [None, "4"])
def test_the_cli_keeps_its_steps_setting(monkeypatch, tmp_path, child_env, step_value):
    """launch/sglang_server.py as the sbatch runs it: the server step's environment is the server's already
    (train_disaggregated.sbatch starts it without the learner's value; SGLANG_ENV may give one), so what the
    step has reaches the server as it is."""
    monkeypatch.setenv("RLPO_SGLANG_KEY", "k" * 32)  # the job's key (launch/slurm/common.sh exports one)
    if step_value is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", step_value)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = sglang_server.main(["--model-path", "/m", "--port", "1", "--timeout", "30",
                                 "--log-file", str(tmp_path / "server.log")])
    finally:
        for s, h in handlers.items():  # main() leaves them ignored, as a server step's last act
            signal.signal(s, h)
    assert rc == 0
    assert child_env().get("CUDA_DEVICE_MAX_CONNECTIONS") == step_value
    assert child_env()["RLPO_SGLANG_KEY"] == "k" * 32  # for the shim, which adds it to the server's own argv


# --- the rank's GPU before anything touches CUDA ----------------------------------------------------------

class _Stop(Exception):
    pass


@pytest.fixture
def cuda_calls(monkeypatch):
    """torch.cuda.is_available() -> True; torch.cuda.set_device recorded (nothing else of CUDA is reached)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setenv("LOCAL_RANK", "3")
    return calls


def test_init_binds_the_gpu_before_the_platform(monkeypatch, cuda_calls):
    """rlpo_mega.distributed.init: set_device(LOCAL_RANK) before platform.apply() (the TE import in
    moe.model.have_transformer_engine); apply is recorded and stops the run there."""
    from rlpo_mega import distributed, platform

    def apply():
        cuda_calls.append("platform.apply")
        raise _Stop

    monkeypatch.setattr(platform, "apply", apply)
    with pytest.raises(_Stop):
        distributed.init(parallel=None)
    assert cuda_calls == [("set_device", 3), "platform.apply"]


def test_rlpo_mega_train_binds_the_gpu_before_transformer_engine(monkeypatch, cuda_calls):
    """`rlpo-mega train` in a worker (LOCAL_RANK set): set_device before the TE probe, which imports
    transformer_engine.pytorch, and before the trainer's modules import megatron-core (and with it TE)."""
    import moe.model
    from rlpo_mega import cli

    def probe():
        cuda_calls.append("have_transformer_engine")
        raise _Stop

    monkeypatch.setattr(moe.model, "have_transformer_engine", probe)
    monkeypatch.setattr(cli, "die_with_parent", lambda: None)  # not on the test's own process
    with pytest.raises(_Stop):
        cli.main(["train", os.path.join(ROOT, "configs", "demo_cpu.yaml")])
    assert cuda_calls == [("set_device", 3), "have_transformer_engine"]


def test_without_cuda_nothing_is_bound(monkeypatch):
    from rlpo_mega import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device without CUDA"))
    distributed.bind_device()
