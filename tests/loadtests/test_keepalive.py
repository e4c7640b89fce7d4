"""The load client never reuses a keep-alive connection the server may be closing: bursts
separated by more than the server's keep-alive timeout all succeed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loadtests.client import JobClient, Outcome, tokens
from loadtests.server import start_api, stop_api
from sshpool.devhost import LocalHost

SERVER_KEEPALIVE = 2  # seconds: short, so the test stays quick
# Around and past the server's timeout: connections finish at different moments of a burst, so
# some reach the server's timeout just as the next burst reuses them.
GAPS = (1.8, 2.0, 2.2, 2.5, 3.0)
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


def burst(client: JobClient, pool: ThreadPoolExecutor, toks: list[str]) -> list[Outcome]:
    release = threading.Barrier(BURST)

    def one(k: int) -> Outcome:
        release.wait()
        return client.post(toks[k % len(toks)])

    return list(pool.map(one, range(BURST)))


@pytest.mark.timeout(120)
def test_bursts_past_the_server_keepalive_timeout_have_no_failures(api: str) -> None:
    """Bursts of 40 on keep-alive connections, separated by gaps of 1.8 to 3 s against a server
    that closes idle connections after 2 s: every request succeeds (no `reset`)."""
    client = JobClient(
        api, "local", ["true"], "keep-alive", timeout=30, pool_size=BURST,
        max_idle=SERVER_KEEPALIVE / 2,
    )  # fmt: skip
    toks = tokens(8)
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(BURST) as pool:
        outcomes += burst(client, pool, toks)
        for gap in GAPS:
            threading.Event().wait(gap)
            outcomes += burst(client, pool, toks)
    failed = [o.error for o in outcomes if not o.ok]
    assert len(outcomes) == BURST * (len(GAPS) + 1)
    assert failed == [], failed


def test_a_connection_idle_past_max_idle_is_reconnected_not_reused(
    api: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The client reuses a connection idle less than `max_idle` and connects afresh after
    more: it never offers the server a connection the server may be closing."""
    caplog.set_level(logging.DEBUG, logger="urllib3.connectionpool")
    client = JobClient(api, "local", ["true"], "keep-alive", timeout=30, pool_size=1, max_idle=0.5)
    token = tokens(1)[0]
    for pause in (0.0, 0.1, 1.0):
        time.sleep(pause)
        assert client.post(token).ok
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[0] for m in messages if "connection" in m] == [
        "Starting new HTTP connection (1)",
        "Resetting dropped connection",
    ], messages
