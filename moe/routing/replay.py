"""Drive megatron-core's RouterReplay (0.16.1) for routing replay: off | r2 | r3.

- r2 (GSPO's Routing Replay): RECORD the routes of the old-log-prob pass, REPLAY them in the update.
- r3 (rollout routing replay): REPLAY the rollout engine's routes (moe.routing.transport) in the
  old-log-prob pass and in the update.
- off: RECORD only to observe the live routes (metrics).

Megatron's replay gathers the gate weights from the live router's scores at the replayed experts
(`scores.gather(1, top_indices)` in router_replay.py), so the router keeps receiving gradients.

Schedule and recompute: the routes ride in each micro-batch (its `routes` attribute, [b, s_local, L_local, k]; the micro-batch is
rlpo_mega.training.batches.MicroBatch, read here by its `tokens` and `routes` attributes alone) on
the batch's device (`attach` copies this rank's routes there once; r2 records them there), so RouterReplay
gets them where the router's scores are. The wrapped forward_step hands a micro-batch's routes to its
routers just before the forward (REPLAY_FORWARD; set_target_indices also queues them for the backward)
and switches to REPLAY_BACKWARD right after, so an activation recompute during that micro-batch's
backward pops the same routes. The pipeline schedules run backwards in micro-batch order, so the FIFO
queue of each router matches (1F1B and warm-up included). A forward outside any backward while in
REPLAY_BACKWARD (a later unwrapped forward) routes live.

Per-token fallback: route ids < 0 (LIVE -1 from a bad trace in fallback mode, PAD -2 for positions
without a trace row) are routed by the live router (the router instances' class is switched to a
subclass that does that and also keeps the live top-k for the agreement metric).

Caveats (megatron-core 0.16.1): the instance list RouterReplay.global_router_replay_instances is
process-global; this driver addresses its own routers only and `close()` removes them from the list.
The fused TE router path never calls RouterReplay: refused. Aux losses use a fresh top-k (not replayed).
"""
from __future__ import annotations

from typing import Callable

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from .metrics import RoutingStats
from .trace import TraceSpec
from .transport import local_routers

MODES = ("off", "r2", "r3")


class RoutingReplayError(RuntimeError):
    pass


def check_replay_config(config, mode: str):
    """Refuse model configurations under which replay would silently not happen."""
    if mode not in MODES:
        raise ValueError(f"routing.mode={mode!r}; choose one of {', '.join(MODES)}")
    if mode == "off":
        return
    if not config.moe_enable_routing_replay:
        raise RoutingReplayError(f"routing.mode={mode} needs a model built with moe_enable_routing_replay=True "
                                 "(build_policy(..., routing_replay=True))")
    if config.moe_router_fusion:
        raise RoutingReplayError(
            f"routing.mode={mode} with moe_router_fusion=True: the fused router kernel "
            "(moe_utils.topk_routing_with_score_function, fused branch) bypasses RouterReplay, so the "
            "recorded routes would be silently ignored; set moe_router_fusion=False when replaying routes")
    balancing = config.moe_router_load_balancing_type
    if "sinkhorn" in (balancing if isinstance(balancing, list) else [balancing]):
        raise RoutingReplayError(f"routing.mode={mode}: sinkhorn routing does not go through RouterReplay")
    if config.moe_expert_capacity_factor is not None:
        raise RoutingReplayError(f"routing.mode={mode}: capacity-based token dropping "
                                 f"(moe_expert_capacity_factor={config.moe_expert_capacity_factor}) "
                                 "would drop replayed routes")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _LiveFallbackReplay(RouterReplay):
    """RouterReplay whose replayed ids < 0 are routed live; keeps the live/used top-k for metrics.

    Never constructed: the routers' own instances get this class (`__class__` swap, no new state beyond
    the attributes below), so megatron's global list and the routers keep pointing at them."""

    live_topk = None
    used_topk = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        action = self.router_replay_action
        if action == RouterReplayAction.REPLAY_BACKWARD and not _in_backward():
            action = None  # a fresh forward after the replayed schedule: not a recompute
        if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            if action is None:
                probs, idx = default_compute_topk(scores, topk, num_groups, group_topk)
            else:
                probs, idx = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            self.live_topk = self.used_topk = idx.detach()
            return probs, idx
        if action == RouterReplayAction.REPLAY_FORWARD:
            target = self.target_topk_idx
        else:
            if not self.replay_backward_list:
                raise RoutingReplayError("activation recompute found no queued routes: the backward did not "
                                         "follow the forward order of the replayed micro-batches")
            target = self.replay_backward_list.pop(0)
        target = target.to(scores.device).long()
        # Rows with an id < 0 (routes the rollout did not record) take the live top-k. Both are computed for
        # every row: asking first whether any row needs it would stop the host once per MoE layer on a GPU.
        with torch.no_grad():
            live = default_compute_topk(scores.detach(), topk, num_groups, group_topk)[1]
        idx = torch.where((target < 0).any(dim=1, keepdim=True), live, target)
        if action == RouterReplayAction.REPLAY_FORWARD:
            self.live_topk, self.used_topk = live, idx
        return scores.gather(1, idx), idx


