"""Request-side helpers of the SGLang engine (rollout/sglang_engine.py): the worker pool, the per-server
in-flight limit, and the decoding of one /generate answer (log-probs, routes).

Concurrency: every server takes at most `rollout.sglang.max_in_flight_per_server` requests at once, so a
rollout has up to that times the number of servers requests in flight. Each request takes a slot on the
least-loaded server when it is about to be sent (ties go round-robin), not a server fixed up front: a server
whose generations run long keeps its slots busy and the others take the rest of the batch. A slot is given
back as soon as the answer is read, so the answer's decoding (JSON, base64, routes) overlaps with the
server's next request, and with the other requests of the batch still generating.
"""
from __future__ import annotations

import base64
import binascii
import operator
import queue
import threading
from concurrent.futures import Future

import numpy as np
import torch

from moe.routing.trace import RoutingTraceError, compact_dtype


class DaemonPool:
    """Worker threads that never hold the process: ThreadPoolExecutor's threads are joined at interpreter
    exit, so one request blocked on a hung server would keep a stopped trainer alive for request_timeout."""

    def __init__(self, workers: int):
        self.workers, self.queue = workers, queue.SimpleQueue()
        for _ in range(workers):
            threading.Thread(target=self._work, daemon=True).start()

    def _work(self):
        while (item := self.queue.get()) is not None:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:
                    future.set_exception(e)

    def submit(self, fn, *args) -> Future:
        future = Future()
        self.queue.put((future, fn, args))
        return future

    def shutdown(self, futures):
        for f in futures:
            f.cancel()  # only those not started
        for _ in range(self.workers):
            self.queue.put(None)


class SlotsClosed(Exception):
    """The generate() call that owned these slots has ended (stop, hang, error): send nothing more."""


class ServerSlots:
    """At most `limit` requests in flight per server, for one generate() call. `acquire` picks the server
    with the fewest requests in flight (ties: round-robin from `start`, so small batches alternate servers
    over calls) and blocks while every server is full; `close` wakes the blocked workers and refuses the
    rest, so that nothing is sent after the call gave up."""

    def __init__(self, num_servers: int, limit: int, start: int = 0):
        if limit < 1:
            raise ValueError(f"max_in_flight_per_server={limit} must be >= 1")
        self.limit, self.counts, self.peak = limit, [0] * num_servers, [0] * num_servers
        self._next, self._closed = start % num_servers, False
        self._cond = threading.Condition()

    def acquire(self) -> int:
        n = len(self.counts)
        with self._cond:
            while True:
                if self._closed:
                    raise SlotsClosed("the rollout this request belonged to has ended")
                order = [(self._next + j) % n for j in range(n)]
                i = min(order, key=lambda s: self.counts[s])  # first of the least loaded from the cursor
                if self.counts[i] < self.limit:
                    self.counts[i] += 1
                    self.peak[i] = max(self.peak[i], self.counts[i])
                    self._next = (i + 1) % n
                    return i
                self._cond.wait()

    def release(self, i: int) -> None:
        with self._cond:
            self.counts[i] -= 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def pool_size(num_jobs: int, num_servers: int, limit: int) -> int:
    """Workers for one call: every slot, plus one per server to decode an answer while its slot is already
    serving the next request; never more than the jobs."""
    return min(num_jobs, (limit + 1) * num_servers)


def parse_logprobs(entries) -> torch.Tensor:
    """meta_info.output_token_logprobs ([logprob, token_id, text] per token) -> float32 [tokens]. The first
    column is gathered in C (map/itemgetter into np.fromiter): no Python-level loop per token."""
    if not entries:
        return torch.zeros(0, dtype=torch.float32)
    lps = np.fromiter(map(operator.itemgetter(0), entries), dtype=np.float64, count=len(entries))
    return torch.from_numpy(lps.astype(np.float32))  # float64 -> float32: the rounding of torch.tensor(floats)


def decode_routes(data, num_hidden_layers: int, spec, tokens: int | None = None) -> torch.Tensor:
    """meta_info.routed_experts (base64 of little-endian int32 [rows, num_hidden_layers, topk], see
    moe.routing.decoders.decode_sglang) -> the MoE layers' ids [rows, spec.num_layers, topk], vectorized:
    a zero-copy frombuffer view, one numpy index for the MoE layers, one cast to the trace's compact dtype
    (uint8 up to 256 experts). Same checks and messages as decode_sglang + select_moe_layers. Ids outside
    [0, num_experts) (-1 = no data) keep int32: narrowing would wrap them into valid-looking ids, and
    validate_trace must see them to name the token (or fall back). tokens: the rows the sample must have
    (prompt + completion - 1); a payload of another size names the layer count it implies."""
    topk = spec.topk
    if isinstance(data, (str, bytes)):
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RoutingTraceError(f"routed_experts: not valid base64 ({e})") from None
        if len(raw) % 4:
            raise RoutingTraceError(f"routed_experts: {len(raw)} bytes is not a whole number of int32")
        arr = np.frombuffer(raw, dtype="<i4")
    elif isinstance(data, (list, tuple, np.ndarray, torch.Tensor)):
        try:
            arr = np.asarray(data, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError) as e:
            raise RoutingTraceError(f"routed_experts: not an array of expert ids ({e})") from None
    else:
        raise RoutingTraceError(f"routed_experts is {type(data).__name__} {data!r:.40}; expected base64 of int32")
    per_row = num_hidden_layers * topk
    if tokens and arr.size != tokens * per_row:
        raise RoutingTraceError(
            f"routed_experts holds {arr.size} ids for {tokens} tokens, i.e. {arr.size / tokens / topk:.3g} layers "
            f"x top-{topk} per token; model.hf_config has num_hidden_layers={num_hidden_layers}: the server "
            "serves another model than the trainer's")
    if arr.size % per_row:
        raise RoutingTraceError(f"routed_experts: {arr.size} ids is not a multiple of num_hidden_layers * "
                                f"topk = {num_hidden_layers} * {topk}")
    layers = np.asarray(spec.moe_layers, dtype=np.intp)
    if layers.size and int(layers.max()) >= num_hidden_layers:
        raise RoutingTraceError(f"routes cover {num_hidden_layers} layers; MoE layer {int(layers.max())} is missing")
    ids = arr.reshape(-1, num_hidden_layers, topk)[:, layers]  # one gather (a copy) of the MoE layers' columns
    compact = torch.empty(0, dtype=compact_dtype(spec.num_experts)).numpy().dtype
    in_range = ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < spec.num_experts)
    return torch.from_numpy(ids.astype(compact if in_range else np.int32))


__all__ = ["DaemonPool", "ServerSlots", "SlotsClosed", "decode_routes", "parse_logprobs", "pool_size"]
