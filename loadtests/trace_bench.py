"""What traces cost: the API's CPU per job with tracing off against the code before traces, and
with it on at 100 % and 10 % sampling (issue 42); and, in-process, the request span alone made
by our middleware against FastAPI's own telemetry.

    python -m loadtests.trace_bench --before c695d82 --jobs 400 --rounds 5

Jobs: It starts a local sshd (`tuned`) and one API per variant (`loadtests.server`, pooled,
channel mode): `before` (the tree of `--before`, unpacked with `git archive`, imported first
through PYTHONPATH), `off` (this tree, no OTEL_* variable), `on-100` and `on-10` (this tree,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` at a sink in this process that answers every export and
keeps nothing; the sampler `parentbased_always_on`, or `parentbased_traceidratio` at 0.1), and
when asked (`--variants`) `old-on-10` (the tree of `--old` at 10 %: an A/B of a change to the
traced path), `on-0` (this tree at 0 %: what tracing costs a request it does not sample). Each
round runs `--jobs` jobs (`argv ["true"]`, `--concurrency` at once, no traceparent: the root
sampler decides) through each variant in a shuffled order, and reads the API process tree's CPU
seconds (loadtests/cpu.py) around it: CPU ms per job, per variant and round, interleaved. It
prints the median over rounds, the spread, each variant against `before`, and the load average
before and after. Every load is bounded: a fixed number of jobs, each with a 60 s timeout, on
127.0.0.1.

Server spans: `--spans N` requests of `GET /healthz` through httpx's ASGI transport to an app
in this process, untraced, with our middleware's span, and with FastAPI's own telemetry (with
and without its operation spans), interleaved over the rounds: CPU µs per request. Spans go to
a batch processor with an exporter that drops them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from loadtests.cpu import own_seconds, tree_seconds
from loadtests.server import start_api, stop_api, tuned_host

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("before", "off", "on-100", "on-10", "old-on-10", "on-0")
TIMEOUT = 60.0


class Sink:
    """An OTLP/HTTP endpoint that answers every export with 200 and keeps nothing."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def unpack(ref: str, into: Path) -> Path:
    """The tree of git `ref` of this repository, unpacked under `into`."""
    into.mkdir()
    archive = into / "tree.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(REPO), "archive", ref], stdout=out, check=True)
    tree = into / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree)  # our own repository's archive
    return tree


def variant_env(variant: str, sink: str, before: Path, old: Path | None) -> dict[str, str]:
    env = {k: "" for k in os.environ if k.startswith("OTEL_")}  # none inherited
    # `python -m` puts the working directory first on sys.path, before PYTHONPATH: without it,
    # `before` would import this tree.
    env["PYTHONSAFEPATH"] = "1"
    if variant == "before":
        env["PYTHONPATH"] = str(before)
    elif variant == "old-on-10":
        assert old is not None
        env["PYTHONPATH"] = str(old)
    if "on-" in variant:
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = sink
        percent = int(variant.rsplit("-", 1)[1])
        if percent < 100:
            env["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
            env["OTEL_TRACES_SAMPLER_ARG"] = str(percent / 100)
    return env


def token(data_dir: Path) -> str:
    from api.local import local_token, resolve_config
    from api.settings import Settings

    settings = Settings(data_dir=data_dir)
    return local_token(settings, resolve_config(settings), "trace-bench", ["jobs:write"], 3600.0)


def run_jobs(url: str, auth: str, jobs: int, concurrency: int) -> int:
    """`jobs` jobs, `concurrency` at once; how many succeeded."""
    headers = {"Authorization": f"Bearer {auth}", "Prefer": "wait=30"}
    body = {"host": "local", "argv": ["true"]}

    def one(client: httpx.Client) -> bool:
        r = client.post(f"{url}/v1/jobs", json=body, headers=headers)
        return r.status_code == 201 and r.json()["state"] == "succeeded"

    with (
        httpx.Client(timeout=TIMEOUT, limits=httpx.Limits(max_connections=concurrency)) as client,
        ThreadPoolExecutor(concurrency) as threads,
    ):
        return sum(threads.map(lambda _: one(client), range(jobs)))


def check(variant: str, url: str, auth: str, before: Path) -> None:
    """The variant runs what it says: `before` the tree of `--before` (no `trace_id` in its
    jobs when that tree predates traces, else a null one), `off` a null one, `on-*` the trace
    id of the traceparent sent (continued: the sampler follows a sampled caller)."""
    parent = f"00-{'ab' * 16}-{'cd' * 8}-01"
    r = httpx.post(
        f"{url}/v1/jobs",
        json={"host": "local", "argv": ["true"]},
        headers={"Authorization": f"Bearer {auth}", "traceparent": parent},
        timeout=TIMEOUT,
    )
    job = r.json()
    seen = job.get("trace_id", "absent")
    traced_tree = "trace_id" in (before / "api" / "schemas.py").read_text()
    wanted = {
        "before": None if traced_tree else "absent",
        "off": None,
        "on-100": "ab" * 16,
        "on-10": "ab" * 16,
        "old-on-10": "ab" * 16,
        "on-0": "ab" * 16,
    }
    if seen != wanted[variant]:
        raise RuntimeError(f"{variant}: trace_id {seen!r}, expected {wanted[variant]!r}")


def job_costs(args: argparse.Namespace) -> dict[str, list[float]]:
    """CPU ms per job of each variant, one figure per round (module docstring)."""
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    costs: dict[str, list[float]] = {v: [] for v in variants}
    sink = Sink()
    with (
        tempfile.TemporaryDirectory(prefix="trace-bench-") as tmp,
        tuned_host("trace") as (
            host,
            scratch,
        ),
    ):
        before = unpack(args.before, Path(tmp) / "before")
        old = unpack(args.old, Path(tmp) / "old") if "old-on-10" in variants else None
        apis: dict[str, tuple[subprocess.Popen[bytes], str, str]] = {}
        try:
            for v in variants:
                data = scratch / v
                proc, url = start_api(
                    host,
                    backend="asyncssh",
                    pool_mode="pooled",
                    data_dir=data,
                    log=scratch / f"{v}.log",
                    env=variant_env(v, sink.url, before, old),
                )
                apis[v] = (proc, url, token(data))
                check(v, url, apis[v][2], before)
                run_jobs(url, apis[v][2], args.concurrency * 4, args.concurrency)  # warm up
            for n in range(args.rounds):
                order = list(variants)
                random.shuffle(order)
                for v in order:
                    proc, url, auth = apis[v]
                    cpu = tree_seconds(proc.pid)
                    ok = run_jobs(url, auth, args.jobs, args.concurrency)
                    spent = tree_seconds(proc.pid) - cpu
                    if ok != args.jobs:
                        raise RuntimeError(f"{v}: {args.jobs - ok} of {args.jobs} jobs failed")
                    costs[v].append(spent * 1000.0 / args.jobs)
                print(f"round {n + 1}: " + ", ".join(f"{v} {costs[v][-1]:.3f}" for v in variants))
        finally:
            for proc, _, _ in apis.values():
                stop_api(proc)
            sink.close()
    return costs


# ---- the request span alone, in this process


async def span_costs(requests: int, rounds: int) -> dict[str, list[float]]:
    """CPU µs per `GET /healthz` of an app per variant: untraced, our middleware's span,
    FastAPI's own telemetry with and without its operation spans; one figure per round."""
    from fastapi import FastAPI
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from api.metrics import Metrics
    from api.middleware import RequestContext

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    trace.set_tracer_provider(provider)

    def app(ours: bool, fastapi: bool, operations: bool) -> Any:
        telemetry: Any = {"tracing": fastapi, "metrics": False, "logs": False}
        made = FastAPI(telemetry=telemetry | {"operation_spans": operations})

        @made.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "ok"}

        made.add_middleware(RequestContext, metrics=Metrics(), max_body=65536, traced=ours)
        return made

    apps = {
        "untraced": app(False, False, False),
        "ours": app(True, False, False),
        "fastapi": app(False, True, False),
        "fastapi+operations": app(False, True, True),
    }
    costs: dict[str, list[float]] = {name: [] for name in apps}
    for _ in range(rounds):
        order = list(apps)
        random.shuffle(order)
        for name in order:
            transport = httpx.ASGITransport(app=apps[name])
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                for _ in range(50):
                    await client.get("/healthz")
                cpu = own_seconds()
                for _ in range(requests):
                    await client.get("/healthz")
                costs[name].append((own_seconds() - cpu) * 1e6 / requests)
    provider.shutdown()
    return costs


