"""The trainer with a launched SGLang server (the recipes' weight path under torchrun, a killed and a hung
server). A module of its own: the family servers of tests/test_sglang.py are stopped by then (an idle SGLang
server on this CPU keeps its scheduler processes spinning, which slowed these runs by about half).
"""
import json
import os

import pytest

from moe.model import load_hf_config
from rlpo_mega.errors import EXIT_STOPPED
from tests.dist import ROOT, free_port, torchrun
from tests.test_sglang import FAMILIES, SERVER_ARGS, SUPPORT, sglang_python  # noqa: F401  (a fixture)
from tests.workers.bridge import make_hf_checkpoint

pytestmark = pytest.mark.timeout(900)

def _trainer_env(sglang_python, ckpt, **extra):
    return {"WANDB_MODE": "disabled", "RLPO_SGLANG_HF": ckpt, "RLPO_SGLANG_PYTHON": sglang_python,
            "RLPO_SGLANG_PORT": str(free_port()), "RLPO_SGLANG_PATH": os.path.join(SUPPORT, "path"),
            "RLPO_SGLANG_SERVER_ARGS": json.dumps(SERVER_ARGS), **extra}


def _scenario(sglang_python, tmp_path, worker, *args, model=FAMILIES["qwen3_moe"]):
    """A checkpoint of `model` (the tiny qwen3_moe) made for the test, then `worker` under torchrun (2 ranks) with
    `args`."""
    hf = load_hf_config(os.path.join(ROOT, model))
    ckpt = str(tmp_path / "hf")
    make_hf_checkpoint(hf, ckpt)
    return torchrun(worker, 2, *args, timeout=900, env=_trainer_env(sglang_python, ckpt))


def test_trainer_sglang_distributed_with_restart(sglang_python, tmp_path):
    """The recipes' weight path under torchrun, with 2 rollout drivers: the trainer (2 learner ranks) launches 2
    SGLang servers from rank 0 (the node's launcher); rollout.sglang.drivers=2 makes ranks 0 and 1 clients of one
    server each. Every sync gives both the full weights (here every rank is a driver: the export's broadcast;
    fewer drivers than ranks get them point-to-point, tests/test_weight_sync.py) and each pushes them to its own
    server with `sglang_distributed`, over its own group and store (hosted by the driver itself: before that fix
    rank 0's rendezvous became a client of torchrun's agent store and the first sync timed out after 300 s).
    GSPO + R3 with streaming dynamic sampling, 3 steps; driver 0's server is killed after step 1: every engine and
    transport is rebuilt (the node's launcher restarts both servers; new groups), both drivers re-sync, and every
    sync is digest-verified inside each server (report_digests). Then driver 0's server is killed again in step
    2's sync as its bucket is sent: driver 0's sync fails, driver 1's completes, the failure is agreed, everything
    is rebuilt once more and both re-sync (a multi-driver sync failure)."""
    r = _scenario(sglang_python, tmp_path, "train_scenarios.py", "sglang_distributed_run", str(tmp_path / "run"))
    assert r["rc"] == 0 and [h["step"] for h in r["history"]] == [1, 2, 3], r
    drivers = r["drivers"]
    urls = [d["syncs"][0]["servers"] for d in drivers]
    assert len(urls) == 2 and all(len(u) == 1 for u in urls) and urls[0] != urls[1], urls  # one server each
    # start, after step 1, the restart's re-sync, step 2's (driver 0's failed mid-bucket), the second rebuild's
    # re-sync, after step 3: each completed one verified every tensor on this driver's own server
    assert [s.get("failed", False) for s in drivers[0]["syncs"]] == [False] * 3 + [True] + [False] * 2, drivers[0]
    assert [s.get("failed", False) for s in drivers[1]["syncs"]] == [False] * 6, drivers[1]
    for d, mine in zip(drivers, urls):
        syncs = [s for s in d["syncs"] if not s.get("failed")]
        assert all(s["tensors"] == drivers[0]["syncs"][0]["tensors"] > 0 for s in syncs), d
        assert all(s["servers"] == mine for s in syncs), d  # the same server URL after each restart
        # every answer this driver read came from its own server: each server had one driver
        assert list(d["answers"]) == mine and d["answers"][mine[0]] > 0, d
    g = [s["group"] for s in drivers[0]["syncs"] if not s.get("failed")]
    assert g[0] == g[1] and len({g[0], g[2], g[3]}) == 3 and g[3] == g[4], g  # a new group per rebuild
    g = [s["group"] for s in drivers[1]["syncs"]]
    assert g[0] == g[1] and g[2] == g[3] and g[4] == g[5] and len({g[0], g[2], g[4]}) == 3, g
    assert [h["engine/restarts"] for h in r["history"]] == [0, 2, 2], r["history"]
    for h in r["history"]:  # dynamic sampling: each driver streamed 4 prompts and kept its 2 groups of mixed rewards
        assert h["dynamic_sampling/kept"] == 4 and h["dynamic_sampling/prompts_drawn"] >= 8, h
    for h in r["history"]:  # every rollout ran on synced weights: steps 2 and 3 after the restart's re-sync
        assert h["routing/update/fallback_entries"] == 0, h  # every token replayed SGLang's routes
        assert 0.5 < h["routing/update/agreement"] <= 1.0, h
        # learner log-probs of SGLang's samples equal the server's (fp32) only if the synced weights took effect
        assert h["mismatch/ratio_dev_max"] < 1e-4 and h["mismatch/k3_kl"] < 1e-8, h


