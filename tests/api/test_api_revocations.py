"""Revocation (issue 28 item 4): an identity revoked by an admin is refused at once on every
replica, its running commands are killed and its pooled connections closed."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from api_helpers import (
    LOCAL_ISS,
    REDIS_URL,
    Api,
    Keys,
    eventually,
    make_settings,
    replicas,
    running_api,
    sse_events,
)
from test_api_certificates import CLAIM, cert_config

from sshpool.devhost import LocalHost
from sshpool.devhost.accounts import ensure_accounts

pytestmark = pytest.mark.timeout(120)
ADMIN = "jobs:read jobs:write admin"


@dataclass
class Rig:
    """A root sshd logging in two researcher accounts: `user`, the one tokens name, and
    `mapped`, the one a policy rule maps subject `mapped` to (a claim never names the host's own
    account, nor one the policy maps)."""

    host: LocalHost
    user: str
    mapped: str

    def processes(self, pattern: str) -> list[int]:
        """Pids of `user`'s processes whose command line matches `pattern`."""
        done = subprocess.run(
            ["pgrep", "-u", self.user, "-f", pattern], capture_output=True, text=True, timeout=10
        )
        return [int(pid) for pid in done.stdout.split()]


@pytest.fixture
def rig(make_host: Callable[..., LocalHost], tmp_path: Path) -> Rig:
    user, mapped = (a.name for a in ensure_accounts(2, data_dir=tmp_path / "accounts"))
    return Rig(make_host("stock", researchers=True), user, mapped)


def rules(rig: Rig) -> str:
    """`root-admin` may use no host (so revoking an account never refuses them); `mapped` runs
    on hpc as `rig.mapped`, fixed by their rule (their token names none)."""
    return f"""[[policy]]
subject = "root-admin"
issuer = "*"
hosts = []

[[policy]]
subject = "mapped"
issuer = "*"
hosts = ["hpc"]
[policy.accounts.hpc]
username = "{rig.mapped}"

"""


@pytest.fixture
def cert_config_file(rig: Rig, secret_file: Path, keys: Keys, tmp_path: Path) -> Path:
    path = tmp_path / "sshapi.toml"
    text = cert_config(rig.host, secret_file, keys)
    fallback = '[[policy]]\nsubject = "*"'
    path.write_text(text.replace(fallback, rules(rig) + fallback, 1))
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


async def test_revoked_while_its_job_runs_and_lifted(api: Api, rig: Rig) -> None:
    """The running job is cancelled and its remote process killed, the connection closed, the
    identity refused (403 identity-revoked) while the others go on; lifting lets it in again."""
    word = f"revoke-{uuid.uuid4().hex[:8]}"
    user = rig.user
    r = await submit(api, "carol", user, ["sh", "-c", f"sleep 60 # {word}"])
    job = r.json()
    await eventually(lambda: rig.processes(word))
    done = await revoke(api, {"issuer": LOCAL_ISS, "subject": "carol"})
    assert done.status_code == 201, done.text
    body = done.json()
    assert (body["jobs_cancelled"], body["connections_closed"]) == (1, 1), body
    await eventually(lambda: not rig.processes(word), timeout=10)
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


async def mapped_job(api: Api, argv: list[str]) -> Any:
    """A job of `mapped`: their rule, not their token, names the account."""
    h = headers(api, "mapped") | {"Prefer": "wait=10"}
    return await api.client.post(
        f"{api.url}/v1/jobs", json={"host": "hpc", "argv": argv}, headers=h
    )


def revoked(r: Any) -> bool:
    return (r.status_code, r.json()["type"].split(":")[-1]) == (403, "identity-revoked")


async def test_revoked_account_closes_its_idle_connection(api: Api, rig: Rig) -> None:
    """Revoking an account closes the idle pooled connection its certificate opened (sshd
    checked the certificate at login only) and refuses, before any login, both the tokens
    naming that account and the callers a policy rule maps to it."""
    user = rig.user
    ok = await submit(api, "erin", user, ["true"], wait=10)
    assert ok.json()["state"] == "succeeded"
    assert (await mapped_job(api, ["id", "-un"])).json()["stdout"].strip() == rig.mapped
    for account in (user, rig.mapped):
        done = await revoke(api, {"account": account})
        assert done.json()["connections_closed"] >= 1, done.text
    before = rig.host.log_path.stat().st_size
    assert revoked(await submit(api, "frank", user, ["true"], wait=5))
    assert revoked(await mapped_job(api, ["true"]))
    assert revoked(await api.client.get(f"{api.url}/v1/jobs", headers=headers(api, "mapped")))
    logged = rig.host.log_path.read_bytes()[before:].decode(errors="replace")
    assert "frank@" not in logged and "mapped@" not in logged, logged


async def test_revoking_yourself_is_409(api: Api, rig: Rig) -> None:
    """An admin cannot revoke their own identity nor an account their rule maps them to (no
    one could lift it then, were they the only admin); another account they may revoke."""
    url, admin = f"{api.url}/v1/admin/revocations", headers(api, "mapped", ADMIN)
    for body, status in (
        ({"account": rig.mapped}, 409),
        ({"issuer": LOCAL_ISS, "subject": "mapped"}, 409),
        ({"account": "someone-else"}, 201),
    ):
        r = await api.client.post(url, json=body, headers=admin)
        assert r.status_code == status, r.text


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
    cert_config_file: Path, secret: str, keys: Keys, tmp_path: Path, rig: Rig
) -> None:
    """Revoked on replica a: b refuses the identity and closes its connection of it within
    the poll interval (1 s)."""
    user = rig.user
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


