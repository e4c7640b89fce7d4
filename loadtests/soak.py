"""Soak: a steady open-model load for a long time, while watching what must stay flat.

    python -m loadtests.soak --rate 100 --minutes 10     # the issue's figure (about 11 minutes)
    python -m loadtests.soak --rate 20 --minutes 0.25    # what the test suite runs

It starts a local sshd (`tuned`) and the API (`loadtests.server.start_api`, a pooled pool), drives
`POST /v1/jobs` with `locust -f loadtests/sustained.py --load-profile soak` rescaled to the rate
and length asked for, and every `--interval` seconds samples the API process's resident memory
and open file descriptors, the pool's SSH connections (`GET /v1/hosts`) and sshd's sessions (the
listener's child processes). It prints a table and a verdict and writes `soak.json` next to the
Locust report. Exit status 0 only when the run had no failed or dropped request and everything
stayed flat:

- memory: the median of the last fifth of the samples is less than `--max-growth` % (10) above
  the median of the first fifth (the first `--settle` seconds, 20 by default, are left out:
  caches and pools fill up there);
- descriptors (less the load generator's HTTP connections, whose number its own pool decides),
  SSH connections, sshd sessions: the last fifth's median is at most `SLACK` (10 descriptors,
  3 connections or sessions) or 10 % above the first fifth's maximum. These go up and down
  with load, and pools may open more connections late in a run (the store's: 2 descriptors
  each on SQLite, up to 15); a leak keeps climbing past any slack over a long run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from loadtests.report import run_dir
from loadtests.schedule import PROFILES
from loadtests.server import start_api, stop_api

REPO = Path(__file__).resolve().parent.parent
LOCUST = Path(sys.executable).parent / "locust"
SOAK = PROFILES["soak"]
MEASURED = next(s for s in SOAK if not s.warmup)
SLACK = {"own_fds": 10, "connections": 3, "sshd_sessions": 3}


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # seconds since the load started
    rss_mb: float
    fds: int  # every open descriptor of the API process
    http_clients: int  # of those, the load generator's HTTP connections (its pool grows)
    connections: int
    sshd_sessions: int

    @property
    def own_fds(self) -> int:
        """Descriptors the API holds for itself: a leak shows here, not in client churn."""
        return self.fds - self.http_clients


def growth(values: list[float]) -> tuple[float, float, float]:
    """(median of the first fifth, max of the first fifth, median of the last fifth)."""
    n = max(1, len(values) // 5)
    first, last = values[:n], values[-n:]
    return statistics.median(first), max(first), statistics.median(last)


def verdict(samples: list[Sample], max_growth: float) -> dict[str, Any]:
    """Per watched quantity: its baseline, end and whether it stayed flat (module docstring)."""
    if len(samples) < 2:
        return {"flat": False, "reason": "fewer than 2 samples", "series": {}}
    series: dict[str, Any] = {}
    for name in ("rss_mb", "own_fds", "connections", "sshd_sessions"):
        values = [float(getattr(s, name)) for s in samples]
        start, start_max, end = growth(values)
        pct = (end - start) / start * 100.0 if start else 0.0
        slack = max(SLACK.get(name, 0), 0.1 * start_max)
        flat = pct < max_growth if name == "rss_mb" else end <= start_max + slack
        series[name] = {
            "start": start,
            "end": end,
            "growth_pct": round(pct, 1),
            "min": min(values),
            "max": max(values),
            "flat": flat,
        }
    return {"flat": all(v["flat"] for v in series.values()), "series": series}


class Sampler(threading.Thread):
    """Samples the API process, its pool and the sshd listener every `interval` seconds."""

    def __init__(self, api_pid: int, sshd_pid: int, url: str, token: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.api = psutil.Process(api_pid)
        self.sshd = psutil.Process(sshd_pid)
        self.url, self.token, self.interval = url, token, interval
        self.port = int(url.rsplit(":", 1)[1])
        self.samples: list[Sample] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.wait(self.interval):
                hosts = client.get(
                    f"{self.url}/v1/hosts", headers={"Authorization": f"Bearer {self.token}"}
                ).json()
                self.samples.append(
                    Sample(
                        t=round(time.monotonic() - self.t0, 1),
                        rss_mb=round(self.api.memory_info().rss / 2**20, 1),
                        fds=self.api.num_fds(),
                        http_clients=sum(
                            1
                            for c in self.api.net_connections("tcp")
                            if c.laddr and c.laddr.port == self.port and c.raddr
                        ),
                        connections=sum(p["connections"] for h in hosts for p in h["pool"]),
                        # One child of the listener per SSH connection (sshd forks per client).
                        sshd_sessions=len(self.sshd.children()),
                    )
                )


def admin_token(data_dir: Path) -> str:
    from api.local import local_token, resolve_config
    from api.settings import Settings

    settings = Settings(data_dir=data_dir)
    return local_token(settings, resolve_config(settings), "soak-watch", ["admin"], 24 * 3600.0)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=100.0, help="Requests per second.")
    p.add_argument("--minutes", type=float, default=10.0, help="Length of the measured load.")
    p.add_argument("--interval", type=float, default=5.0, help="Seconds between samples.")
    p.add_argument("--settle", type=float, default=20.0, help="Seconds left out at the start.")
    p.add_argument("--max-growth", type=float, default=10.0, help="Memory growth limit, %%.")
    p.add_argument("--backend", default="asyncssh", choices=["asyncssh", "paramiko", "ssh2"])
    p.add_argument("--remote-command", default="hostname")
    p.add_argument(
        "--pool-mode",
        default="auto",
        choices=["auto", "pooled", "agent"],
        help="auto: exec_mode auto, the API's default (agent where python3 answers); pooled: "
        "channels; agent: exec_mode agent.",
    )
    p.add_argument("--out", type=Path, default=Path("reports"))
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The soak of `args` on a rig of its own; writes `reports/<time>-soak/soak.json` and returns
    what it holds, with `report`: its path."""
    from sshpool.devhost import Rig, RigSpec

    out = run_dir(args.out, "soak")
    rig = Rig(RigSpec("soak", "tuned"), data_dir=out / "hosts").start()
    host = rig.host
    api_dir = out / "api"
    try:
        proc, url = start_api(
            host,
            backend=args.backend,
            pool_mode=args.pool_mode,
            data_dir=api_dir,
            log=out / "api.log",
        )
        assert host.pid is not None
        sampler = Sampler(proc.pid, host.pid, url, admin_token(api_dir), args.interval)
        env = {**os.environ, "SSHAPI_DATA_DIR": str(api_dir)}
        env.pop("SSHAPI_TOKEN", None)
        env.pop("SSHAPI_CONFIG", None)
        locust = [
            str(LOCUST), "-f", str(REPO / "loadtests" / "sustained.py"), "--headless", "-H", url,
            "--load-profile", "soak", "--report-dir", str(out),
            "--rate-factor", str(args.rate / MEASURED.rate),
            "--duration-factor", str(args.minutes * 60.0 / MEASURED.duration),
            "--remote-command", args.remote_command,
            "--run-meta", json.dumps({"soak": vars(args) | {"out": str(args.out)}}),
        ]  # fmt: skip
        sampler.start()
        try:
            done = subprocess.run(locust, env=env, capture_output=True, text=True, check=False)
        finally:
            sampler.stop.set()
            sampler.join()
            stop_api(proc)
    finally:
        rig.stop()
    (out / "locust.log").write_text(done.stdout + done.stderr)
    reports = sorted(out.glob("*-sustained*/summary.json"))
    summary = json.loads(reports[-1].read_text()) if reports else {}
    measured = [s for s in sampler.samples if s.t >= args.settle]
    result = verdict(measured, args.max_growth)
    errors = {k: summary.get(k) for k in ("requests", "ok", "failed", "errors")}
    errors["dropped"] = summary.get("validity", {}).get("dropped")
    ok = bool(summary) and summary["failed"] == 0 and not errors["dropped"] and result["flat"]
    doc = {
        "args": vars(args) | {"out": str(args.out)},
        "requests": errors,
        "verdict": result,
        "ok": ok,
        "samples": [asdict(s) for s in sampler.samples],
        "locust_exit": done.returncode,
    }
    (out / "soak.json").write_text(json.dumps(doc, indent=2))
    return doc | {"report": str(out / "soak.json")}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    doc = measure(args)
    errors, result, ok = doc["requests"], doc["verdict"], doc["ok"]
    print(f"soak: {args.rate:g} req/s for {args.minutes:g} min, {len(doc['samples'])} samples")
    print(f"requests: {errors}")
    for name, v in result.get("series", {}).items():
        state = "flat" if v["flat"] else "GROWING"
        print(
            f"  {name:14} start {v['start']:8.1f}  end {v['end']:8.1f}  growth "
            f"{v['growth_pct']:6.1f}%  range {v['min']:g}..{v['max']:g}  {state}"
        )
    print(f"verdict: {'OK' if ok else 'FAIL'}")
    print(f"soak report: {doc['report']}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
