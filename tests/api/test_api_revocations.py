"""Revocation (issue 28 item 4): an identity revoked by an admin is refused at once on every
replica, its running commands are killed and its pooled connections closed."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from api_helpers import LOCAL_ISS, Api, Keys, eventually, make_settings, replicas, running_api
from test_api_certificates import CLAIM, cert_config

from sshpool.devhost import LocalHost

pytestmark = pytest.mark.timeout(120)
ADMIN = "jobs:read jobs:write admin"


@pytest.fixture
def cert_config_file(stock_host: LocalHost, secret_file: Path, keys: Keys, tmp_path: Path) -> Path:
    path = tmp_path / "sshapi.toml"
    path.write_text(cert_config(stock_host, secret_file, keys))
    return path


@pytest.fixture
async def api(
    cert_config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    settings = make_settings(tmp_path, cert_config_file, "sqlite", None)
    async with running_api(settings, keys, secret) as running:
        yield running


def headers(
    api: Api, sub: str, scope: str = "jobs:read jobs:write", **claims: Any
) -> dict[str, str]:
    return {"Authorization": f"Bearer {api.token(sub, scope, **claims)}"}


async def submit(api: Api, sub: str, account: str, argv: list[str], wait: float = 0) -> Any:
    h = headers(api, sub, **{CLAIM: account}) | {"Prefer": f"wait={wait:g}"}
    return await api.client.post(
        f"{api.url}/v1/jobs", json={"host": "hpc", "argv": argv}, headers=h
    )


async def revoke(api: Api, body: dict[str, Any]) -> Any:
    return await api.client.post(
        f"{api.url}/v1/admin/revocations", json=body, headers=headers(api, "root-admin", ADMIN)
    )


async def test_revoked_while_its_job_runs_and_lifted(api: Api, stock_host: LocalHost) -> None:
    """The running job is cancelled and its remote process killed, the connection closed, the
    identity refused (403 identity-revoked) while the others go on; lifting lets it in again."""
    word = f"revoke-{uuid.uuid4().hex[:8]}"
    user = stock_host.username
    r = await submit(api, "carol", user, ["sh", "-c", f"sleep 60 # {word}"])
    job = r.json()
    await eventually(lambda: stock_host.processes(word))
    done = await revoke(api, {"issuer": LOCAL_ISS, "subject": "carol"})
    assert done.status_code == 201, done.text
    body = done.json()
    assert (body["jobs_cancelled"], body["connections_closed"]) == (1, 1), body
    await eventually(lambda: not stock_host.processes(word), timeout=10)
    seen = await api.client.get(
        f"{api.url}/v1/jobs/{job['id']}", headers=headers(api, "root-admin", ADMIN)
    )
    assert seen.json()["state"] == "cancelled", seen.json()
    refused = await submit(api, "carol", user, ["true"], wait=5)
    assert (refused.status_code, refused.json()["type"].split(":")[-1]) == (403, "identity-revoked")
    other = await submit(api, "dave", user, ["id", "-un"], wait=10)
    assert other.json()["stdout"].strip() == user
    listed = await api.client.get(
        f"{api.url}/v1/admin/revocations", headers=headers(api, "root-admin", ADMIN)
    )
    assert [x["subject"] for x in listed.json()] == ["carol"]
    gone = await api.client.delete(
        f"{api.url}/v1/admin/revocations/{body['id']}", headers=headers(api, "root-admin", ADMIN)
    )
    assert gone.status_code == 204
    again = await submit(api, "carol", user, ["id", "-un"], wait=10)
    assert again.json()["stdout"].strip() == user, again.text


async def test_revoked_account_closes_its_idle_connection(api: Api, stock_host: LocalHost) -> None:
    """Revoking an account closes the idle pooled connection its certificate opened (sshd
    checked the certificate at login only) and refuses tokens naming that account."""
    user = stock_host.username
    ok = await submit(api, "erin", user, ["true"], wait=10)
    assert ok.json()["state"] == "succeeded"
    done = await revoke(api, {"account": user})
    assert done.json()["connections_closed"] == 1, done.text
    refused = await submit(api, "frank", user, ["true"], wait=5)
    assert refused.status_code == 403


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"issuer": LOCAL_ISS},
        {"issuer": LOCAL_ISS, "subject": "x", "account": "y"},
        {"subject": "x\n"},
        {"issuer": LOCAL_ISS, "subject": "a\0b"},
        {"account": "x" * 65},
        {"account": ["alice"]},
        {"issuer": "i" * 600, "subject": "s"},
    ],
    ids=repr,
)
async def test_bad_revocation_requests_are_422(api: Api, body: dict[str, Any]) -> None:
    r = await revoke(api, body)
    assert r.status_code == 422, r.text


async def test_revocations_need_the_admin_scope(api: Api) -> None:
    url = f"{api.url}/v1/admin/revocations"
    r = await api.client.post(url, json={"account": "x"}, headers=headers(api, "mallory"))
    assert r.status_code == 403 and r.json()["type"].endswith(":insufficient-scope")
    r = await api.client.get(url, headers=headers(api, "mallory"))
    assert r.status_code == 403
    for junk in ("nope", str(uuid.uuid4())):
        r = await api.client.delete(f"{url}/{junk}", headers=headers(api, "root-admin", ADMIN))
        assert r.status_code == 404


async def test_revocation_reaches_the_other_replica(
    cert_config_file: Path, secret: str, keys: Keys, tmp_path: Path, stock_host: LocalHost
) -> None:
    """Revoked on replica a: b refuses the identity and closes its connection of it within
    the poll interval (1 s)."""
    user = stock_host.username
    async with replicas(tmp_path, cert_config_file, keys, secret) as (a, b):
        ok = await submit(b, "gina", user, ["true"], wait=10)
        assert ok.json()["state"] == "succeeded"
        start = time.perf_counter()
        done = await revoke(a, {"issuer": LOCAL_ISS, "subject": "gina"})
        assert done.status_code == 201
        # Another replica's state: nothing to await but its answers.
        while (await submit(b, "gina", user, ["true"], wait=5)).status_code != 403:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        refused_after = time.perf_counter() - start
        print(f"replica b refused the revoked identity {refused_after:.2f} s after the POST on a")
        assert refused_after < 3.0, refused_after
