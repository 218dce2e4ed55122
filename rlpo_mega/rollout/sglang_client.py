"""Request-side helpers of the SGLang engine (rollout/sglang_engine.py): persistent connections, the worker
pool, the per-server in-flight limit, and the decoding of one /generate answer (log-probs, routes).

Concurrency: every server takes at most `rollout.sglang.max_in_flight_per_server` requests at once, so a
rollout has up to that times the number of servers requests in flight. A group's first request takes a slot on
the least-loaded server when it is about to be sent (ties go round-robin); the group's other samples follow it
to that server, so they share the prompt's prefix cache. A slot is given back as soon as the answer is read,
so the answer's decoding (JSON, base64, routes) overlaps with the server's next request.

Cost per route row (a token position with routes: 48 layers x top-8 int32 = 1.5 KB, 2 KB as base64): the
answer is cut before its JSON parse (`split_routes`: the base64 string of routed_experts is located in the
body, never copied into a Python str), decoded with pybase64 and parsed with orjson where installed (the
stdlib otherwise), checked in uint8 (moe.routing.trace.clean_trace) and held in its compact form only.
Answers are read and decoded at most `decode_concurrency` at a time, so the raw bodies held at once are
bounded whatever the number of requests in flight (the kernel's socket buffers hold the rest).
"""
from __future__ import annotations

import base64
import binascii
import http.client
import json
import operator
import os
import queue
import re
import select
import socket
import threading
import time
import urllib.parse
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch

from moe.routing.trace import RoutingTraceError, compact_dtype

try:  # the fast parsers where installed (SGLang's own dependencies); the stdlib otherwise
    import orjson

    loads, dumps = orjson.loads, orjson.dumps
except ImportError:  # pragma: no cover - exercised by monkeypatching in tests
    loads = json.loads

    def dumps(obj) -> bytes:
        return json.dumps(obj).encode()
try:
    from pybase64 import b64decode
except ImportError:  # pragma: no cover
    b64decode = base64.b64decode


def _shutdown(conns) -> None:
    """Shut each connection's socket: a worker blocked reading it returns at once with an error."""
    for conn in conns:
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _host_port(url: str) -> tuple:
    u = urllib.parse.urlsplit(url)
    return u.hostname, u.port


class Connections:
    """Keep-alive HTTP/1.1 connections per server, reused across requests and steps: no TCP handshake per
    request, and http.client reads no proxy environment (a server address never goes through http_proxy).
    `close_active()` shuts the sockets of the requests in flight, so workers blocked on a stopped or hung
    rollout return at once instead of holding a thread until request_timeout."""

    def __init__(self, receive_buffer: int = 0):
        self.receive_buffer = receive_buffer  # bytes per connection (sglang_client.receive_buffer); 0: the kernel's
        self._idle: dict[str, list] = {}
        self._active: set = set()
        self._epoch = 0  # close_active() calls so far: a request failing after one is not retried
        self._lock = threading.Lock()

    def _take(self, url: str, timeout: float):
        with self._lock:
            idle = self._idle.get(url) or []
            conn = None
            while idle and conn is None:
                conn = idle.pop()
                if _dropped(conn):  # closed by the server while idle (uvicorn: after 5 s), or never usable
                    conn.close()
                    conn = None
            reused = conn is not None
            if conn is None:
                u = urllib.parse.urlsplit(url)
                cls = _HTTPSConnection if u.scheme == "https" else _HTTPConnection
                conn = cls(u.hostname, u.port, timeout=timeout)
                conn.receive_buffer = self.receive_buffer
            self._active.add(conn)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, reused

    def _give(self, url: str, conn, keep: bool):
        with self._lock:
            self._active.discard(conn)
            if keep:
                self._idle.setdefault(url, []).append(conn)
                return
        conn.close()

    @contextmanager
    def post(self, url: str, path: str, body: bytes, timeout: float):
        """Yields the response (headers read, body not yet): the caller reads it when it can hold it."""
        epoch = self._epoch
        for attempt in range(2):
            conn, reused = self._take(url, timeout)
            try:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._give(url, conn, False)
                if reused and attempt == 0 and epoch == self._epoch:  # not after close_active: that was us
                    # the server closed this idle connection as we sent (the race _dropped cannot see): the
                    # request never reached it; once more on a new connection
                    self._drop_idle(url)
                    continue
                raise
            except BaseException:
                self._give(url, conn, False)
                raise
            break
        keep = False
        try:
            yield resp
            keep = resp.isclosed() and not resp.will_close
        finally:
            self._give(url, conn, keep)

    def _drop_idle(self, url: str) -> None:
        with self._lock:
            idle = self._idle.pop(url, [])
        for c in idle:
            c.close()

    def close_url(self, url: str) -> None:
        """Shut the sockets of the requests in flight to `url` (a server declared dead or hung): their workers
        return at once with an error, and the engine sends those requests elsewhere."""
        self._drop_idle(url)
        with self._lock:
            active = [c for c in self._active if (c.host, c.port) == _host_port(url)]
        _shutdown(active)

    def close_active(self) -> None:
        with self._lock:
            self._epoch += 1
            active = list(self._active)
        _shutdown(active)

    def close(self) -> None:
        self.close_active()
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for c in conns:
                c.close()


