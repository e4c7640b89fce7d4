"""Revocation (issue 28 item 4): an identity revoked by an admin is refused at once on every
replica, its running commands are killed and its pooled connections closed."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
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
        {"account": "x", "end_running": "yes"},
        {"account": "x", "end_running": 1},
        {"account": "x", "end_running": None},
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
            jobs = []
            for api in (a, b):
                r = await submit(api, "gina", user, ["sh", "-c", f"sleep 60 # {word}"])
                assert r.is_success, r.text
                jobs.append((api, r.json()["id"]))
            # Both started on the host, not only submitted: a job still waiting for its slot
            # when the revocation lands never starts (R1) and ends `error`, not `cancelled`.
            # (Two processes with the word are not enough: one job is its `sh -c` and, for a
            # moment, the login shell above it.)
            for api, job_id in jobs:
                async with asyncio.timeout(20):
                    while (await admin_view(api, job_id))["started_at"] is None:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
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


# ---- issue 38: what was admitted before a revocation starts nothing after it (R1, R2, R3)


def made(path: str) -> bool:
    """Whether the host (this machine) has `path`: a job's marker."""
    return Path(path).exists()


async def job_on(api: Api, host: str, sub: str, argv: list[str], wait: float = 0) -> Any:
    """A job of `sub` on `host` (`tiny`: the host's own account, one channel, one waiter)."""
    h = headers(api, sub) | {"Prefer": f"wait={wait:g}"}
    return await api.client.post(f"{api.url}/v1/jobs", json={"host": host, "argv": argv}, headers=h)


async def admin_view(api: Api, job_id: str) -> Any:
    r = await api.client.get(
        f"{api.url}/v1/jobs/{job_id}", headers=headers(api, "root-admin", ADMIN)
    )
    return r.json()


async def final(api: Api, job_id: str, timeout: float = 20) -> Any:
    """The job once it is final (as an admin sees it)."""
    async with asyncio.timeout(timeout):
        while (job := await admin_view(api, job_id))["state"] in ("queued", "running"):  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    return job


async def test_body_after_the_revocation_is_403_and_runs_nothing(api: Api, rig: Rig) -> None:
    """R1: a job request whose headers (and token) were accepted before the revocation and whose
    body came after it is 403 identity-revoked, and nothing runs on the host."""
    marker = f"/tmp/sshapi-revoked-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"host": "hpc", "argv": ["touch", marker]}).encode()
    token = headers(api, "gina", **{CLAIM: rig.user})["Authorization"]
    address, port = api.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(address, int(port))
    try:
        writer.write(
            (
                f"POST /v1/jobs HTTP/1.1\r\nHost: {address}\r\nAuthorization: {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Expect: 100-continue\r\n\r\n"
            ).encode()
        )
        # uvicorn answers 100 Continue once the app asks for the body: the token was verified
        # and found not revoked by then (api/gate.py, ahead of the app).
        async with asyncio.timeout(20):
            assert (await reader.readline()).startswith(b"HTTP/1.1 100 ")
            assert await reader.readline() == b"\r\n"
        assert (await revoke(api, {"issuer": LOCAL_ISS, "subject": "gina"})).status_code == 201
        writer.write(body)
        async with asyncio.timeout(20):
            status = await reader.readline()
            length = 0
            while (line := await reader.readline()) != b"\r\n":
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            answer = json.loads(await reader.readexactly(length))
    finally:
        writer.close()
    assert status.startswith(b"HTTP/1.1 403 "), (status, answer)
    assert answer["type"].endswith(":identity-revoked"), answer
    listed = await api.client.get(f"{api.url}/v1/jobs", headers=headers(api, "root-admin", ADMIN))
    assert [j for j in listed.json()["items"] if marker in j["argv"]] == []
    assert not made(marker)


async def test_job_queued_behind_a_full_pool_never_starts(api: Api, stock_host: LocalHost) -> None:
    """R1: gina's job waits behind dave's on `tiny` (one channel); gina is revoked with
    end_running false (dave's job is not hers, hers is only queued): when the channel frees,
    her job ends `error` identity-revoked and never ran (the pool's gate, asked as the slot is
    granted)."""
    marker = f"/tmp/sshapi-revoked-{uuid.uuid4().hex[:8]}"
    word = f"hold-{uuid.uuid4().hex[:8]}"
    held = (await job_on(api, "tiny", "dave", ["sh", "-c", f"sleep 60 # {word}"])).json()
    await eventually(lambda: stock_host.processes(word))
    queued = (await job_on(api, "tiny", "gina", ["touch", marker])).json()
    assert queued["state"] == "queued", queued
    done = await revoke(api, {"issuer": LOCAL_ISS, "subject": "gina", "end_running": False})
    assert done.status_code == 201, done.text
    assert (done.json()["jobs_cancelled"], done.json()["end_running"]) == (0, False)
    assert (await admin_view(api, queued["id"]))["state"] == "queued"
    dave = headers(api, "dave")
    assert (await api.client.delete(f"{api.url}/v1/jobs/{held['id']}", headers=dave)).is_success
    job = await final(api, queued["id"])
    assert (job["state"], job["error_kind"]) == ("error", "identity-revoked"), job
    assert not made(marker)


