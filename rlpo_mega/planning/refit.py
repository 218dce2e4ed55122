"""`rlpo-mega plan`'s refit table: for each weight-sync transport, the bytes one sync moves through the busiest
learner GPU and into the busiest server GPU, and its time bound by the links at the cluster's stated speeds, at the
recipe's real size. A user picks a transport before queueing.

The model is the bytes on each link, not a simulation: every GPU's traffic is split by link -- NVLink to a GPU of its
own node, its NIC to another node's, PCIe to its host, the node's storage -- each link runs at its stated speed in
each direction at once, and a sync takes as long as its busiest link of any GPU or node. Latency, the receivers' own
per-tensor cost (sglang#30848) and the senders' digests are not in it: the figure is the least a sync can take.

How each transport moves the weights (what the code does, named where it is done):
- in_process, sglang_distributed and disk funnel (moe/bridge/megatron_io.ExportStream with dst=the drivers): each
  parameter's leader (its lowest holding rank) gathers it over its TP group and sends it whole to every driver, which
  then hands its servers the whole model -- in_process through host shared memory (update_weights_from_tensor: a
  server on the driver's host), sglang_distributed by one NCCL broadcast to every TP rank of its servers, disk as an
  HF checkpoint each server rank reads.
- colocated (rollout.colocate): the export broadcasts every tensor to every learner rank, and the rank on each
  server rank's GPU hands it over by CUDA IPC (sglang_payloads): no link past the broadcast.
- reshard: moe/bridge/reshard.reshard_plan, each learner rank's own shards to the server ranks holding them
  (rlpo_mega/weight_sync/reshard.py follows it: one group of every learner rank and server TP rank; colocated, the
  learner ranks exchange the pieces so that the rank on each server rank's GPU packs them, handed over by CUDA IPC:
  the same traffic, a piece already on its server rank's GPU moving over no link)."""
from __future__ import annotations

import copy
import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from moe.bridge.peft import sglang_adapter_numel
from moe.bridge.reshard import (CannotPlan, LearnerLayout, ModelSpec, ServerLayout, box_numel, learner_shards,
                                reshard_plan, server_shard_bytes)
from rlpo_mega.planning.rows import GB
from rlpo_mega.shares import share_of
from rlpo_mega.weight_sync.sglang_payloads import placements
from rlpo_mega.rollout.sglang_plan import planned_servers

TRANSPORTS = ("in_process", "sglang_distributed", "disk", "reshard")

Gpu = tuple[int, int]  # (node, local index)


@dataclass
class Links:
    """Bytes per GPU and direction on each link, and per node to and from storage."""
    nvlink: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # gpu -> [out, in]
    nic: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    pcie: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # gpu -> [to host, from host]
    storage: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # node -> [write, read]
    sent: dict = field(default_factory=lambda: defaultdict(int))  # gpu -> bytes it sends to other GPUs or its host
    received: dict = field(default_factory=lambda: defaultdict(int))

    def move(self, src: Gpu, dst: Gpu, nbytes: int):
        if src == dst or not nbytes:  # the same GPU: a CUDA IPC handle, no copy over a link
            return
        link = self.nvlink if src[0] == dst[0] else self.nic
        link[src][0] += nbytes
        link[dst][1] += nbytes
        self.sent[src] += nbytes
        self.received[dst] += nbytes

    def to_host(self, gpu: Gpu, nbytes: int):
        self.pcie[gpu][0] += nbytes
        self.sent[gpu] += nbytes

    def from_host(self, gpu: Gpu, nbytes: int):
        self.pcie[gpu][1] += nbytes
        self.received[gpu] += nbytes

    def seconds(self, c) -> float:
        """The busiest link's time: every link of every GPU at once, each direction apart (a transport sends bucket
        after bucket, so its stages overlap); storage after: a checkpoint is written whole, then read."""
        speeds = ((self.nvlink, c.nvlink_gb_per_s), (self.nic, c.nic_gb_per_s), (self.pcie, c.host_device_gb_per_s))
        links = max([max(v) / (speed * GB) for link, speed in speeds for v in link.values()], default=0.0)
        writes, reads = zip(*self.storage.values()) if self.storage else ((0,), (0,))
        return links + (max(writes) + max(reads)) / (c.storage_gb_per_s * GB)


