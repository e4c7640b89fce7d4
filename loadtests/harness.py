"""What burst.py and sustained.py share inside Locust: the command-line options, the per-process
recorder, moving records from workers to the master, generator CPU sampling, and writing the
report when a test stops. Imported only by locustfiles (it imports gevent and locust)."""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import psutil
from locust import events
from locust.env import Environment
from locust.runners import LocalRunner, MasterRunner, WorkerRunner

from loadtests import report, webui
from loadtests.client import MAX_IDLE, JobClient, Outcome, tokens
from loadtests.records import DROPPED, Kind, Record, from_wire, to_wire
from loadtests.summary import CPU_INTERVAL

DEFAULT_HOST = "http://127.0.0.1:8000"


def add_common_arguments(parser: Any) -> None:
    group = parser.add_argument_group("sshapi load suite")
    group.add_argument("--report-dir", default="reports", help="Where run directories go.")
    group.add_argument("--ssh-host", default="local", help="The API's host name to run on.")
    group.add_argument("--remote-command", default="hostname", help="argv to run (shell-split).")
    group.add_argument(
        "--subjects", type=int, default=64, help="Token subjects to spread requests over."
    )
    group.add_argument(
        "--use-env-token", action="store_true", default=False,
        help="Send every request with SSHAPI_TOKEN (one identity: it meets the per-identity "
        "limits) instead of minting --subjects tokens from the local secret.",
    )  # fmt: skip
    group.add_argument(
        "--connection", choices=["keep-alive", "new"], default="keep-alive",
        help="Reuse HTTP connections, or a new connection per request.",
    )  # fmt: skip
    group.add_argument("--request-timeout", type=float, default=60.0, help="Seconds per request.")
    group.add_argument(
        "--max-idle", type=float, default=MAX_IDLE,
        help="keep-alive: a connection idle longer than this (s) is reconnected, not reused; "
        "keep it below the server's keep-alive timeout.",
    )  # fmt: skip
    group.add_argument(
        "--in-flight-cap", type=int, default=1000, help="Open model: most requests in flight."
    )
    group.add_argument(
        "--run-meta", default="{}", help="JSON merged into the report's metadata (server side)."
    )
    # The web UI starts runs and shows the API's URL to whoever reaches it, unauthenticated:
    # this machine only, unless --web-host says otherwise (Locust's default is every address).
    parser.set_defaults(web_host="127.0.0.1")


def ui_option(group: Any, *names: str, **kwargs: Any) -> None:
    """An option of the shape that the web UI shows and lets Start change: Locust marks only
    what its parser's own `add_argument` adds, not an argument group's."""
    action = group.add_argument(*names, **kwargs)
    action.include_in_web_ui = True
    action.is_secret = action.is_required = action.is_multiple = False
    webui.UI_OPTIONS[action.dest] = action  # parsed there, as typed in the page


