"""Bad input as a new user gives it (issue 14; shared/notes/bad-inputs.md): each case asserts the exit code, the
one line (printed once, no traceback) and that nothing was lost or left half-written.

Cheap cases run `rlpo-mega` in this process (cli.main: what the console script calls); the ones that need
processes (torchrun, signals, a killed rank, a full disk during a real save) run the real launcher.
Output directories: tests/test_output_safety.py; checkpoint ownership (save_dir of another run, keep_last,
`latest`): there too.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from rlpo_mega import cli
from tests.dist import ROOT, WORKERS, free_port

DEMO = "configs/demo_cpu.yaml"
QUICK = ("trainer.warmup.steps=0", "trainer.eval_every=0", "checkpoint.save_dir=null", "logging.mode=disabled",
         "logging.progress_bar=false", "parallel.expert=1", "logging.plot=false")
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def one_line(err: str, command: str, *needles: str) -> str:
    """The single `rlpo-mega <command>:` line of err, holding every needle; no traceback."""
    lines = [l for l in err.splitlines() if l.startswith("rlpo-mega ")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"rlpo-mega {command}: "), lines
    assert "Traceback" not in err, err[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def run_cli(capsys, monkeypatch, *argv):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RLPO_ERROR_FILE", raising=False)
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.err


def snapshot(path):
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(path) for f in files}


# ----------------------------------------------------------------------------------------- config
CONFIG_CASES = {
    "unknown key": (["parallel.tensr=2"], "Did you mean 'parallel.tensor'"),
    "wrong type": (["train_iters=many"], "train_iters"),
    "unknown loss": (["algorithm.loss.name=ppo2"], "algorithm.loss.name"),
    "soft_overlong without L_max": (["algorithm.shaping.soft_overlong=true"], "max_response_length"),
    "soft_overlong L_cache > L_max": (["algorithm.shaping.soft_overlong=true",
                                       "algorithm.shaping.max_response_length=4",
                                       "algorithm.shaping.overlong_cache=8"], "L_cache <= L_max"),
    "max_new_tokens beyond the context": (["rollout.max_new_tokens=100000"], "max_position_embeddings"),
    "prompts file missing": (["prompts.path=configs/data/absent.jsonl"], "prompts.path"),
    "hf_config missing": (["model.hf_config=configs/models/absent.json"], "model.hf_config"),
    "negative keep_last": (["checkpoint.keep_last=0"], "checkpoint.keep_last"),
    "layout does not divide": (["parallel.tensor=3", "--world-size", "2"], "world size 2"),
    "token budget below a sample": (["trainer.max_tokens_per_micro_batch=2"], "max_tokens_per_micro_batch"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_check_config(case, capsys, monkeypatch):
    overrides, needle = CONFIG_CASES[case]
    rc, err = run_cli(capsys, monkeypatch, "check", DEMO, *overrides)
    assert rc == 2
    one_line(err, "check", "config error", needle)


def test_config_file_errors(tmp_path, capsys, monkeypatch):
    rc, err = run_cli(capsys, monkeypatch, "check", str(tmp_path / "absent.yaml"))
    assert rc == 2 and "absent.yaml" in one_line(err, "check")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train_iters: [1, 2\nprompts: {")
    rc, err = run_cli(capsys, monkeypatch, "check", str(bad))
    assert rc == 2 and "bad.yaml" in one_line(err, "check")


def test_unsupported_model_type(tmp_path, capsys, monkeypatch):
    cfg = json.load(open(os.path.join(ROOT, "configs/models/tiny_qwen3_moe.json")))
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli(capsys, monkeypatch, "check", DEMO, f"model.hf_config={tmp_path}", "routing.mode=off")
    assert rc == 2
    one_line(err, "check", "'llama' is not supported")


@pytest.mark.parametrize("argv, needle", [
    (["--nproc-per-node", "0"], "--nproc-per-node=0"),
    (["--nproc-per-node", "2", "parallel.tensor=3"], "world size 2"),  # before torchrun starts
])
def test_launcher_refuses_before_torchrun(argv, needle, capsys, monkeypatch):
    t0 = time.monotonic()
    rc, err = run_cli(capsys, monkeypatch, "train", DEMO, *QUICK, *argv)
    assert rc == 2 and time.monotonic() - t0 < 60
    one_line(err, "train", needle)


# ------------------------------------------------------------------------------------------- data
DATA_CASES = {
    "empty file": ("empty.jsonl", b"", "empty"),
    "malformed JSON": ("bad.jsonl", b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": \n', "line 2"),
    "missing field": ("nofield.jsonl", b'{"question": "1+1", "answer": "2"}\n', "prompt"),
    "wrong answer type": ("type.jsonl", b'{"prompt": "1+1", "answer": true}\n', "answer"),
    "not UTF-8": ("latin.jsonl", b'{"prompt": "caf\xe9", "answer": "2"}\n', "UTF-8"),
    "not Parquet": ("fake.parquet", b"PAR1 this is not parquet", "fake.parquet"),
    "prompt longer than the context": ("long.jsonl",
                                       json.dumps({"prompt": "1+" * 300, "answer": "2"}).encode() + b"\n",
                                       "max_position_embeddings"),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_data_file_refused_before_the_model_is_built(case, tmp_path, capsys, monkeypatch):
    name, data, needle = DATA_CASES[case]
    (tmp_path / name).write_bytes(data)
    t0 = time.monotonic()
    rc, err = run_cli(capsys, monkeypatch, "train", DEMO, *QUICK, f"prompts.path={tmp_path / name}")
    assert rc == 2
    one_line(err, "train", needle)
    assert time.monotonic() - t0 < 60  # no process group, no model: the data is read first


def test_unknown_rollout_producer_is_one_error_before_the_model_is_built(capsys, monkeypatch):
    rc, err = run_cli(capsys, monkeypatch, "train", DEMO, *QUICK, "rollout.producer=streaming")
    assert rc == 2
    one_line(err, "train", "rollout.producer='streaming' is not known; known: async, sync.")


@pytest.mark.parametrize("which", ["trainer.warmup.path", "trainer.eval_path"])
def test_warmup_and_eval_files_checked_up_front(which, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1"}\n{"prompt": 5, "answer": "2"}\n')
    on = "trainer.warmup.steps=1" if "warmup" in which else "trainer.eval_every=1"
    rc, err = run_cli(capsys, monkeypatch, "train", DEMO, *QUICK, on, f"{which}={bad}")
    assert rc == 2
    one_line(err, "train", "bad.jsonl")


# ------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A real dist checkpoint (rlpo-mega convert of a tiny HF model) and one converted from NaN weights."""
    from moe.model import load_hf_config
    from tests.workers.bridge import make_hf_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    hf = load_hf_config(os.path.join(ROOT, "configs/models/tiny_qwen3_moe.json"))
    make_hf_checkpoint(hf, str(root / "hf"))
    shutil.copytree(root / "hf", root / "hf_nan")
    from safetensors.torch import load_file, save_file

    file = next(f for f in os.listdir(root / "hf_nan") if f.endswith(".safetensors"))
    tensors = load_file(str(root / "hf_nan" / file))
    name = next(n for n in tensors if "layers.1.self_attn.o_proj" in n)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(root / "hf_nan" / file), metadata={"format": "pt"})
    for src, out in (("hf", "dist"), ("hf_nan", "dist_nan")):
        proc = subprocess.run([sys.executable, "-m", "rlpo_mega.cli", "convert", "--hf", str(root / src), "--out",
                               str(root / out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _copy(ckpt, tmp_path, name="dist"):
    shutil.copytree(ckpt / name, tmp_path / name)
    return tmp_path / name


def _shard(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]


def _verify(path):
    from rlpo_mega.checkpoint.dist import read_meta
    from rlpo_mega.checkpoint.files import verify_files

    return verify_files(str(path), read_meta(str(path))["files"])


def test_checkpoint_records_every_file_and_the_model(ckpt):
    from rlpo_mega.checkpoint.dist import read_meta
    from rlpo_mega.checkpoint.files import checkpoint_files

    meta = read_meta(str(ckpt / "dist"))
    assert set(meta["files"]) == set(checkpoint_files(str(ckpt / "dist"), skip=("rlpo_meta.json",)))
    assert meta["model"]["model_type"] == "qwen3_moe" and meta["model"]["num_experts"] == 4
    assert _verify(ckpt / "dist") is None


@pytest.mark.parametrize("damage, needle", [
    ("truncate", "is truncated or changed"),
    ("flip", "is corrupted"),
    ("delete", "is missing"),
    ("truncate_state", "is truncated or changed"),
])
def test_damaged_checkpoint_file_is_named(damage, needle, ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    victim = path / (_shard(path) if damage != "truncate_state" else "common.pt")
    data = victim.read_bytes()
    if damage == "delete":
        victim.unlink()
    elif damage == "flip":
        victim.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])  # same size, one byte changed
    else:
        victim.write_bytes(data[:len(data) // 2])
    problem = _verify(path)
    assert problem and str(victim) in problem and needle in problem and "checkpoint.verify=false" in problem


def test_unreadable_meta_is_one_error(ckpt, tmp_path):
    from rlpo_mega.checkpoint.dist import CheckpointError, read_meta

    path = _copy(ckpt, tmp_path)
    (path / "rlpo_meta.json").write_text('{"format": 1, "has_opt')
    with pytest.raises(CheckpointError, match="rlpo_meta.json is unreadable"):
        read_meta(str(path))


def test_export_of_a_corrupted_checkpoint(ckpt, tmp_path):
    """Through the real CLI: one line naming the file, exit 2, no output directory."""
    path = _copy(ckpt, tmp_path)
    victim = path / _shard(path)
    victim.write_bytes(victim.read_bytes()[:-64])
    proc = subprocess.run([sys.executable, "-m", "rlpo_mega.cli", "export", "--ckpt", str(path), "--hf-out",
                           str(tmp_path / "out")], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    one_line(proc.stderr, "export", str(victim), "truncated")
    assert not (tmp_path / "out").exists()


def test_non_finite_weights_refused_at_load(ckpt, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlpo_mega.cli", "export", "--ckpt", str(ckpt / "dist_nan"),
                           "--hf-out", str(tmp_path / "out")], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    one_line(proc.stderr, "export", "NaN/inf", "linear_proj")
    assert not (tmp_path / "out").exists()


def _as_trainer_checkpoint(src, save_dir, step=3, meta_update=None):
    """A converted checkpoint arranged as a trainer's step directory (what plan_checkpoints reads)."""
    d = save_dir / f"step_{step:08d}"
    shutil.copytree(src, d)
    (d / "trainer_state.pt").write_bytes(b"state")
    meta = json.loads((d / "rlpo_meta.json").read_text())
    meta.update({"step": step, "run_id": "r1", **(meta_update or {})})
    (d / "rlpo_meta.json").write_text(json.dumps(meta))
    (save_dir / "latest").write_text(d.name)
    return d


@pytest.mark.parametrize("overrides, meta_update, needle", [
    (["model.hf_config=configs/models/tiny_mixtral.json"], None, "model_type is 'qwen3_moe' in the checkpoint"),
    ([], {"model": None, "model_type": "mixtral"}, "model_type is 'mixtral' in the checkpoint"),  # before identities
    ([], {"model": {"model_type": "qwen3_moe", "num_hidden_layers": 4}}, "num_hidden_layers is 4"),
    ([], {"model": {"model_type": "qwen3_moe", "num_experts": 8}}, "num_experts is 8"),
])
def test_resume_with_another_model_is_refused(overrides, meta_update, needle, ckpt, tmp_path, capsys, monkeypatch):
    save = tmp_path / "ck"
    step = _as_trainer_checkpoint(ckpt / "dist", save, meta_update=meta_update)
    kept = snapshot(save)
    for command, extra in (("check", ()), ("train", ("trainer.warmup.steps=0", "trainer.eval_every=0",
                                                    "logging.mode=disabled", "parallel.expert=1"))):
        rc, err = run_cli(capsys, monkeypatch, command, DEMO, *extra, *overrides, f"checkpoint.save_dir={save}",
                          "checkpoint.resume=true")
        assert rc == 2
        one_line(err, command, "written for another model", needle, str(step))
    assert snapshot(save) == kept


# ----------------------------------------------------------------------------- routing payloads
@pytest.mark.parametrize("payload, needle", [
    ("not base64!!", "not valid base64"),
    (None, "routed_experts is NoneType"),
    ({"ids": [1]}, "expected base64"),
])
def test_bad_routing_payload_names_the_cause(payload, needle):
    from moe.routing.trace import RoutingTraceError, TraceSpec
    from rlpo_mega.rollout.sglang_client import decode_routes

    spec = TraceSpec(num_experts=4, topk=2, moe_layers=(0, 1))
    with pytest.raises(RoutingTraceError, match=needle):
        decode_routes(payload, 2, spec)


def test_routes_of_another_layer_count_say_so():
    import base64

    import numpy as np

    from moe.routing.trace import RoutingTraceError, TraceSpec
    from rlpo_mega.rollout.sglang_client import decode_routes

    spec = TraceSpec(num_experts=4, topk=2, moe_layers=(0, 1))
    four_layers = base64.b64encode(np.zeros(5 * 4 * 2, dtype="<i4").tobytes()).decode()  # 5 tokens, 4 layers
    with pytest.raises(RoutingTraceError, match=r"4 layers x top-2 per token; model.hf_config has num_hidden_layers=2"):
        decode_routes(four_layers, 2, spec, tokens=5)


def test_failed_rewards_are_on_the_console_line():
    from rlpo_mega.logging import format_console_line

    line = format_console_line(3, {"reward/mean": 0.0, "reward/failed": 32, "reward/samples": 32})
    assert "REWARD FAILED 32/32" in line


# --------------------------------------------------------------------------------------- disk full
def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path):
    """A real save (1 process) that runs out of space -- in megatron's shard writing, then in `latest`: one
    CheckpointError naming the cause, no .tmp, the previous step and `latest` intact and verified."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                           os.path.join(WORKERS, "disk_full.py"), str(tmp_path / "ck")],
                          cwd=ROOT, env={**ENV, "RLPO_REPORT": str(tmp_path / "r.json")}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert "no space left on device" in r["shard_error"] and "previous checkpoint and `latest` are intact" in r["shard_error"]
    assert "could not point" in r["latest_error"] and "still names the previous checkpoint" in r["latest_error"]
    assert "could not point" in r["resave_error"]  # and step_1, which `latest` names, was kept (below)
    assert r["after"] == ["latest", "step_00000001"], r["after"]  # no step_2, no .tmp, no latest.tmp
    assert r["latest"] == "step_00000001" and r["verified"] is None


# ------------------------------------------------------------------------------ signals, processes
def _tagged(tag):
    """PIDs of live processes whose environment holds tag (every process a run started)."""
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/environ", "rb") as f:
                    if tag.encode() in f.read():
                        pids.append(int(p))
            except OSError:
                pass
    return pids


def _launch(tmp_path, *overrides, nproc=2):
    tag = f"RLPO_TEST_TAG={uuid.uuid4().hex}"
    key, value = tag.split("=")
    args = [DEMO, "train_iters=500", "prompts.prompts_per_step=4", "prompts.n_samples=4", "trainer.eval_every=0",
            "logging.mode=disabled", f"logging.dir={tmp_path / 'run'}", "logging.progress_bar=false", *overrides]
    args = list(args)
    proc = subprocess.Popen([sys.executable, "-m", "rlpo_mega.cli", "train", *args, "--nproc-per-node", str(nproc)],
                            start_new_session=True,
                            cwd=ROOT, env={**ENV, key: value}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    return proc, tag, args


def _wait_for(cond, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        time.sleep(0.3)
    assert cond()


def _no_orphans(tag, timeout=15):
    deadline = time.monotonic() + timeout
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not _tagged(tag), _tagged(tag)


def test_sigterm_to_the_launcher_saves_and_resumes(tmp_path):
    """SIGTERM to `rlpo-mega` (what SLURM preemption sends to the batch step): every worker finishes its step
    and saves, the run exits 75, nothing is left running; the same command continues from the save."""
    ck = tmp_path / "ckpt"
    proc, tag, args = _launch(tmp_path, "trainer.warmup.steps=0", f"checkpoint.save_dir={ck}", "checkpoint.save_every=0",
                              "checkpoint.resume=true")
    metrics = tmp_path / "run" / "metrics.jsonl"
    _wait_for(lambda: proc.poll() is not None or (metrics.exists() and len(metrics.read_text().splitlines()) >= 2))
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=200)
    assert proc.returncode == 75, output[-3000:]
    assert "stopped by signal after step" in output and "stopped by SIGTERM" in output, output[-3000:]
    _no_orphans(tag)
    from rlpo_mega.checkpoint.run import complete_steps

    saved = complete_steps(str(ck))
    assert len(saved) == 1 and saved[0] >= 2, saved
    from rlpo_mega.checkpoint.dist import read_meta

    meta = read_meta(str(ck / f"step_{saved[0]:08d}"))  # the model and the run's key settings are recorded
    assert meta["model"]["model_type"] == "qwen3_moe" and meta["settings"]["algorithm.loss.name"] == "gspo"
    # the pre-emption window holds the save and nothing more: each checksum taken as its file was written
    assert meta["files"] and all(size > 0 and isinstance(digest, str) and len(digest) == 16
                                 for size, digest in meta["files"].values())
    args[1] = f"train_iters={saved[0] + 1}"
    done = subprocess.run([sys.executable, "-m", "rlpo_mega.cli", "train", *args, "algorithm.loss.name=sapo",
                           "--nproc-per-node", "2"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stderr + done.stdout
    assert "resumed from" in out and "resuming with algorithm.loss.name=sapo; the run that saved" in out, out[-3000:]


def test_sigterm_during_warmup_is_honoured_within_a_warmup_step(tmp_path):
    proc, tag, _ = _launch(tmp_path, "trainer.warmup.steps=100000", "checkpoint.save_dir=null")
    out = []
    import threading

    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    _wait_for(lambda: proc.poll() is not None or any("warm-up step" in l for l in list(out)))
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    reader.join(10)
    text = "".join(out)
    assert proc.returncode == 75, text[-3000:]
    assert "stopped by signal at warm-up step" in text and time.monotonic() - t0 < 60
    _no_orphans(tag)


def test_killed_rank_ends_the_run_and_leaves_nothing(tmp_path):
    """SIGKILL of one worker: the run ends (exit 1, the rank named), no helper process of any rank stays."""
    proc, tag, _ = _launch(tmp_path, "trainer.warmup.steps=0", f"checkpoint.save_dir={tmp_path / 'ck'}",
                           "checkpoint.save_every=1")
    metrics = tmp_path / "run" / "metrics.jsonl"
    _wait_for(lambda: proc.poll() is not None or (metrics.exists() and len(metrics.read_text().splitlines()) >= 2))
    workers = [p for p in _tagged(tag) if b"rlpo_mega.cli" in open(f"/proc/{p}/cmdline", "rb").read()
               and p != proc.pid and b"LOCAL_RANK=1" in open(f"/proc/{p}/environ", "rb").read()]
    assert workers
    os.kill(workers[0], signal.SIGKILL)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "rank 1 failed (signal SIGKILL)" in output, output[-3000:]
    _no_orphans(tag)
    from rlpo_mega.checkpoint.run import latest_checkpoint

    assert latest_checkpoint(str(tmp_path / "ck"))  # `latest` names a complete step


def test_killed_launcher_takes_its_workers(tmp_path):
    proc, tag, _ = _launch(tmp_path, "trainer.warmup.steps=0", "checkpoint.save_dir=null")
    metrics = tmp_path / "run" / "metrics.jsonl"
    _wait_for(lambda: proc.poll() is not None or (metrics.exists() and len(metrics.read_text().splitlines()) >= 1))
    proc.kill()
    proc.wait(10)
    _no_orphans(tag, timeout=20)


def test_launched_server_dies_with_its_trainer(tmp_path):
    """An SGLang server the trainer launched stops when the trainer dies, SIGKILL included (a stand-in server:
    an HTTP /health on the port, nothing else)."""
    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/sh\nexec {sys.executable} {os.path.join(WORKERS, 'stub_server.py')} \"$@\"\n")
    stub.chmod(0o755)
    parent = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {ROOT!r})
from launch.sglang_server import SGLangServer
s = SGLangServer("model", port=int(sys.argv[1]), python={str(stub)!r}, log_dir={str(tmp_path)!r}).start(60)
print(s.proc.pid, flush=True)
time.sleep(600)
""", str(free_port())], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert os.path.exists(f"/proc/{pid}")
    parent.kill()
    parent.wait(10)
    _wait_for(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
              timeout=20)


def test_launched_server_on_a_taken_port_names_the_port(tmp_path):
    """A server whose HTTP port is taken exits during start-up (uvicorn's exit 3, as a CI run once met): the
    error names the port and the setting to change, not only the exit code."""
    import socket

    from launch.sglang_server import SGLangServer

    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/sh\nexec {sys.executable} {os.path.join(WORKERS, 'stub_server.py')} \"$@\"\n")
    stub.chmod(0o755)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError) as e:
            SGLangServer("model", port=port, python=str(stub), log_dir=str(tmp_path)).start(30)
    assert "exited with code 3" in str(e.value) and f"port {port}" in str(e.value), e.value
    assert "already in use" in str(e.value) and "rollout.sglang.base_port" in str(e.value), e.value


def test_hung_server_is_one_error_not_a_hang(tmp_path):
    """An SGLang server that accepts connections and never answers: the trainer's first call to it fails
    within rollout.sglang.control_timeout, as one line, exit 2 (it waited the 600 s request timeout before)."""
    from tests.test_engine_timeouts import silent_server

    with silent_server() as url:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "rlpo_mega.cli", "train", DEMO, *QUICK, "rollout.engine=sglang",
                               f"rollout.sglang.urls=[{url}]", "rollout.sglang.control_timeout=2",
                               "rollout.sglang.health_timeout=0.5", f"logging.dir={tmp_path}"],
                              cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    one_line(proc.stderr, "train", url, "2 s")
    assert took < 120, took