@dataclass
class RefitRow:
    transport: str
    unavailable: Optional[str] = None  # why this transport cannot sync this recipe's servers
    learner_sent: int = 0  # the busiest learner GPU's bytes out (to other GPUs and its host)
    server_received: int = 0  # the busiest server GPU's bytes in
    server_shard: int = 0  # that server GPU's own shard of the model (what it holds)
    seconds: float = 0.0
    configured: bool = False  # the recipe's rollout.sync_transport


@dataclass
class Placement:
    """Where everything sits: the learner's GPUs, each server's TP ranks, its driver."""
    learner: list  # global rank -> Gpu
    servers: list  # server -> [Gpu per TP rank]
    driver_of: list  # server -> driver's global rank
    colocated: bool
    same_host: bool  # every server on its driver's node (in_process's shared memory reaches it)


def placement(cfg, world_size: int, drivers: list[int]) -> Placement:
    c, sg = cfg.cluster, cfg.rollout.sglang
    local = min(c.gpus_per_node, world_size)
    learner = [divmod(r, local) for r in range(world_size)]
    tp = sg.tp_size
    if cfg.rollout.colocate:  # the servers on the learner's GPUs, as the engine places them
        placed = placements(world_size, local, sg.num_servers, tp, drivers)
        servers = [[learner[r] for r in p.producers] for p in placed]
        owner = [p.driver for p in placed]
    else:
        n = planned_servers(cfg)
        owner = [drivers[d] for d in range(len(drivers)) for _ in share_of(range(n), d, len(drivers))]
        if c.rollout_nodes:  # servers on nodes of their own, after the learner's, GPUs in order
            first = (world_size + c.gpus_per_node - 1) // c.gpus_per_node
            servers = [[divmod(s * tp + r, c.gpus_per_node) for r in range(tp)] for s in range(n)]
            servers = [[(first + node, gpu) for node, gpu in ranks] for ranks in servers]
        else:  # on the GPUs the learner leaves free on its driver's node
            servers = [[(learner[owner[s]][0], local + s * tp + r) for r in range(tp)] for s in range(n)]
    same = all(g[0] == learner[owner[s]][0] for s, ranks in enumerate(servers) for g in ranks)
    return Placement(learner, servers, owner, bool(cfg.rollout.colocate), same)


def _funnel(model: ModelSpec, lay: LearnerLayout, place: Placement) -> Links:
    """The export's part of in_process, sglang_distributed and disk: every tensor gathered over its leader's TP group
    and sent whole to every driver."""
    links, drivers, memo = Links(), sorted(set(place.driver_of)), {}
    for spec in model.tensors:
        shards = learner_shards(spec, model, lay, memo)
        group = [min(holders) for _, holders in shards]  # the leader's TP group: each shard's first holder
        leader = min(group)
        if len(group) > 1:  # all_gather: each member sends its shard to each other member
            for (box, _), member in zip(shards, group):
                for other in group:
                    if other != member:
                        links.move(place.learner[member], place.learner[other], box_numel(box) * spec.dtype.itemsize)
        for d in drivers:
            links.move(place.learner[leader], place.learner[d], spec.nbytes)
    return links


def _colocated_broadcast(model: ModelSpec, lay: LearnerLayout, place: Placement, links: Links):
    """rollout.colocate: each tensor from its leader to every learner rank (a ring broadcast: each rank receives it and
    passes it on); the ranks on server GPUs hand it over by CUDA IPC."""
    world, memo = len(place.learner), {}
    for spec in model.tensors:
        leader = min(min(holders) for _, holders in learner_shards(spec, model, lay, memo))
        ring = [(leader + i) % world for i in range(world)]
        for a, b in zip(ring, ring[1:]):
            links.move(place.learner[a], place.learner[b], spec.nbytes)


