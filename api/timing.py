"""Per-request stage timings for the `Server-Timing` header (auth, queue, connect, open, exec,
store). The middleware puts a fresh `Timing` in a context variable; code on the request's path
adds to it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

STAGES = ("auth", "queue", "connect", "open", "exec", "store")


class Timing:
    __slots__ = ("ms",)

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    def add(self, stage: str, seconds: float) -> None:
        self.ms[stage] = self.ms.get(stage, 0.0) + seconds * 1000.0

    def add_ms(self, stages: dict[str, float]) -> None:
        for name, ms in stages.items():
            self.ms[name] = self.ms.get(name, 0.0) + ms

    def header(self) -> str:
        return ", ".join(f"{s};dur={self.ms[s]:.2f}" for s in STAGES if s in self.ms)


TIMING: ContextVar[Timing | None] = ContextVar("sshapi_timing", default=None)


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Time a block into the current request's `name` stage (no-op outside a request)."""
    timing = TIMING.get()
    start = time.perf_counter()
    try:
        yield
    finally:
        if timing is not None:
            timing.add(name, time.perf_counter() - start)
