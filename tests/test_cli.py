"""`rlpo-mega` CLI: the torchrun command line (built, not run), `check`, `plot`, and config errors -> exit 2."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rlpo_mega import cli

ROOT = Path(__file__).resolve().parent.parent


def _train_args(*argv):
    return cli.build_parser().parse_args(["train", "configs/demo_cpu.yaml", "parallel.expert=2", *argv])


def test_torchrun_single_node():
    cmd = cli.torchrun_argv(_train_args("--nproc-per-node", "2"), env={})
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == ["--nnodes=1", "--nproc-per-node=2", "--standalone", "--max-restarts=0", "-m", "rlpo_mega.cli",
                       "train", "configs/demo_cpu.yaml", "parallel.expert=2"]


def test_overrides_after_options():
    args = cli.parse(["train", "configs/demo_cpu.yaml", "a.b=1", "--nproc-per-node", "2", "c.d=2", "e.f=3"])
    assert args.overrides == ["a.b=1", "c.d=2", "e.f=3"] and args.nproc_per_node == 2
    for bad in (["train", "configs/demo_cpu.yaml", "--nproc-per-node", "2", "stray"],
                ["export", "--ckpt", "c", "--hf-out", "h", "a.b=1"]):
        with pytest.raises(SystemExit):
            cli.parse(bad)


def test_the_agents_rendezvous_event_names_are_torchs_without_inspect():
    """The agent's stand-in for torch's get_method_name (cli._frame_method_name: the frame instead of
    inspect.stack(), seconds of the agent's CPU per run) names the same function at every depth, and the same
    fallback past the outermost frame."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def caller_of_record(name_of):
        def _record():
            return name_of()  # as torch's _record calls it: the default depth names _record's caller
        return _record()

    assert caller_of_record(cli._frame_method_name) == caller_of_record(dynamic_rendezvous.get_method_name) \
        == "caller_of_record"
    for depth in (2, 3, 10_000):  # (0 and 1 are the two functions themselves)
        assert cli._frame_method_name(depth) == dynamic_rendezvous.get_method_name(depth)
    assert cli._frame_method_name(10_000) == "no_method_name"


def test_torchrun_multi_node_flags():
    args = _train_args("--nproc-per-node", "8", "--nnodes", "4", "--node-rank", "3", "--master-addr", "n1",
                       "--master-port", "23456", "--rdzv-id", "job7", "--max-restarts", "2", "--log-dir", "logs/tr")
    cmd = cli.torchrun_argv(args, env={"MASTER_ADDR": "ignored", "NODE_RANK": "1"})
    assert cmd[3:-5] == ["--nnodes=4", "--nproc-per-node=8", "--node-rank=3", "--master-addr=n1",
                         "--master-port=23456", "--rdzv-id=job7", "--max-restarts=2", "--log-dir=logs/tr", "--tee=3"]
    assert cmd[-5:] == ["-m", "rlpo_mega.cli", "train", "configs/demo_cpu.yaml", "parallel.expert=2"]


def test_torchrun_multi_node_from_environment():
    cmd = cli.torchrun_argv(_train_args("--nnodes", "2", "--nproc-per-node", "8"),
                            env={"MASTER_ADDR": "n1", "MASTER_PORT": "20007", "NODE_RANK": "1", "SLURM_JOB_ID": "7"})
    assert "--node-rank=1" in cmd and "--master-addr=n1" in cmd and "--master-port=20007" in cmd
    assert "--rdzv-id=7" in cmd and "--standalone" not in cmd


def test_torchrun_bad_flags():
    with pytest.raises(ValueError, match="needs the rendezvous host"):
        cli.torchrun_argv(_train_args("--nnodes", "2"), env={})
    with pytest.raises(ValueError, match=r"--node-rank=2 must be in \[0, --nnodes=2\)"):
        cli.torchrun_argv(_train_args("--nnodes", "2", "--node-rank", "2", "--master-addr", "n1"), env={})


def test_train_multi_node_without_master_exits_2(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert cli.main(["train", "configs/demo_cpu.yaml", "--nnodes", "2"]) == 2
    assert "needs the rendezvous host" in capsys.readouterr().err


def test_train_config_error_exit_2(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["train", "configs/demo_cpu.yaml", "parallel.tensr=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlpo-mega train: config error:") and "Did you mean 'parallel.tensor'" in err


def test_train_trainer_config_error_exit_2(capsys, monkeypatch):
    """A ConfigError raised inside the trainer (its check_run_config) surfaces the same way."""
    import types

    from rlpo_mega.config import ConfigError

    def train(cfg):
        raise ConfigError("rollout.temperature=0.7 != algorithm.temperature=1.0")

    monkeypatch.chdir(ROOT)
    monkeypatch.setitem(sys.modules, "rlpo_mega.training.trainer", types.SimpleNamespace(train=train))
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert cli.main(["train", "configs/demo_cpu.yaml"]) == 2
    assert capsys.readouterr().err.strip() == \
        "rlpo-mega train: config error: rollout.temperature=0.7 != algorithm.temperature=1.0"
    monkeypatch.setitem(sys.modules, "rlpo_mega.training.trainer", types.SimpleNamespace(train=lambda cfg: 0))
    assert cli.main(["train", "configs/demo_cpu.yaml"]) == 0


def test_check_command(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    recipe = "configs/recipes/qwen3_30b_a3b_gspo_r3_2nodes.yaml"
    data = "prompts.path=configs/data/toy_add_train.jsonl"
    urls = "rollout.sglang.urls=[http://n3:30000,http://n3:30001]"  # one per rollout driver at least
    assert cli.main(["check", recipe, data, urls, "--world-size", "16"]) == 0
    assert f"{recipe}: ok at world size 16 (planned) (0 warnings)" in capsys.readouterr().out
    assert cli.main(["check", recipe, data, "--world-size", "24"]) == 2
    assert "rlpo-mega check: config error: " in capsys.readouterr().err
    # the recipe's own size (cluster.learner_nodes) is checked through `rlpo-mega plan`: a budget it exceeds
    # there is the check's failure, in one line
    assert cli.main(["check", recipe, data, urls, "cluster.gpu_memory_gb=50"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlpo-mega check: learner GPU every rank: ") and "50 GB budget" in err[0]
    assert cli.main(["check", recipe, data, "rollout.temperature=0.6"]) == 2
    assert "rollout.temperature=0.6 != algorithm.temperature=1.0" in capsys.readouterr().err


def test_plot_command(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": s, "reward/mean": s / 10}) + "\n"
                                               for s in range(1, 6)))
    out = tmp_path / "curves.png"
    assert cli.main(["plot", str(run), "--out", str(out), "--metrics", "reward/mean"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["plot", str(run), "--metrics", "reward/nope"]) == 2
    assert "rlpo-mega plot: " in capsys.readouterr().err


def test_torchrun_under_the_agent_exits_75_on_a_stop(tmp_path):
    """launch/torchrun.sh runs `rlpo-mega torchrun <torchrun's flags> ENTRY`: a SIGTERM to it reaches the workers,
    which save and exit 75, and so does the launcher (plain torchrun exits 1 whatever its workers did)."""
    import os
    import signal
    import subprocess
    import time

    worker = tmp_path / "w.py"
    worker.write_text("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
                      "open(sys.argv[1] + '.' + __import__('os').environ['RANK'], 'w').close()\ntime.sleep(60)\n")
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "rlpo_mega.cli", "torchrun", "--standalone", "--nproc-per-node=2",
                             str(worker), str(ready)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    assert "stopped by SIGTERM" in err
