"""Who owns a task: every task the API starts has an owner that awaits it, so none is lost.

- `Supervisor`: the process's long-lived tasks (the store's writer, the live relay's listener,
  trackers, renewers, prewarms) in one
  `asyncio.TaskGroup`, each started under a policy that says what its death means (api/services.py
  lists them): `RESTART` (logged, started again after a pause; dying `MAX_RESTARTS` times within
  `RESTART_WINDOW` seconds takes the process down, since a task that keeps dying is a bug that
  restarting the process may clear, and a replica that half works is worse than one that
  restarts), `ONCE` (logged, never started again: a best-effort task) or `FATAL` (any death
  takes the process down). Taking the process down: the group cancels the other tasks, /readyz
  answers 503 from then on, and the process's fatal handler runs (`on_fatal`: `sshapi serve`
  sets one that stops the server and exits non-zero, so its supervisor, systemd or the
  orchestrator starts it again; an app a test runs in its own process stays up, not ready).
  Shutdown cancels the tasks one at a time, the last started first, each awaited before the next;
  an owner that must end its task before others close (the store's writer after its last
  write) stops it itself (`stop`).
- `TaskSet`: the short-lived tasks of a service (a job's run, a DELETE's cancel, the lookup of a
  batch submission): one set it owns, cancels and awaits on close. A task that fails with nobody
  awaiting it is logged, never dropped silently.

May import: the standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger("sshapi.tasks")

T = TypeVar("T")

MAX_RESTARTS = 3  # deaths of one RESTART task within RESTART_WINDOW that take the process down
RESTART_WINDOW = 60.0
RESTART_DELAY = (0.5, 10.0)  # the pause before a restart: from the first figure, doubling


class OnDeath(enum.Enum):
    RESTART = "restart"
    ONCE = "once"
    FATAL = "fatal"


class TaskDied(Exception):
    """A supervised task died and took the process down."""


@dataclass(slots=True, eq=False)
class Child:
    """A task of the supervisor's (what `spawn` returns, for `stop`)."""

    name: str
    start: Callable[[], Coroutine[Any, Any, None]]
    policy: OnDeath
    task: asyncio.Task[None] | None = None
    deaths: list[float] = field(default_factory=list)


# What a task that takes the process down does besides making it unready: process-wide, like
# the signals the process model handles (api/workers.py sets it before serving).
_fatal: Callable[[BaseException], None] | None = None


def on_fatal(handler: Callable[[BaseException], None] | None) -> None:
    """Set this process's fatal handler (None: none)."""
    global _fatal
    _fatal = handler


class Supervisor:
    """The long-lived tasks of one process, in one TaskGroup (see the module docstring)."""

    def __init__(self) -> None:
        self._children: list[Child] = []
        self._group: asyncio.TaskGroup | None = None
        self._owner: asyncio.Task[None] | None = None
        self._running = asyncio.Event()
        self._stop = asyncio.Event()
        self.failure: BaseException | None = None

    @property
    def healthy(self) -> bool:
        return self.failure is None

    async def start(self) -> None:
        """Open the group (its body waits in a task of its own until `close`)."""
        self._owner = asyncio.create_task(self._main(), name="supervisor")
        await self._running.wait()

    def spawn(
        self, name: str, start: Callable[[], Coroutine[Any, Any, None]], policy: OnDeath
    ) -> Child:
        """Run `start()` in the group under `policy`; `start` is called again for a restart."""
        if self._group is None or self.failure is not None:
            raise RuntimeError("the supervisor is not running")
        child = Child(name, start, policy)
        self._children.append(child)
        child.task = self._group.create_task(self._supervise(child), name=name)
        return child

    async def _main(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                self._running.set()
                await self._stop.wait()
        except* Exception as died:
            self.failure = died
            log.critical("a background task died: the process goes down")
            if _fatal is not None:
                _fatal(died)
        finally:
            self._group = None
            self._running.set()

    async def _supervise(self, child: Child) -> None:
        delay = RESTART_DELAY[0]
        while True:
            try:
                await child.start()
                if child.policy is OnDeath.ONCE:
                    return
                # A loop that returns has stopped doing its work: a death like any other.
                raise TaskDied(f"{child.name} returned; it should run until shutdown")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if child.policy is OnDeath.ONCE:
                    log.exception("background task %s failed (not restarted)", child.name)
                    return
                now = time.monotonic()
                child.deaths = [t for t in child.deaths if now - t < RESTART_WINDOW] + [now]
                if child.policy is OnDeath.FATAL or len(child.deaths) >= MAX_RESTARTS:
                    log.critical(
                        "background task %s died (%d time(s) within %g s)",
                        child.name,
                        len(child.deaths),
                        RESTART_WINDOW,
                        exc_info=True,
                    )
                    raise TaskDied(f"{child.name} died: {exc!r}") from exc
                log.exception("background task %s died: restarting it in %g s", child.name, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_DELAY[1])

    async def stop(self, *children: Child) -> None:
        """Cancel these tasks (the owner of a task that must end before others, a service
        closing in its turn), the last given first, each awaited before the next."""
        for child in reversed(children):
            if child in self._children:
                self._children.remove(child)
            if child.task is not None and not child.task.done():
                child.task.cancel()
                await asyncio.wait([child.task])

    async def close(self) -> None:
        """Cancel the tasks still running, the last started first, each awaited before the
        next; then close the group."""
        await self.stop(*self._children)
        self._stop.set()
        if self._owner is not None:
            await asyncio.wait([self._owner])


@contextlib.asynccontextmanager
async def supervised() -> AsyncIterator[Supervisor]:
    """A started supervisor, closed on exit (for an object used on its own, as tests do)."""
    supervisor = Supervisor()
    await supervisor.start()
    try:
        yield supervisor
    finally:
        await supervisor.close()


class TaskSet:
    """Short-lived tasks one service owns (see the module docstring)."""

    def __init__(self, what: str, expected: tuple[type[BaseException], ...] = ()) -> None:
        self.what = what
        # Failures its tasks raise to their awaiters on purpose (a cancel's HTTP problem).
        self._expected = expected
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # retrieved: logged here even when an awaiter saw it too
        if exc is not None and not isinstance(exc, self._expected):
            log.error("%s task %s failed", self.what, task.get_name(), exc_info=exc)

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout` seconds) for the tasks there are now to end by themselves."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def close(self, timeout: float | None = None) -> None:
        """Cancel every task and wait for them (at most `timeout` seconds)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
