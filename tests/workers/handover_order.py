"""2 ranks, rollout.colocate's hand-over (training/colocate.HandOver) with rank 1's offload and onload made slow (a
rank whose copies to the host take longer, as the first pinned offload does): every rank records when its state left
and returned, rank 0 (the driver) when it asked the engine to take memory back or give it up. Rank 0 reports every
rank's events, in wall-clock time (one machine). The engine is a recorder of those calls: what is under test is the
order the hand-over makes across ranks, not a server."""
import time

import torch
import torch.distributed as dist

import rlpo_mega.rollout.engines as engines_module
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.residency import Residency
from rlpo_mega.rollout.engines import EngineGuard, EngineSlot, StopRequested
from rlpo_mega.training.colocate import HandOver
from tests.dist import write_report

dist.init_process_group("gloo")
rank = dist.get_rank()
group = distributed.control_group(120.0)
events = []  # (time, rank, phase, what)
current = ["launch"]
SLOW = 0.5 if rank == 1 else 0.0


def note(what):
    events.append((time.time(), rank, current[0], what))


class SlowResidency(Residency):
    def offload(self):
        time.sleep(SLOW)
        out = super().offload()
        note("offloaded")
        return out

    def onload(self):
        note("onload")
        time.sleep(SLOW)
        return super().onload()


class Recorder:
    """The driver's engine: the calls the hand-over makes, timed."""
    def release_memory(self):
        note("release")

    def resume_memory(self, what):
        note(f"resume {what}")


def launched(sg, model, node, nodes, colocate, extra_args=None):  # extra_args: rollout.weights=fp8 only
    note("launch")
    return []


engines_module.launch_node_servers = launched
engines_module.build_engine = lambda cfg, hf: Recorder() if rank == 0 else None
engines_module.make_transport = lambda cfg, engine, hf: None
cfg = load_config(None, ("rollout.engine=sglang", "rollout.sglang.launch=true", "rollout.colocate=true"))
state = torch.arange(1000, dtype=torch.float32)
handover = HandOver(True, SlowResidency(lambda: [state]), group)
slot = EngineSlot(cfg, None, group=group, before_launch=handover.before_launch)  # launches: the learner off first


def sync():
    with handover.weights_out():
        note("sync")


guard = EngineGuard(slot, sync, restarts=0, group=group)
handover.attach(slot, guard)


def phase(name, fn):
    dist.barrier(group=group)
    current[0] = name
    fn()
    dist.barrier(group=group)


phase("learner_in", handover.learner_in)
phase("first_sync", lambda: guard.run(sync))


def rollout():
    with handover.generation():
        note("generate")


phase("generation", rollout)


def resync_mid_generation():  # a rebuild's re-sync in the middle of generation (the learner off)
    with handover.generation():
        guard.run(sync)
        note("generate")


phase("resync", resync_mid_generation)


def stopped():
    try:
        with handover.generation():
            raise StopRequested("stop requested while waiting for the engine")
    except StopRequested:
        note("stopped")


phase("stop", stopped)
every = [None] * dist.get_world_size()
dist.all_gather_object(every, events, group=group)
if rank == 0:
    report = {}
    for t, r, name, what in sorted(e for evs in every for e in evs):  # each phase's events, all ranks, in time order
        report.setdefault(name, []).append([r, what])
    write_report(report)
dist.destroy_process_group()
