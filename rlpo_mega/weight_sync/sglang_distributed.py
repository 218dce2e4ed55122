"""The `sglang_distributed` weight-sync transport: SGLang's own weight-update group (init_weights_update_group +
update_weights_from_distributed), the learner's driver rank as the group's rank 0 broadcasting each bucket to its
servers' TP ranks. Beside the other transports (transports.py); it drives the SGLang engine
(rlpo_mega/rollout/sglang_engine.py) through the engine's own control calls, and imports nothing of the rollout
side: the rollout side sits above weight sync (tests/test_layering.py)."""
from __future__ import annotations

import itertools
import logging
import os
import secrets
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Optional

import torch

from moe.bridge.digest import verify
from rlpo_mega.config import ConfigError
from rlpo_mega.engine_errors import EngineError
from rlpo_mega.weight_sync.transports import TRANSPORTS

log = logging.getLogger("rlpo_mega")


def nccl_mismatch(learner_nccl, learner_torch: str, servers: dict) -> Optional[str]:
    """The one line refusing a weight-update group across NCCL versions (NCCL's init fails on peers of another
    version, "Mismatched NCCL version"), or None. learner_nccl: torch.cuda.nccl.version() of the sending rank;
    servers: {URL: environment report} (SGLangEngine.environments)."""
    mine = _version(learner_nccl)
    for url, env in servers.items():
        theirs = _version(env.get("nccl"))
        if theirs != mine:
            # the newer NCCL into the older side: a torch binds NCCL's functions lazily and calls newer ones than an
            # older NCCL has (torch 2.14.1, SGLang 0.5.23's, calls ncclCommGrow; launch/README.md, "NCCL")
            older, newer = ("learner's", theirs) if _key(mine) < _key(theirs) else ("servers'", mine)
            return (f"NCCL version mismatch: the learner has NCCL {mine} (torch {learner_torch}), SGLang server {url} "
                    f"has NCCL {theirs} (torch {env.get('torch')}): rollout.sync_transport=sglang_distributed needs "
                    f"one NCCL on both sides; install the newer NCCL in the {older} environment (pip install "
                    f"nvidia-nccl-cu{str(env.get('cuda') or '12').split('.')[0]}=={newer}; launch/README.md, NCCL) "
                    "or use rollout.sync_transport=disk (a filesystem both sides see)")
    return None


def _key(v: Optional[str]) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in (v or "0").split("."))


def _version(v) -> Optional[str]:
    """'2.27.3' from torch's (2, 27, 3), a list from JSON, or a string; None stays None (no CUDA)."""
    if v is None:
        return None
    return ".".join(str(x) for x in v) if isinstance(v, (tuple, list)) else str(v)