async def test_revoking_says_whether_it_knows_whom(api: Api, rig: Rig) -> None:
    """R3: an account or identity nobody has seen is recorded all the same (an admin may revoke
    ahead) and the answer says `known: false`; the host's configured account, an account a job
    ran as and an identity with a job are `known: true`."""
    assert (await submit(api, "ivy", rig.user, ["true"], wait=10)).is_success
    for body, known in (
        ({"account": "no-such-account"}, False),
        ({"account": rig.host.username}, True),
        ({"account": rig.user}, True),
        ({"issuer": LOCAL_ISS, "subject": "nobody-ever"}, False),
        ({"issuer": LOCAL_ISS, "subject": "ivy"}, True),
    ):
        r = await revoke(api, body)
        assert r.status_code == 201, r.text
        assert r.json()["known"] is known, (body, r.json())
    listed = await api.client.get(
        f"{api.url}/v1/admin/revocations", headers=headers(api, "root-admin", ADMIN)
    )
    assert len(listed.json()) == 5 and all(x["end_running"] for x in listed.json())


async def test_end_running_on_two_replicas(
    cert_config_file: Path, secret: str, keys: Keys, tmp_path: Path, rig: Rig
) -> None:
    """Revoked on a while jobs run on b: with end_running false gina's `sleep` goes on (b
    refuses her new work); with end_running true hal's is killed on the host and his job ends
    `cancelled`, saying by a revocation. Prints the time from the POST to the kill."""
    user = rig.user
    async with replicas(tmp_path, cert_config_file, keys, secret, REDIS_URL) as (a, b):
        words = {sub: f"run-{sub}-{uuid.uuid4().hex[:8]}" for sub in ("gina", "hal")}
        jobs = {}
        for sub, word in words.items():
            jobs[sub] = (await submit(b, sub, user, ["sh", "-c", f"sleep 60 # {word}"])).json()
            await eventually(lambda w=word: rig.processes(w))  # type: ignore[misc]
        kept = await revoke(a, {"issuer": LOCAL_ISS, "subject": "gina", "end_running": False})
        assert kept.json()["jobs_cancelled"] == 0, kept.text
        async with asyncio.timeout(10):
            while not revoked(await submit(b, "gina", user, ["true"], wait=5)):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert rig.processes(words["gina"])
        assert (await admin_view(b, jobs["gina"]["id"]))["state"] == "running"
        start = time.perf_counter()
        ended = await revoke(a, {"issuer": LOCAL_ISS, "subject": "hal", "end_running": True})
        # Not its `jobs_cancelled`: a's kill and b's own cancel race, and a counts 0 when its
        # kill failed before b recorded `cancelled` (seen once in 15 runs). The host and the
        # job say what happened.
        assert ended.status_code == 201, ended.text
        await eventually(lambda: not rig.processes(words["hal"]), timeout=10)
        killed = time.perf_counter() - start
        job = await final(b, jobs["hal"]["id"])
        assert job["state"] == "cancelled" and "revocation" in job["error"], job
        print(f"end_running: hal's sleep gone {killed:.2f} s after the POST on a (job on b)")
        await b.client.delete(
            f"{b.url}/v1/jobs/{jobs['gina']['id']}", headers=headers(b, "root-admin", ADMIN)
        )