# Kernel receive buffer per /generate connection (Linux reserves twice what is set). Unbounded, the kernel grows
# each one to net.ipv4.tcp_rmem's maximum (32 MB here), and hundreds of answers ending at once -- every sample
# stopped by max_new_tokens ends at the same decode step -- park gigabytes in socket buffers while the driver
# decodes one at a time: copying an answer out of memory gone cold cost ~3x the system time of reading it as it
# arrives, and past net.ipv4.tcp_mem's pressure threshold (counted over the host's TCP memory: these buffers and
# the servers' send buffers) the kernel drops packets and every connection crawls on retransmission timeouts.
# Measured with tools/bench_rollout_scale.py (4 fake servers x 128 requests in flight, this machine's tcp_mem
# pressure at 1.5 GB): 512 answers of 4k tokens (9 MB each) did not finish in 10 minutes with 1.5 or 2 MB
# buffers and took 4.7 s with 0.75 or 1 MB; 1k-token answers (3 MB) take about 0.1 us more driver CPU per route
# row at 1 MB than at 2 MB. So each connection gets a third of the pressure threshold's share per connection,
# within [RECEIVE_BUFFER_MIN, RECEIVE_BUFFER_MAX]; the rest of a longer answer waits on its server.
RECEIVE_BUFFER_MIN, RECEIVE_BUFFER_MAX = 256 << 10, 2 << 20