class RoutingReplay:
    """Routing replay for one model (its local routers). Plugs into policy_step through
    `attach(micro)`, `wrap_old(step)` and `wrap_update(step)`; `metrics()` gives the step's routing metrics."""

    def __init__(self, model_chunks, spec: TraceSpec, mode: str = "r3"):
        inner = model_chunks[0]
        config = getattr(inner, "module", inner).config  # under megatron's DDP wrapper or bare
        check_replay_config(config, mode)
        self.mode, self.spec = mode, spec
        self._routes = None
        routers = local_routers(model_chunks)
        self.observe = all(r.router_replay is not None for _, r in routers)
        self.layers = [layer for layer, _ in routers]
        self.cols = [spec.moe_layers.index(layer) for layer in self.layers]
        # The `model` a forward_step receives is one of model_chunks: its routers and their local columns.
        self._by_chunk = {}
        j = 0
        for chunk in model_chunks:
            mine = [r for r in chunk.modules() if any(r is x for _, x in routers)]
            self._by_chunk[id(chunk)] = [(j + i, r) for i, r in enumerate(mine)]
            j += len(mine)
        self._recomputed = {id(r): _recomputed(r, chunk) for chunk in model_chunks
                            for r in chunk.modules() if any(r is x for _, x in routers)}
        self._replays = [r.router_replay for _, r in routers if r.router_replay is not None]
        for rr in self._replays:
            rr.__class__ = _LiveFallbackReplay
        # the counters live where the routers' outputs do: the model's device
        device = next(model_chunks[0].parameters()).device
        self.stats = RoutingStats(spec.num_layers, spec.num_experts, spec.moe_layers, device=device)

    # --- data --------------------------------------------------------------------------------------
    def set_routes(self, routes: torch.Tensor):
        """This rank's routes [rows of its DP share, local sequence shard, local MoE layers, topk]
        (transport.scatter_routes / local_routes), for r3 (or for observing agreement when off)."""
        if routes.shape[2] != len(self.layers) or routes.shape[3] != self.spec.topk:
            raise RoutingReplayError(f"routes of shape {tuple(routes.shape)}; this rank has {len(self.layers)} "
                                     f"MoE layers with top-{self.spec.topk}")
        self._routes = routes

    def attach(self, micro: list):
        """Split this rank's routes into the micro-batches (rows, as rlpo_mega.training.warmup.split_rows does), on the
        micro-batches' device (one copy of this rank's routes)."""
        if self._routes is None and micro and all(mb.routes is not None for mb in micro):
            return  # cut per micro-batch already (packed micro-batches differ in shape)
        if self._routes is None:
            if self.mode == "r3":
                raise RoutingReplayError("routing.mode=r3: no rollout routes for this batch (call set_routes "
                                         "with the transport's output before preparing the micro-batches)")
            return
        rows = sum(mb.tokens.shape[0] for mb in micro)
        if rows != self._routes.shape[0] or micro[0].tokens.shape[1] % max(1, self._routes.shape[1]):
            raise RoutingReplayError(f"routes for {self._routes.shape[0]} rows x {self._routes.shape[1]} positions; "
                                     f"the micro-batches hold {rows} rows x {micro[0].tokens.shape[1]}")
        for mb, r in zip(micro, self._routes.to(micro[0].tokens.device).chunk(len(micro))):
            mb.routes = r
        self._routes = None

    # --- forward_step wrappers ---------------------------------------------------------------------
    def wrap_old(self, step: Callable) -> Callable:
        return self.wrap(step, {"off": "observe", "r2": "record", "r3": "replay"}[self.mode], "old")

    def wrap_update(self, step: Callable) -> Callable:
        return self.wrap(step, "observe" if self.mode == "off" else "replay", "update")

    def wrap(self, step: Callable, action: str, phase: str) -> Callable:
        if action not in ("observe", "record", "replay"):
            raise ValueError(f"unknown routing action {action!r}")
        if action != "observe" or self.observe:
            for rr in self._replays:  # a new schedule: drop the queue of a schedule without backward
                rr.clear_indices()
        if action == "observe" and not self.observe:
            return step

        recorded = set()  # ids of the micro-batches whose routes this schedule recorded

        def wrapped(data_iterator, model):
            batch = next(data_iterator)
            entries = self._by_chunk[id(model)]
            b = batch.tokens.shape[0]
            routes = batch.routes
            if action == "replay":
                if routes is None and entries:
                    raise RoutingReplayError(f"routing.mode={self.mode}: a micro-batch has no routes to replay"
                                             + (" (r2 records them in the old-log-prob pass)" if self.mode == "r2" else ""))
                backward = torch.is_grad_enabled() and model.training
                for col, router in entries:
                    rr = router.router_replay
                    rr.set_target_indices(_flat(routes[:, :, col]))
                    if not (backward and self._recomputed[id(router)]):
                        rr.replay_backward_list.pop()  # no recompute will pop it
                    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                for _, router in entries:
                    router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
            out = step(iter([batch]), model)
            for col, router in entries:
                rr = router.router_replay
                if action == "replay":
                    rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                else:
                    rr.clear_router_replay_action()
                target = _flat(routes[:, :, col]) if routes is not None and id(batch) not in recorded else None
                self.stats.update(phase, self.cols[col], rr.used_topk, rr.live_topk, target)
            if action == "record" and entries:
                rec = torch.stack([router.router_replay.used_topk for _, router in entries], dim=1)
                s = rec.shape[0] // b
                if id(batch) not in recorded:  # r2 replays what it records, not any attached routes
                    batch.routes = torch.full((b, s, len(self.layers), self.spec.topk), -2, dtype=torch.int16,
                                                 device=rec.device)
                    recorded.add(id(batch))
                cols = [c for c, _ in entries]
                batch.routes[:, :, cols] = rec.reshape(s, b, len(entries), -1).transpose(0, 1).to(torch.int16)
            return out

        return wrapped

    def metrics(self, group=None) -> dict:
        """This step's routing metrics (collective over all ranks); resets the counters."""
        out = self.stats.reduce(group)
        out["routing/mode"] = self.mode
        return out

    def reset(self):
        """Plain live routing until the next wrapped schedule (queued routes and actions dropped)."""
        for rr in self._replays:
            rr.clear_indices()
            rr.clear_router_replay_action()

    def close(self):
        """Detach from megatron's process-global instance list (models built later start clean)."""
        ids = {id(rr) for rr in self._replays}
        RouterReplay.global_router_replay_instances[:] = [
            x for x in RouterReplay.global_router_replay_instances if id(x) not in ids]
        self.reset()


def _flat(routes_bsk: torch.Tensor) -> torch.Tensor:
    """[b, s, k] -> the router's token order [s * b, k] (hidden states are [s, b, h]); kept compact
    (int16) while queued for a recompute, widened at use."""
    return routes_bsk.transpose(0, 1).reshape(-1, routes_bsk.shape[-1])


def _recomputed(router, chunk) -> bool:
    """Does activation recompute run this router again in the backward (transformer_block.py:735,
    _checkpointed_forward's uniform/block methods; moe_layer.py:153 selective "moe")?"""
    c = router.config
    if c.recompute_granularity == "selective":
        return "moe" in (c.recompute_modules or [])
    if c.recompute_granularity != "full":
        return False
    if c.recompute_method == "uniform":
        return True
    layers = [m for m in chunk.modules() if hasattr(m, "mlp") and hasattr(m, "self_attention")]
    index = next(i for i, layer in enumerate(layers) if getattr(layer.mlp, "router", None) is router)
    return index < (c.recompute_num_layers or 0)