@pytest.mark.parametrize("redis_url", [None, REDIS_URL], ids=["poll", "redis"])
async def test_download_ends_when_revoked_on_the_other_replica(
    cert_config_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
    stock_host: LocalHost,
    redis_url: str | None,
) -> None:
    """R2: dave downloads a 256 MiB file from `local` (the host's own account, keys: no
    connection of his to close) on replica b, reading at a few MB/s; revoked on a, the
    download ends short, within its replica's learning of it (a nudge, or the 1-s poll)."""
    size = 256 << 20
    name = f"big-{uuid.uuid4().hex[:8]}"
    async with replicas(tmp_path, cert_config_file, keys, secret, redis_url) as (a, b):
        made = await job_on(a, "local", "dave", ["truncate", "-s", str(size), name], wait=10)
        assert made.json()["state"] == "succeeded", made.text
        url = f"{b.url}/v1/hosts/local/files/content"
        got, at = 0, {}
        posted: asyncio.Task[Any] | None = None
        try:
            async with b.client.stream(
                "GET", url, params={"path": name}, headers=headers(b, "dave", "files:read")
            ) as r:
                assert r.status_code == 200, await r.aread()
                async for chunk in r.aiter_raw():
                    got += len(chunk)
                    if posted is None and got >= 4 << 20:
                        at["start"] = time.perf_counter()
                        body = {"issuer": LOCAL_ISS, "subject": "dave"}
                        posted = asyncio.create_task(revoke(a, body))
                    await asyncio.sleep(0.005)  # a client taking a few MB/s
        except httpx.RemoteProtocolError:
            pass  # closed short of its Content-Length: the client knows it is incomplete
        at["end"] = time.perf_counter()
        assert posted is not None and (await posted).status_code == 201
        took = at["end"] - at["start"]
        print(f"download on b ended {took:.2f} s after the POST on a, {got >> 20} of 256 MiB")
        assert got < size // 2, got
        assert took < 5.0, took
        await job_on(a, "local", "erin", ["rm", "-f", name], wait=10)


async def test_upload_under_way_is_refused_at_its_next_piece(api: Api) -> None:
    """R2: dave uploads 64 MiB to `local`; revoked after 4 MiB, the upload is answered 403
    identity-revoked long before its end, and no file lands (its temporary one removed)."""
    size, piece = 64 << 20, 64 << 10
    folder = f"up-{uuid.uuid4().hex[:8]}"
    erin = headers(api, "erin", "files:read files:write")
    made_dir = await api.client.post(
        f"{api.url}/v1/hosts/local/files/mkdir", json={"path": folder}, headers=erin
    )
    assert made_dir.status_code == 201, made_dir.text
    token = headers(api, "dave", "files:write files:read")["Authorization"]
    address, port = api.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(address, int(port))
    sent, posted = 0, None
    try:
        writer.write(
            (
                f"PUT /v1/hosts/local/files/content?path={folder}/f HTTP/1.1\r\nHost: {address}\r\n"
                f"Authorization: {token}\r\nContent-Length: {size}\r\n\r\n"
            ).encode()
        )
        answer = asyncio.create_task(reader.readline())
        async with asyncio.timeout(60):
            while not answer.done() and sent < size:
                writer.write(b"\0" * piece)
                await writer.drain()
                sent += piece
                if posted is None and sent >= 4 << 20:
                    posted = await revoke(api, {"issuer": LOCAL_ISS, "subject": "dave"})
                await asyncio.sleep(0.002)  # a client sending a few tens of MB/s
            status = await answer
    finally:
        writer.close()
    assert posted is not None and posted.status_code == 201
    assert status.startswith(b"HTTP/1.1 403 "), status
    assert sent < size // 2, sent
    # Neither the file nor its temporary one.
    listed = await api.client.get(
        f"{api.url}/v1/hosts/local/files", params={"path": folder}, headers=erin
    )
    assert (listed.status_code, listed.json()["items"]) == (200, []), listed.text


async def test_a_resumable_uploads_next_chunk_after_a_revocation_is_refused(api: Api) -> None:
    """dave's resumable upload takes a chunk; revoked, his next chunk is 403 identity-revoked
    and nothing lands under the file's name (its temporary file waits for the upload's
    expiry)."""
    folder = f"up-{uuid.uuid4().hex[:8]}"
    erin = headers(api, "erin", "files:read files:write")
    made = await api.client.post(
        f"{api.url}/v1/hosts/local/files/mkdir", json={"path": folder}, headers=erin
    )
    assert made.status_code == 201, made.text
    dave = headers(api, "dave", "files:write files:read")
    created = await api.client.post(
        f"{api.url}/v1/hosts/local/files/uploads",
        params={"path": f"{folder}/r"},
        headers={**dave, "Upload-Length": str(2 << 20)},
    )
    assert created.status_code == 201, created.text
    url = f"{api.url}{created.headers['location']}"
    first = await api.client.patch(
        url, content=b"\0" * (1 << 20), headers={**dave, "Upload-Offset": "0"}
    )
    assert first.status_code == 204, first.text
    posted = await revoke(api, {"issuer": LOCAL_ISS, "subject": "dave"})
    assert posted.status_code == 201, posted.text
    second = await api.client.patch(
        url, content=b"\0" * (1 << 20), headers={**dave, "Upload-Offset": str(1 << 20)}
    )
    assert second.status_code == 403, second.text
    listed = await api.client.get(
        f"{api.url}/v1/hosts/local/files", params={"path": folder}, headers=erin
    )
    names = [i["name"] for i in listed.json()["items"]]
    assert "r" not in names and all(n.endswith(".part") for n in names), names