def generator_cpu(used: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """All generator processes together: CPU seconds, requests sent, ms of CPU per request."""
    seconds = sum(u["seconds"] for u in used.values())
    requests = sum(u["requests"] for u in used.values())
    return {
        "seconds": round(seconds, 3),
        "requests": requests,
        "ms_per_request": round(seconds * 1000.0 / requests, 3) if requests else None,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


class Harness:
    """One per process. On the master and a local runner it owns the run: tokens, the records of
    every generator, the report. On a worker it records and ships its records at test stop."""

    def __init__(self, name: str) -> None:
        self.env = Environment()  # replaced by Locust's own at init
        self.name = name
        self.records: list[Record] = []
        # worker -> [(Unix time, percent of one core), ...] (summary.CpuSamples)
        self.cpu: dict[str, list[tuple[float, float]]] = {}
        # Per generator process: CPU seconds spent over its run and the requests it sent.
        self.cpu_used: dict[str, dict[str, float]] = {}
        self._cpu0 = 0.0
        self.done = 0
        self.t0 = time.time()
        self.meta: dict[str, Any] = {}
        self.exit_code = 0
        self.running = False  # between this run's test_start and its test_stop
        self.finished: list[dict[str, Any]] = []  # each run's verdict and report, for the web UI
        self._sampler: gevent.Greenlet | None = None
        self.describe: Callable[[], dict[str, Any]] = dict
        events.test_start.add_listener(self._on_test_start)
        events.test_stop.add_listener(self._on_test_stop)
        events.quitting.add_listener(self._on_quitting)
        events.init.add_listener(self._on_init)

    # -- options and identity of this generator
    @property
    def options(self) -> Any:
        return self.env.parsed_options

    @property
    def worker_label(self) -> str:
        runner = self.env.runner
        return f"worker{runner.worker_index}" if isinstance(runner, WorkerRunner) else "local"

    def slot(self) -> tuple[int, int]:
        """(index, count) of this process among the generators of the run."""
        runner = self.env.runner
        if isinstance(runner, WorkerRunner):
            return runner.worker_index, int(self.options.sshapi_generators)
        return 0, 1

    def client(self) -> JobClient:
        o = self.options
        return JobClient(
            self.env.host or DEFAULT_HOST,
            o.ssh_host,
            shlex.split(o.remote_command),
            o.connection,
            o.request_timeout,
            pool_size=o.in_flight_cap,
            max_idle=o.max_idle,
        )

    def tokens(self) -> list[str]:
        return list(self.options.sshapi_tokens)

    # -- recording
    def record(
        self,
        kind: Kind,
        t: float,
        latency_ms: float,
        lateness_ms: float,
        outcome: Outcome | None,
        stage: int,
        warmup: bool,
        rate: float = 0.0,
        burst_size: int = 0,
        name: str = "/v1/jobs",
    ) -> None:
        """Keep one request's record and report it to Locust's own statistics too. `outcome`
        None is an arrival dropped at the in-flight cap: recorded, never sent, so not in Locust's
        table."""
        o = outcome
        self.records.append(
            Record(
                kind, t, latency_ms if o else 0.0, o.service_ms if o else 0.0, lateness_ms,
                o.ok if o else False, o.status if o else 0, o.error if o else DROPPED, stage,
                warmup, rate, burst_size, self.options.connection, self.slot()[0],
                o.server if o else {},
            )
        )  # fmt: skip
        if outcome is None:
            return
        self.env.events.request.fire(
            request_type="POST",
            name=name,
            response_time=outcome.service_ms,
            response_length=outcome.length,
            exception=outcome.exception,
            context={},
        )

    def generator_done(self) -> None:
        """This generator sent its last request. A worker ships its records with the news: the
        master's shape ends the run on it, so records sent any later (at test stop) would
        arrive after the master wrote the report."""
        self._measure_cpu()
        runner = self.env.runner
        if isinstance(runner, WorkerRunner):
            runner.send_message(
                "sshapi_done",
                {"records": to_wire(self.records), "cpu": self.cpu, "cpu_used": self.cpu_used},
            )
            self.records = []
        else:
            self.done += 1

    def _measure_cpu(self) -> None:
        """This generator's CPU since the test started, beside the requests it sent (dropped
        arrivals left out: they cost next to nothing)."""
        t = psutil.Process(os.getpid()).cpu_times()
        sent = sum(1 for r in self.records if r.error != DROPPED)
        self.cpu_used[self.worker_label] = {
            "seconds": t.user + t.system - self._cpu0,
            "requests": float(sent),
        }

    # -- lifecycle
    def _on_init(self, environment: Environment, **_: Any) -> None:
        self.env = environment
        if not environment.host:
            environment.host = DEFAULT_HOST
        runner = environment.runner
        if isinstance(runner, MasterRunner):
            runner.register_message("sshapi_done", self._on_done_message)
        webui.install(environment, self.finished)
        o = environment.parsed_options
        local = not isinstance(runner, WorkerRunner)
        if local and o is not None and o.use_env_token and not os.environ.get("SSHAPI_TOKEN"):
            raise SystemExit("sshapi load suite: --use-env-token, but SSHAPI_TOKEN is not set")

    def _on_done_message(self, msg: Any, **_: Any) -> None:
        self.records.extend(from_wire(msg.data["records"]))
        self.cpu.update(msg.data["cpu"])
        self.cpu_used.update(msg.data.get("cpu_used", {}))
        self.done += 1

    def _on_test_start(self, environment: Environment, **_: Any) -> None:
        self.running = True
        self.records = []
        self.cpu = {}
        self.cpu_used = {}
        t = psutil.Process(os.getpid()).cpu_times()
        self._cpu0 = t.user + t.system
        self.done = 0
        self.t0 = time.time()
        runner = environment.runner
        if not isinstance(runner, WorkerRunner):
            # Set here, on the master, these travel to the workers with the spawn message.
            o = self.options
            o.sshapi_tokens = self._tokens()
            o.sshapi_generators = runner.worker_count if isinstance(runner, MasterRunner) else 1
            self.meta = self._meta_before()
        if not isinstance(runner, MasterRunner):
            self._sampler = gevent.spawn(self._sample_cpu, self.worker_label)

    def _sample_cpu(self, label: str) -> None:
        proc = psutil.Process(os.getpid())
        proc.cpu_percent(None)
        samples = self.cpu.setdefault(label, [])
        while True:
            gevent.sleep(CPU_INTERVAL)
            samples.append((time.time(), proc.cpu_percent(None)))

    def _on_test_stop(self, environment: Environment, **_: Any) -> None:
        if self._sampler is not None:
            self._sampler.kill(block=False)
            self._sampler = None
        runner = environment.runner
        if isinstance(runner, WorkerRunner):
            return  # its records went to the master with generator_done
        started, self.running = self.running, False
        # A web UI's next Start begins from nothing: the shape ends a run once `done` counts
        # every generator, so a count left from this run would end the next before its first
        # request, and its report would repeat this one's records.
        records, self.records, self.done = self.records, [], 0
        if not started:
            print("sshapi load suite: the run stopped before it started: no report written")
            self.exit_code = 1
            return
        if not records:
            print("sshapi load suite: no requests were recorded, no report written")
            self.exit_code = 1
            return
        if not isinstance(runner, MasterRunner) and not self.cpu_used:
            self._measure_cpu()  # the closed model never reports done
        meta = {**self.meta, **self._meta_after(), "duration_s": round(time.time() - self.t0, 1)}
        meta["generator_cpu"] = generator_cpu(self.cpu_used)
        out = report.run_dir(Path(self.options.report_dir), self.name)
        summary = report.write_run(out, records, meta, self.cpu)
        failed = sum(1 for r in records if not r.ok)
        self.exit_code = 1 if failed else 0
        self.finished.append(webui.row(summary, str(out / "report.md")))
        v = summary["validity"]
        lat = summary["latency_ms"]
        print(
            f"\nsshapi load suite: {summary['requests']} measured requests, {summary['failed']} "
            f"failed ({summary['errors'] or 'no errors'}); latency ms p50 {lat['p50']} "
            f"p90 {lat['p90']} p99 {lat['p99']} p99.9 {lat['p99.9']} max {lat['max']}\n"
            f"generator CPU {_ms(meta['generator_cpu']['ms_per_request'])} ms per request\n"
            f"run {'VALID' if v['valid'] else 'INVALID: ' + '; '.join(v['reasons'])}"
            + "".join(f"; LIMITED: {reason}" for reason in v["limited"])
            + "\n"
            f"report: {out / 'report.md'}\n",
            flush=True,
        )

    def _on_quitting(self, environment: Environment, **_: Any) -> None:
        if isinstance(environment.runner, LocalRunner | MasterRunner) and self.exit_code:
            environment.process_exit_code = self.exit_code

    def _tokens(self) -> list[str]:
        o = self.options
        if not o.use_env_token:
            return tokens(o.subjects)
        given = os.environ["SSHAPI_TOKEN"]  # checked at init
        print(
            "sshapi load suite: warning: every request uses SSHAPI_TOKEN, one identity: it meets "
            "the per-identity limits (the local policy: 5 jobs/s, 8 at once), so failures "
            "measure them (drop --use-env-token to spread over --subjects identities)",
            flush=True,
        )
        return [given]

    # -- metadata
    def _hosts_info(self) -> Any:
        import requests

        o = self.options
        try:
            resp = requests.get(
                f"{(self.env.host or DEFAULT_HOST).rstrip('/')}/v1/hosts/{o.ssh_host}",
                headers={"Authorization": f"Bearer {o.sshapi_tokens[0]}"},
                timeout=5,
            )
            return resp.json().get("pool", []) if resp.ok else f"http {resp.status_code}"
        except (requests.RequestException, ValueError) as exc:
            return f"unavailable: {type(exc).__name__}"

    def _meta_before(self) -> dict[str, Any]:
        o = self.options
        runner = self.env.runner
        return {
            "title": self.name,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "api": self.env.host,
            "ssh_host": o.ssh_host,
            "remote_command": o.remote_command,
            "connection": o.connection,
            "max_idle_s": o.max_idle,
            "subjects": len(o.sshapi_tokens),
            "in_flight_cap": o.in_flight_cap,
            "request_timeout_s": o.request_timeout,
            "generators": o.sshapi_generators,
            "distributed": isinstance(runner, MasterRunner),
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(),
            "versions": report.versions(),
            # Backend, sshd profile and pool settings live in the server: the experiment runner
            # passes them here; run by hand, pass --run-meta '{"backend": ...}' to record them.
            **json.loads(o.run_meta),
            **self.describe(),
            "pool_before": self._hosts_info(),
        }

    def _meta_after(self) -> dict[str, Any]:
        return {"pool_after": self._hosts_info()}
