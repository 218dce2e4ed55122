"""No command deletes what it did not create (issue 14, item 1; shared/notes/bad-inputs.md "Data lost"):
`export --hf-out` and `convert --out` refuse a non-empty directory with one line and exit 2, leaving it as it
was; `--overwrite` replaces only an earlier output of the same command, never a checkpoint, a save_dir or
other files; writes go to a fresh temporary sibling (a user's `<out>.tmp` is never touched)."""
import os
import subprocess
import sys

import pytest

from moe.bridge.outputs import MARKER, OutputExistsError, check_target, mark, swap_in, temp_sibling
from moe.model import load_hf_config
from tests.dist import ROOT

CFG = "configs/models/tiny_qwen3_moe.json"


def _user_dir(path, files=("notes.txt", "data/run.jsonl")):
    for name in files:
        p = path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"the user's {name}\n")
    return path


def _snapshot(path):
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(path) for f in files}


def _save_dir(path):
    (path / "step_00000040").mkdir(parents=True)
    (path / "step_00000040" / "trainer_state.pt").write_bytes(b"state")
    (path / "latest").write_text("step_00000040")
    return path


# ------------------------------------------------------------------ the rule (moe/bridge/outputs.py)
def test_check_target_rule(tmp_path):
    check_target(str(tmp_path / "absent"), "hf_export")
    (tmp_path / "empty").mkdir()
    check_target(str(tmp_path / "empty"), "hf_export")
    user = _user_dir(tmp_path / "user")
    for overwrite in (False, True):
        with pytest.raises(OutputExistsError, match="not empty .files rlpo-mega did not write"):
            check_target(str(user), "hf_export", overwrite)
        with pytest.raises(OutputExistsError, match="trainer save_dir .* never replaced"):
            check_target(str(_save_dir(tmp_path / f"save{overwrite}")), "hf_export", overwrite)
    ckpt = tmp_path / "step"
    ckpt.mkdir()
    (ckpt / "trainer_state.pt").write_bytes(b"x")
    with pytest.raises(OutputExistsError, match="trainer checkpoint"):
        check_target(str(ckpt), "dist_checkpoint", True)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "model.safetensors").write_bytes(b"x")
    mark(str(earlier), "hf_export")
    with pytest.raises(OutputExistsError, match="earlier hf_export output: .* --overwrite"):
        check_target(str(earlier), "hf_export")
    check_target(str(earlier), "hf_export", overwrite=True)
    with pytest.raises(OutputExistsError, match="a hf_export output"):  # another command's output
        check_target(str(earlier), "dist_checkpoint", overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExistsError, match="not a directory"):
        check_target(str(tmp_path / "file"), "hf_export", True)


def test_temp_sibling_and_swap_leave_other_names_alone(tmp_path):
    out = tmp_path / "out"
    users_tmp = _user_dir(tmp_path / "out.tmp")  # the old writer deleted exactly this
    users_old = _user_dir(tmp_path / "out.old")
    before = _snapshot(tmp_path / "out.tmp"), _snapshot(tmp_path / "out.old")
    for generation in range(2):
        tmp = temp_sibling(str(out))
        assert os.path.dirname(tmp) == str(tmp_path) and not os.listdir(tmp)
        (tmp_path / tmp / "w").write_text(str(generation))
        mark(tmp, "hf_export")
        swap_in(tmp, str(out))
        assert (out / "w").read_text() == str(generation)
    assert (_snapshot(users_tmp), _snapshot(users_old)) == before
    assert sorted(os.listdir(tmp_path)) == ["out", "out.old", "out.tmp"]


def test_interrupted_save_leftover_is_cleared_only_if_ours(tmp_path):
    from rlpo_mega.checkpoint.dist import PARTIAL, _clear_leftover

    ours = tmp_path / "ckpt.tmp"
    ours.mkdir()
    (ours / PARTIAL).touch()
    (ours / "shard").write_bytes(b"x")
    assert _clear_leftover(str(ours)) is None and not ours.exists()
    theirs = _user_dir(tmp_path / "other.tmp")
    why = _clear_leftover(str(theirs))
    assert "was not written by an rlpo-mega save" in why and "move it away" in why
    assert (theirs / "notes.txt").exists()