def summary(costs: dict[str, list[float]], base: str, unit: str) -> None:
    """Per variant: the median over rounds, their spread, the median against `base`'s, and the
    median of the per-round differences to `base` (each round's pair ran minutes apart at
    most: the figure the box's drift disturbs least)."""
    ref = statistics.median(costs[base])
    for name, values in costs.items():
        med = statistics.median(values)
        spread = f"{min(values):.3f}-{max(values):.3f}"
        paired = statistics.median(v - b for v, b in zip(values, costs[base], strict=True))
        # A base of 0: too few jobs for one of /proc's 10-ms ticks (a short run on an idle box).
        ratio = f"{(med / ref - 1) * 100:+6.1f} %" if ref else "   n/a  "
        share = f"{paired / ref * 100:+.1f} %" if ref else "n/a"
        print(
            f"  {name:<20} median {med:8.3f} {unit} (rounds {spread}) "
            f"{ratio} vs {base}; paired {paired:+.3f} {unit} ({share})"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtests.trace_bench", description=__doc__)
    p.add_argument("--before", default="main", help="git ref of the code before traces.")
    p.add_argument(
        "--old",
        default="main",
        help="git ref of older traced code, run at 10 %% sampling as variant old-on-10.",
    )
    p.add_argument("--jobs", type=int, default=400, help="Jobs per variant and round.")
    p.add_argument("--concurrency", type=int, default=8, help="Jobs at once.")
    p.add_argument("--rounds", type=int, default=5, help="Interleaved rounds.")
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS[:4]),
        help="Which of before,off,on-100,on-10,old-on-10,on-0 to run.",
    )
    p.add_argument("--spans", type=int, default=2000, help="Requests per server-span variant.")
    args = p.parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    t0 = time.monotonic()
    if args.jobs:
        costs = job_costs(args)
        print(f"API CPU per job, ms ({args.jobs} jobs x {args.rounds} rounds, interleaved):")
        summary(costs, "before" if "before" in costs else next(iter(costs)), "ms")
        if "on-10" in costs and "old-on-10" in costs:
            print("  on-10 against old-on-10:")
            summary({v: costs[v] for v in ("old-on-10", "on-10")}, "old-on-10", "ms")
    if args.spans:
        spans = asyncio.run(span_costs(args.spans, args.rounds))
        print(f"CPU per GET /healthz in-process, µs ({args.spans} x {args.rounds} rounds):")
        summary(spans, "untraced", "µs")
    print(f"load average after: {os.getloadavg()} ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
