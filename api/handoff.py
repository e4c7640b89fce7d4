"""Each new connection handed to the least busy worker.

With several workers (`settings.workers` > 1) the supervisor accepts every connection on the
port itself and passes it (its descriptor, over a Unix socket pair: SCM_RIGHTS, no byte of the
connection goes through the supervisor) to the worker with the fewest requests in flight,
counting the connections handed to it that it has not taken yet; ties go round the workers in
turn. Each worker counts its requests in flight (`Counted`, around the app) in memory it shares
with the supervisor (`Loads`), and serves what it is handed (`HandedServer`).

Why not let every worker accept on the one socket: the first worker to wake takes every
connection waiting (asyncio accepts up to its backlog per wake-up), so connections opened
together land together: four 1 GiB downloads started at once ran three on one worker and one on
the other, that worker's interpreter the bottleneck of all three. A socket per worker
(SO_REUSEPORT) spreads by a hash of the addresses, blind to load. A download or a followed
output holds its worker for minutes: where it lands is what decides the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import multiprocessing.sharedctypes
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from api.tasks import TaskSet

log = logging.getLogger("sshapi.handoff")

# Seconds the supervisor's accept loop waits before it looks at its stop flag again.
POLL = 0.5
# Seconds it pauses accepting after an accept fails for a reason of the process's own (out of
# descriptors or memory: asyncio pauses its own accept loop alike): the connections wait in the
# backlog meanwhile. The loop never ends on an error: a supervisor that stopped accepting would
# leave its healthy workers serving nobody.
PAUSE = 0.1
# Seconds a connection may wait for a worker able to take it (every pair full, or every worker
# dead and being started again) before it is closed: about a worker's start.
HOLD = 10.0
# Seconds between two tries of a connection no worker could take.
RETRY = 0.001
# Seconds between two log lines about connections closed for want of a worker.
LOG_EVERY = 10.0


class Loads:
    """Per worker, two counters in shared memory: its requests in flight and the connections
    it has taken from its socket pair. Each worker writes its own two and the supervisor reads
    them; a counter is one aligned machine word, written by one process only."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._words = multiprocessing.sharedctypes.RawArray(ctypes.c_long, 2 * workers)

    def busy(self, index: int) -> int:
        return int(self._words[2 * index])

    def add_busy(self, index: int, n: int) -> None:
        self._words[2 * index] += n

    def taken(self, index: int) -> int:
        return int(self._words[2 * index + 1])

    def add_taken(self, index: int, n: int) -> None:
        self._words[2 * index + 1] += n

    def reset(self, index: int) -> None:
        """A worker started (again): nothing in flight, nothing taken."""
        self._words[2 * index] = 0
        self._words[2 * index + 1] = 0


def preference(load: Sequence[int], start: int) -> list[int]:
    """Worker indexes, the one to try first first: the least `load`, and among equal loads
    from `start` round (so equal workers take turns)."""
    n = len(load)
    turn = [(start + k) % n for k in range(n)]
    return sorted(turn, key=lambda i: load[i])  # a stable sort keeps the turn among ties