def test_trainer_reshard_with_restart_and_a_server_killed_mid_refit(sglang_python, tmp_path):
    """The trainer with rollout.sync_transport=reshard (every learner rank sends its own shards: EP2 learners, 2
    drivers, 2 launched servers): driver 0's server killed after step 1 (rebuilt, a new refit group, both
    re-synced) and again as step 2's shards leave (the sync fails on both ranks, agreed, rebuilt, re-synced).
    Every completed sync passed its per-piece digests; the learner's log-probs of every step's samples equal the
    servers' (the synced weights took effect, bit for bit)."""
    r = _scenario(sglang_python, tmp_path, "train_scenarios.py", "reshard_run", str(tmp_path / "run"))
    assert r["rc"] == 0 and [h["step"] for h in r["history"]] == [1, 2, 3], r
    for rank, mine in enumerate(r["ranks"]):
        syncs = mine["syncs"]
        # start, after step 1 (its rollout then fails on driver 0's dead server: rebuilt), the rebuild's re-sync,
        # step 2's (killed mid-refit), the second rebuild's re-sync, after step 3
        assert [s.get("failed", False) for s in syncs] == [False, False, False, True, False, False], (rank, syncs)
        done = [s for s in syncs if not s.get("failed")]
        assert all(s["bytes"] > 0 and s["pieces"] > 0 for s in done), (rank, syncs)
        groups = [s["group"] for s in done]
        assert groups[0] == groups[1] and len({groups[0], groups[2], groups[3]}) == 3 and groups[3] == groups[4], groups
    assert [h["engine/restarts"] for h in r["history"]] == [0, 2, 2], r["history"]
    for h in r["history"]:
        assert h["mismatch/ratio_dev_max"] < 1e-4 and h["mismatch/k3_kl"] < 1e-8, h


