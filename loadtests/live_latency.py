"""First-byte latency of live output: from the remote process writing a line to this client
reading it from `GET /v1/jobs/{id}/output?follow=true`, on one machine (one clock).

    python -m loadtests.live_latency --url http://127.0.0.1:8000 --token "$TOKEN"

The remote command prints its own clock (`date +%s.%N`, taken just before the write) every
`--interval` seconds; each line's latency is the client's clock at receipt minus that stamp.
Meaningful only with the API and the host on this machine (the same clock). Prints p50, p90,
p99 and max over `--samples` lines. A figure, not a test: the issue's target is p99 <= 100 ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx


def measure(url: str, token: str, host: str, samples: int, interval: float) -> list[float]:
    headers = {"Authorization": f"Bearer {token}"}
    script = f"for i in $(seq {samples}); do date +%s.%N; sleep {interval}; done"
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(30, read=None)) as c:
        r = c.post("/v1/jobs", json={"host": host, "command": script}, headers={"Prefer": "wait=0"})
        r.raise_for_status()
        job = r.json()["id"]
        latencies: list[float] = []
        pending = b""
        with c.stream("GET", f"/v1/jobs/{job}/output", params={"follow": "true"}) as body:
            body.raise_for_status()
            for chunk in body.iter_raw():
                now = time.time()
                pending += chunk
                *lines, pending = pending.split(b"\n")
                latencies += [(now - float(line)) * 1000 for line in lines if line]
        return latencies


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--token", required=True)
    parser.add_argument("--host", default="local", help="a host on this machine")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.02)
    args = parser.parse_args(argv)
    ms = sorted(measure(args.url, args.token, args.host, args.samples, args.interval))
    q = statistics.quantiles(ms, n=100, method="inclusive")
    print(
        f"live output first-byte latency over {len(ms)} lines: p50 {q[49]:.1f} ms, "
        f"p90 {q[89]:.1f} ms, p99 {q[98]:.1f} ms, max {ms[-1]:.1f} ms (target p99 <= 100 ms)"
    )


if __name__ == "__main__":
    main()
