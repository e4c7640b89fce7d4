"""Prometheus metrics. One registry per app, so several apps (tests) never share counters."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
POOL_GAUGES = ("connections", "channels_in_use", "capacity", "waiters", "handshakes_in_flight")


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
            summed: dict[str, float] = {}
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
            for name, counter in counters.items():
                if name == "connection_wait_seconds":
                    value = sum(float(s[name]) for s in sshds)
                else:
                    value = sum(float(s["counters"].get(name, 0)) for s in sshds)
                counter.add_metric([host], value)
        yield connections
        yield from gauges.values()
        yield from shares.values()
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


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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

    def watch_pool(
        self, stats: Callable[[], dict[str, list[dict[str, Any]]]], nodes: NodeStats
    ) -> None:
        """`stats()`: host name -> the stats of that host's pools (one per account);
        `nodes()`: host name (those with login nodes only) -> node name -> `Pool.nodes` stats."""
        self.registry.register(PoolCollector(stats, nodes))
        self.registry.register(NodeCollector(nodes))

    def watch_sshds(self, stats: Callable[[], dict[str, list[dict[str, Any]]]]) -> None:
        """`stats()`: host name -> the budgets of the sshds its accounts reach (usually one)."""
        self.registry.register(SshdCollector(stats))

    def watch_trackers(self, trackers: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(TrackerCollector(trackers))

    def render(self) -> bytes:
        return generate_latest(self.registry)
