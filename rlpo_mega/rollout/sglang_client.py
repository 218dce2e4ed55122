"""Request-side helpers of the SGLang engine (rollout/sglang_engine.py): the I/O event loop, its persistent
connections, the per-server in-flight limit, and the decoding of one /generate answer (log-probs, routes).

One event loop for the I/O: every /generate request of an engine is a task on one thread's asyncio loop
(`IOLoop`), which sends it on a keep-alive connection (`Connections`), reads the answer's body straight into a
reused receive buffer (`BodyBuffers`: no copy between the kernel and the decoder) and decodes it there, as it
arrives. A thread per request in flight (~500 of them handing over the GIL) cost the driver ~1 ms of CPU per
answer whatever its length; here an answer costs its parse, its decode and one wake-up of the thread that
consumes the stream. Failures are the same as a blocking client's: a request gets `request_timeout` seconds
without data before TimeoutError; an idle keep-alive connection the server closed as the request went out is
retried once on a new one; `close_url` / `close_active` abort the connections of a dead server or of an ended
rollout, and their requests fail at once.

Concurrency: every server takes at most `rollout.sglang.max_in_flight_per_server` requests at once, so a
rollout has up to that times the number of servers requests in flight. A group's first request takes a slot on
the least-loaded server when it is about to be sent (ties go round-robin); the group's other samples follow it
to that server, so they share the prompt's prefix cache. A slot is given back as soon as the answer is read,
so the answer's decoding (JSON, base64, routes) overlaps with the server's next request.

Cost per route row (a token position with routes: 48 layers x top-8 int32 = 1.5 KB, 2 KB as base64): the
answer is cut before its JSON parse (`split_routes`: the base64 string of routed_experts is located in the
body, never copied into a Python str), decoded with pybase64 and parsed with orjson where installed (the
stdlib otherwise), checked in uint8 (moe.routing.trace.clean_trace) and held in its compact form only.
Bodies are read at most `decode_concurrency` at a time (a connection whose answer's head has arrived stops
reading until it has a permit), so the raw bodies held at once are bounded whatever the number of requests in
flight (the kernel's socket buffers hold the rest).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import http.client
import json
import operator
import os
import re
import socket
import ssl
import threading
import urllib.parse
from collections import deque
from concurrent.futures import Future
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


class SlotsClosed(Exception):
    """The generate() call that owned these slots has ended (stop, hang, error): send nothing more."""


class IOLoop:
    """The engine's one I/O thread: an asyncio event loop that runs every request as a task. Started by the
    first request; `close()` stops and joins it (the engine's shutdown, and at interpreter exit through its
    finalizer). A daemon thread: one still running when the process must exit never holds it."""

    def __init__(self, name: str = "rlpo-sglang-io"):
        self.name = name
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.threads: list[threading.Thread] = []  # the loop's thread(s) so far (one per start)
        self._lock = threading.Lock()

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                t = threading.Thread(target=_run_loop, args=(self.loop,), daemon=True, name=self.name)
                self.threads.append(t)
                t.start()
            return self.loop

    def on_loop(self) -> bool:
        return bool(self.threads) and threading.current_thread() is self.threads[-1]

    def submit(self, jobs) -> list[Future]:
        """Run each (async function, args) of `jobs` as a task on the loop (one wake-up of the loop for all);
        a concurrent Future per job, which can be cancelled until its task starts, as a thread pool's."""
        loop = self._start()
        futures = [Future() for _ in jobs]
        loop.call_soon_threadsafe(_start_tasks, loop, list(zip(futures, jobs)))
        return futures

    def run(self, fn, *args, timeout: float):
        """fn(*args) (async) on the loop from another thread, waited for at most `timeout` s (then cancelled:
        TimeoutError)."""
        future = asyncio.run_coroutine_threadsafe(fn(*args), self._start())
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def call(self, fn, *args) -> None:
        """fn(*args) on the loop's thread: now when called there, else as soon as the loop wakes up."""
        loop = self.loop
        if loop is None:
            return  # never started: nothing of its own to act on
        if self.on_loop():
            fn(*args)
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed meanwhile
            pass

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop (its tasks are cancelled) and join its thread within `timeout`."""
        with self._lock:
            loop, self.loop = self.loop, None
            threads = list(self.threads)
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout)


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:  # stopped: what still runs is cancelled (its futures end with SlotsClosed), the sockets closed
        tasks = asyncio.all_tasks(loop)
        for t in tasks:
            t.cancel()
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=5.0))
        loop.run_until_complete(asyncio.sleep(0))  # the aborted transports' connection_lost
        loop.close()


def _start_tasks(loop, items) -> None:
    for future, (fn, args) in items:
        if future.set_running_or_notify_cancel():
            loop.create_task(fn(*args)).add_done_callback(functools.partial(_settle, future))


def _settle(future: Future, task: asyncio.Task) -> None:
    if task.cancelled():
        future.set_exception(SlotsClosed("the engine shut down before this request ended"))
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


class Connections:
    """Keep-alive HTTP/1.1 connections per server on the engine's I/O loop, reused across requests and steps: no
    TCP handshake per request, and no proxy environment is read (a server address never goes through
    http_proxy). Used on the loop's thread; `close_url` / `close_active` / `close` may be called from any.
    auth: the header line(s) every request carries (b"Authorization: Bearer <key>\r\n": the job's key)."""

    def __init__(self, io: IOLoop, receive_buffer: int = 0, auth: bytes = b""):
        self.io = io
        self.auth = auth
        self.receive_buffer = receive_buffer  # bytes per connection (sglang_client.receive_buffer); 0: the kernel's
        self.buffers = BodyBuffers()
        self._idle: dict[str, list] = {}
        self._active: set = set()
        self._epoch = 0  # close_active() calls so far: a request failing after one is not retried

    async def post(self, url: str, path: str, body: bytes, timeout: float, permit=None) -> tuple:
        """(status, buffer, size): one POST's answer, its body in buffer[:size] (give the buffer back to
        `buffers` once decoded). permit (an asyncio.Semaphore): taken once the answer's head has arrived and held
        on return, so that the bodies read at once are bounded (until then the answer waits in the kernel)."""
        epoch = self._epoch
        for attempt in range(2):
            conn, reused = await self._take(url, timeout)
            try:
                status = await conn.send(path, body, timeout)
            except ConnectionError:
                self._give(url, conn, False)
                if reused and not conn.received and attempt == 0 and epoch == self._epoch:
                    # the server closed this idle connection as the request went out (uvicorn closes idle ones
                    # after 5 s): it never reached the server; once more on a new connection (not after
                    # close_active: that was us)
                    self._drop_idle(url)
                    continue
                raise
            except BaseException:
                self._give(url, conn, False)
                raise
            break
        held = False
        try:
            if permit is not None:
                await permit.acquire()
                held = True
            buf, size = await conn.read_body(self.buffers)
        except BaseException:
            if held:
                permit.release()
            self._give(url, conn, False)
            raise
        self._give(url, conn, conn.reusable)
        return status, buf, size

    async def _take(self, url: str, timeout: float) -> tuple:
        idle = self._idle.get(url)
        while idle:
            conn = idle.pop()
            if conn.usable:  # not closed by the server while idle
                self._active.add(conn)
                return conn, True
            conn.close()
        conn = _Conn(url, self.receive_buffer, self.auth)
        self._active.add(conn)
        try:
            await asyncio.wait_for(conn.connect(), timeout)
        except BaseException:
            self._active.discard(conn)
            conn.close()
            raise
        return conn, False

    def _give(self, url: str, conn: "_Conn", keep: bool) -> None:
        self._active.discard(conn)
        if keep and conn.usable:
            self._idle.setdefault(url, []).append(conn)
        else:
            conn.close()

    def _drop_idle(self, url: str) -> None:
        for conn in self._idle.pop(url, []):
            conn.close()

    def close_url(self, url: str) -> None:
        """Abort the connections of the requests in flight to `url` (a server declared dead or hung): they fail at
        once, and the engine sends those requests elsewhere."""
        self.io.call(self._close_url, url)

    def _close_url(self, url: str) -> None:
        self._drop_idle(url)
        for conn in [c for c in self._active if c.url == url]:
            conn.close()

    def close_active(self) -> None:
        """Abort every request in flight (an ended rollout): each fails at once and none is retried."""
        self._epoch += 1
        self.io.call(self._close_active)

    def _close_active(self) -> None:
        for conn in list(self._active):
            conn.close()

    def close(self) -> None:
        self.close_active()
        self.io.call(self._close_idle)

    def _close_idle(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


class _Conn(asyncio.BufferedProtocol):
    """One keep-alive HTTP/1.1 client connection: a POST at a time. The answer's head is read into a small
    buffer, its body straight into a receive buffer sized by Content-Length (chunked bodies and bodies that end
    with the connection are gathered apart). Each wait for data has `timeout` seconds without any before
    TimeoutError; a connection closed before the answer's end is ConnectionResetError."""

    HEAD = 64 << 10  # the most an answer's status line and headers may take

    def __init__(self, url: str, receive_buffer: int = 0, auth: bytes = b""):
        u = urllib.parse.urlsplit(url)
        self.auth = auth
        self.url, self.https, self.host = url, u.scheme == "https", u.hostname
        self.port = u.port or (443 if self.https else 80)
        self.receive_buffer = receive_buffer
        self.transport = None
        self.closed = False
        self.received = False  # a byte of the current answer has arrived
        self.reusable = False  # the last answer ended cleanly and the server keeps the connection
        self._state = "idle"  # idle -> head -> wait (head read; reading paused) -> body | raw -> idle
        self._loop = None
        self._waiter: Optional[asyncio.Future] = None
        self._timer = None
        self._timeout, self._last = 0.0, 0.0
        self._head, self._hn = bytearray(self.HEAD), 0
        self._scratch: Optional[bytearray] = None
        self._keep, self._length, self._chunked, self._extra = False, None, False, b""
        self._buf = self._view = None
        self._got = self._n = 0
        self._raw = self._chunks = None
        self._cpos = 0
        self._clean_eof = False  # the server closed the connection (no error): a body without length ends there

    # ------------------------------------------------------------------ connection
    async def connect(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._loop.create_connection(lambda: self, self.host, self.port,
                                           ssl=ssl.create_default_context() if self.https else None)
        if self.closed:  # closed while connecting (close_url, close_active)
            self.transport.abort()
            raise ConnectionAbortedError(f"{self.url}: connection closed by this client")

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if self.receive_buffer and sock is not None:  # above net.core.rmem_max the kernel caps it: still a bound
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer)

    @property
    def usable(self) -> bool:
        return not self.closed and self.transport is not None and self._state == "idle"

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()  # connection_lost fails a request still waiting

    def connection_lost(self, exc) -> None:
        self.closed, self._clean_eof = True, exc is None
        if self._timer is not None:
            self._timer.cancel()
        if self._state == "raw" and not self._chunked and exc is None:  # the body ends with the connection
            self._finish(self._raw, len(self._raw))
            return
        if self._waiter is not None and not self._waiter.done():
            where = (f"after {self._got} of {self._n} bytes" if self._state == "body" else
                     "mid-answer" if self.received else "before answering")
            err = ConnectionResetError(f"{self.url}: the connection closed {where}")
            err.__cause__ = exc
            self._waiter.set_exception(err)

    # ------------------------------------------------------------------ one request
    async def send(self, path: str, body: bytes, timeout: float) -> int:
        """Send a POST; its answer's status once the head has arrived (reading then pauses until read_body)."""
        if self.closed:
            raise ConnectionResetError(f"{self.url}: the connection closed before the request")
        self._state, self._hn, self.received, self.reusable = "head", 0, False, False
        self._extra = b""
        self._waiter = self._loop.create_future()
        self._arm(timeout)
        self.transport.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n%s"
                             b"Content-Length: %d\r\n\r\n" % (path.encode(), self.host.encode(), self.port, self.auth,
                                                               len(body)) + body)
        return await self._waiter

    async def read_body(self, buffers: "BodyBuffers") -> tuple:
        """(buffer, size): the answer's body, in a buffer of `buffers` when its length was announced."""
        extra, self._extra = self._extra, b""
        if self._length is not None:
            n = self._length
            buf = buffers.take(n)
            k = min(len(extra), n)
            buf[:k] = extra[:k]
            if len(extra) > n:  # bytes past the answer: nothing this connection can be trusted with
                self._keep = False
            if k == n:
                self._finish(buf, n)
                return buf, n
            self._buf, self._view, self._got, self._n = buf, memoryview(buf), k, n
            self._state = "body"
        else:
            self._raw, self._chunks, self._cpos, self._state = bytearray(extra), bytearray(), 0, "raw"
            if self._chunked and self._chunked_end():
                self._finish(None, 0)
                return self._raw_result()
            if not self._chunked and self.closed and self._clean_eof:  # it ended with the connection, unread
                self._finish(None, 0)
                return self._raw_result()
        if self.closed:
            raise ConnectionResetError(f"{self.url}: the connection closed mid-answer")
        self._waiter = self._loop.create_future()
        self._arm(self._timeout)
        self.transport.resume_reading()
        return await self._waiter

    # ------------------------------------------------------------------ the protocol's callbacks
    def get_buffer(self, sizehint: int):
        if self._state == "body":
            return self._view[self._got:self._n]
        if self._state == "head":
            return memoryview(self._head)[self._hn:]
        if self._scratch is None:  # a chunked body, one up to the close, or bytes nobody asked for
            self._scratch = bytearray(self.HEAD)
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self._last = self._loop.time()
        self.received = True
        state = self._state
        if state == "body":
            self._got += nbytes
            if self._got >= self._n:
                self._finish(self._buf, self._n)
        elif state == "head":
            start = max(0, self._hn - 3)
            self._hn += nbytes
            end = self._head.find(b"\r\n\r\n", start, self._hn)
            if end >= 0:
                self._parse_head(end)
            elif self._hn >= self.HEAD:
                self._fail(http.client.HTTPException(f"{self.url}: an answer's head over {self.HEAD} bytes"))
        elif state == "raw":
            self._raw += memoryview(self._scratch)[:nbytes]
            if self._chunked and self._chunked_end():
                self._finish(*self._raw_result())
        elif state == "wait":  # arrived as reading paused (a TLS record's rest): the body's first bytes
            self._extra += bytes(memoryview(self._scratch)[:nbytes])
        else:  # idle: bytes no request asked for; the connection is not reused
            self._fail(http.client.HTTPException(f"{self.url}: {nbytes} bytes without a request"))

    def eof_received(self):
        return False  # the transport closes itself: connection_lost decides

    # ------------------------------------------------------------------ helpers
    def _parse_head(self, end: int) -> None:
        head, extra = bytes(self._head[:end]), bytes(self._head[end + 4:self._hn])
        lines = head.split(b"\r\n")
        parts = lines[0].split(None, 2)
        try:
            version, status = parts[0], int(parts[1])
            if not version.startswith(b"HTTP/"):
                raise ValueError
        except (IndexError, ValueError):
            return self._fail(http.client.BadStatusLine(lines[0][:80].decode(errors="replace")))
        if 100 <= status < 200:  # an interim answer (100 Continue): the real head follows
            self._head[:len(extra)], self._hn = extra, len(extra)
            end = self._head.find(b"\r\n\r\n", 0, self._hn)
            return self._parse_head(end) if end >= 0 else None
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(b":")
            headers[key.strip().lower()] = value.strip().lower()
        connection = headers.get(b"connection", b"")
        self._chunked = b"chunked" in headers.get(b"transfer-encoding", b"")
        length = headers.get(b"content-length")
        try:
            self._length = 0 if status in (204, 304) else None if self._chunked or length is None else int(length)
        except ValueError:
            return self._fail(http.client.HTTPException(f"{self.url}: Content-Length {length[:40]!r}"))
        self._keep = ((version == b"HTTP/1.1" and b"close" not in connection) or b"keep-alive" in connection) and (
            self._chunked or self._length is not None)
        self._extra, self._state = extra, "wait"
        self.transport.pause_reading()
        if self._timer is not None:
            self._timer.cancel()  # waiting for a decode permit is not the server's time
        self._waiter.set_result(status)

    def _chunked_end(self) -> bool:
        """Decode the chunks of self._raw from self._cpos; True once the last one (and its trailers) is in."""
        raw, pos = self._raw, self._cpos
        while True:
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            try:
                size = int(bytes(raw[pos:eol]).split(b";")[0], 16)
            except ValueError:
                self._fail(http.client.HTTPException(f"{self.url}: bad chunk size {bytes(raw[pos:eol])[:40]!r}"))
                return False
            if size == 0:
                done = raw.find(b"\r\n\r\n", eol) if raw[eol + 2:eol + 4] != b"\r\n" else eol
                if done < 0:
                    break
                del raw[done + 4:]  # nothing may follow on a connection kept alive
                return True
            if len(raw) < eol + 4 + size:
                break
            self._chunks += raw[eol + 2:eol + 2 + size]
            pos = eol + 4 + size
        self._cpos = pos
        return False

    def _raw_result(self) -> tuple:
        body = self._chunks if self._chunked else self._raw
        self._raw = self._chunks = None
        return body, len(body)

    def _finish(self, buf, n: int) -> None:
        self._state, self.reusable = "idle", self._keep and not self.closed
        self._buf = self._view = None
        if not self.closed:
            self.transport.resume_reading()  # idle: a close by the server is seen (a no-op where reading runs)
        if self._timer is not None:
            self._timer.cancel()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result((buf, n))

    def _fail(self, err: BaseException) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(err)
        self.close()

    def _arm(self, timeout: float) -> None:
        """`timeout` s without data fail the wait (re-armed on data: the timer checks the last arrival)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timeout, self._last = timeout, self._loop.time()
        self._timer = self._loop.call_later(timeout, self._expire)

    def _expire(self) -> None:
        if self._state not in ("head", "body", "raw") or self._waiter is None or self._waiter.done():
            return
        quiet = self._loop.time() - self._last
        if quiet < self._timeout:
            self._timer = self._loop.call_later(self._timeout - quiet, self._expire)
            return
        self._fail(TimeoutError(f"{self.url}: no data for {self._timeout:g} s"))


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


class ServerSlots:
    """At most `limit` requests in flight per server, for one generate() call, on the engine's I/O loop.
    `acquire` picks the server with the fewest requests in flight (ties: round-robin from `start`, so small
    batches alternate servers over calls), or the server of the request's group, and waits while that is full;
    `close` (from any thread) wakes the waiting requests and refuses the rest, so that nothing is sent after the
    call gave up. A release wakes one request waiting for that server, else one waiting for any: no herd."""

    def __init__(self, num_servers: int, limit: int, start: int = 0, out=None):
        if limit < 1:
            raise ValueError(f"max_in_flight_per_server={limit} must be >= 1")
        self.limit, self.counts, self.peak = limit, [0] * num_servers, [0] * num_servers
        self._next, self._closed = start % num_servers, False
        self.groups: dict = {}  # group -> its server
        self.out = out or (lambda i: False)  # server i is out of the pool (dead): never picked
        self._lock = threading.Lock()
        self._waiting = [deque() for _ in range(num_servers)]  # futures of requests waiting for server i
        self._waiting_any: deque = deque()  # ... for the least-loaded server

    def _try(self, group) -> tuple:
        """(server, None) with its slot taken, or (None, the server waited for: None for any). Lock held."""
        if self._closed:
            raise SlotsClosed("the rollout this request belonged to has ended")
        n = len(self.counts)
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
        if self.counts[i] >= self.limit:
            return None, (i if placed else None)
        self.counts[i] += 1
        self.peak[i] = max(self.peak[i], self.counts[i])
        if not placed:
            self._next = (i + 1) % n
            if group is not None:
                self.groups[group] = i
        return i, None

    async def acquire(self, group=None) -> int:
        """A slot on the least-loaded server; for a `group` already placed (a prompt's samples), on that
        group's server as soon as it has room, so that the group shares the prompt's prefix cache."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                i, want = self._try(group)
                if i is not None:
                    return i
                waiter = loop.create_future()
                (self._waiting_any if want is None else self._waiting[want]).append(waiter)
            await waiter

    def place(self, group, i: int) -> None:
        """Put `group` on server i before its first request (a multi-turn episode's server: its prefix cache)."""
        with self._lock:
            self.groups[group] = i

    def release(self, i: int) -> None:
        with self._lock:
            self.counts[i] -= 1
            for queue in (self._waiting[i], self._waiting_any):  # one waiter: it takes the slot or waits again
                while queue:
                    waiter = queue.popleft()
                    if not waiter.done():
                        _wake([waiter])
                        return

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            waiters = [w for q in (*self._waiting, self._waiting_any) for w in q]
            for q in (*self._waiting, self._waiting_any):
                q.clear()
        _wake(waiters)


def _wake(waiters) -> None:
    """Resolve each waiter future, on its loop's thread (close() is called from the stream's)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    for waiter in waiters:
        loop = waiter.get_loop()
        if loop is running:
            _resolve(waiter)
        else:
            try:
                loop.call_soon_threadsafe(_resolve, waiter)
            except RuntimeError:  # its loop has closed: nothing waits any more
                pass


def _resolve(waiter) -> None:
    if not waiter.done():
        waiter.set_result(None)


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
    """Receive buffers reused across answers (one per body being read or decoded): an answer of megabytes is
    read straight into one, with no fresh allocation, page faults or join per answer."""

    def __init__(self):
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> bytearray:
        """A buffer of at least n bytes; give it back once its body is decoded."""
        with self._lock:
            buf = self._free.pop() if self._free else bytearray()
        if len(buf) < n:
            buf = bytearray(max(n, len(buf) * 5 // 4))  # new, not resized: an old view may still exist
        return buf

    def give(self, buf) -> None:
        if isinstance(buf, bytearray):
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


__all__ = ["BodyBuffers", "Connections", "IOLoop", "ServerSlots", "SlotsClosed", "decode_routes", "dumps", "loads",
           "parse_logprobs", "receive_buffer", "split_routes"]
