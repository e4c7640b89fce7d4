"""Generate the Grafana dashboards of deploy/grafana/dashboards/ from the panels listed here:
one place says what each panel asks Prometheus, and the JSON (Grafana's dashboard model,
schemaVersion 39) follows. `--check` only says whether the committed files are current
(tests/deploy/test_prometheus.py compares them too, and asks a real Prometheus every query).

    python scripts/gen_dashboards.py [--check]

In the queries: `$host` (the hosts picked, a regex), `$__rate_interval` (Grafana's: at least
four scrape intervals). The datasource is the dashboard's `datasource` variable, so the files
load into any Grafana whose Prometheus scrapes deploy/prometheus/prometheus.yml's job.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "deploy" / "grafana" / "dashboards"

RATE = "[$__rate_interval]"
POOL = 'ssh_client_connection_pool_name=~"$host"'
HOST = 'host=~"$host"'
HTTP = "http_server_request_duration_seconds"
# The `host` variable's values: the configured host names (the pools' names).
HOSTS = "label_values(ssh_client_connection_count, ssh_client_connection_pool_name)"

# A panel: title, unit, [(PromQL, legend)], description.
Panel = tuple[str, str, list[tuple[str, str]], str]


def quantiles(metric: str, by: str, selector: str = "") -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{selector}}}{RATE})))",
            f"p{int(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.99)
    ]


DASHBOARDS: dict[str, tuple[str, str, list[Panel]]] = {
    "sshapi-jobs": (
        "sshapi: jobs and requests",
        "What the API does for its callers: jobs by outcome, where a job's time goes, the "
        "answers by route and status.",
        [
            (
                "Jobs finished by state",
                "ops",
                [
                    (
                        f"sum by (state) (rate(sshapi_jobs_finished_total{{{HOST}}}{RATE}))",
                        "{{state}}",
                    )
                ],
                "Jobs reaching a final state per second. `failed` is the command's own non-zero "
                "exit; `error` and `lost` are the API's or the host's.",
            ),
            (
                "Jobs queued or running",
                "short",
                [(f"sum by (host) (sshapi_jobs_active{{{HOST}}})", "{{host}}")],
                "Over all replicas.",
            ),
            (
                "Job stages, p50 and p99",
                "s",
                quantiles("sshapi_job_stage_seconds", "stage"),
                "queue: waiting for a slot; connect: a new connection made for the job; open: "
                "channel or executor start; exec: the command.",
            ),
            (
                "Requests by route",
                "reqps",
                [(f"sum by (http_route) (rate({HTTP}_count{RATE}))", "{{http_route}}")],
                "Route templates (an empty route: paths no route takes).",
            ),
            (
                "Request duration by route, p99",
                "s",
                [
                    (
                        f"histogram_quantile(0.99, sum by (http_route, le) "
                        f"(rate({HTTP}_bucket{RATE})))",
                        "{{http_route}}",
                    )
                ],
                "A job's POST includes its command when it finishes within Prefer: wait.",
            ),
            (
                "Answers by status",
                "reqps",
                [
                    (
                        f"sum by (http_response_status_code) (rate({HTTP}_count{RATE}))",
                        "{{http_response_status_code}}",
                    )
                ],
                "429: limits; 503: a host down or a queue deadline; 5xx alert: SshapiHigh5xxRate.",
            ),
            (
                "5xx share of answers",
                "percentunit",
                [
                    (
                        f"(sum(rate({HTTP}_count"
                        f'{{http_response_status_code=~"5.."}}{RATE})) or vector(0))'
                        f" / sum(rate({HTTP}_count{RATE}))",
                        "5xx",
                    )
                ],
                "The SshapiHigh5xxRate alert fires above 5 % for 5 minutes.",
            ),
        ],
    ),
    "sshapi-pool": (
        "sshapi: SSH pool per host and sshd budget",
        "The pools of each host (all its accounts and login nodes, all replicas summed) and "
        "the sshd budget they share.",
        [
            (
                "Connections by state",
                "short",
                [
                    (
                        f"sum by (ssh_client_connection_pool_name, ssh_client_connection_state) "
                        f"(ssh_client_connection_count{{{POOL}}})",
                        "{{ssh_client_connection_pool_name}} {{ssh_client_connection_state}}",
                    ),
                    (
                        f"sum by (ssh_client_connection_pool_name) "
                        f"(ssh_client_connection_max{{{POOL}}})",
                        "{{ssh_client_connection_pool_name}} max",
                    ),
                ],
                "used: a channel or the executor busy. max: the accounts' max_connections capped "
                "by each process's share of the sshd budget. SshapiPoolSaturated: used >= 90 % "
                "of max with callers waiting.",
            ),
            (
                "Callers waiting for a slot",
                "short",
                [
                    (
                        f"sum by (ssh_client_connection_pool_name) "
                        f"(ssh_client_connection_pending_requests{{{POOL}}})",
                        "{{ssh_client_connection_pool_name}}",
                    )
                ],
                "Jobs, transfers and reads queued at the pool.",
            ),
            (
                "Wait for a slot, p50 and p99",
                "s",
                quantiles(
                    "ssh_client_connection_wait_time_seconds",
                    "ssh_client_connection_pool_name",
                    POOL,
                ),
                "0 when a slot was free. SshapiPoolWaitP99High: p99 over 1 s for 10 minutes.",
            ),
            (
                "Channels in use and capacity",
                "short",
                [
                    (f"sum by (host) (sshpool_channels_in_use{{{HOST}}})", "{{host}} in use"),
                    (f"sum by (host) (sshpool_capacity{{{HOST}}})", "{{host}} capacity"),
                ],
                "Capacity: max_sessions per connection (agent mode: agent_max_commands), shrunk "
                "where sshd refused a channel.",
            ),
            (
                "sshd connections by state",
                "short",
                [
                    (
                        f"sum by (host, state) (sshpool_sshd_connections{{{HOST}}})",
                        "{{host}} {{state}}",
                    )
                ],
                "Every account's connections to the host's sshd (the budget counts these).",
            ),
            (
                "sshd budget: shares and leases",
                "short",
                [
                    (
                        f"sum by (host) (sshpool_sshd_share_connections{{{HOST}}})",
                        "{{host}} shares",
                    ),
                    (
                        f"max by (host) (sshpool_sshd_leased_connections{{{HOST}}})",
                        "{{host}} leased (Redis)",
                    ),
                    (f"max by (host) (sshpool_sshd_processes{{{HOST}}})", "{{host}} processes"),
                ],
                "Each process's share summed, and what Redis says all processes lease (absent "
                "without Redis, or while it is lost).",
            ),
            (
                "Circuit breaker open",
                "short",
                [(f"max by (host) (sshpool_breaker_open{{{HOST}}})", "{{host}}")],
                "1: the host is down for the API, work fails fast (SshapiBreakerOpen).",
            ),
            (
                "Refused and given up",
                "ops",
                [
                    (
                        f"sum by (ssh_client_connection_pool_name) "
                        f"(rate(ssh_client_connection_timeouts_total{{{POOL}}}{RATE}))",
                        "{{ssh_client_connection_pool_name}} queue deadline",
                    ),
                    (
                        f"sum by (host) (rate(sshpool_refused_full_total{{{HOST}}}{RATE}))",
                        "{{host}} queue full",
                    ),
                    (
                        f"sum by (host) (rate(sshpool_refused_breaker_total{{{HOST}}}{RATE}))",
                        "{{host}} breaker",
                    ),
                ],
                "Work the pool turned away (the callers got 503).",
            ),
            (
                "Evictions and yields",
                "ops",
                [
                    (
                        f"sum by (host) (rate(sshpool_sshd_evictions_total{{{HOST}}}{RATE}))",
                        "{{host}} evictions",
                    ),
                    (
                        f"sum by (host) (rate(sshpool_sshd_yields_total{{{HOST}}}{RATE}))",
                        "{{host}} yields",
                    ),
                ],
                "Connections given up at a full sshd so that another account gets its turn.",
            ),
        ],
    ),
    "sshapi-handshakes": (
        "sshapi: handshakes and logins",
        "Making SSH connections: how many, how long, what the sshd drops or refuses.",
        [
            (
                "Connects and failures",
                "ops",
                [
                    (
                        f"sum by (host) (rate(sshpool_connects_total{{{HOST}}}{RATE}))",
                        "{{host}} made",
                    ),
                    (
                        f"sum by (host) (rate(sshpool_connects_failed_total{{{HOST}}}{RATE}))",
                        "{{host}} failed",
                    ),
                ],
                "SshapiHandshakeFailures: more than 3 failures in 10 minutes.",
            ),
            (
                "Connection create time, p50 and p99",
                "s",
                quantiles(
                    "ssh_client_connection_create_time_seconds",
                    "ssh_client_connection_pool_name",
                    POOL,
                ),
                "TCP, key exchange, login (certificate minted), agent mode's executor start.",
            ),
            (
                "Handshakes in flight and queued",
                "short",
                [
                    (
                        f"sum by (host) (sshpool_sshd_handshakes_in_flight{{{HOST}}})",
                        "{{host}} in flight",
                    ),
                    (
                        f"sum by (host) (sshpool_sshd_handshakes_queued{{{HOST}}})",
                        "{{host}} accounts queued",
                    ),
                ],
                "The sshd's handshake gate (max_handshakes, under MaxStartups).",
            ),
            (
                "Dropped handshakes (MaxStartups) and lost connections",
                "ops",
                [
                    (
                        f"sum by (host) (rate(sshpool_connect_retries_total{{{HOST}}}{RATE}))",
                        "{{host}} dropped, retried",
                    ),
                    (
                        f"sum by (host) (rate(sshpool_connections_lost_total{{{HOST}}}{RATE}))",
                        "{{host}} lost",
                    ),
                    (
                        f"sum by (host) (rate(sshpool_channel_refused_total{{{HOST}}}{RATE}))",
                        "{{host}} channels refused",
                    ),
                ],
                "sshd shedding load (SshapiSshdDroppingHandshakes), connections dropping under "
                "work (SshapiConnectionsLost), MaxSessions below max_sessions.",
            ),
            (
                "Accounts waiting for their turn to connect",
                "s",
                [
                    (
                        f"sum by (host) "
                        f"(rate(sshpool_sshd_connection_wait_seconds_total{{{HOST}}}{RATE}))",
                        "{{host}}",
                    )
                ],
                "Seconds waited per second: above 1, accounts queue for the sshd's budget.",
            ),
            (
                "Login penalty and its threshold",
                "s",
                [
                    (f"max by (host) (sshpool_sshd_penalty_seconds{{{HOST}}})", "{{host}} penalty"),
                    (
                        f"max by (host) (sshpool_sshd_penalty_threshold{{{HOST}}})",
                        "{{host}} threshold",
                    ),
                ],
                "OpenSSH >= 9.8 PerSourcePenalties as the pool counts refused logins "
                "(SshapiLoginPenaltyRising at half the threshold).",
            ),
            (
                "Logins refused",
                "ops",
                [
                    (
                        f"sum by (host) (rate(sshpool_sshd_logins_refused_total{{{HOST}}}{RATE}))",
                        "{{host}}",
                    )
                ],
                "A certificate or key the sshd did not accept (SshapiLoginsRefused).",
            ),
        ],
    ),
    "sshapi-transfers": (
        "sshapi: file transfers",
        "Uploads and downloads through SFTP.",
        [
            (
                "Bytes moved",
                "Bps",
                [(f"sum by (direction) (rate(sshapi_file_bytes_total{RATE}))", "{{direction}}")],
                "Over all replicas.",
            ),
            (
                "Transfers in progress",
                "short",
                [("sum by (direction) (sshapi_file_transfers_active)", "{{direction}}")],
                "Each holds one SFTP channel of its host's pool.",
            ),
            (
                "SFTP sessions opened",
                "ops",
                [
                    (
                        f"sum by (host) (rate(sshpool_sftp_sessions_total{{{HOST}}}{RATE}))",
                        "{{host}}",
                    )
                ],
                "Transfers, listings, checksums.",
            ),
            (
                "File routes, p99",
                "s",
                [
                    (
                        f"histogram_quantile(0.99, sum by (http_route, le) "
                        f'(rate({HTTP}_bucket{{http_route=~"/v1/hosts/.*/files.*"}}{RATE})))',
                        "{{http_route}}",
                    )
                ],
                "A download's duration is its whole body's.",
            ),
        ],
    ),
    "sshapi-live": (
        "sshapi: live followers",
        "Clients following output as it comes (output?follow=true, /events).",
        [
            (
                "Live followers",
                "short",
                [("sum by (instance) (sshapi_live_followers)", "{{instance}}")],
                "Per replica; each identity has its cap over all of them (api.max_followers).",
            ),
            (
                "Feeds",
                "short",
                [
                    ("sum(sshapi_live_commands)", "commands run here"),
                    ("sum(sshapi_live_watchers)", "followed from elsewhere"),
                    ("sum(sshapi_live_publishers)", "published to other replicas"),
                ],
                "A job run on one replica and followed on another is published by the one "
                "(Redis) and watched by the other.",
            ),
            (
                "Follow requests",
                "reqps",
                [
                    (
                        f"sum by (http_route) "
                        f'(rate({HTTP}_count{{http_route=~".*/(events|output)"}}{RATE}))',
                        "{{http_route}}",
                    )
                ],
                "New follows and output reads per second.",
            ),
        ],
    ),
    "sshapi-replicas": (
        "sshapi: replicas",
        "Each API process: up, its name, CPU, memory, store writer, Redis.",
        [
            (
                "Replicas up",
                "short",
                [('up{job="sshapi"}', "{{instance}}")],
                "SshapiReplicaDown: 0 for a minute; SshapiNoReplicaUp: none up.",
            ),
            (
                "Replica names and releases",
                "short",
                [("sshapi_replica_info", "{{instance}} {{replica}} {{version}}")],
                "SSHAPI_REPLICA of each target (its unfinished jobs are marked lost on restart).",
            ),
            (
                "CPU per replica",
                "percentunit",
                [(f'rate(process_cpu_seconds_total{{job="sshapi"}}{RATE})', "{{instance}}")],
                "1 = one core.",
            ),
            (
                "Resident memory per replica",
                "bytes",
                [('process_resident_memory_bytes{job="sshapi"}', "{{instance}}")],
                "",
            ),
            (
                "Open descriptors per replica",
                "short",
                [('process_open_fds{job="sshapi"}', "{{instance}}")],
                "Client connections, SSH connections, the store (LimitNOFILE=16384).",
            ),
            (
                "Requests per replica",
                "reqps",
                [(f"sum by (instance) (rate({HTTP}_count{RATE}))", "{{instance}}")],
                "nginx's least_conn spreads them.",
            ),
            (
                "Store writes pending and mean commit time",
                "short",
                [
                    ("sshapi_store_writes_pending", "{{instance}} pending"),
                    (
                        f"rate(sshapi_store_commit_seconds_total{RATE})"
                        f" / rate(sshapi_store_commits_total{RATE})",
                        "{{instance}} mean commit (s)",
                    ),
                ],
                "SshapiStoreWriteQueue, SshapiStoreSlowCommits.",
            ),
            (
                "Redis reachable",
                "short",
                [("sshapi_redis_up", "{{instance}}")],
                "With SSHAPI_REDIS_URL only. SshapiRedisLost: 0 for a minute.",
            ),
        ],
    ),
}


def variables(uid: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        }
    ]
    panels = DASHBOARDS[uid][2]
    if any("$host" in expr for _, _, targets, _ in panels for expr, _ in targets):
        found.append(
            {
                "name": "host",
                "label": "Host",
                "type": "query",
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "definition": HOSTS,
                "query": {"query": HOSTS, "refId": "host"},
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "current": {"text": "All", "value": "$__all"},
                "refresh": 2,
                "sort": 1,
                "hide": 0,
            }
        )
    return found


def dashboard(uid: str) -> dict[str, Any]:
    title, description, panels = DASHBOARDS[uid]
    out = []
    for i, (name, unit, targets, text) in enumerate(panels):
        out.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": name,
                "description": text,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {
                        "refId": chr(ord("A") + j),
                        "datasource": {"type": "prometheus", "uid": "${datasource}"},
                        "expr": expr,
                        "legendFormat": legend,
                    }
                    for j, (expr, legend) in enumerate(targets)
                ],
            }
        )
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["sshapi"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": variables(uid)},
        "links": [
            {"type": "dashboards", "tags": ["sshapi"], "asDropdown": True, "title": "sshapi"}
        ],
        "panels": out,
    }


def generate() -> dict[str, str]:
    return {f"{uid}.json": json.dumps(dashboard(uid), indent=2) + "\n" for uid in DASHBOARDS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare with the files")
    args = parser.parse_args()
    stale = [
        n
        for n, text in generate().items()
        if not (OUT / n).exists() or (OUT / n).read_text() != text
    ]
    if args.check:
        for name in stale:
            print(f"{OUT / name} is not what {Path(__file__).name} makes: run it")
        return 1 if stale else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in generate().items():
        (OUT / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
