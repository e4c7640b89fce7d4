"""Sleep until an intended send time to within tens of microseconds, under gevent or asyncio.

Both loops wait in epoll_wait, whose timeout is in whole milliseconds, rounded up (libev: so as
never to wake early; Python's selectors: the same): a send planned for t left at t + 0.5-0.9
ms, and the open model rightly counts that lateness as latency, so it inflated every figure
the load suite reported, most of all at low rates, where the API's overhead over the raw pool
is judged (docs/benchmarks.md). A timerfd fires on the kernel's high-resolution timer instead,
and the loop waits for it like for any socket: a few system calls per send, no busy waiting.

Linux only, as the load suite is. Python 3.13 has `os.timerfd_create`; 3.11 reaches libc's
functions with ctypes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import time

CLOCK_MONOTONIC = 1  # the clock of time.perf_counter() on Linux
TFD_TIMER_ABSTIME = 1
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _check(result: int) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


class DeadlineTimer:
    """One timerfd, armed with absolute `time.perf_counter()` deadlines, one deadline at a
    time: several waiters at once take one each (`Timers`)."""

    def __init__(self) -> None:
        self.fd = _check(_libc.timerfd_create(CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC))

    def arm(self, deadline: float) -> None:
        sec = int(deadline)
        value = _Timespec(sec, int((deadline - sec) * 1e9))
        spec = _Itimerspec(_Timespec(0, 0), value)
        _check(_libc.timerfd_settime(self.fd, TFD_TIMER_ABSTIME, ctypes.byref(spec), None))

    def clear(self) -> None:
        """Consume the expiry, so that the descriptor is not readable until the next one."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)

    def sleep_until(self, deadline: float) -> None:
        """Block this greenlet (gevent) until `deadline`; at once if it has passed."""
        if deadline <= time.perf_counter():
            return
        from gevent.socket import wait_read  # only the Locust side runs on gevent

        self.arm(deadline)
        wait_read(self.fd)
        self.clear()

    async def wait_until(self, deadline: float) -> None:
        """Wait on the running asyncio loop until `deadline`; at once if it has passed."""
        if deadline <= time.perf_counter():
            return
        loop = asyncio.get_running_loop()
        fired = loop.create_future()
        self.arm(deadline)
        loop.add_reader(self.fd, fired.set_result, None)
        try:
            await fired
        finally:
            loop.remove_reader(self.fd)
            self.clear()

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> DeadlineTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Timers:
    """DeadlineTimers for greenlets that wait at the same time, kept for reuse (a timerfd per
    send would be two more system calls each)."""

    def __init__(self) -> None:
        self._free: list[DeadlineTimer] = []
        self._all: list[DeadlineTimer] = []

    def sleep_until(self, deadline: float) -> None:
        """`DeadlineTimer.sleep_until` on a timer no other greenlet is waiting on."""
        if deadline <= time.perf_counter():
            return
        timer = self._free.pop() if self._free else self._new()
        try:
            timer.sleep_until(deadline)
        finally:
            self._free.append(timer)

    def _new(self) -> DeadlineTimer:
        timer = DeadlineTimer()
        self._all.append(timer)
        return timer

    def close(self) -> None:
        for timer in self._all:
            timer.close()
        self._all, self._free = [], []

    def __enter__(self) -> Timers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