@functools.lru_cache(maxsize=8)
def _reshard_plan(model: ModelSpec, lay: LearnerLayout, servers: tuple):
    """reshard_plan once per layout in a process (seconds at a recipe's real size: a plan at two length
    distributions, `check` then `plan`, asks for the same one)."""
    return reshard_plan(model, lay, list(servers))


@dataclass
class Refit:
    """A plan's refit table."""
    rows: list  # RefitRow per transport
    model_bytes: int  # the policy's export in bf16: what one sync moves
    speeds: dict  # link -> GB/s each direction (cluster.*_gb_per_s)
    fp8_bytes: Optional[int] = None  # rollout.weights=fp8: the model as the servers receive it (codes and scales)
    # model.lora: the adapter as SGLang receives it in bf16 (what a rollout.lora_sync=adapter sync sends each server,
    # moe/bridge/peft.sglang_adapter); the merged sync moves model_bytes
    adapter_bytes: Optional[int] = None

    def to_json(self) -> dict:
        return {"model_bytes": self.model_bytes, "fp8_bytes": self.fp8_bytes, "adapter_bytes": self.adapter_bytes,
                "speeds_gb_per_s": self.speeds,
                "transports": [r.__dict__ for r in self.rows]}


def refit_plan(cfg, hf, layout, world_size: int, drivers: list[int]) -> Refit:
    """One row per transport for this recipe's learner and servers (rollout.engine=sglang)."""
    c, sg = cfg.cluster, cfg.rollout.sglang
    model = ModelSpec.of(hf, torch.bfloat16)
    fp8 = cfg.rollout.weights == "fp8"
    # what reshard plans: rollout.weights=fp8, the FP8 weights' codes and scales (moe/bridge/reshard.py)
    served_model = ModelSpec.of(hf, torch.bfloat16, fp8=True) if fp8 else model
    lay = LearnerLayout(world_size, layout.tensor, layout.pipeline, layout.expert, layout.expert_tensor,
                        cfg.model.vocab_divisible_by)
    place = placement(cfg, world_size, drivers)
    server = ServerLayout(sg.tp_size, int(sg.server_args.get("ep_size", 1) or 1))
    shard = max(server_shard_bytes(served_model, server))
    served = served_model.nbytes  # what the drivers hand their servers
    funnel = None  # the export's traffic, shared by the transports that funnel through the drivers
    rows = []
    for name in TRANSPORTS:
        row = RefitRow(name, configured=name == cfg.rollout.sync_transport)
        links = Links()
        if name == "in_process" and not place.same_host:
            row.unavailable = "servers on another node than their driver (host shared memory does not reach them)"
        elif name == "sglang_distributed" and place.colocated:
            row.unavailable = "servers on the learner's GPUs (NCCL takes one rank per GPU)"
        elif name == "reshard":
            try:
                plan = _reshard_plan(served_model, lay, (server,) * len(place.servers))
            except CannotPlan as e:
                row.unavailable = str(e)
            else:
                for t in plan.transfers:
                    links.move(place.learner[t.src], place.servers[t.server][t.rank], t.nbytes)
        elif place.colocated and name == "in_process":
            _colocated_broadcast(model, lay, place, links)
        else:
            if funnel is None:
                funnel = _funnel(model, lay, place)
            # every driver then holds the whole model (FP8: quantised there, moe/bridge/fp8.QuantizedStream)
            links, whole = copy.deepcopy(funnel), served
            for d in sorted(set(place.driver_of)):
                dgpu = place.learner[d]
                ranks = [g for s, gpus in enumerate(place.servers) if place.driver_of[s] == d for g in gpus]
                if name == "in_process":  # the driver's copy in host shared memory, each server rank copies it in
                    links.to_host(dgpu, whole)
                    for g in ranks:
                        links.from_host(g, whole)
                elif name == "sglang_distributed":
                    # one NCCL broadcast over the driver's weight-update group (itself and every TP rank of its
                    # servers: sglang_distributed.py), a ring through them
                    ring = [dgpu] + ranks
                    for a, b in zip(ring, ring[1:]):
                        links.move(a, b, whole)
                else:  # disk: the driver writes an HF checkpoint, then each server rank reads it whole -- from
                    # storage once per node (the page cache serves the node's other ranks)
                    links.to_host(dgpu, whole)
                    links.storage[dgpu[0]][0] += whole
                    for node in sorted({g[0] for g in ranks}):
                        links.storage[node][1] += whole
                    for g in ranks:
                        links.from_host(g, whole)
        if row.unavailable is None:
            learner_gpus = set(place.learner)
            server_gpus = {g for ranks in place.servers for g in ranks}
            row.learner_sent = max((links.sent[g] for g in learner_gpus), default=0)
            row.server_received = max((links.received[g] for g in server_gpus), default=0)
            row.server_shard = shard
            row.seconds = links.seconds(c)
        rows.append(row)
    lo = cfg.model.lora
    adapter = (sglang_adapter_numel(hf, lo.rank, lo.targets, lo.expert_layout) * torch.bfloat16.itemsize
               if lo.rank else None)
    return Refit(rows, model.nbytes, {"nvlink": c.nvlink_gb_per_s, "nic": c.nic_gb_per_s,
                                      "pcie": c.host_device_gb_per_s, "storage": c.storage_gb_per_s},
                 served if fp8 else None, adapter)