# ------------------------------------------------------------------ the commands
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rlpo_mega.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}, timeout=600)


@pytest.fixture
def refused(capsys):
    """Runs the CLI in this process (a refusal happens before any process group or torchrun) and checks: exit 2,
    one line on stderr naming each phrase."""
    from rlpo_mega.cli import main

    def check(argv, *phrases):
        rc = main(list(argv))
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
        for p in phrases:
            assert p in lines[0], lines[0]
    return check


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests.workers.bridge import make_hf_checkpoint

    root = tmp_path_factory.mktemp("outputs")
    make_hf_checkpoint(load_hf_config(os.path.join(ROOT, CFG)), str(root / "hf"))
    proc = _cli("convert", "--hf", str(root / "hf"), "--out", str(root / "dist"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def test_export_never_replaces_what_it_did_not_write(converted, tmp_path, refused):
    dist = str(converted / "dist")
    user = _user_dir(tmp_path / "mine")
    save = _save_dir(tmp_path / "ck")
    kept = _snapshot(user), _snapshot(save), _snapshot(dist)
    for flag in ((), ("--overwrite",)):
        refused(("export", "--ckpt", dist, "--hf-out", str(user), *flag), str(user), "did not write")
        refused(("export", "--ckpt", dist, "--hf-out", str(save), *flag), "save_dir", "never replaced")
        refused(("export", "--ckpt", dist, "--hf-out", dist, *flag), "dist_checkpoint output")
    assert (_snapshot(user), _snapshot(save), _snapshot(dist)) == kept

    out = tmp_path / "hf_out"
    users_tmp = _user_dir(tmp_path / "hf_out.tmp")
    assert _cli("export", "--ckpt", dist, "--hf-out", str(out)).returncode == 0
    assert (out / MARKER).is_file() and (out / "config.json").is_file()
    refused(("export", "--ckpt", dist, "--hf-out", str(out)), "earlier hf_export output", "--overwrite")
    first = _snapshot(out)
    proc = _cli("export", "--ckpt", dist, "--hf-out", str(out), "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _snapshot(out) == first  # the same checkpoint exported again
    assert (users_tmp / "notes.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["ck", "hf_out", "hf_out.tmp", "mine"]  # no temporary left


def test_convert_never_replaces_what_it_did_not_write(converted, tmp_path, refused):
    hf = str(converted / "hf")
    user = _user_dir(tmp_path / "mine")
    save = _save_dir(tmp_path / "ck")
    kept = _snapshot(user), _snapshot(save)
    for flag in ((), ("--overwrite",)):
        refused(("convert", "--hf", hf, "--out", str(user), *flag), "did not write")
        # checked by the launcher, once, before torchrun starts its 2 workers
        refused(("convert", "--hf", hf, "--out", str(save), "--tp", "2", *flag), "save_dir")
    assert (_snapshot(user), _snapshot(save)) == kept

    out = tmp_path / "dist"
    assert _cli("convert", "--hf", hf, "--out", str(out)).returncode == 0
    refused(("convert", "--hf", hf, "--out", str(out)), "earlier dist_checkpoint output", "--overwrite")
    proc = _cli("convert", "--hf", hf, "--out", str(out), "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / MARKER).is_file() and (out / "hf" / "config.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["ck", "dist", "mine"]


# ------------------------------------------------------------------ checkpoint directories (item 2)
def _step(save_dir, step, run):
    import json

    from rlpo_mega.checkpoint.dist import META
    from rlpo_mega.checkpoint.run import STATE_FILE, step_dir

    d = step_dir(str(save_dir), step)
    os.makedirs(d)
    open(os.path.join(d, STATE_FILE), "wb").close()
    with open(os.path.join(d, META), "w") as f:
        json.dump({"format": 1, "step": step, "run_id": run}, f)


def _ckpt_cfg(save_dir, **kw):
    from rlpo_mega.config import CheckpointConfig

    return CheckpointConfig(save_dir=str(save_dir), **kw)


def _earlier_run(tmp_path, steps=(40, 60, 80), run="A"):
    save = tmp_path / "ck"
    for s in steps:
        _step(save, s, run)
    (save / "latest").write_text(f"step_{steps[-1]:08d}")
    return save


def test_fresh_run_into_another_runs_save_dir_is_refused(tmp_path):
    from rlpo_mega.checkpoint.dist import CheckpointError
    from rlpo_mega.checkpoint.run import plan_checkpoints

    save = _earlier_run(tmp_path)
    with pytest.raises(CheckpointError) as e:
        plan_checkpoints(_ckpt_cfg(save, resume=False))
    msg = str(e.value)
    for way in ("step_00000040, step_00000060, step_00000080", "this run starts fresh", "checkpoint.resume=true",
                "new checkpoint.save_dir", "checkpoint.overwrite=true"):
        assert way in msg, msg
    plan = plan_checkpoints(_ckpt_cfg(save, resume=False, overwrite=True))
    assert plan.start is None and plan.stale == [40, 60, 80]
    plan = plan_checkpoints(_ckpt_cfg(save))  # resume=true: that run continues, nothing is stale
    assert plan.start.endswith("step_00000080") and (plan.step, plan.run_id, plan.stale) == (80, "A", [])
    # resuming an earlier step of it into the same save_dir: 60 and 80 are another timeline
    with pytest.raises(CheckpointError, match=r"step_00000060, step_00000080\) and this run continues"):
        plan_checkpoints(_ckpt_cfg(save, load_dir=str(save / "step_00000040")))
    _step(save, 20, "B")  # a step of yet another run
    with pytest.raises(CheckpointError, match=r"\(step_00000020\) and this run continues"):
        plan_checkpoints(_ckpt_cfg(save))


def test_latest_naming_a_missing_step_is_an_error(tmp_path):
    from rlpo_mega.checkpoint.dist import CheckpointError
    from rlpo_mega.checkpoint.run import plan_checkpoints

    save = _earlier_run(tmp_path, steps=(40,))
    (save / "latest").write_text("step_00000080")
    with pytest.raises(CheckpointError, match=r"latest names 'step_00000080', which is not a complete checkpoint "
                                              r"\(complete ones here: step_00000040\): set checkpoint.load_dir"):
        plan_checkpoints(_ckpt_cfg(save))
    import shutil

    shutil.rmtree(save / "step_00000040")  # only `latest` left: still an error, not a fresh start at step 0
    with pytest.raises(CheckpointError, match="complete ones here: none"):
        plan_checkpoints(_ckpt_cfg(save))


def test_keep_last_prunes_only_this_runs_older_steps(tmp_path):
    from rlpo_mega.checkpoint.run import complete_steps, prune

    save = _earlier_run(tmp_path, steps=(10, 20), run="A")
    _step(save, 5, "B")
    for s in (30, 40):
        _step(save, s, "A")
    assert prune(str(save), 40, "A", keep_last=2) == [10, 20] and complete_steps(str(save)) == [5, 30, 40]
    assert prune(str(save), 40, "A", keep_last=1) == [30] and complete_steps(str(save)) == [5, 40]
    # the old pruning by step number deleted the step just written when higher steps of another run were there
    _step(save, 90, "B")
    _step(save, 50, "A")
    assert prune(str(save), 50, "A", keep_last=1) == [40] and complete_steps(str(save)) == [5, 50, 90]
    # an explicit overwrite: the other run's steps go after this run's save
    assert prune(str(save), 50, "A", keep_last=1, stale=[5, 90]) == [5, 90] and complete_steps(str(save)) == [50]


def test_train_refuses_another_runs_save_dir_before_starting(tmp_path, refused):
    save = _earlier_run(tmp_path)
    kept = _snapshot(save)
    refused(("train", os.path.join(ROOT, "configs/demo_cpu.yaml"), f"checkpoint.save_dir={save}",
             "checkpoint.overwrite=false", f"logging.dir={tmp_path / 'logs'}", "--nproc-per-node", "2"),
            "holds checkpoints of another run", "checkpoint.overwrite=true")
    assert _snapshot(save) == kept and not (tmp_path / "logs").exists()  # torchrun never started
