"""The `reshard` weight-sync transport: every learner rank sends its own shards to the SGLang server ranks that
hold them, following moe/bridge/reshard.reshard_plan; no rank gathers the model, a server rank receives only its
own slice (issue 60).

One process group joins every learner rank (its ranks 0..L-1) with every TP rank of every live server (after them,
server by server, in driver order): gloo on CPU, NCCL on GPU. Inside each server the project's report hook
(launch/rlpo_sglang_hooks.py, the loader SGLang runs in every TP worker through /update_weights_from_tensor) joins
it with SGLang's own group constructor, makes the same plan from the same inputs, receives its pieces bucket by
bucket (plan_buckets: both sides cut the plan alike) and loads each tensor's region through the O(1) receiver
(launch/rlpo_sglang_receiver.Receiver.load_regions). A sync:

  drivers   refresh their servers, read each one's layout (/server_info); every rank learns every server's
  all       (re)make the group where its members changed (a server restarted or lost)
  drivers   open the update session and post each server the sync request (it returns once received and loaded)
  all       send their pieces, bucket by bucket, in plan order; digest each piece sent
  drivers   read each server rank's digests of the pieces it holds, read back from its parameters
  all       agree: every piece's digests compared (DigestMismatchError), every failure raised on every rank

Colocated servers (rollout.colocate: the servers on the learner's own GPUs, where NCCL refuses a second rank of one
communicator on a GPU) take the same plan by CUDA IPC instead of a group: bucket by bucket the learner ranks exchange
the pieces among themselves (point to point over the learner's group), so that the learner rank on each server
rank's GPU holds that rank's pieces; it packs them into one byte tensor on its GPU (moe/bridge/reshard.packed_offsets)
and relays the tensor's IPC handle to the server's driver (sglang_payloads.PayloadRelay), which posts each
server one `reshard_local` hook request carrying each TP rank's own handle. The hook opens it on its GPU and loads
through the same receiver. No rank gathers the model here either: a GPU holds at most one bucket of its server
rank's pieces beside the learner's shards.

Block FP8 (rollout.weights=fp8): the plan's FP8 weights are pieces of e4m3 codes, each followed by its scales' piece
(moe/bridge/reshard.py); the sender cuts each such piece from its shard in bf16 and quantises it (moe/bridge/fp8.
quantize_block: whole 128-blocks, so the codes and scales are those of the whole tensor), codes travelling as their
bytes (gloo refuses float8); the servers load codes and scales into their FP8 parameters region by region.

Each piece is digested on both sides (moe.bridge.reshard.piece_key); a name SGLang loads itself (a family's
post-processed tensors, MoEFamily.sglang_loader_keys) is digested as received, counted in the result. A failure
on any rank (a server dead mid-refit, a send refused) drops this rank's side of the group at once, so every peer's
pending receive or send fails rather than waits out the group's timeout; the failure is then agreed on the control
group and raised on every rank (EngineError), where EngineGuard rebuilds engines and transport and syncs again.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from moe.bridge import reshard as rs
from moe.bridge.digest import DigestMismatchError, algorithm_for, tensor_digests, verify
from moe.bridge.fp8 import FP8_DTYPE, quantize_block
from moe.bridge.mapping import Dims, param_maps, shard_to_hf
from moe.bridge.megatron_io import _export_plan, _inner
from rlpo_mega.config import ConfigError
from rlpo_mega.engine_errors import EngineError
from rlpo_mega.weight_sync.sglang_payloads import PayloadRelay, ServerPlacement, placements, serialize
from rlpo_mega.weight_sync.transports import TRANSPORTS

log = logging.getLogger("rlpo_mega")


def learner_layout(chunks, vocab_divisible_by: int) -> rs.LearnerLayout:
    """This run's megatron layout as the plan reads it (collective: the whole-on-TP parameters of every stage)."""
    from megatron.core import parallel_state as ps

    mine, _, _, _ = _export_plan(chunks[0])
    whole = [n for n, lp in mine.items() if lp.map.kind == "column" and lp.tp_size == 1
             and ps.get_tensor_model_parallel_world_size() > 1]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, whole)
    return rs.LearnerLayout(dist.get_world_size(), ps.get_tensor_model_parallel_world_size(),
                            ps.get_pipeline_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                            ps.get_expert_tensor_parallel_world_size(), vocab_divisible_by,
                            frozenset(n for w in every for n in w))


