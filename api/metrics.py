"""Prometheus metrics. One registry per app, so several apps (tests) never share counters."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from sshpool import Durations

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# OpenTelemetry's advised boundaries for http.server.request.duration (HTTP semconv 1.23+).
HTTP_SERVER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
# The methods OTel's http.request.method keeps; any other is "_OTHER" (h11 accepts any token
# as a method: a client must not be able to mint label values).
HTTP_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
)
POOL_GAUGES = ("connections", "channels_in_use", "capacity", "waiters", "handshakes_in_flight")
# Emitted for every host from the start, at 0 until they happen: an alert or a dashboard
# panel over a counter that appears only with the first failure would see no series.
POOL_COUNTERS = (
    "connects",
    "connects_failed",
    "connect_retries",
    "commands",
    "channel_refused",
    "connections_lost",
    "timeouts_queue",
    "timeouts_command",
    "cancelled",
    "killed",
    "kill_failed",
    "refused_gate",
    "refused_breaker",
    "refused_full",
    "sftp_sessions",
    "evicted",
    "discarded",
)
# OTel's DB-client connection-pool attributes, with `db` read as `ssh`.
POOL_NAME = "ssh_client_connection_pool_name"
POOL_STATE = "ssh_client_connection_state"


NODE_STATES = ("up", "down", "draining", "drained")
NODE_GAUGES = ("connections", "channels_in_use", "waiters")
NODE_COUNTERS = {
    "routed": "Commands and file sessions sent to the login node",
    "spilled": "Of those, sent there because the account's own node had a long queue",
    "failovers": "Work that failed on the login node before it started and moved to another",
    "downs": "Times the login node was found down",
    "probes": "Health probes of the login node",
    "probes_failed": "Health probes of the login node that failed",
}

NodeStats = Callable[[], dict[str, dict[str, dict[str, Any]]]]
Stats = Callable[[], dict[str, list[dict[str, Any]]]]
PoolDurations = Callable[[], dict[str, list[dict[str, Any]]]]


class PoolCollector(Collector):
    """Reads the pools' stats at scrape time, per configured host name: gauges and counters
    summed over the host's accounts, the breaker open if any account's is; on a host with
    login nodes, open only while no node takes work (up, and no account's breaker open there:
    one node down is the node's, `NodeCollector`). Labelled by host, never by target:
    user@host:port names remote accounts."""

    def __init__(
        self, stats: Callable[[], dict[str, list[dict[str, Any]]]], nodes: NodeStats
    ) -> None:
        self._stats = stats
        self._nodes = nodes

    def collect(self) -> Iterator[Any]:
        gauges = {
            name: GaugeMetricFamily(f"sshpool_{name}", f"Pool {name} per host", labels=["host"])
            for name in POOL_GAUGES
        }
        breaker = GaugeMetricFamily(
            "sshpool_breaker_open",
            "1 while a circuit breaker of the host is open",
            labels=["host"],
        )
        counters: dict[str, CounterMetricFamily] = {}
        clusters = self._nodes()
        for host, pools in self._stats().items():
            if not pools:
                continue
            for name, family in gauges.items():
                total = sum(float(p[name]) for p in pools if _number(p.get(name)))
                family.add_metric([host], total)
            if host in clusters:
                nodes = clusters[host].values()
                open_ = not any(n["state"] == "up" and not n["breaker_open"] for n in nodes)
            else:
                open_ = any(p.get("breaker", "closed") != "closed" for p in pools)
            breaker.add_metric([host], 1.0 if open_ else 0.0)
            summed = dict.fromkeys(POOL_COUNTERS, 0.0)
            for p in pools:
                for name, value in (p.get("counters") or {}).items():
                    if _number(value):
                        summed[name] = summed.get(name, 0.0) + float(value)
            for name, value in summed.items():
                if name not in counters:
                    counters[name] = CounterMetricFamily(
                        f"sshpool_{name}", f"Pool counter {name}", labels=["host"]
                    )
                counters[name].add_metric([host], value)
        yield from gauges.values()
        yield breaker
        yield from counters.values()


class NodeCollector(Collector):
    """Reads the login nodes of each host with several at scrape time: a node's state (one
    series per state, 1 for the current one), its breaker (any account's), its gauges summed
    over the accounts and its routing counters. Labelled by host and node (the node names are
    the operator's configuration, like host names)."""

    def __init__(self, nodes: NodeStats) -> None:
        self._nodes = nodes

    def collect(self) -> Iterator[Any]:
        state = GaugeMetricFamily(
            "sshpool_node_state",
            "1 for the login node's state (up, down, draining, drained), 0 for the others",
            labels=["host", "node", "state"],
        )
        breaker = GaugeMetricFamily(
            "sshpool_node_breaker_open",
            "1 while a circuit breaker (any account's) of the login node is not closed",
            labels=["host", "node"],
        )
        gauges = {
            name: GaugeMetricFamily(
                f"sshpool_node_{name}", f"Pool {name} per login node", labels=["host", "node"]
            )
            for name in NODE_GAUGES
        }
        counters = {
            name: CounterMetricFamily(f"sshpool_node_{name}", text, labels=["host", "node"])
            for name, text in NODE_COUNTERS.items()
        }
        for host, nodes in self._nodes().items():
            for node, stats in nodes.items():
                for name in NODE_STATES:
                    state.add_metric([host, node, name], float(stats["state"] == name))
                breaker.add_metric([host, node], float(stats["breaker_open"]))
                for name, gauge in gauges.items():
                    gauge.add_metric([host, node], float(stats[name]))
                for name, counter in counters.items():
                    counter.add_metric([host, node], float(stats["counters"].get(name, 0)))
        yield state
        yield breaker
        yield from gauges.values()
        yield from counters.values()


class SshdCollector(Collector):
    """Reads the sshd budgets at scrape time, per configured host name: one sshd is shared by
    every account (and every host name) reaching it, so these are the sshd's figures, not sums
    over accounts. Labelled by host only, like the pool's."""

    def __init__(self, stats: Callable[[], dict[str, list[dict[str, Any]]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        connections = GaugeMetricFamily(
            "sshpool_sshd_connections",
            "Connections to the host's sshd, all accounts, by state (busy: a channel in use)",
            labels=["host", "state"],
        )
        gauges = {
            name: GaugeMetricFamily(f"sshpool_sshd_{name}", text, labels=["host"])
            for name, text in (
                ("handshakes_in_flight", "Handshakes in flight to the host's sshd"),
                ("handshakes_queued", "Accounts waiting for their turn to connect"),
                ("accounts_holding", "Accounts holding connections to the host's sshd"),
                ("connections_max", "The most connections held at once"),
            )
        }
        # The sshd's PerSourcePenalties as the pool counts them against the API's address: the
        # worst of the host's sshds (one, usually), not a sum.
        penalties = {
            name: GaugeMetricFamily(f"sshpool_sshd_{name}", text, labels=["host"])
            for name, text in (
                ("penalty_seconds", "Penalty seconds sshd holds against this address now"),
                ("penalty_threshold", "Penalty at which sshd refuses every login from it"),
            )
        }
        # Several processes sharing the sshd (api/sshd_budget.py): this process's share, and
        # what Redis says of all of them (with Redis only).
        shares = {
            name: GaugeMetricFamily(f"sshpool_sshd_{name}", text, labels=["host"])
            for name, text in (
                ("share_connections", "Connections this process may hold to the host's sshd"),
                ("share_handshakes", "Handshakes this process may have in flight to the sshd"),
                ("leased_connections", "Connection slots leased by all processes (Redis)"),
                ("leased_handshakes", "Handshake slots leased by all processes (Redis)"),
                ("processes", "Processes holding a lease of the host's sshd (Redis)"),
            )
        }
        counters = {
            name: CounterMetricFamily(f"sshpool_sshd_{name}", text, labels=["host"])
            for name, text in (
                ("evictions", "Idle connections closed to make room for another account"),
                ("yields", "Connections an account with a backlog gave up for another account"),
                ("handshakes_granted", "Handshakes the sshd's gate let through"),
                ("connection_wait_seconds", "Seconds accounts waited for their turn to connect"),
                ("logins_refused", "Logins the sshd refused (what its penalties count)"),
            )
        }
        for host, sshds in self._stats().items():
            if not sshds:
                continue
            for state in ("busy", "idle", "closing"):
                value = sum(float(s[f"connections_{state}"]) for s in sshds)
                connections.add_metric([host, state], value)
            for name, gauge in gauges.items():
                gauge.add_metric([host], sum(float(s[name]) for s in sshds))
            for name, gauge in shares.items():
                values = [s[name] if name in s else s["shared"].get(name) for s in sshds]
                if all(_number(v) for v in values):
                    gauge.add_metric([host], sum(float(v) for v in values))
            for name, gauge in penalties.items():
                gauge.add_metric([host], max(float(s.get(name, 0.0)) for s in sshds))
            for name, counter in counters.items():
                if name in ("connection_wait_seconds", "logins_refused"):
                    value = sum(float(s.get(name, 0.0)) for s in sshds)
                else:
                    value = sum(float(s["counters"].get(name, 0)) for s in sshds)
                counter.add_metric([host], value)
        yield connections
        yield from gauges.values()
        yield from shares.values()
        yield from penalties.values()
        yield from counters.values()


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class TrackerCollector(Collector):
    """Reads the batch trackers at scrape time: how many jobs each follows, and what that costs."""

    def __init__(self, trackers: Callable[[], dict[str, Any]]) -> None:
        self._trackers = trackers

    def collect(self) -> Iterator[Any]:
        tracked = GaugeMetricFamily(
            "sshapi_batch_jobs_tracked", "Batch jobs followed per host", labels=["host"]
        )
        polls = CounterMetricFamily(
            "sshapi_scheduler_polls", "Polls of the scheduler per host", labels=["host"]
        )
        commands = CounterMetricFamily(
            "sshapi_scheduler_poll_commands",
            "SSH commands the polls ran per host (squeue, scontrol)",
            labels=["host"],
        )
        waiting = GaugeMetricFamily(
            "sshapi_batch_waiters",
            "Requests waiting for a batch job to end (Prefer: wait) per host",
            labels=["host"],
        )
        for host, tracker in self._trackers().items():
            tracked.add_metric([host], float(len(tracker.tracked)))
            waiting.add_metric([host], float(tracker.waiting))
            polls.add_metric([host], float(tracker.polls))
            commands.add_metric([host], float(tracker.commands))
        yield from (tracked, polls, commands, waiting)


class ConnectionPoolCollector(Collector):
    """The pools after OpenTelemetry's DB-client connection-pool conventions
    (`db.client.connection.*`, read as `ssh.client.connection.*`), one pool per configured
    host name (summed over its accounts and login nodes): connections by state (`idle`,
    `used`: a channel or the executor in use), the most it may hold, callers waiting, waits
    given up, and histograms of the time a connection took to make and a caller waited for
    a slot. The same figures as the `sshpool_*` families, in the names dashboards written for
    other pools already read."""

    def __init__(self, stats: Stats, durations: PoolDurations, sshds: Stats) -> None:
        self._stats = stats
        self._durations = durations
        self._sshds = sshds

    def collect(self) -> Iterator[Any]:
        count = GaugeMetricFamily(
            "ssh_client_connection_count",
            "SSH connections of the host's pools by state (used: a channel in use)",
            labels=[POOL_NAME, POOL_STATE],
        )
        most = GaugeMetricFamily(
            "ssh_client_connection_max",
            "The most connections the host's pools may hold in this process: their accounts'"
            " max_connections, capped by this process's share of the sshd budget",
            labels=[POOL_NAME],
        )
        pending = GaugeMetricFamily(
            "ssh_client_connection_pending_requests",
            "Callers waiting for a slot on the host's pools",
            labels=[POOL_NAME],
        )
        timeouts = CounterMetricFamily(
            "ssh_client_connection_timeouts",
            "Callers that gave up waiting for a slot (the queue deadline passed)",
            labels=[POOL_NAME],
        )
        hists = {
            name: HistogramMetricFamily(
                f"ssh_client_connection_{name}_seconds", text, labels=[POOL_NAME]
            )
            for name, text in (
                ("create_time", "Seconds each SSH connection took to make (handshake, login)"),
                ("wait_time", "Seconds each caller waited for a slot (0: one was free)"),
            )
        }
        durations = self._durations()
        sshds = self._sshds()
        for host, pools in self._stats().items():
            if not pools:
                continue
            used = sum(int(p.get("connections_used", 0)) for p in pools)
            total = sum(int(p.get("connections", 0)) for p in pools)
            count.add_metric([host, "idle"], float(total - used))
            count.add_metric([host, "used"], float(used))
            pending.add_metric([host], float(sum(int(p.get("waiters", 0)) for p in pools)))
            gave_up = sum(int((p.get("counters") or {}).get("timeouts_queue", 0)) for p in pools)
            timeouts.add_metric([host], float(gave_up))
            figures = durations.get(host, [])
            limit = float(sum(int(d["max_connections"]) for d in figures))
            shares: list[Any] = [s.get("share_connections") for s in sshds.get(host, [])]
            finite = [float(v) for v in shares if _number(v)]
            if shares and len(finite) == len(shares):  # None: no cap, the sshd's budget is inf
                limit = min(limit, sum(finite))
            most.add_metric([host], limit)
            for name, family in hists.items():
                _add_histogram(family, [host], [d[name] for d in figures])
        yield from (count, most, pending, timeouts, *hists.values())


def _add_histogram(
    family: HistogramMetricFamily, labels: list[str], parts: list[Durations]
) -> None:
    """Sum `parts` (same bounds) into one series of `family`, cumulative as Prometheus wants."""
    if not parts:
        return
    bounds = parts[0].bounds
    counts = [sum(p.counts[i] for p in parts) for i in range(len(bounds) + 1)]
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip(bounds, counts, strict=False):
        running += n
        buckets.append((f"{float(bound)}", float(running)))
    buckets.append(("+Inf", float(running + counts[-1])))
    family.add_metric(labels, buckets, sum(p.sum for p in parts))


class ServiceCollector(Collector):
    """The process's own parts at scrape time: the job store's writer queue, the live
    followers, whether Redis answered the last check (with Redis only), and which replica
    this is (an `_info` series, to name replicas on dashboards)."""

    def __init__(
        self,
        replica: str,
        version: str,
        store: Callable[[], dict[str, float]],
        live: Callable[[], dict[str, int]],
        redis_up: Callable[[], bool | None],
    ) -> None:
        self._info = (replica, version)
        self._store = store
        self._live = live
        self._redis_up = redis_up

    def collect(self) -> Iterator[Any]:
        info = GaugeMetricFamily(
            "sshapi_replica_info",
            "This API process: its replica name and release",
            labels=["replica", "version"],
        )
        info.add_metric(list(self._info), 1.0)
        yield info
        store = self._store()
        yield GaugeMetricFamily(
            "sshapi_store_writes_pending",
            "Job store writes accepted and not yet committed (queued or in the transaction)",
            value=float(store["pending"]),
        )
        for name, text in (
            ("commits", "Job store transactions (group commits)"),
            ("writes", "Job store writes those transactions carried"),
            ("commit_seconds", "Seconds the job store's transactions took"),
        ):
            yield CounterMetricFamily(f"sshapi_store_{name}", text, value=float(store[name]))
        live = self._live()
        for name, text in (
            ("followers", "Live followers (output?follow=true, /events) in this process"),
            ("commands", "Commands run here whose live output can be followed"),
            ("watchers", "Jobs run elsewhere (other replicas, batch jobs) followed here"),
            ("publishers", "Commands of this process copied out to other replicas' followers"),
        ):
            yield GaugeMetricFamily(f"sshapi_live_{name}", text, value=float(live[name]))
        up = self._redis_up()
        if up is not None:
            yield GaugeMetricFamily(
                "sshapi_redis_up",
                "1 when Redis answered this scrape's ping (SSHAPI_REDIS_URL set only)",
                value=1.0 if up else 0.0,
            )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # CPU, memory, descriptors, start time of this process (read from /proc at scrape).
        ProcessCollector(registry=self.registry)
        # OTel's http.server.request.duration: its count is the requests, so this family
        # replaces both sshapi_http_* (deprecated, kept one release: docs/operations.md).
        self.http_duration = Histogram(
            "http_server_request_duration_seconds",
            "Duration of HTTP server requests (OpenTelemetry http.server.request.duration)",
            ["http_request_method", "http_route", "http_response_status_code"],
            buckets=HTTP_SERVER_BUCKETS,
            registry=self.registry,
        )
        # (method, route, status) -> the three series a request adds to: labels() looks a
        # child up under a lock each call; this dict is one lookup per request.
        self._series: dict[tuple[str, str, int], tuple[Any, Any, Any]] = {}
        self.requests = Counter(
            "sshapi_http_requests",
            "HTTP requests by route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "sshapi_http_request_duration_seconds",
            "HTTP request latency by route template and status",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.jobs = Counter(
            "sshapi_jobs_finished",
            "Jobs reaching a final state",
            ["host", "state"],
            registry=self.registry,
        )
        self.jobs_active = Gauge(
            "sshapi_jobs_active",
            "Jobs queued or running in this process",
            ["host"],
            registry=self.registry,
        )
        self.stage = Histogram(
            "sshapi_job_stage_seconds",
            "Seconds per job stage (queue, connect, open, exec)",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

        self.file_bytes = Counter(
            "sshapi_file_bytes",
            "Bytes moved by file transfers (direction: upload, download)",
            ["direction"],
            registry=self.registry,
        )
        self.file_transfers = Gauge(
            "sshapi_file_transfers_active",
            "File uploads and downloads in progress in this process",
            ["direction"],
            registry=self.registry,
        )
        for direction in ("upload", "download"):  # at 0 from the start (POOL_COUNTERS says why)
            self.file_bytes.labels(direction)
            self.file_transfers.labels(direction)
        self._pool: tuple[Stats, PoolDurations] | None = None
        # Set by each scrape (api/routes/ops.py): did Redis answer? None: no Redis.
        self.redis_up: bool | None = None

    def request(self, method: str, route: str | None, status: int, seconds: float) -> None:
        """One HTTP request answered: `route` is the route template (None: no route took the
        path, which then counts under `unmatched`, and with no http_route in OTel's family)."""
        # Keyed by the method as labelled: a client sending endless made-up methods must not
        # grow this dict either.
        name = method if method in HTTP_METHODS else "_OTHER"
        key = (name, route or "", status)
        series = self._series.get(key)
        if series is None:
            code = str(status)
            old = (name, route or "unmatched", code)
            series = self._series[key] = (
                self.requests.labels(*old),
                self.latency.labels(*old),
                self.http_duration.labels(name, route or "", code),
            )
        series[0].inc()
        series[1].observe(seconds)
        series[2].observe(seconds)

    def watch_pool(self, stats: Stats, nodes: NodeStats, durations: PoolDurations) -> None:
        """`stats()`: host name -> the stats of that host's pools (one per account);
        `nodes()`: host name (those with login nodes only) -> node name -> `Pool.nodes` stats;
        `durations()`: host name -> the `Pool.durations` of the same pools."""
        self.registry.register(PoolCollector(stats, nodes))
        self.registry.register(NodeCollector(nodes))
        self._pool = (stats, durations)

    def watch_service(
        self,
        replica: str,
        version: str,
        store: Callable[[], dict[str, float]],
        live: Callable[[], dict[str, int]],
    ) -> None:
        collector = ServiceCollector(replica, version, store, live, lambda: self.redis_up)
        self.registry.register(collector)

    def watch_sshds(self, stats: Stats) -> None:
        """`stats()`: host name -> the budgets of the sshds its accounts reach (usually one).
        After `watch_pool`: the pools' OTel-shaped family reads both."""
        self.registry.register(SshdCollector(stats))
        if self._pool is not None:
            self.registry.register(ConnectionPoolCollector(*self._pool, stats))

    def watch_trackers(self, trackers: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(TrackerCollector(trackers))

    def render(self) -> bytes:
        return generate_latest(self.registry)
