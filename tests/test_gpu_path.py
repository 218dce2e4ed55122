"""Defects of the CUDA path that a CPU can show: each depends on what only a GPU machine has and is made visible
here with a stand-in for it --
- a Transformer Engine whose torch binding does not load (a stand-in TE package);
- Apex's/TE's FusedAdam, which creates its state at its first step (a lazy Adam in the distributed-optimizer launch);
- SGLang's CUDA-only fusion of the shared expert into the routed ones (the fused layout, built without a server);
- NCCL versions of learner and servers (stand-in versions; a real server reports its own in test_sglang.py);
- the servers' TP size, which the SLURM launch never passed (a stand-in /server_info; a real one in test_sglang.py).
Each test failed on the code before its fix."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBCUDART = "libcudart.so.12: cannot open shared object file: No such file or directory"


def _stand_in_te(root, binding: str, version: str | None = None, modules: dict[str, str] | None = None) -> str:
    """A `transformer_engine` package whose top level swallows its torch binding's failure, as TE's does; the
    binding's module body is `binding`; version: its __version__; modules: more of its files ({path: text}).
    Returns the directory to put on PYTHONPATH."""
    pkg = root / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    top = (f"__version__ = {version!r}\n" if version else "") + "try:\n    from . import pytorch  # noqa: F401\n"
    (pkg / "__init__.py").write_text(top + "except Exception:\n    pass\n")
    (pkg / "pytorch" / "__init__.py").write_text(binding)
    for path, text in (modules or {}).items():
        (pkg / path).parent.mkdir(parents=True, exist_ok=True)
        (pkg / path).write_text(text)
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


def _probe(*paths, megatron_flag=None):
    """[moe.model.have_transformer_engine() (or "error: <its one line>"), megatron-core's own HAVE_TE (or "error:
    <what its import raised>")] in a fresh interpreter, the probe first. megatron_flag: megatron's TE extension is
    imported first with the stand-in TE out of sys.path, and its HAVE_TE set to this (a TE that megatron takes as
    present cannot be faked here: megatron's import reaches deep into TE)."""
    code = textwrap.dedent(f"""
        import importlib, json, sys
        if {megatron_flag!r} is not None:
            path = sys.path[:]
            sys.path[:] = [p for p in path if p not in {list(paths)!r}]
            from megatron.core.extensions import transformer_engine
            transformer_engine.HAVE_TE = {megatron_flag!r}
            sys.path[:] = path
            importlib.invalidate_caches()
        from moe.model import TransformerEngineError, have_transformer_engine
        try:
            ours = have_transformer_engine()
        except TransformerEngineError as e:
            ours = "error: " + str(e)
        try:
            from megatron.core.extensions import transformer_engine
            theirs = transformer_engine.HAVE_TE
        except Exception as e:
            theirs = "error: " + type(e).__name__ + ": " + str(e)
        print(json.dumps([ours, theirs]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(*paths), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_transformer_engine_is_present_exactly_when_megatron_says_so(tmp_path):
    """Absent: False (megatron's local spec), megatron agreeing. A TE whose binding loads is present only when
    megatron-core's own flag says so (the TE spec then holds TE's classes, not megatron's MagicMocks)."""
    assert _probe() == [False, False]
    te = _stand_in_te(tmp_path, "VERSION = 'stand-in'\n")
    assert _probe(te, megatron_flag=True) == [True, True]


# TE 2.x (megatron's fp8_utils.py:43-46 imports QuantizedTensor from it once TE is >= 2.0)
_TENSOR = {"pytorch/tensor/__init__.py": "class QuantizedTensor:\n    pass\n"}


@pytest.mark.parametrize("fp8", ["absent", "without fp8_autocast"])
def test_a_transformer_engine_megatron_does_not_take_is_one_line(tmp_path, fp8):
    """A TE whose torch binding loads but whose `transformer_engine.pytorch.fp8` is gone (TE marks it deprecated) or
    lacks `fp8_autocast`, as outside the range megatron-core 0.16.1 is tested with. The probe imported
    `transformer_engine.pytorch` only and said present. Gone: megatron-core's own import stops
    (fp8_utils.py:667-668), a traceback out of the first `import megatron.core`. Without fp8_autocast: megatron's
    HAVE_TE is False (extensions/transformer_engine.py:61-77), its TE classes are MagicMocks, and the TE spec asked
    for died in TEDotProductAttention.__init__ with "Transformer Engine is not installed". Now both are one line
    naming the failed import and the range to install."""
    fp8 = {} if fp8 == "absent" else {"pytorch/fp8.py": "class FP8GlobalStateManager:\n    pass\n"}
    te = _stand_in_te(tmp_path, "VERSION = 'stand-in'\n", version="2.12.0", modules={**_TENSOR, **fp8})
    ours, megatron = _probe(te)
    assert megatron is not True, megatron
    assert ours is not True, f"the probe says TE is present where megatron-core says {megatron}"
    assert isinstance(ours, str) and "\n" not in ours, ours
    reason = ("megatron-core does not import with it: ModuleNotFoundError: No module named "
              "'transformer_engine.pytorch.fp8'" if not fp8 else
              "megatron-core does not take it as present (HAVE_TE is False: its import of FP8GlobalStateManager and "
              "fp8_autocast from transformer_engine.pytorch.fp8 fails with ImportError: cannot import name "
              "'fp8_autocast'")
    for needle in ("error: Transformer Engine is installed", reason, "transformer-engine[pytorch]>=2.9,<2.12",
                   "pip uninstall transformer-engine", "local layer spec"):
        assert needle in ours, (needle, ours)


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


@pytest.mark.parametrize("config", ["configs/models/tiny_glm4_moe.json", "configs/models/tiny_deepseek_v3.json"])
def test_sglang_fused_shared_expert_unfuses_to_its_hf_names(config):
    """On CUDA (compute capability >= 8.0) SGLang folds the one shared expert of a DeepSeek-V3-block model (GLM-4.5-Air,
    DeepSeek-V3) into the routed experts as slot n_routed_experts; the digest hook names the server's tensors from
    that layout, whole and one expert slot at a time as it gathers them. Before, slot n_routed came out as
    `experts.<n_routed>.*`, a name the learner never sends, and `shared_experts.*` never came: the digest check failed
    at the first sync on every GPU server. A slot past that is a layout this code does not know: refused."""
    from moe.families.sglang_names import sglang_to_hf
    from tests.sglang_layout import sglang_layout

    hf, ref, sgl = sglang_layout(config, fuse_shared_experts=True)
    fused = [n for n in sgl if n.endswith("experts.w13_weight")]
    assert fused and all(sgl[n].shape[0] == hf.n_routed_experts + 1 for n in fused)
    assert not any(".shared_experts." in n for n in sgl)
    back = sglang_to_hf(sgl, hf)
    assert sorted(back) == sorted(ref) and all(torch.equal(back[k], ref[k]) for k in ref)
    for name in fused + [n.replace("w13", "w2") for n in fused]:  # the hook: one slot at a time
        for k in range(sgl[name].shape[0]):
            one = sglang_to_hf({name: sgl[name][k:k + 1]}, hf, first_expert=k, tie=False)
            assert all(torch.equal(v, ref[n]) for n, v in one.items()) and len(one) == (2 if "w13" in name else 1)
    extra = {fused[0]: torch.cat([sgl[fused[0]], sgl[fused[0]][:1]])}
    with pytest.raises(ValueError, match="--disable-shared-experts-fusion"):
        sglang_to_hf(extra, hf)


def test_nccl_versions_are_checked_before_the_weight_update_group(monkeypatch):
    """sglang_distributed on GPUs: the learner's rank 0 and every server rank form one NCCL group, and NCCL refuses
    peers of another version ("Mismatched NCCL version") -- the servers run from their own environment, SGLang
    pins its own torch. Each server reports its versions from inside (launch/rlpo_sglang_hooks.py environment(),
    run against a real server in test_sglang.py); the learner compares before it joins: one line naming both
    versions and the way out, and no group is formed. The learner's NCCL is a stand-in here (no CUDA)."""
    from rlpo_mega.rollout import EngineError
    from rlpo_mega.weight_sync.sglang_distributed import SGLangDistributedTransport, nccl_mismatch

    same = {"http://s0:30000": {"torch": "2.9.1", "cuda": "12.8", "nccl": [2, 27, 3]}}
    assert nccl_mismatch((2, 27, 3), "2.11.0", same) is None
    other = {**same, "http://s1:30000": {"torch": "2.8.0", "cuda": "12.8", "nccl": [2, 26, 2]}}
    line = nccl_mismatch((2, 27, 3), "2.11.0", other)
    for needle in ("NCCL version mismatch", "NCCL 2.27.3 (torch 2.11.0)", "http://s1:30000 has NCCL 2.26.2 (torch 2.8.0)",
                   "nvidia-nccl-cu12==2.27.3", "in the servers' environment", "rollout.sync_transport=disk"):
        assert needle in line, (needle, line)
    # the learner's the older (torch 2.11's 2.28.9 against SGLang 0.5.23's torch 2.14.1 with 2.30.7): the newer into it
    line = nccl_mismatch((2, 28, 9), "2.11.0", {"http://s0:30000": {"torch": "2.14.1", "cuda": "13.0",
                                                                    "nccl": [2, 30, 7]}})
    assert "nvidia-nccl-cu13==2.30.7" in line and "in the learner's environment" in line, line

    class Engine:  # what the transport asks of the engine before it forms the group
        servers = list(other)
        formed = False
        driver = 0  # the first rollout driver (its index names the group)

        def _check_layout(self):
            pass

        def environments(self):
            return other

        def store(self):
            Engine.formed = True  # the rendezvous: never reached
            raise AssertionError("the group was being formed")

    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    transport = SGLangDistributedTransport(Engine(), backend="nccl", timeout_s=5)
    with pytest.raises(EngineError, match=r"http://s1:30000 has NCCL 2\.26\.2"):
        transport._init_group()
    assert not Engine.formed and transport.pg is None


def test_a_server_of_another_tp_size_is_refused_before_the_first_transfer():
    """rollout.sglang.tp_size sizes the weight-update group (1 + servers x TP ranks) and the per-rank payloads;
    launch/slurm/train_disaggregated.sbatch never passed SGLANG_TP, so its own TP4 example failed or hung at the
    first sync. The servers' /server_info says their TP size: a mismatch is one line, before any transfer (a stand-in
    server answering SGLang 0.5.23's /server_info; test_sglang.py reads a real one)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from moe.model import load_hf_config
    from rlpo_mega.config import SGLangEngineConfig
    from rlpo_mega.rollout import EngineError
    from rlpo_mega.rollout.sglang_engine import SGLangEngine

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"tp_size": 4, "pp_size": 1, "dp_size": 1} if self.path == "/server_info" else {}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            raise AssertionError(f"{self.path}: a transfer before the layout check")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        hf = load_hf_config(os.path.join(ROOT, "configs/models/tiny_qwen3_moe.json"))
        engine = SGLangEngine(SGLangEngineConfig(urls=[url], tp_size=1, control_timeout=10), hf)
        with pytest.raises(EngineError, match=r"runs at tensor parallel size 4 but rollout\.sglang\.tp_size=1: set "
                                              r"rollout\.sglang\.tp_size=4"):
            engine.begin_weight_update()
        engine.shutdown()
    finally:
        server.shutdown()
    with open(os.path.join(ROOT, "launch", "slurm", "train_disaggregated.sbatch")) as f:
        assert '"rollout.sglang.tp_size=$SGLANG_TP"' in f.read()


def _image_distributions() -> set[str]:
    """What a lent GPU machine's image holds, modelled here: Python 3.12's pip, setuptools and wheel, torch and
    transformers, with their dependency closure (this venv's metadata, markers read for Python 3.12; no extras)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo = set(), ["pip", "setuptools", "wheel", "torch", "transformers"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in map(Requirement, requires):
            if r.marker is None or r.marker.evaluate({"extra": "", "python_version": "3.12",
                                                       "python_full_version": "3.12.0"}):
                todo.append(r.name)
    return seen


_BLOCKER = """import importlib.abc, importlib.util, os, sys
_blocked = set(os.environ["RLPO_BLOCKED_MODULES"].split(","))
class _Bare(importlib.abc.MetaPathFinder):  # as if these were not installed (a bare GPU image)
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Bare())
_find_spec = importlib.util.find_spec
def find_spec(name, package=None):  # a probe of an absent package finds nothing (transformers asks for accelerate)
    return None if name.split(".")[0] in _blocked else _find_spec(name, package)
importlib.util.find_spec = find_spec
"""


def test_the_gpu_smoke_needs_exactly_its_listed_wheels(tmp_path):
    """tools/gpu_smoke.py's NEEDS (what tools/gpu_wheels.sh downloads and the smoke checks first) is enough and no
    more: a run of configs/gpu_smoke.yaml (shortened here: 1 step and a checkpoint) completes in every process it
    starts with nothing importable but the standard library, the image's torch and transformers (with their
    dependency closure), this repository and NEEDS -- every other installed module raises ModuleNotFoundError, as
    on the bare machine; and each of NEEDS is imported by that run or required by one that is."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_smoke
    finally:
        sys.path.pop(0)
    listed = {canonicalize_name(Requirement(r).name) for r in gpu_smoke.NEEDS.values()}
    allowed = _image_distributions() | listed | {"rlpo-mega"}
    owners = md.packages_distributions()
    import setuptools

    # what setuptools vendors (its own copies, e.g. jaraco) stays importable even where a separate distribution of
    # the same name is installed here
    vendored = {n.split("-")[0].split(".")[0] for n in os.listdir(os.path.join(os.path.dirname(setuptools.__file__),
                                                                               "_vendor"))}
    blocked = sorted(m for m, dists in owners.items()
                     if not {canonicalize_name(d) for d in dists} & allowed and m not in sys.stdlib_module_names
                     and m not in vendored)
    assert "wandb" in blocked and "omegaconf" not in blocked
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "sitecustomize.py").write_text(_BLOCKER)
    bare = {**_env(str(tmp_path / "bare")), "RLPO_BLOCKED_MODULES": ",".join(blocked)}
    probe = subprocess.run([sys.executable, "-c", "import wandb"], env=bare, capture_output=True, text=True, timeout=60)
    assert "ModuleNotFoundError: No module named 'wandb'" in probe.stderr, probe.stderr[-1000:]  # the blocker works
    proc = subprocess.run(
        [sys.executable, "-m", "rlpo_mega.cli", "train", "configs/gpu_smoke.yaml", "--nproc-per-node", "1",
         "train_iters=1", "trainer.warmup.steps=1", "checkpoint.save_every=1", f"logging.dir={tmp_path / 'run'}",
         f"checkpoint.save_dir={tmp_path / 'ckpt'}"],
        cwd=ROOT, env={**bare, "PYTHONPROFILEIMPORTTIME": "1"},
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    modules = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in proc.stderr.splitlines()
               if line.startswith("import time:") and "|" in line}
    imported = {canonicalize_name(d) for m in modules for d in owners.get(m, [])}
    required_by_imported = {canonicalize_name(Requirement(r).name) for d in imported & listed
                            for r in md.requires(d) or [] if Requirement(r).marker is None}
    assert listed <= imported | required_by_imported, sorted(listed - imported - required_by_imported)


def test_the_gpu_smoke_checkpoints_before_the_first_step_and_resumes(tmp_path):
    """The smoke's runs C and D as it starts them (tools/gpu_smoke.plan), on the CPU: no warm-up and no RL step
    (train_iters=0) writes the checkpoint of a never-stepped distributed optimizer, and a run resumed from it
    takes step 1 and checkpoints after it."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_smoke
    finally:
        sys.path.pop(0)
    out = tmp_path / "smoke"
    for name in ("C", "D"):
        proc = subprocess.run([sys.executable, "-m", "rlpo_mega.cli", "train", gpu_smoke.CONFIG, "--nproc-per-node",
                               "1", *gpu_smoke.plan(str(out))[name]], cwd=ROOT, env=_env(), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        # megatron's "Overwriting old incomplete / corrupted checkpoint" is false for our fresh .tmp directory
        assert "corrupted checkpoint" not in proc.stderr, (name, proc.stderr[-3000:])
    assert (out / "C" / "ckpt" / "step_00000000").is_dir() and (out / "D" / "ckpt" / "step_00000001").is_dir()
    assert [h["step"] for h in gpu_smoke.history(str(out / "D"))] == [1]
    assert "resumed from" in proc.stderr


def test_the_gpu_smoke_checks_its_imports_first(tmp_path):
    """A bare GPU image: the smoke names each module it cannot import and how to carry it, before anything runs
    (a stand-in for a missing module: a package that fails to import, first on the path)."""
    (tmp_path / "omegaconf").mkdir()
    (tmp_path / "omegaconf" / "__init__.py").write_text("raise ImportError('No module named omegaconf')\n")
    proc = subprocess.run([sys.executable, "tools/gpu_smoke.py"], cwd=ROOT, env=_env(str(tmp_path)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "missing omegaconf: omegaconf==" in proc.stderr and "tools/gpu_wheels.sh" in proc.stderr, proc.stderr
    here = subprocess.run([sys.executable, "tools/gpu_smoke.py", "--check-imports"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert here.returncode == 0 and "all import" in here.stdout, here.stdout + here.stderr


def test_launched_servers_get_their_own_gpus_or_are_refused():
    """rollout.sglang.launch=true started every server with the same arguments: on a GPU node all of them on GPUs
    0..tp-1, on top of the learner's ranks. Now server i gets base_gpu_id after the learner ranks' GPUs and the
    servers before it, and servers that do not fit beside the learner are one line; a config sized for full learner
    nodes (cluster.learner_nodes) that launches servers is refused by `rlpo-mega check`."""
    from rlpo_mega.config import ConfigError, load_config
    from rlpo_mega.config_checks import check_run_config
    from rlpo_mega.rollout import EngineError
    from rlpo_mega.rollout.sglang_launch import server_gpus

    assert server_gpus(2, 2, learner_gpus=4, gpus=8) == [4, 6]
    assert server_gpus(1, 4, learner_gpus=4, gpus=8) == [4]
    with pytest.raises(EngineError, match=r"12 GPUs needed, 8 here, so they would share the learner's GPUs; run "
                                          r"the learner on 4 GPU\(s\) of this node \(--nproc-per-node 4\)"):
        server_gpus(2, 2, learner_gpus=8, gpus=8)
    recipe = os.path.join(ROOT, "configs/recipes/qwen3_30b_a3b_gspo_r3_2nodes.yaml")
    cfg = load_config(recipe, ["rollout.sglang.launch=true", "model.init_from_hf=/tmp/unused",
                              "rollout.sglang.server_args.enable_return_routed_experts=true"])
    with pytest.raises(ConfigError, match=r"cluster.learner_nodes=2 x gpus_per_node=8 are all learner ranks"):
        check_run_config(cfg, files=False, log_warnings=False)
    with open(recipe) as f:  # the recipe's comment no longer offers it
        assert "launch: true, num_servers" not in f.read()


def test_the_gpu_smoke_reads_sync_places_and_fails_when_ours_grow_with_layers(tmp_path, capsys):
    """logging.host_syncs' host_syncs.jsonl (MetricsLogger.log_sync_sites) as the smoke reads it: the last step's
    places, split into megatron's MoE layer and ours; a deeper model may add MoE-layer syncs, never ours."""
    from collections import Counter

    from rlpo_mega.logging import LoggingConfig, MetricsLogger

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_smoke
    finally:
        sys.path.pop(0)
    moe = "megatron/core/transformer/moe/moe_utils.py:369 permute <- rlpo_mega/training/update.py:61 model_forward"
    ours = "rlpo_mega/training/update.py:194 reduce_report"
    per_layer = "megatron/core/utils.py:1206 local_multi_tensor_l2_norm <- rlpo_mega/training/update.py:216 x"

    def run(name: str, layers: int, extra: dict) -> dict:
        logger = MetricsLogger(LoggingConfig(dir=str(tmp_path / name), mode="disabled", plot=False))
        for step in (1, 2):  # the last step is the one read
            sites = {"old_logprob": Counter({ours: 1}), "update": Counter({moe: 4 * layers, ours: 2, **extra})}
            logger.log_sync_sites(step, sites if step == 2 else {"update": Counter({"first step only": 9})})
        logger.close()
        return gpu_smoke.sync_sites(str(tmp_path / name))

    shallow = run("a", 2, {})
    assert shallow == {"old_logprob/ours": {ours: 1}, "update/megatron_moe": {moe: 8}, "update/ours": {ours: 2}}
    assert gpu_smoke.compare_sync_sites(shallow, run("e", 4, {}))
    assert not gpu_smoke.compare_sync_sites(run("a2", 2, {per_layer: 66}), run("e2", 4, {per_layer: 126}))
    assert "our host syncs GROW with the layers" in capsys.readouterr().out


def test_the_gpu_checklist_sizes_its_model_to_most_of_the_gpu_and_the_plan_holds_it():
    """tools/gpu_checklist.py (`make gpu-smoke`) trains a Qwen3-MoE sized to the GPU it finds and compares each
    phase's CUDA peak with `rlpo-mega plan` of the same config: here, on the CPU, that plan at an H100's and an
    H200's memory exits 0 with the training row between half of the GPU and its budget (a check of most of the GPU,
    not of a tiny model), and the check needs a GPU (one line, exit 2, without one)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_checklist
    finally:
        sys.path.pop(0)
    from rlpo_mega.config import load_config
    from rlpo_mega.planning import plan as planning

    for gpu_gb in (80, 141):
        hf = gpu_checklist.model_for_gpu(gpu_gb)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "config.json")
            with open(path, "w") as f:
                json.dump(hf, f)
            # what `rlpo-mega plan configs/gpu_smoke.yaml <overrides> --world-size 1 --lengths all-max
            # --prompt-tokens 16` plans and exits 0 on (cli._plan), in this process (its meta build the suite's warm
            # fork, tests/conftest.py): the checklist runs that command on the GPU machine
            cfg = load_config(os.path.join(ROOT, "configs/gpu_smoke.yaml"),
                              (*gpu_checklist.train_overrides(tmp, path), f"cluster.gpu_memory_gb={gpu_gb}"))
            plan = planning.make_plan(cfg, "configs/gpu_smoke.yaml", 1, "all-max", prompt_tokens=16, refit=True)
            assert plan.first_exceeded() is None, plan.first_exceeded()
            made = json.loads(json.dumps(plan.to_json()))
        rows = {r["name"].rsplit(", ", 1)[-1]: r for r in made["learner_gpus"]}
        assert set(rows) == {"training", "generation", "sync"}, rows
        train = rows["training"]
        assert 0.5 * gpu_gb * 1e9 < train["total"] <= train["budget"], (gpu_gb, train)
        assert train["parameters"] == sum(gpu_checklist.layer_params(hf)[0] * hf["num_hidden_layers"]
                                          for _ in [0]) + gpu_checklist.layer_params(hf)[1], train
    # the row reads the metrics where the run writes them (the run directory is logging.dir itself)
    cfg = load_config(os.path.join(ROOT, "configs/gpu_smoke.yaml"), tuple(gpu_checklist.train_overrides("/o", "/m.json")))
    assert gpu_checklist.metrics_path("/o") == os.path.join(cfg.logging.dir, "metrics.jsonl")
    proc = subprocess.run([sys.executable, "tools/gpu_checklist.py"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device visible" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_gpu_checklists_fp8_gemm_takes_what_rollout_weights_fp8_sends():
    """The checklist's fp8 rows feed rollout.weights=fp8's codes and weight_scale_inv (moe/bridge/fp8.quantize_block)
    to Hopper's block-FP8 GEMM (torch's scaled_mm, 1x128 x 128x128). Here, on the CPU: torch's own check of that
    GEMM's operands (its meta function: shapes and strides, the same rules as the CUDA kernel's,
    torch/_meta_registrations.py _check_scaled_mm_sizes_v2) accepts them at every checked shape and refuses the
    weight's scales untransposed; and the activations' 1x128 quantisation dequantises to within e4m3's rounding."""
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_checklist
    finally:
        sys.path.pop(0)
    from moe.bridge.fp8 import quantize_block

    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    for n, k in gpu_checklist.FP8_GEMM_SHAPES.values():
        x = torch.randn(256, k).to(torch.bfloat16)
        xq, xs = gpu_checklist.quantize_activations(x)
        wq, ws = quantize_block((torch.randn(n, k) * 0.02).to(torch.bfloat16))
        assert xs.shape == (256, k // 128) and ws.shape == (n // 128, k // 128)
        out = gpu_checklist.block_fp8_mm(meta(xq), meta(xs), meta(wq), meta(ws))
        assert out.shape == (256, n) and out.dtype == torch.bfloat16
        scale = xs.repeat_interleave(128, 1)
        # e4m3: 3 mantissa bits (half a step: 2^-4 relative), subnormal steps of 2^-9 times the group's scale
        assert ((xq.float() * scale - x.float()).abs() <= x.float().abs() * 2 ** -4 + scale * 2 ** -10).all()
        with pytest.raises(Exception, match="blockwise"):  # the weight's scales as stored, not transposed
            F.scaled_mm(meta(xq), meta(wq).t(), meta(xs).t().contiguous().t(), F.ScalingType.BlockWise1x128,
                        meta(ws), F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