def _tcp_mem_pressure() -> int:
    """net.ipv4.tcp_mem's pressure threshold in bytes (0 where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_mem") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGESIZE")
    except (OSError, ValueError, IndexError):
        return 0


def receive_buffer(connections: int) -> int:
    """The receive buffer of each of `connections` concurrent /generate connections (the comment above)."""
    pressure = _tcp_mem_pressure()
    if not pressure:
        return RECEIVE_BUFFER_MIN
    return max(RECEIVE_BUFFER_MIN, min(RECEIVE_BUFFER_MAX, pressure // (3 * max(1, connections))))


class _Bounded:
    receive_buffer = 0  # set per Connections (0: the kernel's autotuning)

    def connect(self):
        super().connect()
        if self.receive_buffer:  # above net.core.rmem_max the kernel caps it there: still a bound
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer)


class _HTTPConnection(_Bounded, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_Bounded, http.client.HTTPSConnection):
    pass


def _dropped(conn) -> bool:
    """An idle keep-alive connection the server has closed (or that has unexpected bytes): readable at once."""
    if conn.sock is None:
        return True
    try:  # poll, not select: a trainer's descriptors run past select's FD_SETSIZE (1024)
        poller = select.poll()
        poller.register(conn.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class WorkerPool:
    """Worker threads started on demand up to `max_workers` and reused across rollouts; `close()` ends and
    joins them (the engine's shutdown, and at interpreter exit through a finalizer). Daemon threads: a worker
    still blocked when the process must exit never holds it, but none is left running after `close()`."""

    def __init__(self, max_workers: int):
        self.max_workers, self.queue = max_workers, queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()

    def _work(self):
        while True:
            with self._lock:
                self._idle += 1
            item = self.queue.get()
            with self._lock:
                self._idle -= 1
            if item is None:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:
                    future.set_exception(e)
            del future, fn, args, item  # nothing of a finished request stays referenced while idle

    def submit(self, fn, *args) -> Future:
        future = Future()
        self.queue.put((future, fn, args))
        with self._lock:
            start = self._idle < self.queue.qsize() and len(self.threads) < self.max_workers
            if start:
                t = threading.Thread(target=self._work, daemon=True, name=f"rlpo-sglang-{len(self.threads)}")
                self.threads.append(t)
        if start:
            t.start()
        return future

    def close(self, timeout: float = 10.0) -> None:
        """Ends the workers: those idle at once, one still blocked (its socket was shut) within `timeout` in all."""
        threads, self.threads = self.threads, []
        for _ in threads:
            self.queue.put(None)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


class SlotsClosed(Exception):
    """The generate() call that owned these slots has ended (stop, hang, error): send nothing more."""


class ServerSlots:
    """At most `limit` requests in flight per server, for one generate() call. `acquire` picks the server
    with the fewest requests in flight (ties: round-robin from `start`, so small batches alternate servers
    over calls), or the server of the request's group, and blocks while that is full; `close` wakes the
    blocked workers and refuses the rest, so that nothing is sent after the call gave up."""

    def __init__(self, num_servers: int, limit: int, start: int = 0, out=None):
        if limit < 1:
            raise ValueError(f"max_in_flight_per_server={limit} must be >= 1")
        self.limit, self.counts, self.peak = limit, [0] * num_servers, [0] * num_servers
        self._next, self._closed = start % num_servers, False
        self.groups: dict = {}  # group -> its server
        self.out = out or (lambda i: False)  # server i is out of the pool (dead): never picked
        self._cond = threading.Condition()

    def acquire(self, group=None) -> int:
        """A slot on the least-loaded server; for a `group` already placed (a prompt's samples), on that
        group's server as soon as it has room, so that the group shares the prompt's prefix cache."""
        n = len(self.counts)
        with self._cond:
            while True:
                if self._closed:
                    raise SlotsClosed("the rollout this request belonged to has ended")
                i = self.groups.get(group) if group is not None else None
                if i is not None and self.out(i):  # the group's server died: the group goes where the next request lands
                    del self.groups[group]
                    i = None
                placed = i is not None
                if not placed:
                    order = [k for k in ((self._next + j) % n for j in range(n)) if not self.out(k)]
                    if not order:
                        raise SlotsClosed("every server of this rollout is out")
                    i = min(order, key=lambda s: self.counts[s])  # first of the least loaded from the cursor
                if self.counts[i] < self.limit:
                    self.counts[i] += 1
                    self.peak[i] = max(self.peak[i], self.counts[i])
                    if not placed:
                        self._next = (i + 1) % n
                        if group is not None:
                            self.groups[group] = i
                    return i
                self._cond.wait()

    def place(self, group, i: int) -> None:
        """Put `group` on server i before its first request (a multi-turn episode's server: its prefix cache)."""
        with self._cond:
            self.groups[group] = i

    def release(self, i: int) -> None:
        with self._cond:
            self.counts[i] -= 1
            self._cond.notify_all()  # a waiter may want this server in particular

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def pool_size(num_servers: int, limit: int) -> int:
    """Workers an engine may need: every slot, plus one per server to decode an answer while its slot is
    already serving the next request."""
    return (limit + 1) * num_servers


_ROUTES_KEY = b'"routed_experts"'
_COLON_QUOTE = re.compile(rb'\s*:\s*"')


def split_routes(body, end: Optional[int] = None) -> tuple[bytes, Optional[memoryview]]:
    """(the answer without its routed_experts string, a view of that base64 string), or (body, None) when
    the routes are absent or not a plain string. body: bytes or a bytearray holding the answer in [0, end).
    The routes are 98% of an answer's bytes: cut out by two forward byte searches (the key comes before its
    value, so the first search never crosses the base64), they never pass through the JSON parser or become a
    Python str. The key cannot match inside a JSON string value (a quote there is escaped as \\"), and base64
    holds no quote, so the next quote ends it."""
    end = len(body) if end is None else end
    i = body.find(_ROUTES_KEY, 0, end)
    if i < 0:
        return body[:end], None
    m = _COLON_QUOTE.match(body, i + len(_ROUTES_KEY), end)
    if m is None:
        return body[:end], None  # null or a list: parsed with the rest
    j = body.find(b'"', m.end(), end)
    if j < 0:
        return body[:end], None  # unterminated: the parser decides
    return body[:i] + b'"routed_experts":null' + body[j + 1:end], memoryview(body)[m.end():j]


class BodyBuffers:
    """Receive buffers reused across answers (one per decode permit in use): an answer of megabytes is read
    straight into one with readinto, with no fresh allocation, page faults or join per answer."""

    def __init__(self):
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def read(self, resp) -> tuple[bytearray, int]:
        """(a buffer holding the whole body in [0, n), n); give the buffer back once decoded."""
        if resp.length is None or resp.chunked:  # no Content-Length: read as it comes
            data = bytearray(resp.read())
            return data, len(data)
        n = resp.length
        with self._lock:
            buf = self._free.pop() if self._free else bytearray()
        if len(buf) < n:
            buf = bytearray(max(n, len(buf) * 5 // 4))  # new, not resized: an old view may still exist
        view, got = memoryview(buf), 0
        try:
            while got < n:
                k = resp.readinto(view[got:n])
                if not k:
                    raise http.client.IncompleteRead(bytes(view[:min(got, 64)]), n - got)
                got += k
        finally:
            view.release()
        return buf, n

    def give(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)


def parse_logprobs(entries) -> torch.Tensor:
    """meta_info.output_token_logprobs ([logprob, token_id, text] per token) -> float32 [tokens]. The first
    column is gathered in C (map/itemgetter into np.fromiter): no Python-level loop per token."""
    if not entries:
        return torch.zeros(0, dtype=torch.float32)
    lps = np.fromiter(map(operator.itemgetter(0), entries), dtype=np.float64, count=len(entries))
    return torch.from_numpy(lps.astype(np.float32))  # float64 -> float32: the rounding of torch.tensor(floats)


DECODE_BLOCK = 1 << 18  # bytes of int32 ids decoded at once: they stay in cache, and below malloc's mmap threshold


def decode_routes(data, num_hidden_layers: int, spec, tokens: int | None = None) -> torch.Tensor:
    """meta_info.routed_experts (base64 of little-endian int32 [rows, num_hidden_layers, topk], see
    moe.routing.decoders.decode_sglang) -> the MoE layers' ids [rows, spec.num_layers, topk] in the trace's
    compact dtype (uint8 up to 256 experts). Same checks and messages as decode_sglang + select_moe_layers.
    Base64 is decoded in blocks of DECODE_BLOCK bytes straight into the compact result: per block one decode, a
    zero-copy frombuffer view, one unsigned max (a negative id, -1 = no data, wraps above any expert count) and
    one narrowing copy of the MoE layers -- no int32 copy of the whole answer, whose fresh pages cost as much as
    the decode. Ids outside [0, num_experts) keep int32 (the whole answer then): narrowing would wrap them into
    valid-looking ids, and validate_trace must see them to name the token (or fall back). tokens: the rows the
    sample must have (prompt + completion - 1); a payload of another size names the layer count it implies."""
    topk, per_row = spec.topk, num_hidden_layers * spec.topk
    layers = np.asarray(spec.moe_layers, dtype=np.intp)
    if isinstance(data, (str, bytes, bytearray, memoryview)):
        try:
            b64 = memoryview(data.encode("ascii") if isinstance(data, str) else data).cast("B")
        except (UnicodeEncodeError, TypeError) as e:
            raise RoutingTraceError(f"routed_experts: not valid base64 ({e})") from None
        if len(b64) % 4:
            return decode_routes(_unescaped(b64, f"{len(b64)} characters, not a multiple of 4"),
                                 num_hidden_layers, spec, tokens)
        pad = len(b64) and (b64[-1] == 61) + (b64[-2] == 61)  # "=": 61
        nbytes = len(b64) // 4 * 3 - pad
        try:
            size = _ids(nbytes, per_row, tokens, num_hidden_layers, topk)
        except RoutingTraceError:
            try:  # what is not base64 at all says so first (a failure's path only: one whole decode)
                b64decode(b64, validate=True)
            except (binascii.Error, ValueError) as err:
                return decode_routes(_unescaped(b64, str(err)), num_hidden_layers, spec, tokens)
            raise
    elif isinstance(data, (list, tuple, np.ndarray, torch.Tensor)):
        try:
            arr = np.asarray(data, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError) as e:
            raise RoutingTraceError(f"routed_experts: not an array of expert ids ({e})") from None
        b64, size = None, _ids(arr.size * 4, per_row, tokens, num_hidden_layers, topk)
    else:
        raise RoutingTraceError(f"routed_experts is {type(data).__name__} {data!r:.40}; expected base64 of int32")
    if layers.size and int(layers.max()) >= num_hidden_layers:
        raise RoutingTraceError(f"routes cover {num_hidden_layers} layers; MoE layer {int(layers.max())} is missing")
    gather = layers.size != num_hidden_layers  # dense layers among them: the MoE columns only
    compact = torch.empty(0, dtype=compact_dtype(spec.num_experts)).numpy().dtype
    rows = size // per_row
    if b64 is None:
        ids = arr.reshape(rows, num_hidden_layers, topk)
        return _narrow(ids[:, layers] if gather else ids, spec.num_experts, compact)
    out = np.empty((rows, layers.size, topk), dtype=compact)
    step = max(3, DECODE_BLOCK // (per_row * 4) // 3 * 3)  # rows: 3 rows of int32 are whole base64 quads
    quad = per_row * 16  # base64 characters of 3 rows (int32: 3 x 4 bytes per id -> 16 characters)
    for r in range(0, rows, step):
        e = min(rows, r + step)
        try:
            raw = b64decode(b64[r // 3 * quad:(e // 3 * quad if e < rows else len(b64))], validate=True)
        except (binascii.Error, ValueError) as err:
            return decode_routes(_unescaped(b64, str(err)), num_hidden_layers, spec, tokens)
        ids = np.frombuffer(raw, dtype="<i4").reshape(-1, num_hidden_layers, topk)
        if gather:
            ids = ids[:, layers]
        if ids.size and int(ids.view("<u4").max()) >= spec.num_experts:  # out of range: the int32 ids, whole
            whole = np.frombuffer(b64decode(b64, validate=True), dtype="<i4").reshape(rows, num_hidden_layers, topk)
            return torch.from_numpy(whole[:, layers] if gather else whole.copy())
        out[r:e] = ids
    return torch.from_numpy(out)


def _ids(nbytes: int, per_row: int, tokens, num_hidden_layers: int, topk: int) -> int:
    """The number of int32 ids in `nbytes`, checked: whole ids, whole rows, and the rows the sample must have."""
    if nbytes % 4:
        raise RoutingTraceError(f"routed_experts: {nbytes} bytes is not a whole number of int32")
    size = nbytes // 4
    if tokens and size != tokens * per_row:
        raise RoutingTraceError(
            f"routed_experts holds {size} ids for {tokens} tokens, i.e. {size / tokens / topk:.3g} layers "
            f"x top-{topk} per token; model.hf_config has num_hidden_layers={num_hidden_layers}: the server "
            "serves another model than the trainer's")
    if size % per_row:
        raise RoutingTraceError(f"routed_experts: {size} ids is not a multiple of num_hidden_layers * "
                                f"topk = {num_hidden_layers} * {topk}")
    return size


def _unescaped(b64: memoryview, why: str) -> str:
    """The routes' string as JSON reads it, when its raw bytes are not plain base64: a JSON escape inside (e.g.
    "\\/", which split_routes leaves in) is undone; anything else is not valid base64."""
    raw = bytes(b64)  # a failure's path only
    if b"\\" in raw:
        try:
            text = json.loads(b'"' + raw + b'"')
        except ValueError:
            text = None
        if isinstance(text, str) and "\\" not in text:
            return text
    raise RoutingTraceError(f"routed_experts: not valid base64 ({why})")


def _narrow(ids: np.ndarray, num_experts: int, compact) -> torch.Tensor:
    """The compact dtype when every id is in [0, num_experts) (one unsigned max), else int32."""
    in_range = ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < num_experts)
    return torch.from_numpy(ids.astype(compact if in_range else np.int32))


__all__ = ["BodyBuffers", "Connections", "ServerSlots", "SlotsClosed", "WorkerPool", "decode_routes", "dumps",
           "loads", "parse_logprobs", "pool_size", "receive_buffer", "split_routes"]
