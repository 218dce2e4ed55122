"""The rollout side as one composition: every schedule x task x filter cell trains through the real trainer, on the
embedded engine and on stub SGLang servers (tests/workers/composition_matrix.py), with each cell's invariants.
The SGLang cells' episodes run continuous turns (environment.turns=continuous), the embedded engine's lockstep."""
import pytest

from tests.dist import torchrun
from tests.multi_turn_support import write_episode_data

N, PROMPTS, STEPS = 2, 4, 3
CELLS = [f"{engine}/{schedule}/{task}/{filt}" for engine in ("embedded", "sglang") for schedule in ("sync", "async")
         for task in ("single", "episode") for filt in ("all", "ds")]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    data = tmp_path_factory.mktemp("matrix_data")
    write_episode_data(data)
    # the SGLang cells' stub servers take the job's key only (tests/model_sglang.py), as the job's servers do
    return torchrun("composition_matrix.py", 1, str(tmp_path_factory.mktemp("matrix_out")), str(data), timeout=1500,
                    env={"RLPO_SGLANG_KEY": "composition-job-key-" + "c" * 24})


@pytest.mark.parametrize("cell", CELLS)
def test_every_cell_of_the_composition_trains_with_its_invariants(matrix, cell):
    """Each cell trains STEPS steps of PROMPTS whole groups of N (one prompt per group; dynamic sampling: the
    step's quota of kept groups, its carried groups never more than it carried out, counted); every trained sample
    is the engine's record -- tokens and log-probs its calls' answers, each used once, every R3 routing row its
    call's; the sync schedule samples step s on the weights of the sync before it (the s-th), the async one
    tags each token with its call's version, within max_staleness 1 of the step; episodes run several turns (on
    SGLang, continuous turns)."""
    engine, schedule, task, filt = cell.split("/")
    r = matrix[cell]
    assert r["rc"] == 0, r
    steps = [h for h in r["history"] if "reward/mean" in h]
    assert [h["step"] for h in steps] == list(range(1, STEPS + 1))
    assert r["groups"] == {str(s): {"samples": PROMPTS * N, "whole": True} for s in range(STEPS)}, r["groups"]
    checks = r["checks"]
    assert checks["problems"] == [] and checks["samples"] == STEPS * PROMPTS * N, checks
    assert checks["rows"] > 0
    if schedule == "sync":  # the trainer's step s (from 0) samples on the s-th weights synced (0: the first); with
        # dynamic sampling it may train groups carried from the step before (max_carry_steps=1), or only those
        for s in range(STEPS):
            v = checks["step_versions"][str(s)]
            assert v == [s] if filt == "all" else s - 1 <= v[0] <= v[-1] <= s, checks
    else:
        for h in steps[1:]:
            assert h["async/staleness_max"] <= 1 and h["async/stale_dropped_groups"] == 0, h
    if task == "episode":
        assert checks["obs_tokens"] > 0 and max(h["episode/turns_mean"] for h in steps) > 1.5, steps
    if filt == "ds":
        for h in steps:
            assert h["dynamic_sampling/kept"] == PROMPTS and h["reward/samples"] == PROMPTS * N, h
        out = [h["dynamic_sampling/carried_out"] for h in steps]
        back = [h["dynamic_sampling/carried_in"] + h["dynamic_sampling/carry_stale"] for h in steps]
        assert all(sum(back[:k + 1]) <= sum(out[:k]) for k in range(STEPS)), (out, back)
    if engine == "sglang":
        assert r["requests"] >= STEPS * PROMPTS * N  # every sample went through a stub server's /generate
        if schedule == "async" and task == "single":  # a prompt's continued samples go to one server (the prompt
            # prefilled once there), as its n samples did
            assert r["continuations"]["split"] == 0, r["continuations"]
            assert r["continuations"]["groups"] > 0 or filt == "ds", r["continuations"]  # (ds: by timing)