def test_trainer_syncs_the_lora_adapter_alone_and_the_base_to_a_restarted_server(sglang_python, tmp_path):
    """rollout.lora_sync=adapter (model.lora on the attention, TP2+SP learners, a launched server with SGLang's own
    LoRA: --enable-lora and its flags from model.lora): the run's first sync sends the base whole (digest-verified)
    and then the adapter, later syncs the adapter alone -- a few KB where the weights are MBs -- through SGLang's
    /load_lora_adapter_from_tensors, each tensor's sha256 checked inside the server. The server SIGKILLed as step
    1's adapter-only sync posts it the adapter costs that sync only: the guard's rebuild restarts the server from
    the checkpoint and its re-sync sends it the base again, then the adapter. Every step's learner log-probs of the
    server's samples are the server's (fp32: the mismatch bound of every SGLang run here), with adapters that moved:
    the server generated with the learner's adapter, not without it. Then sync_transport=disk: the base reloaded
    from the HF checkpoint the first sync writes, each adapter a PEFT directory the server loads by path
    (/load_lora_adapter), the log-probs the server's again; a SIGTERM as step 1's adapter-only sync loads it stops
    the run with step 1 saved."""
    r = _scenario(sglang_python, tmp_path, "train_scenarios.py", "sglang_lora_adapter", str(tmp_path / "run"))
    assert r["rc"] == 0 and [h["step"] for h in r["history"]] == [1, 2, 3], r
    driver = r["ranks"][0]
    syncs = driver["syncs"]
    print("syncs:", [{k: s[k] for k in ("base_sent", "adapter_tensors", "adapter_bytes", "bytes") if k in s}
                     for s in syncs], "moved:", [rank["moved"] for rank in r["ranks"]],
          "mismatch:", [(h["mismatch/ratio_dev_max"], h["mismatch/k3_kl"]) for h in r["history"]],
          "kl/ref:", [h["kl/ref"] for h in r["history"]], "restarts:", [h["engine/restarts"] for h in r["history"]])
    assert driver["faults"] == {"killed": 1, "sigterm": 1}, driver
    # start; step 1's sync failed (the server killed under it); the rebuild's re-sync; after step 2; after step 3
    assert [s["base_sent"] for s in syncs] == [True, True, False, False], syncs
    assert all(s["adapter_tensors"] == 16 for s in syncs), syncs  # 2 layers x q, k, v, o x (A, B)
    full = syncs[0]["bytes"]
    assert all(0 < s["adapter_bytes"] < full / 10 for s in syncs), (full, syncs)
    assert r["ranks"][1]["syncs"] == [], r["ranks"][1]  # one driver
    assert all(rank["moved"] > 1e-3 for rank in r["ranks"]), r["ranks"]
    # the restart is step 1's (its sync failed and was redone); none after it
    assert [h["engine/restarts"] for h in r["history"]] == [1, 1, 1], r["history"]
    for h in r["history"]:
        assert h["mismatch/ratio_dev_max"] < 1e-4 and h["mismatch/k3_kl"] < 1e-8, h
    # the adapters move the policy away from the base (the KL reference, adapters off) far beyond the mismatch: a
    # server serving the base alone would be that far from the learner
    assert all(h["kl/ref"] > 100 * max(g["mismatch/k3_kl"] for g in r["history"]) for h in r["history"][1:]), \
        r["history"]
    # sync_transport=disk: the base written and reloaded once, each adapter a PEFT directory loaded by path; the
    # SIGTERM in step 1's adapter sync: the run stopped, step 1 saved
    disk = driver["disk_syncs"]
    assert [s["base_sent"] for s in disk] == [True, False] and all("path" in s for s in disk[:1]), disk
    assert r["disk_dir"] == [".rlpo_mega_output", "adapter_config.json", "adapter_model.safetensors"], r["disk_dir"]
    assert r["disk_stopped"] and r["disk_saved"] == ["step_00000001"], r
    assert [h["step"] for h in r["disk_history"]] == [1], r["disk_history"]
    for h in r["disk_history"]:
        assert h["mismatch/ratio_dev_max"] < 1e-4 and h["mismatch/k3_kl"] < 1e-8 and h["kl/ref"] > 0, h


def test_launched_servers_stop_with_the_job_and_the_resume_has_one_fewer(sglang_python, tmp_path):
    """Two servers the trainer launched on its one driver (num_servers=2, drivers=1) pass the first sync and train;
    a SIGTERM to the learners and the servers together (scancel --signal=TERM) in step 2's sync, with the servers
    dead when it runs, saves step 2 and exits 75 with no rebuild; the resume with one server fewer is stopped the
    same way in step 3's rollout (at the driver's first answer; step 2 is not saved again); the next resume
    trains step 3 on the prompts the stopped rollout was sent. Every step trained once, none lost; every
    step's learner log-probs equal the servers' (the resumed server was given the checkpoint's weights)."""
    r = _scenario(sglang_python, tmp_path, "faults.py", str(tmp_path / "run"), "sglang")
    a, b, c = r["a"], r["b"], r["c"]
    assert a["rc"] == EXIT_STOPPED and a["stopped"] and a["steps"] == [1, 2] and a["saved"] == [1, 2], a
    # step 1's sync: the second server died as its bucket was sent; the bucket failed at once on the driver's side
    # (it dropped the group: the live server's receive failed instead of holding the call for control_timeout,
    # 300 s: under half of that, whatever the machine's load) and the sync was retried under the guard
    assert len(a["killed"]) == 1 and len(a["failed_syncs"]) == 2 and a["failed_syncs"][0] < 150, a
    assert a["restarts"] == [1, 1], a
    assert b["rc"] == EXIT_STOPPED and b["stopped"] and b["steps"] == [] and b["saved"] == [1, 2], b
    assert b["saves"] == [], b  # the last completed step was on disk already
    assert c["rc"] == 0 and c["steps"] == [3] and c["alive"] == [1] and c["saved"][-1] == 3, c  # (keep_last 2)
    trained = {}
    for run in (a, b, c):
        for per_rank in run["trained"]:
            for step, prompts in per_rank.items():
                trained.setdefault(int(step), []).extend(tuple(p) for p in prompts)
    assert sorted(trained) == [1, 2, 3] and all(len(p) == 16 for p in trained.values()), trained  # once each
    assert b["sent"]["3"] == c["sent"]["3"], (b["sent"], c["sent"])  # the stopped rollout's prompts, trained
    assert set(trained[3]) == set(map(tuple, c["sent"]["3"])), trained[3]
    assert all(m < 1e-4 for m in a["mismatch"] + c["mismatch"]), (a, c)


