"""/metrics in the standard names beside ours: OpenTelemetry's http.server.request.duration,
the pools after OTel's connection-pool conventions, and the process's own parts (store writer,
live followers, Redis, the replica), each read as a scraper would."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from api_helpers import REDIS_URL, Api, Keys, make_settings, running_api, sse_events

from api.metrics import Metrics

HTTP = "http_server_request_duration_seconds"


def value(text: str, series: str) -> float:
    """The sample of one series (name and labels exactly as exposed)."""
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert match, f"{series} not in /metrics"
    return float(match.group(1))


async def test_http_server_request_duration_is_by_route_template_never_by_path(api: Api) -> None:
    """A job's GET counts under its route template with OTel's label names and advised
    buckets; a path no route takes counts with an empty route, its path nowhere; the
    deprecated families count the same requests."""
    job_id = (await api.submit({"host": "local", "argv": ["true"]})).json()["id"]
    for _ in range(2):
        r = await api.client.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth())
        assert r.status_code == 200
    for n in range(50):  # 50 paths no route takes: one series between them
        assert (await api.client.get(f"{api.url}/nowhere/x7q2z{n}")).status_code == 404
    text = (await api.client.get(f"{api.url}/metrics")).text
    labels = (
        'http_request_method="GET",http_response_status_code="200",http_route="/v1/jobs/{job_id}"'
    )
    assert value(text, f"http_server_request_duration_seconds_count{{{labels}}}") == 2
    for le in ("0.005", "0.075", "7.5", "10.0", "+Inf"):
        assert f'http_server_request_duration_seconds_bucket{{{labels},le="{le}"}}' in text
    unmatched = 'http_request_method="GET",http_response_status_code="404",http_route=""'
    assert value(text, f"http_server_request_duration_seconds_count{{{unmatched}}}") == 50
    assert "x7q2z" not in text and job_id not in text
    counts = [line for line in text.splitlines() if line.startswith(f"{HTTP}_count")]
    assert len(counts) == len({line.split("} ")[0] for line in counts}) <= 6, counts
    old = 'method="GET",route="/v1/jobs/{job_id}",status="200"'
    assert value(text, f"sshapi_http_requests_total{{{old}}}") == 2
    assert value(text, f"sshapi_http_request_duration_seconds_count{{{old}}}") == 2


def test_a_method_no_standard_names_counts_as_other() -> None:
    """A server that parses any token as a method (h11) must not let clients mint label
    values: OTel's `_OTHER` stands for them, in the old families too."""
    metrics = Metrics()
    metrics.request("BREW", None, 405, 0.001)
    metrics.request("X" * 40, "/v1/jobs", 405, 0.001)
    metrics.request("FOO", "/v1/jobs", 405, 0.001)
    assert len(metrics._series) == 2  # the request path's cache is bounded the same way
    text = metrics.render().decode()
    assert "BREW" not in text and "XXXX" not in text
    other = 'http_request_method="_OTHER",http_response_status_code="405",http_route="/v1/jobs"'
    assert value(text, f"http_server_request_duration_seconds_count{{{other}}}") == 2
    assert (
        value(text, 'sshapi_http_requests_total{method="_OTHER",route="unmatched",status="405"}')
        == 1
    )


async def test_pool_metrics_follow_the_connection_pool_conventions(api: Api) -> None:
    """After two jobs on `local`: its pool's connections by state add up to the pool's own
    figure, each connection's making is timed, each job's wait for a slot is, nobody waits,
    and the failure counters are there at 0 before any failure."""
    for argv in (["true"], ["false"]):
        assert (await api.submit({"host": "local", "argv": argv})).status_code == 201
    text = (await api.client.get(f"{api.url}/metrics")).text
    pool = 'ssh_client_connection_pool_name="local"'
    idle = value(text, f'ssh_client_connection_count{{{pool},ssh_client_connection_state="idle"}}')
    used = value(text, f'ssh_client_connection_count{{{pool},ssh_client_connection_state="used"}}')
    assert idle + used == value(text, 'sshpool_connections{host="local"}') >= 1
    assert value(text, f"ssh_client_connection_max{{{pool}}}") >= idle + used
    assert value(text, f"ssh_client_connection_pending_requests{{{pool}}}") == 0
    assert value(text, f"ssh_client_connection_timeouts_total{{{pool}}}") == 0
    created = value(text, f"ssh_client_connection_create_time_seconds_count{{{pool}}}")
    assert created == value(text, 'sshpool_connects_total{host="local"}') >= 1
    assert value(text, f"ssh_client_connection_create_time_seconds_sum{{{pool}}}") > 0
    assert value(text, f"ssh_client_connection_wait_time_seconds_count{{{pool}}}") >= 2
    assert value(text, f'ssh_client_connection_wait_time_seconds_bucket{{le="+Inf",{pool}}}') >= 2
    for counter in ("connects_failed", "connect_retries", "channel_refused", "timeouts_queue"):
        assert value(text, f'sshpool_{counter}_total{{host="local"}}') == 0
    assert value(text, 'sshpool_sshd_penalty_seconds{host="local"}') == 0
    assert value(text, 'sshpool_sshd_logins_refused_total{host="local"}') == 0


async def test_the_process_shows_its_store_writer_followers_and_name(api: Api) -> None:
    """The store's commits and writes grow with a job and nothing stays pending; a live
    follower is counted while it follows; the replica's name and the process's CPU are there;
    without Redis there is no Redis series to mislead."""
    await api.submit({"host": "local", "argv": ["true"]})
    text = (await api.client.get(f"{api.url}/metrics")).text
    assert value(text, "sshapi_store_commits_total") >= 1
    assert value(text, "sshapi_store_writes_total") >= 2  # inserted queued, then final
    assert value(text, "sshapi_store_writes_pending") == 0
    assert value(text, "sshapi_live_followers") == 0
    assert re.search(
        r'^sshapi_replica_info\{replica="test-replica",version="[^"]+"\} 1\.0$', text, re.M
    )
    assert value(text, "process_cpu_seconds_total") > 0
    assert "sshapi_redis_up" not in text
    running = await api.submit({"host": "local", "command": "echo go; sleep 30"}, wait=0)
    url = f"{api.url}/v1/jobs/{running.json()['id']}/events"
    async with api.client.stream("GET", url, headers=api.auth()) as r:
        async for _ in sse_events(r):  # the first event: the follower is in
            break
        text = (await api.client.get(f"{api.url}/metrics")).text
        assert value(text, "sshapi_live_followers") == 1
        assert value(text, "sshapi_live_commands") == 1
    await api.client.delete(url.removesuffix("/events"), headers=api.auth())

    async def followers() -> float:
        return value((await api.client.get(f"{api.url}/metrics")).text, "sshapi_live_followers")

    async with asyncio.timeout(20):  # the server sees the disconnect on its next write
        while await followers():  # noqa: ASYNC110 (a scrape)
            await asyncio.sleep(0.1)


async def test_redis_up_says_whether_redis_answers(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """With SSHAPI_REDIS_URL: 1 while Redis answers the scrape's ping, 0 when nothing
    listens there (the scrape still answers, at once)."""
    base = make_settings(tmp_path, config_file, "sqlite", None)
    for url, up in ((REDIS_URL, 1), ("redis://127.0.0.1:9/0", 0)):
        settings = base.model_copy(update={"redis_url": url, "data_dir": tmp_path / str(up)})
        async with running_api(settings, keys, secret) as api:
            r = await api.client.get(f"{api.url}/metrics")
            assert r.status_code == 200
            assert value(r.text, "sshapi_redis_up") == up