async def test_live_streams_of_a_revoked_identity_end_on_both_replicas(
    cert_config_file: Path, secret: str, keys: Keys, tmp_path: Path, rig: Rig
) -> None:
    """An admin, dave, follows carol's job on replica b (events) and on a (raw bytes); dave is
    revoked on a: a's stream ends at once, b's within its poll of the revocations with a
    final `revoked` event; carol's job goes on."""
    loop = ["sh", "-c", "while :; do echo tick; sleep 0.1; done"]
    async with replicas(tmp_path, cert_config_file, keys, secret) as (a, b):
        job = (await submit(b, "carol", rig.user, loop)).json()
        dave = headers(a, "dave", ADMIN)
        ended: dict[str, float] = {}
        last: list[dict[str, Any]] = []
        ticking = asyncio.Event()

        async def events() -> None:
            url = f"{b.url}/v1/jobs/{job['id']}/events"
            async with b.client.stream("GET", url, headers=dave) as r:
                async for event in sse_events(r):
                    last[:] = [event]
                    if event["event"] == "output":
                        ticking.set()
            ended["b"] = time.perf_counter()

        async def raw() -> None:
            url = f"{a.url}/v1/jobs/{job['id']}/output?follow=true"
            async with a.client.stream("GET", url, headers=dave) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    pass
            ended["a"] = time.perf_counter()

        followers = [asyncio.create_task(events()), asyncio.create_task(raw())]
        await asyncio.wait_for(ticking.wait(), 10)
        start = time.perf_counter()
        assert (await revoke(a, {"issuer": LOCAL_ISS, "subject": "dave"})).status_code == 201
        await asyncio.wait_for(asyncio.gather(*followers), 10)
        print(f"streams ended {ended['a'] - start:.2f} s (a) {ended['b'] - start:.2f} s (b)")
        assert last[0]["event"] == "revoked", last
        assert ended["a"] - start < 1.0 and ended["b"] - start < 3.0, ended
        carol = headers(b, "carol", **{CLAIM: rig.user})
        still = await b.client.get(f"{b.url}/v1/jobs/{job['id']}", headers=carol)
        assert still.json()["state"] == "running"
        await b.client.delete(f"{b.url}/v1/jobs/{job['id']}", headers=carol)


async def connections(api: Api) -> int:
    """The connections this replica's pools hold on host hpc (the admin's view)."""
    r = await api.client.get(f"{api.url}/v1/hosts/hpc", headers=headers(api, "root-admin", ADMIN))
    return sum(p["connections"] for p in r.json()["pool"])


async def timed(at: dict[str, float], start: float, call: Awaitable[Any]) -> Any:
    """`call`'s answer, its time since `start` in at["answer"]."""
    answer = await call
    at["answer"] = time.perf_counter() - start
    return answer


@pytest.mark.parametrize("redis_url", [None, REDIS_URL], ids=["poll", "redis"])
async def test_time_to_revoke_on_two_replicas(
    cert_config_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
    rig: Rig,
    redis_url: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gina runs a command on each replica; revoked on a: the time from the POST until both
    commands are killed (the host's view) and both replicas hold no connection of hers. With
    Redis the poll is made 30 s long: b acts on the nudge alone."""
    # How much later than a (which acts on its own POST) b may close its connections: with
    # Redis it acts on the nudge, as soon as a; without, at its next 1-s poll. Plus 1 s of
    # slack. Judged against a's time in the same round, not a fixed 3 s: a loaded whole-suite
    # run went past 3 s once with Redis. Without the nudge b closed 4-4.5 s after a (an idle
    # close, not its 30-s poll), so the bound still fails.
    later = 1.0
    if redis_url is None:
        later += 1.0  # api.admin.revocations.POLL_INTERVAL
    else:
        monkeypatch.setattr("api.admin.revocations.POLL_INTERVAL", 30.0)
    user = rig.user
    async with replicas(tmp_path, cert_config_file, keys, secret, redis_url) as (a, b):
        admin = headers(a, "root-admin", ADMIN)
        figures = []
        for _ in range(2):
            word = f"revoke-{uuid.uuid4().hex[:8]}"
            for api in (a, b):
                assert (
                    await submit(api, "gina", user, ["sh", "-c", f"sleep 60 # {word}"])
                ).is_success
            # Each job is its `sh -c` (and, for a moment, the login shell above it).
            await eventually(lambda w=word: len(rig.processes(w)) >= 2)  # type: ignore[misc]
            at: dict[str, float] = {}
            start = time.perf_counter()
            posted = asyncio.create_task(
                timed(at, start, revoke(a, {"issuer": LOCAL_ISS, "subject": "gina"}))
            )
            while len(at) < 4 and time.perf_counter() - start < 10:
                for name, api in (("a", a), ("b", b)):
                    if name not in at and await connections(api) == 0:
                        at[name] = time.perf_counter() - start
                if "killed" not in at and not rig.processes(word):
                    at["killed"] = time.perf_counter() - start
                await asyncio.sleep(0.01)
            done = await posted
            figures.append(at)
            assert set(at) == {"a", "b", "killed", "answer"}, at
            # Both ended `cancelled`, whichever replica's cancel came first.
            listed = (await a.client.get(f"{a.url}/v1/jobs", headers=admin)).json()["items"]
            assert [j["state"] for j in listed if word in j["argv"][-1]] == ["cancelled"] * 2
            url = f"{a.url}/v1/admin/revocations/{done.json()['id']}"
            assert (await a.client.delete(url, headers=admin)).status_code == 204
            await asyncio.sleep(0.1 if redis_url else 1.2)  # b reads the lift
        for at in figures:
            print(" ".join(f"{k} {v:.2f} s" for k, v in sorted(at.items())))
        assert all(at["b"] <= at["a"] + later for at in figures), figures