class Dispatcher:
    """The supervisor's side: a thread accepting on the listening socket and handing each
    connection to a worker's socket pair, the least loaded first. A worker whose pair is
    gone (it died) or full (it is behind) is passed over. When no worker can take one (every
    pair full in a flood of new connections, or every worker dead), the thread waits, up to
    `hold` seconds, for a pair with room or a worker started again, and accepts nothing
    meanwhile: the next connections wait in the kernel's backlog, as they did when the workers
    accepted themselves. Only a connection no worker could take for `hold` seconds is closed."""

    def __init__(self, sock: socket.socket, loads: Loads, backlog: int, hold: float = HOLD):
        self._sock = sock
        self._loads = loads
        self._backlog = backlog
        self._hold = hold
        self._lock = threading.Lock()  # the pairs and the handed counts: main thread and ours
        self._pairs: dict[int, socket.socket] = {}
        self._dead: set[int] = set()  # workers whose pair failed other than full: until restarted
        self._closed = 0  # connections closed for want of a worker since the last log line
        self._logged = 0.0
        self._handed = [0] * loads.workers
        self._next = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sshapi-handoff", daemon=True)

    def pair(self, index: int) -> socket.socket:
        """A new socket pair for worker `index`, about to start (again): the supervisor keeps
        one end, the returned end goes to the worker (and is closed here once it has)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        with self._lock:
            old, self._pairs[index] = self._pairs.get(index), ours
            self._dead.discard(index)
            self._handed[index] = 0
            self._loads.reset(index)
        if old is not None:
            old.close()
        return theirs

    def start(self) -> None:
        self._sock.listen(self._backlog)
        self._sock.setblocking(False)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting (new connections wait in the backlog, for nobody) and close the
        pairs: a worker reading one sees its end."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for ours in pairs:
            ours.close()

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                try:
                    if sel.select(POLL):
                        self._accept_all()
                except Exception:  # never ends (see PAUSE): logged, and accepting goes on
                    log.exception("handing connections over failed: going on")
                    time.sleep(PAUSE)

    def _accept_all(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                log.warning("cannot accept connections (%s): pausing %.1f s", exc, PAUSE)
                time.sleep(PAUSE)
                return
            with conn:
                self._hand(conn)

    def _hand(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self._hold
        while not self._stop.is_set():
            if self._try_hand(conn):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wait_for_room(min(left, POLL))
            # A pair that says it has room and still refuses (out of something other than
            # buffer space) must not make this a busy loop.
            time.sleep(RETRY)
        self._closed += 1
        if (now := time.monotonic()) - self._logged >= LOG_EVERY:
            log.warning("no worker could take %d connection(s): closed", self._closed)
            self._closed, self._logged = 0, now

    def _try_hand(self, conn: socket.socket) -> bool:
        with self._lock:
            load = [
                self._loads.busy(i) + max(0, self._handed[i] - self._loads.taken(i))
                if i in self._pairs and i not in self._dead
                else 1 << 30
                for i in range(self._loads.workers)
            ]
            for index in preference(load, self._next):
                ours = self._pairs.get(index)
                if ours is None or index in self._dead:
                    continue
                try:
                    socket.send_fds(ours, [b"c"], [conn.fileno()])
                except ConnectionError:  # its end is gone: it died, and is started again soon
                    self._dead.add(index)
                    continue
                except OSError:  # full (it is behind) or short of something now: the next
                    continue
                self._handed[index] += 1
                self._next = (index + 1) % self._loads.workers
                return True
        return False

    def _wait_for_room(self, timeout: float) -> None:
        """Until a live worker's pair has room or `timeout` seconds pass (a worker started
        again brings a new pair: looked for at the next try)."""
        with self._lock:
            live = [ours for i, ours in self._pairs.items() if i not in self._dead]
        if not live:
            time.sleep(min(timeout, PAUSE))
            return
        with selectors.DefaultSelector() as sel:
            for ours in live:
                # Closed meanwhile by a restart (the new pair is tried next time).
                with contextlib.suppress(ValueError, OSError):
                    sel.register(ours, selectors.EVENT_WRITE)
            if sel.get_map():
                sel.select(timeout)
            else:
                time.sleep(min(timeout, PAUSE))


class Counted:
    """The app with this worker's HTTP requests in flight counted in `loads` (a streamed
    answer counts until its last byte is sent)."""

    def __init__(self, app: ASGIApp, loads: Loads, index: int) -> None:
        self.app = app
        self._loads = loads
        self._index = index

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._loads.add_busy(self._index, 1)
        try:
            await self.app(scope, receive, send)
        finally:
            self._loads.add_busy(self._index, -1)


class HandedServer(uvicorn.Server):
    """uvicorn serving the connections handed over `pair` instead of accepting on a socket:
    the same protocol (so the same edge limits, api/server.py), the same graceful shutdown,
    which first stops taking connections."""

    def __init__(self, config: uvicorn.Config, pair: socket.socket, loads: Loads, index: int):
        super().__init__(config)
        self._pair = pair
        self._loads = loads
        self._index = index
        self._opening = TaskSet("handed connection")  # connections being set up
        self._reading = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # no listening socket: only the lifespan and state
        loop = asyncio.get_running_loop()
        protocol: Callable[[], asyncio.Protocol] = functools.partial(
            self.config.http_protocol_class,  # type: ignore[call-arg]
            config=self.config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
            _loop=loop,
        )
        self._pair.setblocking(False)
        loop.add_reader(self._pair.fileno(), self._take, loop, protocol)
        self._reading = True

    def _take(
        self, loop: asyncio.AbstractEventLoop, protocol: Callable[[], asyncio.Protocol]
    ) -> None:
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self._pair, 64, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg, fds = b"", []
            for fd in fds:
                self._loads.add_taken(self._index, 1)
                conn = socket.socket(fileno=fd)
                if self.should_exit:  # shutting down: it goes back closed, as to a full server
                    conn.close()
                    continue
                self._opening.spawn(self._open(loop, protocol, conn), name="handed connection")
            if not msg:  # the supervisor is gone: nothing more comes
                self._stop_reading()
                return

    async def _open(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol: Callable[[], asyncio.Protocol],
        conn: socket.socket,
    ) -> None:
        try:
            await loop.connect_accepted_socket(protocol, conn)
        except OSError as exc:  # the client went while it was handed over
            log.debug("a handed connection could not be set up: %s", exc)
            conn.close()

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            asyncio.get_running_loop().remove_reader(self._pair.fileno())

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._stop_reading()
        await self._opening.wait()
        await super().shutdown(sockets)
        with contextlib.suppress(OSError):
            self._pair.close()
