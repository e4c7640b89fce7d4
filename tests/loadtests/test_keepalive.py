"""The load client never reuses a keep-alive connection the server may be closing: bursts
separated by more than the server's keep-alive timeout all succeed. (That a connection idle past
`max_idle` is reconnected rather than reused is tests/loadtests/test_client.py's.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gevent
import pytest
from gevent.event import Event

from loadtests.client import JobClient, Outcome, tokens
from loadtests.server import start_api, stop_api
from sshpool.devhost import LocalHost

SERVER_KEEPALIVE = 1  # seconds: the shortest the server takes, so the test stays quick
# Around and past the server's timeout: connections finish at different moments of a burst, so
# some reach the server's timeout just as the next burst reuses them.
GAPS = (0.9, 1.0, 1.1, 1.25, 1.5)
BURST = 40


@pytest.fixture
def api(tuned_host: LocalHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    data = tmp_path / "api"
    proc, url = start_api(
        tuned_host, backend="asyncssh", pool_mode="pooled", data_dir=data,
        log=tmp_path / "api.log", env={"SSHAPI_KEEPALIVE_TIMEOUT": str(SERVER_KEEPALIVE)},
    )  # fmt: skip
    monkeypatch.setenv("SSHAPI_DATA_DIR", str(data))
    monkeypatch.delenv("SSHAPI_TOKEN", raising=False)
    monkeypatch.delenv("SSHAPI_CONFIG", raising=False)
    try:
        yield url
    finally:
        stop_api(proc)


def burst(client: JobClient, toks: list[str]) -> list[Outcome]:
    """BURST requests released at once, on greenlets as in a Locust run."""
    go = Event()

    def one(k: int) -> Outcome:
        go.wait()
        return client.post(toks[k % len(toks)])

    greenlets = [gevent.spawn(one, k) for k in range(BURST)]
    gevent.sleep(0)  # every greenlet reaches the barrier
    go.set()
    gevent.joinall(greenlets, raise_error=True)
    return [g.value for g in greenlets]


@pytest.mark.timeout(120)
def test_bursts_past_the_server_keepalive_timeout_have_no_failures(api: str) -> None:
    """Bursts of 40 on keep-alive connections, separated by gaps of 0.9 to 1.5 s against a
    server that closes idle connections after 1 s: every request succeeds (no `reset`)."""
    client = JobClient(
        api, "local", ["true"], "keep-alive", timeout=30, pool_size=BURST,
        max_idle=SERVER_KEEPALIVE / 2,
    )  # fmt: skip
    toks = tokens(8)
    outcomes: list[Outcome] = []
    try:
        outcomes += burst(client, toks)
        for gap in GAPS:
            gevent.sleep(gap)
            outcomes += burst(client, toks)
    finally:
        client.close()
    failed = [o.error for o in outcomes if not o.ok]
    assert len(outcomes) == BURST * (len(GAPS) + 1)
    assert failed == [], failed