@TRANSPORTS.register("sglang_distributed")
class SGLangDistributedTransport:
    """SGLang's own distributed protocol: POST /init_weights_update_group once per engine (the driver is the
    group's rank 0; its server i's TP ranks follow), then per bucket POST /update_weights_from_distributed
    (names, dtypes, shapes) while the driver broadcasts the tensors (each driver to its own servers); gloo on
    CPU, NCCL on GPU. Ends with the digest check of what the servers hold. Built once per engine (the group
    lives as long as the servers do); `close()` destroys it on both sides, and a rebuilt engine gets a new
    transport and group. `engine`: rlpo_mega/rollout/sglang_engine.SGLangEngine (its servers, its control calls and
    its digest read-back), which declares `weight_update_group`."""

    _instances = itertools.count()

    def __init__(self, engine, backend: Optional[str] = None, timeout_s: Optional[float] = None):
        self.engine = engine
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s or engine.cfg.control_timeout
        self.group_name = self._new_name()
        self.pg, self.members = None, []  # the group, and the servers in it (URLs)

    def _new_name(self) -> str:
        # one name per group: a rebuilt engine's group, or the one after a group broken mid-sync (left on the
        # servers' side), never meets an old one's leftovers; the driver index keeps the names apart in the logs. The
        # random part keeps it secret: it travels only in keyed requests (/init_weights_update_group), and the group
        # meets under it as a prefix on the driver's TCP store, which anyone who reaches the port could write to
        return (f"rlpo_weight_sync_d{self.engine.driver}_{os.getpid()}_{next(self._instances)}_"
                f"{secrets.token_hex(8)}")

    @classmethod
    def check_config(cls, cfg, engine_cls) -> None:
        """`rlpo-mega check`: the configured engine's servers must take a weight-update group."""
        if not getattr(engine_cls, "weight_update_group", False):
            raise ConfigError(f"rollout.sync_transport=sglang_distributed needs rollout.engine=sglang "
                              f"(got {cfg.rollout.engine})")

    @classmethod
    def from_config(cls, cfg, engine, hf):
        if not getattr(engine, "weight_update_group", False):
            raise EngineError("rollout.sync_transport=sglang_distributed needs rollout.engine=sglang")
        return cls(engine)

    def _concurrently(self, calls):
        """Run HTTP calls that block until our side joins a collective; returns their results."""
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            futures = [pool.submit(f) for f in calls]
            yield
            for f in futures:
                f.result()

    def _bucket(self, calls, send):
        """One bucket: the servers' update calls (each returns once its server has received the bucket) while
        `send` broadcasts it. A failure on either side -- the broadcast's, or a call's (a member dead mid-sync) --
        drops our side of the group at once, so that the live members' receives fail and their calls return,
        instead of waiting out the group's timeout (a server SIGKILLed mid-sync otherwise held the other's
        scheduler in its receive for control_timeout)."""
        failure = None
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            futures = [pool.submit(f) for f in calls]
            try:
                send()
            except RuntimeError as err:  # gloo: closed or reset by a peer; NCCL: its error. Only its text is
                failure = f"the broadcast failed: {str(err).splitlines()[0]}"  # kept: its frames hold the group
            if failure is None:
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                failure = next((str(f.exception()) for f in done if f.exception() is not None), None)
            if failure is not None:
                members = ", ".join(self.members)
                self._drop_group()
        if failure is not None:  # (the pool's exit waited for the other calls: they failed with the group)
            raise EngineError(f"SGLang driver {self.engine.driver}: a weight-update bucket to {members} failed "
                              f"({failure}): a server left mid-sync")
        for f in futures:
            f.result()

    def _drop_group(self):
        """Our side of a group broken mid-sync, gone without the servers' (they may be dead): destroyed and no
        longer referenced, which closes its connections; the next group gets a new name (the servers may still
        hold this one)."""
        torch.distributed.destroy_process_group(self.pg)
        self.pg, self.members, self.group_name = None, [], self._new_name()

    def _init_group(self):
        from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

        e = self.engine
        e._check_layout()
        if self.backend == "nccl":  # NCCL refuses peers of another version: one line now, not a failed init
            problem = nccl_mismatch(torch.cuda.nccl.version(), torch.__version__, e.environments())
            if problem:
                raise EngineError(problem)
        servers = e.live
        world = 1 + len(servers) * e.cfg.tp_size
        store = e.store()  # hosted by this rank: see SGLangEngine.store
        calls = [lambda s=s, i=i: e._post_ok(s, "/init_weights_update_group", {
            "master_address": e.learner_address(), "master_port": store.port, "rank_offset": 1 + i * e.cfg.tp_size,
            "world_size": world, "group_name": self.group_name, "backend": self.backend},
            timeout=self.timeout_s) for i, s in enumerate(servers)]
        for _ in self._concurrently(calls):
            # what sglang's init_custom_process_group does on its side: the group-name prefix on the store
            timeout = timedelta(seconds=self.timeout_s)
            self.pg, _ = _new_process_group_helper(world, 0, [], torch.distributed.Backend(self.backend),
                                                   PrefixStore(self.group_name, store), group_name=self.group_name,
                                                   timeout=timeout)
            _world.pg_group_ranks[self.pg] = {i: i for i in range(world)}  # as sglang does: src=0 resolves
        self.members = [s.url for s in servers]

    def sync(self, stream) -> dict:
        try:
            return self._sync(stream)
        except BaseException:
            if stream.receives:
                self.engine.abandon_weight_update()
            raise

    def _sync(self, stream) -> dict:
        e = self.engine
        if stream.receives:
            e.refresh()  # servers out rejoin, dead ones leave: the group is the live servers
            if self.pg is not None and self.members != [s.url for s in e.live]:
                log.warning("SGLang driver %d: the weight-update group changes (%s -> %s): made anew", e.driver,
                            ", ".join(self.members), ", ".join(s.url for s in e.live))
                self.close()
            if self.pg is None:
                self._init_group()
            e.begin_weight_update(refresh=False)
        dev = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        for bucket in stream:
            if not stream.receives or not bucket:
                continue
            flat = any(t.dtype == torch.float8_e4m3fn for _, t in bucket)
            if flat:  # widest first: each tensor at a byte offset its element size divides (below)
                bucket = sorted(bucket, key=lambda nt: -nt[1].element_size())
            meta = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                    "flush_cache": False, **({"load_format": "flattened_bucket"} if flat else {})}
            calls = [lambda s=s: e._post_ok(s, "/update_weights_from_distributed", meta) for s in e.live]
            if flat:
                # block FP8 (rollout.weights=fp8): the bucket as one uint8 tensor, which SGLang receives whole and
                # views back by the names' dtypes and shapes (model_runner_components/weight_updater.py:300-310,
                # weight_sync/tensor_bucket.py:86-140): gloo cannot broadcast float8 ("Invalid scalar type"), and
                # SGLang's receive of a float8 tensor would need it to. Its views need each tensor at an offset
                # its element size divides (tensor_bucket.py:98): fp32 scales, then bf16, then fp8 codes
                packed = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket]).to(dev)
                self._bucket(calls, lambda: torch.distributed.broadcast(packed, src=0, group=self.pg))
                del packed
                continue
            self._bucket(calls, lambda: [torch.distributed.broadcast(t.contiguous().to(dev), src=0, group=self.pg)
                                         for _, t in bucket])
        if not stream.receives:
            return {}
        e.end_weight_update()
        verify(stream.digests, e.weight_digests(list(stream.digests), stream.digest_algorithm))
        return {"tensors": len(stream.digests), "bytes": stream.bytes_sent}

    def close(self):
        if self.pg is None:
            return
        e = self.engine
        for s in e.servers:
            if s.url not in self.members or not e._healthy(s):
                continue  # dead or hung: no group left to destroy, and no reply to wait for
            try:
                e._post_ok(s, "/destroy_weights_update_group", {"group_name": self.group_name},
                           timeout=e.cfg.health_timeout * 6)
            except EngineError:
                pass
        torch.distributed.destroy_process_group(self.pg)
        self.pg = None