def test_export_names_its_outputs_and_peft_needs_adapters(ckpt, tmp_path, capsys, monkeypatch):
    """`rlpo-mega export` with neither --hf-out nor --peft-out: one line naming both. --peft-out of a checkpoint
    saved without model.lora: one line naming --hf-out, exit 2, nothing written."""
    rc, err = run_cli(capsys, monkeypatch, "export", "--ckpt", str(ckpt / "dist"))
    assert rc == 2
    one_line(err, "export", "--hf-out", "--peft-out")
    rc, err = run_cli(capsys, monkeypatch, "export", "--ckpt", str(ckpt / "dist"), "--peft-out", str(tmp_path / "a"))
    assert rc == 2
    one_line(err, "export", "saved without model.lora", "--hf-out")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("what", ["config dir", "save_dir without a finished step"])
def test_export_of_something_that_is_not_a_checkpoint(what, tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    if what == "config dir":
        shutil.copytree(os.path.join(ROOT, "configs/models"), src)
    else:
        (src / "step_00000002").mkdir(parents=True)
        (src / "step_00000002" / "trainer_state.pt").write_bytes(b"x")
        (src / "latest").write_text("step_00000002")
    kept = snapshot(src)
    rc, err = run_cli(capsys, monkeypatch, "export", "--ckpt", str(src), "--hf-out", str(tmp_path / "out"))
    assert rc == 2
    one_line(err, "export", "is not a finished checkpoint", "--ckpt")
    assert snapshot(src) == kept and not (tmp_path / "out").exists()
