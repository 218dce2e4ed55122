"""rollout.partial_rollout_kv=keep on its bad days (tests/test_faults.py), one process: the async producer with
partial rollout holding the running requests in place across each sync, on two stub SGLang servers that hold
(tests/model_sglang.py: /pause_generation in_place, /continue_generation, kill()), the composition matrix's
single-answer task (tests/workers/composition_matrix.py), 3 steps, each saved.

  clean:   uninterrupted.
  stop:    a SIGTERM once step 2's sync has held the servers: step 2 saved, exit 75, no server left held.
  resumed: the stop resumed: step 3 trains what the clean run's step 3 trained.
  dead:    the second server dies (kill) while held in step 1's sync: its requests are sent again to the first
           (held too: they wait for the new weights), the sync and the run go on without it.

argv: out_dir data_dir. Writes {run: {"rc", "stopped", "steps", "saved", "trained", "held", "pauses",
"continues", "history", "checks", "groups"}}."""
import json
import os
import sys

from rlpo_mega.checkpoint import run as state
from rlpo_mega.rollout.sglang_engine import SGLangEngine
from rlpo_mega.training.trainer import train
from tests.dist import write_report
from tests.workers.async_scenarios import recorded, slow_mid_call
from tests.workers.composition_matrix import _groups, cell_config, sglang_extra, stub_servers
from tests.workers.faults import Faults
from tests.workers.multi_turn import _check_episodes

KEEP = ("rollout.partial_rollout_kv=keep", "checkpoint.save_every=1")


class Holds(Faults):
    """Faults at the hold: phase "hold" fires the SIGTERM once the sync after step `at` has held the servers;
    kill_at: `victim` dies right after the sync after that step held it."""

    def __init__(self, *args, victim=None, kill_at=None, **kw):
        super().__init__(*args, **kw)
        self.victim, self.kill_at = victim, kill_at

    def __enter__(self):
        super().__enter__()
        f, self.orig_pause = self, SGLangEngine.pause

        def pause(engine):
            f.orig_pause(engine)
            if f.trainer.started:  # a step's sync (the run's first holds nothing)
                f.fire("hold", f.trainer.step)
                if f.kill_at == f.trainer.step and not f.victim.dead:
                    f.victim.kill()
        SGLangEngine.pause = pause
        return self

    def __exit__(self, *exc):
        SGLangEngine.pause = self.orig_pause
        return super().__exit__(*exc)


def _run(out, data, name, *more, first_version=0, **faults):
    run_dir, ck = os.path.join(out, name), os.path.join(out, "ckpt_" + name.split("_")[0])
    servers = stub_servers()
    if "kill_at" in faults:
        faults["victim"] = servers[1]
    cfg = cell_config(run_dir, data, sglang_extra(servers), "async", "single", "all",
                      f"checkpoint.save_dir={ck}", *KEEP, *more)
    trained: dict = {}
    try:
        with recorded(trained), Holds(**faults) as f:
            rc = train(cfg, keep_world=True)
    finally:
        held = [s.held for s in servers]  # before close() lets a held one go
        for s in servers:
            s.close()
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        history = [json.loads(line) for line in fh]
    return {"rc": rc, "stopped": f.trainer.stopped, "steps": [h["step"] for h in history if "reward/mean" in h],
            "saved": state.complete_steps(ck), "trained": {s: p for s, p in f.trained.items()},
            "held": held, "pauses": [s.pauses for s in servers], "continues": [s.continues for s in servers],
            "requests": [s.requests for s in servers], "history": history,
            "checks": _check_episodes(trained, versioned=True, first_version=first_version), "groups": _groups(trained)}


if __name__ == "__main__":
    out, data = sys.argv[1:]
    # a slow engine: the next step's calls still run when the learner syncs, after their first tokens (a stub server
    # answers one request at a time: 4 requests of 6 tokens each, the others queued on it)
    with slow_mid_call("0.08"):
        report = {"clean": _run(out, data, "clean"),
                  "stop": _run(out, data, "stop", phase="hold", at=2),
                  "resumed": _run(out, data, "stop_resumed", "checkpoint.resume=true", "checkpoint.overwrite=false",
                                      first_version=2),
                  "dead": _run(out, data, "dead", "trainer.engine_restarts=1", kill_at=1)}
    write_report(report)