def _tied_refusal(hf):
    """The line refusing a tied output layer, or None. The plan sends the embedding only (the export has no separate
    head), and SGLang 0.5.23's Mixtral keeps a head of its own whatever tie_word_embeddings says, which this
    transport's per-piece digests would not see (the engine's own transports send lm_head too: tied_aliases)."""
    if getattr(hf, "tie_word_embeddings", False):
        return ("rollout.sync_transport=reshard with a tied output layer (tie_word_embeddings=true in model.hf_config) "
                "is not planned (some SGLang models keep a separate lm_head): use rollout.sync_transport="
                "sglang_distributed")
    return None


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What a piece travels as: block-FP8 codes as their bytes (gloo refuses float8; NCCL moves bytes alike), a view
    of the same memory, so a receive fills the codes."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _layout_request(layout: rs.LearnerLayout) -> dict:
    return {"world_size": layout.world_size, "tensor": layout.tensor, "pipeline": layout.pipeline,
            "expert": layout.expert, "expert_tensor": layout.expert_tensor,
            "vocab_divisible_by": layout.vocab_divisible_by, "whole_on_tp": sorted(layout.whole_on_tp)}


@TRANSPORTS.register("reshard")
class ReshardTransport:
    """Shard-to-shard refit into SGLang servers (module docstring). Built on every learner rank (`all_ranks`):
    `engine` is the rank's SGLang engine where it drives servers, None elsewhere; the trainer's sync calls
    `sync_model(chunks)` on every rank."""

    all_ranks = True

    def __init__(self, cfg, engine, hf, dtype: torch.dtype):
        self.cfg, self.engine, self.hf, self.dtype = cfg, engine, hf, dtype
        self.fp8 = cfg.rollout.weights == "fp8"  # the plan's FP8 weights quantised per piece by their senders
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.timeout_s = cfg.rollout.sglang.control_timeout
        self.bucket_bytes = cfg.rollout.sync_bucket_mb << 20
        self.pg, self.members, self.group_name = None, None, None
        self._rendezvous = None  # rank 0: the TCP store the group meets at
        self._plans: dict = {}
        self.control = None
        # rollout.colocate: the servers on the learner's GPUs, which take their pieces by CUDA IPC (_local)
        self.colocate = bool(cfg.rollout.colocate)
        self._maps, self._spec_cache = None, None  # _pieces' and _exchange's lookups, made once

    @classmethod
    def check_config(cls, cfg, engine_cls) -> None:
        if not getattr(engine_cls, "weight_update_group", False):
            raise ConfigError(f"rollout.sync_transport=reshard needs rollout.engine=sglang (got {cfg.rollout.engine})")

    @staticmethod
    def check_layout(cfg, hf, layout, world_size: int) -> None:
        """`rlpo-mega check`: the refit planned for the configured learner layout and servers (rollout.sglang.tp_size
        and server_args, read as /server_info reports them); a layout the plan does not cover is one line naming
        what is not planned and the transport that syncs it (moe/bridge/reshard.CannotPlan)."""
        sg = cfg.rollout.sglang
        tied = _tied_refusal(hf)
        if tied:
            raise ConfigError(tied)
        try:
            server = rs.ServerLayout.from_server_info({**sg.server_args, "tp_size": sg.tp_size})
            learner = rs.LearnerLayout(world_size, layout.tensor, layout.pipeline, layout.expert, layout.expert_tensor,
                                       cfg.model.vocab_divisible_by)
            rs.reshard_plan(rs.ModelSpec.of(hf, torch.bfloat16, fp8=cfg.rollout.weights == "fp8"), learner, [server])
        except (rs.CannotPlan, ValueError) as e:
            raise ConfigError(f"rollout.sync_transport=reshard: {e}") from None

    @classmethod
    def from_config(cls, cfg, engine, hf):
        from rlpo_mega.model_setup import PARAMS_DTYPES

        if engine is not None and not getattr(engine, "weight_update_group", False):
            raise EngineError("rollout.sync_transport=reshard needs rollout.engine=sglang")
        tied = _tied_refusal(hf)
        if tied:
            raise EngineError(tied)
        # FP8 servers serve in bf16: the tensors kept unquantised go in bf16 and the quantised ones are quantised
        # from bf16, as by the other transports (training/sync.py)
        fp8 = cfg.rollout.weights == "fp8"
        return cls(cfg, engine, hf, torch.bfloat16 if fp8 else PARAMS_DTYPES[cfg.model.params_dtype])

    # ---- agreement over the control group ------------------------------------------------------------------
    def _control(self):
        if self.control is None:
            from rlpo_mega import distributed

            self.control = distributed.control_group(self.cfg.rollout.wait_timeout)
        return self.control

    def _gather(self, obj) -> list:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, obj, group=self._control())
        return every

    def _agree(self, error: Optional[str], what: str):
        """Raise on every rank where any rank failed (`error` its text), after every rank reached this point."""
        every = self._gather(error)
        failed = [(r, e) for r, e in enumerate(every) if e]
        if failed:
            self._drop()
            raise EngineError(f"refit ({what}) failed: " + "; ".join(f"rank {r}: {e}" for r, e in failed))

    # ---- the group -------------------------------------------------------------------------------------------
    def _servers(self) -> list:
        """[(driver rank, URL, (tp, ep, attention dp), its place in the run's server list)] of every live server, in
        rank order (every rank); the place names a colocated server's GPUs (sglang_payloads.placements)."""
        mine, error = [], None
        e = self.engine
        if e is not None:
            try:
                e.refresh()
                e._check_layout()
                for s in e.live:
                    status, body = e._http(s, "/server_info", method="GET")
                    layout = rs.ServerLayout.from_server_info(json.loads(body))
                    mine.append((dist.get_rank(), s.url, (layout.tensor, layout.expert, layout.attention_dp),
                                 e._place[s.url]))
            except (EngineError, rs.CannotPlan, ValueError) as err:
                error = str(err)
        every = self._gather((mine, error))
        errors = [(r, err) for r, (_, err) in enumerate(every) if err]
        if errors:
            raise EngineError("refit: " + "; ".join(f"rank {r}: {err}" for r, err in errors))
        return [s for servers, _ in every for s in servers]

    def _drop(self):
        """This rank's side of the group, destroyed: a peer waiting on it fails now, not at the group's timeout."""
        if self.pg is not None:
            try:
                dist.destroy_process_group(self.pg)
            except Exception as e:  # (already broken)
                log.debug("dropping the refit group: %s", e)
        self.pg, self.members = None, None

    def _join(self, servers: list):
        """Every learner rank and every server TP rank into one new group (collective over the learner ranks)."""
        from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

        self._drop()
        learners, tp = dist.get_world_size(), self.cfg.rollout.sglang.tp_size
        world = learners + tp * len(servers)
        if dist.get_rank() == 0:
            if self._rendezvous is None:
                self._rendezvous = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                                 timeout=timedelta(seconds=self.timeout_s))
            host = self.engine.learner_address() if self.engine is not None else os.environ.get("MASTER_ADDR",
                                                                                                 "127.0.0.1")
            meeting = (host, self._rendezvous.port, f"rlpo_refit_{os.getpid()}_{secrets.token_hex(8)}")
        else:
            meeting = None
        host, port, name = self._gather(meeting)[0]
        store = self._rendezvous if dist.get_rank() == 0 else dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
        calls, e = [], self.engine
        for i, (driver, url, _, _) in enumerate(servers):
            if driver == dist.get_rank():
                server = next(s for s in e.live if s.url == url)
                calls.append(lambda s=server, i=i: e._hook_request(s, {
                    "what": "reshard_join", "rendezvous": [host, port], "rank_offset": learners + i * tp,
                    "world_size": world, "group": name, "backend": self.backend}, "refit group", every_rank=True))
        error = None
        with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
            futures = [pool.submit(c) for c in calls]
            try:
                self.pg, _ = _new_process_group_helper(world, dist.get_rank(), [], dist.Backend(self.backend),
                                                       PrefixStore(name, store), group_name=name,
                                                       timeout=timedelta(seconds=self.timeout_s))
                _world.pg_group_ranks[self.pg] = {i: i for i in range(world)}  # group ranks are the plan's ranks
            except RuntimeError as err:
                error = f"joining the refit group: {str(err).splitlines()[0]}"
            for f in futures:
                try:
                    f.result()
                except EngineError as err:
                    error = error or str(err)
        self._agree(error, "joining")
        self.members, self.group_name = [s[1] for s in servers], name

    # ---- the sync --------------------------------------------------------------------------------------------
    def _plan(self, chunks, servers):
        layouts = tuple(rs.ServerLayout(*s[2]) for s in servers)
        if layouts not in self._plans:
            learner = learner_layout(chunks, self.cfg.model.vocab_divisible_by)
            model = rs.ModelSpec.of(self.hf, self.dtype, fp8=self.fp8)
            plan = rs.reshard_plan(model, learner, layouts)
            joined = frozenset(n for pm in param_maps(self.hf) if pm.with_previous for n in pm.hf)
            self._plans = {layouts: (plan, rs.plan_buckets(plan, self.bucket_bytes, joined))}
        return self._plans[layouts]

    def sync_model(self, chunks) -> dict:
        """One refit, on every learner rank; {"tensors", "pieces", "bytes" (sent by this rank), ...} on drivers."""
        servers = self._servers()
        if not servers:
            raise EngineError("refit: no live SGLang server to sync")
        if not self.colocate and (self.pg is None or self.members != [s[1] for s in servers]):
            self._join(servers)
        plan, buckets = self._plan(chunks, servers)
        algorithm = algorithm_for(next(_inner(chunks[0]).parameters()).device)
        e, rank = self.engine, dist.get_rank()
        request = {"learner": _layout_request(plan.learner), "servers": [list(s[2]) for s in servers],
                   "dtype": str(self.dtype).split(".")[-1], "fp8": self.fp8, "bucket_bytes": self.bucket_bytes,
                   "algorithm": algorithm, "check": [len(plan.transfers), sum(t.nbytes for t in plan.transfers)]}
        mine = [(i, s[1]) for i, s in enumerate(servers) if s[0] == rank]
        error = None
        if mine:
            try:
                e.begin_weight_update(refresh=False)
            except EngineError as err:
                error = str(err)
        move = self._local if self.colocate else self._remote
        sent, received, reports, error = move(chunks, plan, buckets, servers, request, mine, algorithm, error)
        if mine and error is None:
            try:
                e.end_weight_update()
            except EngineError as err:
                error = str(err)
        if mine and error is not None:
            e.abandon_weight_update()
        self._agree(error, "sending")
        expected = self._to_drivers(sent, servers)  # the sender digests of each driver's servers' pieces
        if mine:
            ours = {i for i, _ in mine}
            expected = {k: expected.get(k, "never sent") for k in
                        (rs.piece_key(t) for t in plan.transfers if t.server in ours)}
            try:
                verify(expected, received, where=f"SGLang servers of driver {rank}")
            except DigestMismatchError as err:
                error = str(err)
        self._agree(error, "digests")
        out = {"pieces": sum(len(d) for d in sent.values()),
               "bytes": sum(t.nbytes for t in plan.transfers if t.src == rank)}
        if mine:
            out.update(tensors=len({t.name for t in plan.transfers}), servers=[u for _, u in mine],
                       group=self.group_name, server_ranks=reports)
        return out

    @staticmethod
    def _take(reports: dict, url: str, got: list, received: dict):
        """A server's per-rank reports (in TP rank order) into the digests received and the per-rank counts."""
        for r, report in enumerate(got):
            received.update(report["digests"])
            mine = reports.setdefault(f"{url}#{r}", {"bytes": 0, "as_received": 0})
            mine["bytes"] += report["bytes"]
            mine["as_received"] += report["as_received"]
            mine["receiver"] = report["receiver"] or mine.get("receiver", {})

    def _remote(self, chunks, plan, buckets, servers, request, mine, algorithm, error):
        """Servers on their own GPUs: each driver posts each of its servers one sync request (the server's ranks
        receive over the refit group, bucket by bucket) while every rank sends its pieces."""
        e, sent, received, reports = self.engine, {}, {}, {}
        with ThreadPoolExecutor(max_workers=max(1, len(mine))) as pool:
            futures = {}
            if error is None:
                try:
                    for i, url in mine:
                        server = next(s for s in e.live if s.url == url)
                        futures[url] = pool.submit(e._hook_request, server, {
                            **request, "what": "reshard_sync", "group": self.group_name, "index": i}, "refit",
                            session=False, every_rank=True)
                except EngineError as err:
                    error = str(err)
            if error is None:
                try:
                    sent = self._send(chunks, plan, buckets, algorithm)
                except RuntimeError as err:  # gloo: a peer closed or reset; NCCL: its error (text only: no frames)
                    error = f"sending its shards: {str(err).splitlines()[0]}"
            if error is not None:
                self._drop()  # the servers' pending receives fail now
            for url, f in futures.items():
                try:
                    self._take(reports, url, f.result(), received)
                except EngineError as err:
                    error = error or str(err)
                    self._drop()
        return sent, received, reports, error

    def _local(self, chunks, plan, buckets, servers, request, mine, algorithm, error):
        """rollout.colocate: bucket by bucket, the learner ranks exchange the pieces (each to the learner rank on
        the GPU of the server rank that takes it: one batch of point-to-point sends and receives over the learner's
        own group, NCCL on GPUs); that rank packs each of its server ranks' pieces into one byte tensor on its GPU
        and relays its CUDA IPC handle (on a CPU, a shared-memory file) to the server's driver, which posts each
        server one request with every TP rank's own (sglang_payloads.PayloadRelay, the colocated in_process path's
        relay). The relay's acknowledgement keeps a packed bucket alive until its server has loaded it. A failure
        stops the posting, not the exchange: every rank runs every bucket's collectives, then the failure is agreed."""
        world, sg = dist.get_world_size(), self.cfg.rollout.sglang
        # the learner rank on each server rank's GPU (the engine's own placement: its drivers are the live
        # servers' own, from _servers)
        places = {p.index: p for p in placements(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                                                 sg.num_servers, sg.tp_size, [0])}
        relay = PayloadRelay([ServerPlacement(i, s[0], places[s[3]].producers) for i, s in enumerate(servers)],
                             dist.get_rank(), self._control())
        device = next(_inner(chunks[0]).parameters()).device
        producer = {(i, k): p for i, s in enumerate(servers) for k, p in enumerate(places[s[3]].producers)}
        e, rank, sent, received, reports = self.engine, dist.get_rank(), {}, {}, {}
        live = {s.url: s for s in e.live} if mine else {}
        for b, (start, stop) in enumerate(buckets):
            transfers = plan.transfers[start:stop]
            packed, keep, made = {}, [], {}
            try:
                pieces = self._pieces(chunks, plan, transfers, algorithm, sent)
                got = self._exchange(plan, transfers, pieces, producer, device)
                for j, k, d in relay.entries:
                    todo = [(n, t) for n, t in enumerate(transfers) if t.server == j and t.rank == k]
                    if not todo:
                        made.setdefault(d, []).append([j, k, ""])
                        continue
                    flat = rs.pack([t for _, t in todo], [got[n] for n, _ in todo], device)
                    keep.append(flat)
                    made.setdefault(d, []).append([j, k, serialize(flat)])  # one pickle per entry, its own reference
                del pieces, got
            except (RuntimeError, torch.cuda.OutOfMemoryError) as err:  # a send refused, no memory for a bucket
                keep, made = [], relay.failed(err)
            step = relay.exchange(made, keep)
            try:
                error = error or (f"making the packed buckets: {'; '.join(step.errors)}" if step.errors else None)
                posts = [(i, url) for i, url in mine if any(step.payloads.get(i) or ())] if error is None else []
                with ThreadPoolExecutor(max_workers=max(1, len(posts))) as pool:
                    futures = {url: pool.submit(e._hook_request, live[url], {
                        **request, "what": "reshard_local", "index": i, "bucket": b}, "refit", session=False,
                        every_rank=True, per_rank=[{"entry": x} for x in step.payloads[i]]) for i, url in posts}
                    for url, f in futures.items():
                        try:
                            self._take(reports, url, f.result(), received)
                        except EngineError as err:
                            error = error or str(err)
            finally:
                relay.finish(step)
        return sent, received, reports, error

    def _send(self, chunks, plan, buckets, algorithm) -> dict:
        """This rank's pieces, bucket by bucket (isends in plan order, waited per bucket); their digests."""
        digests = {}
        for start, stop in buckets:
            transfers = plan.transfers[start:stop]
            pieces = self._pieces(chunks, plan, transfers, algorithm, digests)
            first = plan.learner.world_size  # the server ranks follow the learner's in the group
            works = [dist.isend(_wire(pieces[n]), dst=first + self._offset(plan, transfers[n]), group=self.pg)
                     for n in sorted(pieces)]
            for w in works:
                w.wait()
        return digests

    def _pieces(self, chunks, plan, transfers, algorithm, digests: dict) -> dict:
        """{index in `transfers`: the piece} of those this rank sends, cut from its own shards in the plan's dtype,
        each digested into `digests` ({server index: {piece_key: digest}})."""
        from megatron.core import parallel_state as ps

        rank = dist.get_rank()
        todo = [(n, t) for n, t in enumerate(transfers) if t.src == rank]
        if not todo:
            return {}
        mine, _, _, _ = _export_plan(chunks[0])  # (cached on the model)
        if self._maps is None:  # what cuts a shard into HF slices: the same for every bucket and sync
            tp = ps.get_tensor_model_parallel_world_size()
            self._maps = ({n: (pm, j) for pm in param_maps(self.hf) for j, n in enumerate(pm.hf)},
                          Dims.of(self.hf, self.cfg.model.vocab_divisible_by, tp))
        maps, dims = self._maps
        specs = self._specs(plan)
        slices, pieces, scales = {}, {}, {}
        for n, t in todo:
            spec = specs[t.name]
            if spec.block_of is not None:  # made with its codes (the plan puts them first, from this rank)
                pieces[n] = scales.pop((t.server, t.rank, t.region))
                continue
            pm, j = maps[t.name]
            if pm.megatron not in slices:
                lp = mine[pm.megatron]
                slices[pm.megatron] = shard_to_hf(pm.kind, lp.tensor(), dims, lp.tp_rank, lp.tp_size)
            part = slices[pm.megatron][j][tuple(slice(a, b) for a, b in t.src_box)]
            if spec.dtype == FP8_DTYPE:
                # whole 128-blocks (the plan refuses others): the whole tensor's codes and scales, sliced
                pieces[n], s = quantize_block(part.to(self.dtype))
                scales[(t.server, t.rank, rs.block_box(t.region, spec.shape, t.name))] = s  # its scales' region
            else:
                pieces[n] = part.to(spec.dtype).contiguous()
        for (_, t), digest in zip(todo, tensor_digests(list(pieces.values()), algorithm)):
            digests.setdefault(t.server, {})[rs.piece_key(t)] = digest
        return pieces

    def _to_drivers(self, sent: dict, servers: list) -> dict:
        """Every rank's sender digests ({server index: {piece key: digest}}) to the driver of each server, one gather
        per driver over the control group: a driver receives its servers' pieces' digests only (at Qwen3-235B's
        scale an all-gather would hand every rank every one of some 100k pieces' digests). On a driver: its
        servers' {piece key: digest} from every rank; elsewhere {}."""
        rank, world, got = dist.get_rank(), dist.get_world_size(), {}
        for d in sorted({s[0] for s in servers}):
            part = {k: v for i, digests in sent.items() if servers[i][0] == d for k, v in digests.items()}
            every = [None] * world if rank == d else None
            dist.gather_object(part, every, dst=d, group=self._control())
            for p in every or ():
                got.update(p)
        return got

    def _exchange(self, plan, transfers, pieces: dict, producer: dict, device) -> dict:
        """rollout.colocate: every piece to the learner rank that packs its server rank's bucket (`producer`: (server,
        TP rank) -> learner rank), as one batch of sends and receives over the learner's group (batched: two ranks
        that both send and receive would otherwise each wait on its send first, on NCCL's one stream); {index in
        `transfers`: piece} of those this rank packs, its own included."""
        rank, specs = dist.get_rank(), self._specs(plan)
        out, ops = {}, []
        for n, t in enumerate(transfers):
            p = producer[(t.server, t.rank)]
            if t.src == rank and p == rank:
                out[n] = pieces[n]
            elif t.src == rank:
                ops.append(dist.P2POp(dist.isend, _wire(pieces[n]), p))
            elif p == rank:
                out[n] = torch.empty([b - a for a, b in t.region], dtype=specs[t.name].dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, _wire(out[n]), t.src))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return out

    def _specs(self, plan) -> dict:
        """{HF name: TensorSpec} of the plan's model, made once per plan (not per bucket)."""
        if self._spec_cache is None or self._spec_cache[0] is not plan.model:
            self._spec_cache = (plan.model, {t.name: t for t in plan.model.tensors})
        return self._spec_cache[1]

    @staticmethod
    def _offset(plan, t) -> int:
        return sum(s.tensor for s in plan.servers[:t.server]) + t.rank

    def close(self):
        if self.pg is None:
            return
        e = self.engine
        if e is not None:
            for s in e.live:
                if s.url in (self.members or ()):
                    try:
                        e._hook_request(s, {"what": "reshard_leave", "group": self.group_name}, "refit group",
                                        every_rank=True)
                    except EngineError as err:  # gone or failing: it holds no group worth a reply; ours is dropped
                        log.debug("SGLang server %s did not leave the refit group: %s", s.url, err)
        self._drop()


__all__ = ["ReshardTransport", "learner_layout"]
