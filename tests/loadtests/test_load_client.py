"""The load client (geventhttpclient): keep-alive reuse, the idle rule, and what it counts as a
failure, against a small real HTTP/1.1 server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import gevent
import pytest
from gevent.pywsgi import WSGIServer

from loadtests.client import JobClient


class Server:
    """An HTTP/1.1 keep-alive server answering POST /v1/jobs with `status` and `state`; records
    the client port of every request (one port per connection)."""

    def __init__(self) -> None:
        self.ports: list[str] = []
        self.status = "201 Created"
        self.state = "succeeded"
        self.wsgi = WSGIServer(("127.0.0.1", 0), self.app, log=None)

    def app(self, environ: dict[str, Any], start: Any) -> list[bytes]:
        self.ports.append(environ["REMOTE_PORT"])
        environ["wsgi.input"].read()
        body = json.dumps({"state": self.state}).encode()
        start(self.status, [("Content-Type", "application/json"),
                            ("Content-Length", str(len(body))),
                            ("Server-Timing", "store;dur=1.5, exec;dur=2")])  # fmt: skip
        return [body]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.wsgi.server_port}"


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    s.wsgi.start()
    try:
        yield s
    finally:
        s.wsgi.stop()


CLIENTS: list[JobClient] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while CLIENTS:
        CLIENTS.pop().close()


def client(url: str, connection: str = "keep-alive", max_idle: float = 2.5) -> JobClient:
    c = JobClient(url, "local", ["true"], connection, 5.0, pool_size=4, max_idle=max_idle)  # type: ignore[arg-type]
    CLIENTS.append(c)
    return c


def test_keep_alive_reuses_a_connection_and_reads_server_timing(server: Server) -> None:
    """Back-to-back requests share one connection; the answer's Server-Timing is parsed."""
    c = client(server.url)
    outcomes = [c.post("t") for _ in range(3)]
    assert all(o.ok and o.status == 201 for o in outcomes)
    assert len(set(server.ports)) == 1
    assert outcomes[0].server == {"store": 1.5, "exec": 2.0}


def test_a_connection_idle_past_the_limit_is_not_reused(server: Server) -> None:
    """After sitting idle longer than max_idle, the next request opens a new connection."""
    c = client(server.url, max_idle=0.2)
    assert c.post("t").ok
    gevent.sleep(0.05)
    assert c.post("t").ok
    gevent.sleep(0.3)
    assert c.post("t").ok
    assert server.ports[0] == server.ports[1] != server.ports[2]


def test_a_steady_low_rate_over_many_identities_keeps_one_connection(server: Server) -> None:
    """Connections are shared by every identity (tokens are headers, not connections) and the
    most recently used one is taken first: at a steady low rate, requests spaced well below
    max_idle all go over one connection, so no request pays a TCP connect."""
    c = client(server.url, max_idle=0.5)
    for n in range(5):
        assert c.post(f"identity-{n}").ok
        gevent.sleep(0.1)
    assert len(server.ports) == 5 and len(set(server.ports)) == 1


def test_connection_new_opens_one_connection_per_request(server: Server) -> None:
    """`new` sends Connection: close: every request has its own connection."""
    c = client(server.url, connection="new")
    assert all(c.post("t").ok for _ in range(3))
    assert len(set(server.ports)) == 3


def test_other_statuses_and_unfinished_jobs_are_failures_by_kind(server: Server) -> None:
    """202, a non-succeeded state and a refused connection are failures with their kind."""
    server.status = "202 Accepted"
    assert client(server.url).post("t").error == "http 202"
    server.status, server.state = "201 Created", "failed"
    assert client(server.url).post("t").error == "job failed"
    server.wsgi.stop()
    refused = client(server.url).post("t")
    assert not refused.ok and refused.error == "refused"


def test_a_request_ends_at_its_last_byte_not_after_the_client_parsed_it(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The open model's latency runs to `Outcome.end`: the answer's last byte. Reading the JSON
    afterwards is the generator's work, not the API's (it cost 0.09 ms per request at 10/s)."""
    c = client(server.url)
    assert c.post("t").ok  # connected
    parse = json.loads

    def slow_parse(text: str | bytes) -> Any:
        time.sleep(0.2)
        return parse(text)

    monkeypatch.setattr(json, "loads", slow_parse)
    before = time.perf_counter()
    outcome = c.post("t")
    after = time.perf_counter()
    assert outcome.ok
    assert after - outcome.end >= 0.2  # the parse came after the end
    assert outcome.service_ms == pytest.approx((outcome.end - before) * 1000.0, abs=5.0)
    assert outcome.service_ms < 150.0