def test_reshard_a_server_killed_mid_refit_then_a_stop_in_the_sync_saves(sglang_python, tmp_path):
    """rollout.sync_transport=reshard under the fault harness's stop (tests/workers/faults.py, run a), with the
    servers in block FP8 (rollout.weights=fp8: each learner rank quantises the pieces it sends): two launched
    servers on one driver; the second SIGKILLed as step 1's shards leave (the sync fails at once on both ranks and is
    retried under the guard); then SIGTERM to learners and servers together in step 2's sync (the servers dead when
    it runs): the stop wins over the failure, step 2 is saved and the run exits 75. (bf16 reshard: the kill in the
    refit is test_trainer_reshard_with_restart_and_a_server_killed_mid_refit's and test_refit_transport's.)"""
    r = _scenario(sglang_python, tmp_path, "faults.py", str(tmp_path / "run"), "sglang", "reshard", "fp8",
                  model="configs/models/tiny_qwen3_moe_fp8.json")
    a = r["a"]
    assert a["rc"] == EXIT_STOPPED and a["stopped"] and a["steps"] == [1, 2] and a["saved"] == [1, 2], a
    assert len(a["killed"]) == 1 and len(a["failed_syncs"]) == 2 and a["failed_syncs"][0] < 150, a
    assert a["restarts"] == [1, 1], a
    # what FP8 costs, not a server on other weights: k3 KL server vs learner 7e-4 / 2.3e-4 here (2026-11-30),
    # 2e-5 to 3e-3 in tools/bench_fp8.py's runs; the bf16 cells' exactness check (< 1e-4 ratio) cannot hold in FP8
    assert all(0 < k < 1e-2 for k in a["k3"]), a


def test_trainer_sigterm_while_server_hangs(sglang_python, tmp_path):
    """After step 1 the server is frozen (SIGSTOP: it still accepts connections, never answers). Step 2's
    rollout waits; SIGTERM to rank 0 meanwhile: the wait ends, every rank saves step 1 and the run exits."""
    r = _scenario(sglang_python, tmp_path, "train_scenarios.py", "sglang_hang_sigterm", str(tmp_path / "run"))
    assert r["rc"] == 0 and r["stopped"] and [h["step"] for h in r["history"]] == [1], r
    assert r["saved"] == ["step_00000001"] and r["save_on_signal"], r  # the SIGTERM save: no checksum re-read
    # the wait ends at once (aborts bounded by health_timeout, 5 s), not at request_timeout or hang_timeout
    # (600 s here); the save and the server's shutdown follow (the bounds leave room for a loaded machine)
    assert r["sigterm_to_save_s"] < 60 and r["sigterm_to_exit_s"] < 180, r
    print(f"SIGTERM -> save {r['sigterm_to_save_s']:.1f} s, -> exit {r['sigterm_to_exit_s']:.1f} s")


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_trainer_sglang_async_partial_rollout(sglang_python, tmp_path, kv):
    """Asynchronous RL on a launched SGLang server: max_staleness=1 with partial rollout, 4 steps of 64 tokens, so
    that each sync lands while the next step generates. The server names the weight version of every answer;
    each matched the version its request was sent on (or the run would have stopped); continued samples keep
    their routes (every token replayed, no fallback) and carry two versions, the older one step behind.
    kv=keep (rollout.partial_rollout_kv): the syncs hold the running requests in place instead of aborting them,
    and the server's own spans name each token's version: one engine call per step, nothing sent again."""
    r = _scenario(sglang_python, tmp_path, "train_scenarios.py",
                  "sglang_async" if kv == "recompute" else "sglang_async_keep", str(tmp_path / "run"))
    hist = r["history"]
    assert r["rc"] == 0 and [h["step"] for h in hist] == [1, 2, 3, 4], r
    if kv == "keep":  # held, not aborted: each step's samples come from its one call, none continued or restarted
        assert all(h["async/engine_calls"] == 1 and h["async/continue_s"] == 0 and h["async/restarted_samples"] == 0
                   for h in hist), hist
        assert sum(h["async/held_s"] for h in hist) > 0, hist  # the syncs ran under the calls
    for h in hist:
        assert h["routing/update/fallback_entries"] == 0, h  # every token replayed the server's routes
        assert h["async/versions_confirmed"] >= 16 and h["async/stale_dropped_groups"] == 0, h
    assert sum(h["async/continued_samples"] for h in hist) > 0, hist  # the syncs did interrupt generation
    samples = r["samples"]
    assert len(samples) == 4 * 16 and all(s["routes"] for s in samples)
    for s in samples:
        versions = [v for v, _ in s["versions"]]
        assert versions == sorted(versions) and s["step"] - 1 <= versions[0] and versions[-1] <= s["step"], s
        assert sum(n for _, n in s["versions"]) == s["len"], s
    assert any(len(s["versions"]) == 2 for s in samples)


