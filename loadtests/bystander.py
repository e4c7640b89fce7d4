"""Another identity's short jobs while a measurement runs: `true` on host `local`, one after
another in a thread, `every` seconds apart, and their latencies, failures and Server-Timing
stages. What `list_bench` and `transfer_fairness` watch beside their big listings and downloads."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import httpx

from loadtests.records import parse_server_timing

TIMEOUT = 600.0


class Bystander:
    """`with Bystander(url, token) as b:` submits jobs until the block ends; ``wait``: the
    `Prefer: wait=N` of each request (the answer then waits for the job to end)."""

    def __init__(self, url: str, token: str, every: float = 0.25, wait: int | None = None) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {token}"}
        if wait is not None:
            self.headers["Prefer"] = f"wait={wait}"
        self.every = every
        self.ms: list[float] = []
        self.failed = 0
        self.timings: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=TIMEOUT) as client:
            while not self._stop.wait(self.every):
                t0 = time.perf_counter()
                r = client.post(
                    f"{self.url}/v1/jobs",
                    json={"host": "local", "argv": ["true"]},
                    headers=self.headers,
                )
                if r.status_code == 201:
                    self.ms.append((time.perf_counter() - t0) * 1000)
                    self.timings.append(r.headers.get("server-timing", ""))
                else:
                    self.failed += 1

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        if not self.ms:
            return {"jobs": 0, "failed": self.failed}
        return {
            "jobs": len(self.ms),
            "failed": self.failed,
            "p50_ms": statistics.median(self.ms),
            "max_ms": max(self.ms),
        }

    def stages(self) -> dict[str, float]:
        """The median of each Server-Timing stage of the answers, in ms."""
        found: dict[str, list[float]] = {}
        for header in self.timings:
            for name, ms in parse_server_timing(header).items():
                found.setdefault(name, []).append(ms)
        return {name: round(statistics.median(v), 1) for name, v in found.items()}
