"""The generator's send timer: never before the intended time (an early send would hide the
server's latency), and well inside the millisecond that gevent.sleep and asyncio.sleep round
their waits up to (that rounding was counted as the server's latency at every rate)."""

from __future__ import annotations

import asyncio
import statistics
import time

import gevent

from loadtests.timer import DeadlineTimer

SENDS = 30
INTERVAL = 0.01  # 100/s, the rate of the CPU row


def _deadlines() -> list[float]:
    start = time.perf_counter() + 0.005
    return [start + n * INTERVAL for n in range(SENDS)]


def _check(lateness_ms: list[float]) -> None:
    assert min(lateness_ms) >= 0.0, "woke before the intended send time"
    # Rounded-up millisecond waits are late by 0.5-1 ms; the timer here by 0.03-0.07 ms.
    assert statistics.median(lateness_ms) < 0.25, lateness_ms


def test_gevent_sleep_until_wakes_at_the_intended_time() -> None:
    lateness: list[float] = []

    def generator() -> None:
        with DeadlineTimer() as timer:
            for due in _deadlines():
                timer.sleep_until(due)
                lateness.append((time.perf_counter() - due) * 1000)

    # Another greenlet keeps running meanwhile: the wait yields to the hub, it does not spin.
    ticks = 0

    def other() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            gevent.sleep(0.002)

    ticker = gevent.spawn(other)
    gevent.spawn(generator).join()
    ticker.kill()
    _check(lateness)
    assert ticks > SENDS * INTERVAL / 0.002 / 2


async def test_asyncio_wait_until_wakes_at_the_intended_time() -> None:
    lateness: list[float] = []
    with DeadlineTimer() as timer:
        for due in _deadlines():
            await timer.wait_until(due)
            lateness.append((time.perf_counter() - due) * 1000)
        # A deadline already past returns at once, without arming the timer.
        before = time.perf_counter()
        await timer.wait_until(before - 1.0)
        assert time.perf_counter() - before < 0.01
    _check(lateness)
    # The descriptor is gone with the timer, and the loop holds no reader for it.
    loop = asyncio.get_running_loop()
    assert not loop.remove_reader(timer.fd)