def test_colocated_sglang_server_hands_the_memory_over_in_one_order(sglang_python, tmp_path):
    """rollout.colocate=true with a launched CPU SGLang server (2 learner processes, GSPO + R3, the weights by
    update_weights_from_tensor), and the same run apart, same seeds: the hand-over changes no number -- per step the
    losses, rewards, advantages and every learner metric are equal, and the final weights on every rank. The driver's
    calls follow the one order (training/colocate.py): the weights resumed before every sync, the KV cache (and CUDA
    graphs) after it, everything released after each rollout, never a tag resumed that was not released; the server
    generates on exactly the learner's weights after every sync (the learner's log-probs of its samples equal its own).
    The server samples with each request's seed (--enable-deterministic-inference, which SGLang's CPU build takes
    through tests/sglang_support's plugin) and has no prefix cache: its samples depend on seed, prompt and weights.
    What differs between the runs is the server's own log-probs (batch composition; sglang's batch-invariant kernels
    are triton's, CUDA only): the mismatch/ metrics, at 1e-7. SGLang's CPU build has no torch_memory_saver, so
    release and resume free nothing here."""
    r = _scenario(sglang_python, tmp_path, "train_scenarios.py", "sglang_colocate", str(tmp_path / "run"))
    apart = r["apart"]
    own = ("time", "perf/", "colocate/", "sync/", "memory/", "mismatch/")  # clocks, the hand-over's, the server's
    # colocated_reshard: the same colocated run with rollout.sync_transport=reshard (each server rank's shard packed
    # on its "GPU"): the same numbers, so the same weights reached the server
    for run in ("colocated", "colocated_reshard"):
        colocated = r[run]
        assert [h["step"] for h in apart] == [h["step"] for h in colocated] == [1, 2, 3]
        for a, c in zip(apart, colocated):
            assert c["mismatch/ratio_dev_max"] < 1e-4 and a["mismatch/ratio_dev_max"] < 1e-4, (a, c)
            assert c["reward/samples"] == a["reward/samples"] == 16
            assert c["colocate/learner_offloaded_bytes"] > 0 and "colocate/offload_s" not in a
            learner = sorted(k for k in a if not k.startswith(own))
            assert "loss/policy" in learner and "reward/mean" in learner, learner
            differ = {k: (a[k], c.get(k)) for k in learner if a[k] != c.get(k)}
            assert not differ, (run, differ)
    assert r["weights_equal"] == r["weights_equal_colocated_reshard"] == [True, True]
    # the server started with the learner's state off the launching rank's (emulated) GPU, its KV pool sized for
    # the memory it will have (rollout.colocate, HandOver.before_launch); apart, the state stays where it is
    at_launch = r["learner_bytes_at_launch"]
    assert at_launch["colocated"] == [0] and at_launch["apart"][0] > 0, at_launch
    assert not any("memory_occupation" in c for c in r["calls"]["apart"])
    # the colocated driver's memory calls and weight loads, in order: before every sync everything released (the
    # first: a fresh server holds its KV cache too) and the weights resumed, the sync's load; before every rollout
    # the KV cache (and CUDA graphs) resumed
    seen = [c for c in r["calls"]["colocated"] if "memory_occupation" in c or c == "/update_weights_from_tensor"]
    load, kv = "/update_weights_from_tensor", "/resume_memory_occupation ['kv_cache', 'cuda_graph']"
    sync = ["/release_memory_occupation ['weights', 'kv_cache', 'cuda_graph']", "/resume_memory_occupation ['weights']",
            load]
    assert seen == sync + ([kv] + sync) * 3, seen
    # reshard's loads are its report hook's requests (_hook_request), not weight posts: the same memory order
    seen = [c for c in r["calls"]["colocated_reshard"] if "memory_occupation" in c]
    assert seen == sync[:2] + ([kv] + sync[:2]) * 3, seen


