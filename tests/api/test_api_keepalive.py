"""A researcher's HTTP client that keeps a connection idle past a few seconds and POSTs again
gets an answer, not a reset: `sshapi serve` keeps idle connections 75 s
(SSHAPI_KEEPALIVE_TIMEOUT)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import jwt
import pytest
import requests
from api_helpers import AUDIENCE, LOCAL_ISS, make_settings, server_process

IDLE = 11.0  # seconds: past uvicorn's own 5 s default and the 10 s the issue names
BODY = {"host": "local", "argv": ["echo", "hi"]}


def token(secret: str) -> str:
    now = int(time.time())
    claims = {"iss": LOCAL_ISS, "aud": AUDIENCE, "sub": "alice", "iat": now, "exp": now + 300}
    return jwt.encode({**claims, "scope": "jobs:read jobs:write"}, secret, algorithm="HS256")


@pytest.mark.timeout(90)
def test_requests_and_httpx_post_after_idle_get_no_reset(
    config_file: Path, secret: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A requests.Session and an httpx.Client each POST, stay idle 11 s, POST again: both get
    201, and the Session reused its connection (the server kept it open) rather than finding
    it dropped."""
    caplog.set_level(logging.DEBUG, logger="urllib3.connectionpool")
    settings = make_settings(tmp_path, config_file, "sqlite", None)
    headers = {"Authorization": f"Bearer {token(secret)}"}
    with (
        server_process(settings) as (_, url),
        requests.Session() as session,
        httpx.Client(timeout=30) as client,
    ):
        for attempt in range(2):
            r = session.post(f"{url}/v1/jobs", json=BODY, headers=headers, timeout=30)
            assert r.status_code == 201, r.text
            h = client.post(f"{url}/v1/jobs", json=BODY, headers=headers)
            assert h.status_code == 201, h.text
            if attempt == 0:
                time.sleep(IDLE)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("Starting new HTTP connection" in m for m in messages) == 1, messages
    assert not [m for m in messages if "Resetting dropped connection" in m], messages
