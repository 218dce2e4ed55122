import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def distopt_launch(tmp_path_factory):
    """tests/workers/ckpt_distopt.py's one 2-process launch (distributed-optimizer checkpoints), shared by
    test_checkpoint.py and test_gpu_path.py."""
    from tests.dist import torchrun

    return torchrun("ckpt_distopt.py", 2, str(tmp_path_factory.mktemp("distopt")), "qwen3_moe")


@pytest.fixture(scope="session", autouse=True)
def warm_meta_builds():
    """The planner's meta builds (rlpo_mega.planning.meta_build.run: one child process per model to size) forked
    from tests/warm_launch.py's launcher, which has megatron-core, torch and transformers imported, instead of a
    fresh interpreter importing them for each build (~8 s of CPU a build; the suite's in-process plans build ~20).
    The child is the same: meta_build.main() on the same request JSON, in a process of its own that applies the
    CPU platform itself, its stdout read as `run` reads it. The CLI's plans (`rlpo-mega plan`, `check`, tested
    as subprocesses) start their children as users' do."""
    import json
    import tempfile
    from dataclasses import asdict

    from rlpo_mega.planning import meta_build
    from tests.dist import torchrun

    fresh = meta_build.run

    def run(req, timeout: float = 600.0):
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(asdict(req), f)
            f.flush()
            proc = torchrun("meta_build_child.py", 1, f.name, env={"CUDA_VISIBLE_DEVICES": ""},
                            timeout=int(timeout), expect_fail=True)
        return meta_build.child_result(req, proc)

    meta_build.run = run
    yield
    meta_build.run = fresh


# `make test` runs two xdist workers, a file per worker at a time (--dist loadfile), in collection order
# (--no-loadscope-reorder: xdist would otherwise order the files by their number of tests). The
# longest files go first, so that the short ones fill the end of both workers instead of one long file running
# alone at the end (the order of a suite run of 2026-11-27, `--durations`). The files that need the SGLang venv
# (test_recipes, test_sglang*, test_slurm) start after the first files, by when `make test`'s background build
# of that venv (~5 minutes) has finished.
LONGEST_FIRST = ("test_trainer", "test_critic", "test_algorithms_dist", "test_checkpoint", "test_async",
                 "test_multi_turn", "test_platform", "test_bridge", "test_recipes", "test_sglang_trainer",
                 "test_bad_inputs", "test_parity", "test_packing", "test_routing_replay", "test_slurm", "test_sglang",
                 "test_families_sigmoid", "test_device_discipline", "test_plan", "test_host_syncs")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.splitext(os.path.basename(str(item.path)))[0], len(rank)))


# Files whose tests share launches through a per-process cache or a session fixture: one xdist worker runs each
# group, so each launch happens once per suite (each worker that got one of the files launched them again:
# the reference and four layout launches, ~4 minutes, ran on both workers in a suite run of 2026-11-27).
SHARED_LAUNCHES = (("test_critic", "test_parity", "test_plan", "test_bridge", "test_lora"),  # tests/layout_runs.py
                   ("test_checkpoint", "test_gpu_path"))  # distopt_launch above


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling  # only under xdist

    class SharedLaunchScheduling(LoadFileScheduling):
        """--dist loadfile, with each SHARED_LAUNCHES group one unit of work (placed at its first file)."""

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            name = os.path.splitext(os.path.basename(scope))[0]
            group = next((g for g in SHARED_LAUNCHES if name in g), None)
            return "+".join(group) if group else scope

    return SharedLaunchScheduling(config, log)
