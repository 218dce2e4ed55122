"""Defects of the CUDA path that a CPU can show (issue 27 item 1): each depends on what only a GPU machine has --
a Transformer Engine, a lazily-created optimizer state -- and is made visible here with a stand-in."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBCUDART = "libcudart.so.12: cannot open shared object file: No such file or directory"


def _stand_in_te(root, binding: str) -> str:
    """A `transformer_engine` package whose top level swallows its torch binding's failure, as TE's does; the
    binding's module body is `binding`. Returns the directory to put on PYTHONPATH."""
    pkg = root / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("try:\n    from . import pytorch  # noqa: F401\nexcept Exception:\n    pass\n")
    (pkg / "pytorch" / "__init__.py").write_text(binding)
    return str(root)


def _env(*paths):
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, ROOT]), "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore"}


def test_a_broken_transformer_engine_is_one_line_through_train(tmp_path):
    """A TE built for another CUDA (its binding raises OSError on import): `rlpo-mega train` stops with one line
    naming the failure and the two ways out, exit 2 -- it was an uncaught OSError from megatron's own import of
    megatron.core.extensions.transformer_engine on every rank (a test of `import transformer_engine` alone
    took this TE for a working one)."""
    te = _stand_in_te(tmp_path, f"raise OSError({LIBCUDART!r})\n")
    proc = subprocess.run([sys.executable, "-m", "rlpo_mega.cli", "train", "configs/demo_cpu.yaml",
                           "--nproc-per-node", "2", "train_iters=1", f"logging.dir={tmp_path / 'run'}",
                           f"checkpoint.save_dir={tmp_path / 'ckpt'}"],
                          cwd=ROOT, env=_env(te), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rlpo-mega ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = lines[0]
    for needle in ("rlpo-mega train: Transformer Engine is installed", "transformer_engine.pytorch does not load",
                   f"OSError: {LIBCUDART}", "pip uninstall transformer-engine", "local layer spec"):
        assert needle in line, (needle, line)


def test_transformer_engine_is_detected_by_its_working_binding(tmp_path):
    """Absent: False (megatron's local spec); a binding that loads: True (the TE spec)."""
    probe = "from moe.model import have_transformer_engine as h; print(h())"
    absent = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=120)
    assert absent.stdout.strip() == "False", absent.stderr[-2000:]
    te = _stand_in_te(tmp_path, "VERSION = 'stand-in'\n")
    working = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=_env(te), capture_output=True, text=True,
                             timeout=120)
    assert working.stdout.strip() == "True", working.stderr[-2000:]


def test_a_distributed_optimizer_checkpoint_before_the_first_step_with_a_lazy_optimizer(distopt_launch):
    """Apex's and TE's FusedAdam (what megatron-core picks on a GPU with TE) create exp_avg and exp_avg_sq at their
    first step: a save before it (SIGTERM during step 1's rollout, a save during the critic's warm-up) failed with
    KeyError 'exp_avg' in megatron's gather (distrib_optimizer.py:1068). Now it saves Adam's initial state without
    creating any, and both that checkpoint and one after a step resume exactly (tests/workers/ckpt_distopt.py, the
    launch tests/conftest.py shares with test_checkpoint.py)."""
    r = distopt_launch["lazy"]
    assert r["optimizer"] == ["LazyAdam"]
    assert r["state_after_save"] == 0
    assert r["resumed"]["loss1"] == r["ref"]["loss1"]
    assert r["resumed"]["loss2"] == r["ref"]["loss2"]