def test_two_external_servers_on_one_driver_failover_and_rejoin(sglang_python, tmp_path):
    """The issue's first-sync failure, as a new user meets it: the demo (in_process sync) with
    `rollout.engine=sglang rollout.sglang.urls=[two servers]` and one driver, the servers started as the sbatch
    starts them (launch/sglang_server.py). Before the per-driver TCP store was made once, the digest reports of
    the two servers raced to create it and the first sync failed after control_timeout. Then one server is
    SIGKILLed after step 1: step 2's requests to it go to the other and it leaves the weight group (no rebuild);
    started again after step 2, it rejoins at step 3's sync with the full weights, digest-verified, and step 4
    generates on both; SIGKILLed again half-way through step 4's sync, the sync fails, the engine is rebuilt once
    and the re-sync leaves it out: step 5 generates on the other. Every step's learner log-probs equal the
    servers' (fp32): every sample came from synced weights, the rejoined server's included. The servers are keyed as
    the sbatch's are (the job's key in RLPO_SGLANG_KEY, the trainer's environment holding the same): the run is
    unchanged, every request carrying the key (the restarted server too)."""
    from launch.sglang_server import SGLangServer

    hf = load_hf_config(os.path.join(ROOT, FAMILIES["qwen3_moe"]))
    ckpt = str(tmp_path / "hf")
    make_hf_checkpoint(hf, ckpt)
    key = "trainer-test-job-key-" + "t" * 24
    servers = [SGLangServer(ckpt, port=free_port(), server_args=SERVER_ARGS, python=sglang_python,
                            log_dir=str(tmp_path / "logs"), api_key=key,
                            env={"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": os.path.join(SUPPORT, "path")})
               for _ in range(2)]
    try:
        for s in servers:
            s.start(240)
        urls = [s.url for s in servers]
        r = torchrun("train_scenarios.py", 2, "sglang_external_failover", str(tmp_path / "run"), timeout=900,
                     env=_trainer_env(sglang_python, ckpt, RLPO_SGLANG_URLS=",".join(urls), RLPO_SGLANG_KEY=key,
                                      RLPO_SGLANG_PIDS=",".join(str(s.proc.pid) for s in servers)))
    finally:
        for s in servers:
            s.stop()
    hist = r["history"]
    assert r["rc"] == 0 and not r["stopped"] and [h["step"] for h in hist] == [1, 2, 3, 4, 5], r
    assert [h["engine/servers_alive"] for h in hist] == [2, 1, 2, 1, 1], hist
    assert hist[-1]["engine/servers_lost"] == 2 and hist[-1]["engine/server_rejoins"] == 1, hist[-1]
    # no rebuild for a death in the rollout (the failover is the engine's); one for the death mid-sync
    assert [h["engine/restarts"] for h in hist] == [0, 0, 0, 1, 1], hist
    answers = r["answers"]
    assert set(answers["1"]) == set(urls) and set(answers["4"]) == set(urls), answers  # both generate
    for step in ("2", "3", "5"):
        assert set(answers[step]) == {urls[0]}, answers  # the dead one is out
    for h in hist:
        assert h["routing/update/fallback_entries"] == 0, h  # every token replayed SGLang's routes
        assert h["mismatch/ratio_dev_max"] < 1e-4, h  # the servers held the synced weights
