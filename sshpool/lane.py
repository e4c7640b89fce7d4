"""The transfer lane: bulk SFTP bytes moved on connections of their own, whose SSH work runs on
an event loop of its own in a thread, so that the loop serving jobs never decrypts, parses or
sends a transfer's packets (docs/files.md, "The transfer lane", says why a thread and not a
process: the measurement is `loadtests.lane_choice`).

What lives where:

- `Lane` owns the thread and its event loop; `Lane.call` runs one coroutine there and awaits
  it from the caller's loop (cancelling the caller cancels it there, and waits for its end).
- `LaneBackend` wraps a backend: its `connect` runs on the lane's loop and returns a
  `LaneConnection`, whose SFTP sessions (`LaneSFTP`) and files (`LaneFile`) run every call
  there. The host pool that leases these connections (`sshpool.host.HostPool`, one per target,
  `Pool.sftp(bulk=True)`) stays on the caller's loop and joins the same sshd budget as the
  target's command connections: lane connections are counted, gated and evicted like any.
- `Turns` shares the lane's chunk operations (one read or write of up to a chunk) among
  tenants: at most `slots` at once; when all are taken, the tenants waiting get one turn each
  in a ring, and within a tenant its transfers one turn each: a saturated lane gives each
  tenant an equal share of its bytes (chunks are equal), and each transfer an equal share of
  its tenant's.

Invariants: a lane connection's I/O happens on the lane's loop only; the pool's state changes
on the caller's loop only; a chunk operation holds its turn until it ended on the lane, also
when its caller was cancelled; what a lane call made for a caller cancelled meanwhile (a
connection, session or file) is closed there (`Lane.call`'s `release`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Hashable,
    Sequence,
)
from typing import Any, TypeVar

from sshpool.backends.base import Backend, Connection, DirEntry, Exit, FileAttrs, SFTPSession
from sshpool.command import Capture, Stdin
from sshpool.errors import ConnectionLost
from sshpool.target import Target

T = TypeVar("T")

# Chunk operations the lane runs at once by default (`Turns`): each moves up to one of the
# API's 4 MiB chunks, so 8 is 32 MiB in flight over the lane's connections.
DEFAULT_SLOTS = 8
# The interpreter's switch interval while a lane runs (`Lane.start`), seconds.
SWITCH_INTERVAL = 0.001
# How much lower the lane's thread runs in the kernel's CPU priority than the rest of the
# process (nice, on Linux where a thread has its own): on contended cores the threads serving
# jobs run first (docs/files.md, "A lower priority").
LANE_NICE = 10
# Tenants' tags kept before those that no longer matter are dropped (`Turns`).
PRUNE_AT = 1024
# Long paths (`wan_sizes`): the bytes of one read or write call of a transfer and the SSH
# receive window of its channel, from the connection's round trip and the bandwidth a transfer
# should reach (Limits.transfer_bandwidth). The floor is what loopback and LANs use (the API's
# 4 MiB chunk, asyncssh's 2 MiB window); the caps bound memory per transfer (an upload holds a
# chunk gathered, its joined copy and the one being written; a download two chunks and the
# window): at 16 MiB chunks a run through the relay grew the API's RSS by 45 MiB per transfer,
# too near the 50 MiB bound, so 8.
MIB = 1 << 20
MIN_CHUNK = 4 * MIB
MAX_CHUNK = 8 * MIB
MIN_WINDOW = 2 * MIB
MAX_WINDOW = 16 * MIB


def wan_sizes(rtt: float | None, bandwidth: float) -> tuple[int, int]:
    """(chunk, window) for a path of round trip `rtt` seconds (None: not known yet) at
    `bandwidth` bytes/s. A read call ends with a round trip in which nothing of the file moves
    (its last reply comes back, then the next call's first request goes out): a chunk of four
    bandwidth-delay products keeps that pause within a fifth of the time. The window holds two
    products, so the requests of one chunk are never held back by it."""
    if rtt is None or rtt <= 0:
        return MIN_CHUNK, MIN_WINDOW
    bdp = bandwidth * rtt
    chunk = min(MAX_CHUNK, max(MIN_CHUNK, -(-int(4 * bdp) // MIB) * MIB))
    window = min(MAX_WINDOW, max(MIN_WINDOW, int(2 * bdp)))
    return chunk, window


class Lane:
    """A thread running an event loop for transfer connections. `start` before use, `stop`
    after the pool that uses it is closed."""

    def __init__(self, slots: int = DEFAULT_SLOTS, name: str = "sshpool-lane") -> None:
        self.name = name
        self.turns = Turns(slots)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("the transfer lane is not started")
        return self._loop

    def start(self) -> Lane:
        if self._thread is None:
            # The jobs' loop waits for the GIL after each of its system calls while the lane's
            # thread runs: at most the switch interval each time (5 ms by default, a job's
            # few wake-ups then cost tens of ms). 1 ms for the whole process from here on
            # (`loadtests.lane_choice`'s `thread-1ms`; docs/files.md "Why a thread").
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
            self._ready.wait()
        return self

    def _run(self) -> None:
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency of the API
            loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        _lower_priority(LANE_NICE)
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    @property
    def native_id(self) -> int | None:
        """The kernel's id of the lane's thread (None before `start`)."""
        return self._thread.native_id if self._thread is not None else None

    def stop(self) -> None:
        """End the thread (the pool's lane connections closed before: `Pool.close`)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._thread = None
        self._loop = None

    def in_lane(self) -> bool:
        return threading.current_thread() is self._thread

    async def call(
        self,
        fn: Callable[..., Coroutine[Any, Any, T]],
        *args: Any,
        release: Callable[[T], Coroutine[Any, Any, object]] | None = None,
    ) -> T:
        """`await fn(*args)` on the lane's loop, from the caller's. A cancelled caller cancels
        it there and returns once it has ended (so nothing of it runs on after, e.g. on a
        session the caller closes next). `release`: what becomes of a result that ended on the
        lane before the cancel got there, which no one will receive (a connection, session or
        file: closed there, not left open and uncounted)."""
        loop = self.loop
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        task: list[asyncio.Task[T]] = []

        def start() -> None:
            t = loop.create_task(fn(*args))
            task.append(t)
            t.add_done_callback(lambda t: _settle(t, done))

        def cancel() -> None:
            if task:
                task[0].cancel()
            elif not done.done():  # never started
                done.cancel()

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError as exc:  # the lane's loop is closed
            raise ConnectionLost(f"transfer lane stopped: {exc}", started=False) from exc
        waiter = asyncio.wrap_future(done)
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(cancel)
            with contextlib.suppress(BaseException):
                result = await asyncio.shield(waiter)
                if release is not None:
                    await asyncio.shield(self.call(release, result))
            raise


def _lower_priority(by: int) -> None:
    """The calling thread's nice raised by `by`. Linux gives each thread its own (setpriority
    on the thread's id); elsewhere the call would renice the whole process, so nothing is
    done. Raising it needs no privilege; a refusal leaves the thread as it was."""
    if not sys.platform.startswith("linux"):
        return
    me = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, me, os.getpriority(os.PRIO_PROCESS, me) + by)


def _settle(task: asyncio.Task[T], done: concurrent.futures.Future[T]) -> None:
    if done.done():
        return
    if task.cancelled():
        done.cancel()
    elif (exc := task.exception()) is not None:
        done.set_exception(exc)
    else:
        done.set_result(task.result())


class Turns:
    """At most `slots` chunk operations at once; the waiting ones are granted by start-time
    fair queuing over their bytes, tenant first, then transfer within the tenant (module
    docstring). Each tenant has a tag, the bytes it was granted measured on a virtual clock
    (the tag of the last grant): the next grant goes to the waiting tenant whose tag is lowest,
    and within it to its transfer whose own tag is lowest (ties: who waited first). A tenant
    or transfer that comes back after an idle spell starts at the clock, so it gets its share
    from then on and no burst for the time it did not ask. `granted` counts bytes per tenant
    and `order` the tenants of the last grants (what the tests and benchmarks read)."""

    def __init__(self, slots: int = DEFAULT_SLOTS) -> None:
        self.slots = max(1, slots)
        self.busy = 0
        self.queued = 0
        # tenant -> [(transfer, future, bytes, arrival)] in arrival order.
        self._waiting: dict[Hashable, list[tuple[Hashable, asyncio.Future[None], int, int]]] = {}
        self._clock = 0.0
        self._tags: dict[Hashable, float] = {}
        # Per tenant: its transfers' tags and its own clock.
        self._transfer_tags: dict[tuple[Hashable, Hashable], float] = {}
        self._tenant_clock: dict[Hashable, float] = {}
        self._arrivals = 0
        self.granted: Counter[Hashable] = Counter()
        self.order: deque[Hashable] = deque(maxlen=4096)

    @contextlib.asynccontextmanager
    async def turn(self, tenant: Hashable, transfer: Hashable, size: int) -> AsyncIterator[None]:
        if self.busy < self.slots and not self.queued:
            self._grant(tenant, transfer, size)
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._arrivals += 1
            self._waiting.setdefault(tenant, []).append((transfer, fut, size, self._arrivals))
            self.queued += 1
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._release()  # granted as it was cancelled: pass the turn on
                else:
                    self._forget(tenant, fut)
                raise
        try:
            yield
        finally:
            self._release()

    def _grant(self, tenant: Hashable, transfer: Hashable, size: int) -> None:
        start = max(self._tags.get(tenant, 0.0), self._clock)
        self._tags[tenant] = start + size
        self._clock = start
        inner = max(
            self._transfer_tags.get((tenant, transfer), 0.0), self._tenant_clock.get(tenant, 0.0)
        )
        self._transfer_tags[(tenant, transfer)] = inner + size
        self._tenant_clock[tenant] = inner
        self.busy += 1
        self.granted[tenant] += size
        self.order.append(tenant)

    def _forget(self, tenant: Hashable, fut: asyncio.Future[None]) -> None:
        ops = self._waiting.get(tenant, [])
        for i, op in enumerate(ops):
            if op[1] is fut:
                del ops[i]
                self.queued -= 1
                break
        if not ops:
            self._waiting.pop(tenant, None)

    def _release(self) -> None:
        self.busy -= 1
        while self.busy < self.slots and self._waiting:
            tenant = min(
                self._waiting,
                key=lambda t: (max(self._tags.get(t, 0.0), self._clock), self._waiting[t][0][3]),
            )
            ops = self._waiting[tenant]
            clock = self._tenant_clock.get(tenant, 0.0)
            i = min(
                range(len(ops)),
                key=lambda i: (max(self._transfer_tags.get((tenant, ops[i][0]), 0.0), clock), i),
            )
            transfer, fut, size, _ = ops.pop(i)
            if not ops:
                del self._waiting[tenant]
            self.queued -= 1
            self._grant(tenant, transfer, size)
            fut.set_result(None)
        if len(self._tags) > PRUNE_AT:
            # Tenants behind the clock and not waiting would start at the clock anyway.
            for t in [t for t, tag in self._tags.items() if tag <= self._clock]:
                if t not in self._waiting:
                    del self._tags[t]
                    self._tenant_clock.pop(t, None)

    def forget_transfer(self, tenant: Hashable, transfer: Hashable) -> None:
        """A transfer ended: its tag is no longer kept."""
        self._transfer_tags.pop((tenant, transfer), None)


class LaneBackend:
    """A backend whose connections are made, and do all their I/O, on `lane`'s loop."""

    def __init__(self, backend: Backend, lane: Lane) -> None:
        self.backend = backend
        self.lane = lane
        self.name = backend.name

    async def connect(self, target: Target) -> LaneConnection:
        conn = await self.lane.call(self.backend.connect, target, release=_close)
        lane_conn = LaneConnection(conn, self.lane, target.limits.transfer_bandwidth)
        try:
            await lane_conn.probe()
        except BaseException:  # cancelled meanwhile: the caller never gets it to close
            await asyncio.shield(lane_conn.close())
            raise
        return lane_conn


class LaneConnection:
    """A connection living on the lane's loop, used from the caller's. It carries SFTP
    sessions; `exec` runs there too (the captures are then fed on the lane's thread, so the
    pool never runs a caller's command on a lane connection).

    `rtt`: the shortest SFTP round trip seen on it (the probe at its start, then every file
    open), which sizes its sessions' windows and its files' chunks (`wan_sizes`)."""

    def __init__(self, conn: Connection, lane: Lane, bandwidth: float) -> None:
        self._conn = conn
        self._lane = lane
        self.bandwidth = bandwidth
        self.rtt: float | None = None

    def saw(self, rtt: float) -> None:
        self.rtt = rtt if self.rtt is None else min(self.rtt, rtt)

    def sizes(self) -> tuple[int, int]:
        """(chunk, window) for its next session and files: from the round trip where the
        backend takes a window (asyncssh, paramiko: their reads keep as many bytes in flight
        as the window); elsewhere the LAN sizes: ssh2's libssh2 sizes its window itself (it
        grows it to eight times its read-ahead, four times the call's size up to 8 MiB) and
        grew the API's RSS by 45-50 MiB per transfer with 8 MiB calls through the relay."""
        if not hasattr(self._conn, "sftp_window"):
            return MIN_CHUNK, MIN_WINDOW
        return wan_sizes(self.rtt, self.bandwidth)

    async def probe(self) -> None:
        """One SFTP round trip timed (a session opened, `realpath(".")`, closed): the path's
        round trip before the first transfer's window is chosen. A failure is left to the
        transfer's own session to meet."""
        with contextlib.suppress(Exception):
            self.saw(await self._lane.call(_probe, self._conn))

    def is_alive(self) -> bool:
        return self._conn.is_alive()  # a flag the backend sets, read without I/O

    async def exec(
        self, command: str, stdin: bytes | Stdin | None, stdout: Capture, stderr: Capture
    ) -> Exit:
        return await self._lane.call(self._conn.exec, command, stdin, stdout, stderr)

    async def sftp(self) -> LaneSFTP:
        _chunk, window = self.sizes()
        if hasattr(self._conn, "sftp_window"):  # asyncssh's, paramiko's: ssh2 sizes its own
            self._conn.sftp_window = None if window <= MIN_WINDOW else window
        session = await self._lane.call(self._conn.sftp, release=_close)
        return LaneSFTP(session, self._lane, self)

    async def close(self) -> None:
        with contextlib.suppress(ConnectionLost):
            await self._lane.call(self._conn.close)


class LaneSFTP:
    """An SFTP session on a lane connection: each call runs on the lane's loop. `tenant`
    (set by `Pool.sftp`) names whose turns its files' chunks take (`Turns`)."""

    def __init__(self, session: SFTPSession, lane: Lane, conn: LaneConnection) -> None:
        self._s = session
        self._lane = lane
        self._conn = conn
        self.tenant: Hashable = None

    async def realpath(self, path: str) -> str:
        return await self._lane.call(self._s.realpath, path)

    async def realpaths(self, paths: Sequence[str]) -> list[str | None]:
        return await self._lane.call(self._s.realpaths, paths)

    async def stat(self, path: str) -> FileAttrs:
        return await self._lane.call(self._s.stat, path)

    async def lstat(self, path: str) -> FileAttrs:
        return await self._lane.call(self._s.lstat, path)

    async def readlink(self, path: str) -> str:
        return await self._lane.call(self._s.readlink, path)

    async def listdir(self, path: str) -> list[DirEntry]:
        return await self._lane.call(self._s.listdir, path)

    async def scandir(self, path: str) -> AsyncGenerator[DirEntry, None]:
        entries = self._s.scandir(path)
        try:
            while True:
                try:
                    entry = await self._lane.call(_next, entries)
                except StopAsyncIteration:
                    return
                yield entry
        finally:
            await self._lane.call(entries.aclose)

    async def open_read(self, path: str, offset: int = 0) -> LaneFile:
        f, rtt = await self._lane.call(
            _timed, self._s.open_read, path, offset, release=_close_opened
        )
        self._conn.saw(rtt)
        chunk, _window = self._conn.sizes()
        return LaneFile(f, self._lane, self.tenant, chunk)

    async def open_write(self, path: str, *, exclusive: bool = True, mode: int = 0o644) -> LaneFile:
        """A file to write in calls of MIN_CHUNK whatever the path: a backend's write returns
        with its last requests unanswered and the next call's follow them (asyncssh, paramiko),
        so a call's closing round trip no longer idles the pipe, and a bigger call would only
        hold more of the API's memory per upload."""
        f, rtt = await self._lane.call(
            _timed, _open_write, self._s, path, exclusive, mode, release=_close_opened
        )
        self._conn.saw(rtt)
        return LaneFile(f, self._lane, self.tenant, MIN_CHUNK)

    async def open_resume(self, path: str, offset: int) -> LaneFile:
        """A resumable upload's file at `offset`, written in MIN_CHUNK calls (open_write)."""
        f, rtt = await self._lane.call(
            _timed, self._s.open_resume, path, offset, release=_close_opened
        )
        self._conn.saw(rtt)
        return LaneFile(f, self._lane, self.tenant, MIN_CHUNK)

    async def receive_window(self) -> int | None:
        """Its channel's receive window as its backend reports it, read on the lane's thread
        (None: the backend does not say)."""
        return await self._lane.call(_receive_window, self._s)

    async def rename(self, old: str, new: str, *, overwrite: bool) -> None:
        await self._lane.call(_rename, self._s, old, new, overwrite)

    async def remove(self, path: str) -> None:
        await self._lane.call(self._s.remove, path)

    async def rmdir(self, path: str) -> None:
        await self._lane.call(self._s.rmdir, path)

    async def mkdir(self, path: str, mode: int = 0o755) -> None:
        await self._lane.call(self._s.mkdir, path, mode)

    async def setstat(
        self, path: str, *, mode: int | None = None, mtime: int | None = None
    ) -> None:
        await self._lane.call(_setstat, self._s, path, mode, mtime)

    def intact(self) -> bool:
        return self._s.intact()

    async def close(self) -> None:
        with contextlib.suppress(ConnectionLost):
            await self._lane.call(self._s.close)


class LaneFile:
    """An open file of a `LaneSFTP`: each read or write runs on the lane's loop, in its
    tenant's turn (`Turns`); the bytes cross between the threads as they are (no copy).
    `chunk`: the bytes its callers should read or write per call on this path (`wan_sizes`)."""

    def __init__(self, f: Any, lane: Lane, tenant: Hashable, chunk: int = MIN_CHUNK) -> None:
        self._f = f
        self._lane = lane
        self._tenant = tenant
        self.chunk = chunk

    async def read(self, size: int) -> bytes:
        async with self._lane.turns.turn(self._tenant, self, size):
            data: bytes = await self._lane.call(self._f.read, size)
        return data

    async def write(self, data: bytes) -> None:
        async with self._lane.turns.turn(self._tenant, self, len(data)):
            await self._lane.call(self._f.write, data)

    async def flush(self) -> None:
        await self._lane.call(self._f.flush)

    async def close(self) -> None:
        self._lane.turns.forget_transfer(self._tenant, self)
        await self._lane.call(self._f.close)


async def _close(made: Any) -> None:
    """Close what a lane call made for a caller that was cancelled (`Lane.call`'s release)."""
    with contextlib.suppress(Exception):
        await made.close()


async def _close_opened(opened: tuple[Any, float]) -> None:
    await _close(opened[0])


async def _next(entries: AsyncGenerator[DirEntry, None]) -> DirEntry:
    return await entries.__anext__()


async def _timed(fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> tuple[T, float]:
    """`fn(*args)`'s result and how long it took (one SFTP request: a round trip and the
    host's work), timed on the lane's loop."""
    t0 = time.perf_counter()
    result = await fn(*args)
    return result, time.perf_counter() - t0


async def _open_write(s: SFTPSession, path: str, exclusive: bool, mode: int) -> Any:
    return await s.open_write(path, exclusive=exclusive, mode=mode)


async def _probe(conn: Connection) -> float:
    session = await conn.sftp()
    try:
        _, rtt = await _timed(session.realpath, ".")
    finally:
        await session.close()
    return rtt


async def _receive_window(s: SFTPSession) -> int | None:
    window = getattr(s, "receive_window", None)
    return None if window is None else int(window())


async def _rename(s: SFTPSession, old: str, new: str, overwrite: bool) -> None:
    await s.rename(old, new, overwrite=overwrite)


async def _setstat(s: SFTPSession, path: str, mode: int | None, mtime: int | None) -> None:
    await s.setstat(path, mode=mode, mtime=mtime)