def render_refit(refit: Refit) -> list[str]:
    v = refit.speeds
    fp8 = f", {refit.fp8_bytes / GB:.1f} GB to FP8 servers" if refit.fp8_bytes else ""
    if refit.adapter_bytes:  # the table is the merged sync's; the adapter sync moves this much to each server
        fp8 += f" merged, the LoRA adapter alone {refit.adapter_bytes / GB:.2f} GB (rollout.lora_sync=adapter)"
    out = ["", f"refit (one weight sync, {refit.model_bytes / GB:.1f} GB in bf16{fp8}; link-bound at NVLink "
               f"{v['nvlink']:g}, NIC {v['nic']:g}, PCIe {v['pcie']:g} GB/s per GPU and storage {v['storage']:g} GB/s per node, each "
               f"direction (cluster.*_gb_per_s); no latency, no receiver's per-tensor cost)"]
    rows = refit.rows
    head = ["transport", "busiest learner GPU out (GB)", "busiest server GPU in (GB)", "its shard (GB)", "time (s)"]
    table = []
    for r in rows:
        name = r.transport + (" *" if r.configured else "")
        if r.unavailable:
            table.append([name, f"n/a: {r.unavailable}"])
        else:
            table.append([name, f"{r.learner_sent / GB:.1f}", f"{r.server_received / GB:.1f}",
                          f"{r.server_shard / GB:.1f}", f"{r.seconds:.2f}"])
    widths = [max(len(line[i]) for line in [head] + [t for t in table if len(t) > 2]) for i in range(len(head))]
    out.append("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for line in table:
        if len(line) == 2:
            out.append(line[0].ljust(widths[0]) + "  " + line[1])
        else:
            out.append("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(line, widths))))
    out.append("  * this recipe's rollout.sync_transport; reshard: each learner rank's own shards to the server ranks "
               "holding them (moe/bridge/reshard.py; rlpo_mega/weight_sync/reshard.py)")
    return out


__all__ = ["Links", "Refit", "RefitRow", "TRANSPORTS", "placement", "refit_plan", "render_refit"]
