"""Portals without polling (issue 43): job handles, the change feed, conditional GETs, against the
real API and sshd (SQLite; the replica tests on PostgreSQL and Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from subprocess import DEVNULL, PIPE
from typing import Any

import httpx
import pytest
from api_helpers import LOCAL_ISS, REDIS_URL, SSHAPI, Api, Keys, replicas, sse_events

from api.client import AsyncClient, ProblemError

ADMIN = "jobs:read jobs:write admin"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def finished_job(api: Api, command: str = "echo portal", sub: str = "alice") -> str:
    r = await api.submit({"host": "local", "command": command}, wait=20, sub=sub)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def make_handle(
    api: Api, job_id: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    return await api.client.post(
        f"{api.url}/v1/jobs/{job_id}/handles", json=body, headers=headers or api.auth()
    )


async def test_a_handle_reads_its_job_and_nothing_else(api: Api) -> None:
    """A handle reads its job (status, output, events); another job is 404; it cannot submit,
    list, cancel (made without `cancel`), follow the change feed, make handles or see hosts."""
    job_id = await finished_job(api)
    other = await finished_job(api, "echo other")
    r = await make_handle(api, job_id, {"ttl": 600})
    assert r.status_code == 201, r.text
    made = r.json()
    handle = bearer(made["handle"])
    assert made["handle"].startswith("sshh_") and made["cancel"] is False
    expires = datetime.fromisoformat(made["expires_at"])
    assert timedelta(seconds=590) < expires - datetime.now(expires.tzinfo) <= timedelta(seconds=600)

    url = f"{api.url}/v1/jobs"
    r = await api.client.get(f"{url}/{job_id}", headers=handle)
    assert r.status_code == 200 and r.json()["stdout"] == "portal\n", r.text
    r = await api.client.get(f"{url}/{job_id}/output", headers=handle)
    assert r.status_code == 200 and r.content == b"portal\n"
    async with api.client.stream("GET", f"{url}/{job_id}/events", headers=handle) as r:
        assert r.status_code == 200
        kinds = [e.get("event") async for e in sse_events(r)]
    assert kinds[0] == "state" and kinds[-1] == "end"

    assert (await api.client.get(f"{url}/{other}", headers=handle)).status_code == 404
    assert (await api.client.get(f"{url}/{other}/output", headers=handle)).status_code == 404
    body = {"host": "local", "command": "echo no"}
    assert (await api.client.post(url, json=body, headers=handle)).status_code == 403
    assert (await api.client.get(url, headers=handle)).status_code == 403
    assert (await api.client.delete(f"{url}/{job_id}", headers=handle)).status_code == 403
    assert (await api.client.get(f"{url}/events", headers=handle)).status_code == 403
    assert (await make_handle(api, job_id, {"ttl": 60}, handle)).status_code == 403
    hosts = await api.client.get(f"{api.url}/v1/hosts", headers=handle)
    assert hosts.status_code == 200 and hosts.json() == [], hosts.text
    files = await api.client.get(f"{api.url}/v1/hosts/local/files", headers=handle)
    assert files.status_code == 403

    # Someone else cannot make a handle of alice's job, nor see hers.
    bob = api.auth("bob")
    assert (await make_handle(api, job_id, {"ttl": 60}, bob)).status_code == 404
    r = await api.client.get(f"{url}/{job_id}/handles", headers=bob)
    assert r.status_code == 404
    r = await api.client.get(f"{url}/{job_id}/handles", headers=api.auth())
    assert [h["id"] for h in r.json()["items"]] == [made["id"]]
    assert "handle" not in r.json()["items"][0]


async def test_a_handle_outlives_its_creators_token(api: Api) -> None:
    """The creator's token expires (and is refused); the handle still reads the job."""
    job_id = await finished_job(api)
    short = api.token(exp=int(time.time()) + 1)
    r = await make_handle(api, job_id, {"ttl": 600}, bearer(short))
    assert r.status_code == 201, r.text
    handle = bearer(r.json()["handle"])
    leeway = api.config.issuers[0].leeway
    await asyncio.sleep(2 + leeway)
    url = f"{api.url}/v1/jobs/{job_id}"
    expired = await api.client.get(url, headers=bearer(short))
    assert expired.status_code == 401 and "expired" in expired.json()["detail"]
    r = await api.client.get(url, headers=handle)
    assert r.status_code == 200 and r.json()["id"] == job_id


async def test_a_deleted_handle_is_401_and_a_handle_deletes_only_itself(api: Api) -> None:
    job_id = await finished_job(api)
    first = (await make_handle(api, job_id, {"ttl": 600})).json()
    second = (await make_handle(api, job_id, {"ttl": 600})).json()
    url = f"{api.url}/v1/jobs/{job_id}"
    handles = f"{url}/handles"
    r = await api.client.delete(f"{handles}/{second['id']}", headers=bearer(first["handle"]))
    assert r.status_code == 404
    r = await api.client.delete(f"{handles}/{first['id']}", headers=api.auth())
    assert r.status_code == 204
    gone = await api.client.get(url, headers=bearer(first["handle"]))
    assert gone.status_code == 401 and gone.headers["WWW-Authenticate"].startswith("Bearer")
    r = await api.client.delete(f"{handles}/{second['id']}", headers=bearer(second["handle"]))
    assert r.status_code == 204
    assert (await api.client.get(url, headers=bearer(second["handle"]))).status_code == 401
    forged = bearer("sshh_" + "A" * 43)
    assert (await api.client.get(url, headers=forged)).status_code == 401
    assert (await api.client.get(url, headers=bearer("sshh_" + "A" * 500))).status_code == 401


async def test_a_revoked_creator_ends_the_handle(api: Api) -> None:
    """An identity revocation makes the creator's handles 401, and lifting it does not bring
    them back (they were deleted); a revoked creator's handle made by account is 401 too."""
    sub = f"portal-{uuid.uuid4().hex[:6]}"
    job_id = await finished_job(api, sub=sub)
    r = await make_handle(api, job_id, {"ttl": 600}, api.auth(sub))
    handle = bearer(r.json()["handle"])
    url = f"{api.url}/v1/jobs/{job_id}"
    assert (await api.client.get(url, headers=handle)).status_code == 200
    admin = api.auth("root-admin", ADMIN)
    r = await api.client.post(
        f"{api.url}/v1/admin/revocations",
        json={"issuer": LOCAL_ISS, "subject": sub},
        headers=admin,
    )
    assert r.status_code == 201, r.text
    assert (await api.client.get(url, headers=handle)).status_code == 401
    r = await api.client.delete(f"{api.url}/v1/admin/revocations/{r.json()['id']}", headers=admin)
    assert r.status_code == 204
    assert (await api.client.get(url, headers=handle)).status_code == 401
    assert (await api.client.get(url, headers=api.auth(sub))).status_code == 200


async def test_handle_ttl_is_capped_and_cancel_needs_asking(api: Api) -> None:
    """A huge ttl is cut to the policy's week; an absurd one is 422. A handle made with
    `cancel` cancels its job, named after its creator."""
    job_id = await finished_job(api)
    r = await make_handle(api, job_id, {"ttl": 1e9})
    expires = datetime.fromisoformat(r.json()["expires_at"])
    assert expires - datetime.now(expires.tzinfo) <= timedelta(days=7)
    for body in ({"ttl": 1e12}, {"ttl": 0}, {"ttl": 60, "extra": 1}, {}):
        assert (await make_handle(api, job_id, body)).status_code == 422, body
    reader_only = api.auth("alice", "jobs:read")
    r = await make_handle(api, job_id, {"ttl": 60, "cancel": True}, reader_only)
    assert r.status_code == 403

    r = await api.submit({"host": "local", "command": "sleep 60"}, wait=0)
    running = r.json()["id"]
    await api.wait_state(running, ("running",))
    r = await make_handle(api, running, {"ttl": 60, "cancel": True})
    assert r.status_code == 201, r.text
    r = await api.client.delete(f"{api.url}/v1/jobs/{running}", headers=bearer(r.json()["handle"]))
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "cancelled"
    assert r.json()["error"].startswith("cancelled by alice (handle ")


async def test_too_many_handles_of_one_job_is_429(api: Api) -> None:
    job_id = await finished_job(api)
    cap = api.config.api.max_handles_per_job
    for _ in range(cap):
        assert (await make_handle(api, job_id, {"ttl": 60})).status_code == 201
    r = await make_handle(api, job_id, {"ttl": 60})
    assert r.status_code == 429 and r.json()["type"].endswith("too-many-handles")


async def test_etag_304_until_the_job_changes(api: Api) -> None:
    r = await api.submit({"host": "local", "command": "sleep 2; echo done"}, wait=0)
    job_id = r.json()["id"]
    url = f"{api.url}/v1/jobs/{job_id}"
    first = await api.client.get(url, headers=api.auth())
    etag = first.headers["ETag"]
    assert etag.startswith('"') and first.status_code == 200
    if first.json()["state"] in ("queued", "running"):
        same = await api.client.get(url, headers={**api.auth(), "If-None-Match": etag})
        current = same.headers["ETag"]
        # Unless it changed state between the two reads: then 200 and another tag.
        assert (same.status_code, not same.content) == (304, True) or current != etag
    await api.until_final(job_id)
    after = await api.client.get(url, headers={**api.auth(), "If-None-Match": etag})
    assert after.status_code == 200 and after.json()["stdout"] == "done\n"
    assert after.headers["ETag"] != etag
    final = after.headers["ETag"]
    weak = f'"nope", W/{final}'
    again = await api.client.get(url, headers={**api.auth(), "If-None-Match": weak})
    assert again.status_code == 304 and again.headers["ETag"] == final

    listing = f"{api.url}/v1/jobs"
    page = await api.client.get(listing, headers=api.auth())
    tag = page.headers["ETag"]
    r = await api.client.get(listing, headers={**api.auth(), "If-None-Match": tag})
    assert r.status_code == 304
    await finished_job(api)
    r = await api.client.get(listing, headers={**api.auth(), "If-None-Match": tag})
    assert r.status_code == 200 and r.headers["ETag"] != tag


@asynccontextmanager
async def feed(
    api: Api, sub: str, last_event_id: str | None = None
) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
    headers = api.auth(sub)
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    async with api.client.stream("GET", f"{api.url}/v1/jobs/events", headers=headers) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        yield sse_events(r)


async def until_final_events(
    events: AsyncIterator[dict[str, Any]], jobs: set[str], until: set[str] | None = None
) -> list[dict[str, Any]]:
    """Read events until each of `until` (default: `jobs`) had a final one; return those of
    `jobs`."""
    seen: list[dict[str, Any]] = []
    pending = set(jobs if until is None else until)
    async with asyncio.timeout(60):
        async for event in events:
            job = event["data"].get("data", {}).get("id")
            if job in jobs:
                seen.append(event)
                if event["event"] not in ("job.queued", "job.running"):
                    pending.discard(job)
            if not pending:
                return seen
    raise AssertionError(f"feed ended with {pending} not final")


async def test_the_change_feed_resumes_without_loss(api: Api) -> None:
    """Each job's queued, running and final events come in order with increasing ids; a feed
    resumed from any id sends exactly the events after it; a malformed id is 422, one we never
    gave or older than the window a `reset` first."""
    sub = f"feed-{uuid.uuid4().hex[:6]}"
    async with feed(api, sub) as events:
        ready = await anext(events)
        assert ready["event"] == "ready"
        jobs = {await finished_job(api, "true", sub), await finished_job(api, "false", sub)}
        seen = await until_final_events(events, jobs)
    ids = [int(e["id"]) for e in seen]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for job in jobs:
        kinds = [e["event"] for e in seen if e["data"]["data"]["id"] == job]
        assert kinds[0] == "job.queued" and kinds[-1] in ("job.succeeded", "job.failed")
        assert kinds.count("job.queued") == 1 and len(kinds) == len(set(kinds))
    assert seen[0]["data"]["type"] == seen[0]["event"]

    # Resume from the middle: exactly what followed, plus a new job's events.
    middle = seen[len(seen) // 2]
    later = await finished_job(api, "echo later", sub)
    async with feed(api, sub, middle["id"]) as events:
        assert (await anext(events))["event"] == "ready"
        resumed = await until_final_events(events, jobs | {later}, {later})
    after_middle = [e["id"] for e in seen if int(e["id"]) > int(middle["id"])]
    assert [e["id"] for e in resumed][: len(after_middle)] == after_middle
    assert [e["data"]["data"]["id"] for e in resumed][len(after_middle) :] == [later] * (
        len(resumed) - len(after_middle)
    )

    r = await api.client.get(
        f"{api.url}/v1/jobs/events", headers={**api.auth(sub), "Last-Event-ID": "12abc"}
    )
    assert r.status_code == 422
    async with feed(api, sub, "999999999999999") as events:
        first, second = await anext(events), await anext(events)
    assert first["event"] == "reset" and second["event"] == "ready"
    assert int(second["id"]) < 999999999999999


async def test_another_identity_sees_none_of_my_changes(api: Api) -> None:
    mine = f"feed-{uuid.uuid4().hex[:6]}"
    async with feed(api, "bob") as events:
        ready = await anext(events)
        await finished_job(api, "true", mine)
        bobs = await finished_job(api, "true", "bob")
        seen = await until_final_events(events, {bobs})
    assert {e["data"]["data"]["id"] for e in seen} == {bobs}
    assert all(int(e["id"]) > int(ready["id"]) for e in seen)


async def test_change_feeds_per_identity_are_capped(api: Api) -> None:
    cap = api.config.api.max_change_feeds
    sub = f"feed-{uuid.uuid4().hex[:6]}"
    async with contextlib.AsyncExitStack() as stack:
        held = []  # each feed's events, kept: a dropped iterator closes its response
        for _ in range(cap):
            held.append(await stack.enter_async_context(feed(api, sub)))
            await anext(held[-1])
        url = f"{api.url}/v1/jobs/events"
        async with api.client.stream("GET", url, headers=api.auth(sub)) as r:
            body = await r.aread() if r.status_code != 200 else b""
        assert r.status_code == 429 and b"too-many-feeds" in body
    async with feed(api, sub) as events:  # places given back once the feeds closed
        assert (await anext(events))["event"] == "ready"


async def test_a_change_on_one_replica_reaches_a_feed_on_another(
    config_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """Replica a runs the jobs; the feed on b (PostgreSQL, Redis) gets every state change, and a
    feed resumed on a from b's ids loses none."""
    sub = f"feed-{uuid.uuid4().hex[:6]}"
    async with replicas(tmp_path, config_file, keys, secret, REDIS_URL) as (a, b):
        async with feed(b, sub) as events:
            ready = await anext(events)
            jobs = {await finished_job(a, "true", sub), await finished_job(a, "false", sub)}
            seen = await until_final_events(events, jobs)
        assert {e["event"] for e in seen} >= {"job.queued", "job.running"}
        assert {e["data"]["data"]["replica"] for e in seen if "replica" in e["data"]["data"]} <= {
            "a"
        }
        async with feed(a, sub, ready["id"]) as events:
            assert (await anext(events))["event"] == "ready"
            again = await until_final_events(events, jobs)
        assert [e["id"] for e in again] == [e["id"] for e in seen]


async def test_the_client_watches_and_makes_handles(api: Api) -> None:
    """AsyncClient: `watch` yields the change feed's events; a handle made with
    `create_handle` is a token another client reads the job with; `delete_handle` ends it."""
    sub = f"client-{uuid.uuid4().hex[:6]}"
    async with AsyncClient(api.url, api.token(sub)) as c:
        watching = c.watch()
        assert (await anext(watching)).event == "ready"
        job = await c.submit("local", command="echo watched")
        kinds = []
        async with asyncio.timeout(60):
            async for event in watching:
                if event.data["data"]["id"] == job.id:
                    kinds.append(event.event)
                if event.event == "job.succeeded":
                    break
        await watching.aclose()
        assert kinds == ["job.queued", "job.running", "job.succeeded"]
        made = await c.create_handle(job.id, 600)
        assert [h["id"] for h in await c.handles(job.id)] == [made["id"]]
        async with AsyncClient(api.url, made["handle"]) as reader:
            assert (await reader.get(job.id)).stdout == "watched\n"
            await c.delete_handle(job.id, made["id"])
            with pytest.raises(ProblemError) as refused:
                await reader.get(job.id)
            assert refused.value.status == 401


async def sshapi(api: Api, sub: str, *args: str) -> tuple[int, str, str]:
    env = {**os.environ, "SSHAPI_URL": api.url, "SSHAPI_TOKEN": api.token(sub)}
    proc = await asyncio.create_subprocess_exec(
        SSHAPI, *args, env=env, stdout=PIPE, stderr=PIPE, stdin=DEVNULL
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_the_cli_makes_handles_and_watches(api: Api) -> None:
    """`sshapi handles create|list|delete` and `sshapi jobs watch --json`, resumed from an
    event id: it prints the job's changes after it."""
    sub = f"cli-{uuid.uuid4().hex[:6]}"
    job_id = await finished_job(api, "echo cli", sub)
    code, token, _ = await sshapi(api, sub, "handles", "create", job_id, "--ttl", "60")
    assert code == 0 and token.strip().startswith("sshh_")
    r = await api.client.get(f"{api.url}/v1/jobs/{job_id}", headers=bearer(token.strip()))
    assert r.status_code == 200
    code, listed, _ = await sshapi(api, sub, "handles", "list", job_id, "--json")
    handle_id = json.loads(listed)[0]["id"]
    assert (await sshapi(api, sub, "handles", "delete", job_id, handle_id))[0] == 0
    r = await api.client.get(f"{api.url}/v1/jobs/{job_id}", headers=bearer(token.strip()))
    assert r.status_code == 401

    env = {**os.environ, "SSHAPI_URL": api.url, "SSHAPI_TOKEN": api.token(sub)}
    proc = await asyncio.create_subprocess_exec(
        SSHAPI, "jobs", "watch", "--json", "--last-event-id", "0",
        env=env, stdout=PIPE, stderr=PIPE, stdin=DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        async with asyncio.timeout(60):
            while not lines or lines[-1]["event"] != "job.succeeded":
                line = json.loads(await proc.stdout.readline())
                if line["event"].startswith("job."):
                    lines.append(line)
        assert [x["event"] for x in lines] == ["job.queued", "job.running", "job.succeeded"]
        assert {x["data"]["id"] for x in lines} == {job_id}
    finally:
        proc.kill()
        await proc.wait()


async def test_a_revocation_ends_the_change_feed(api: Api) -> None:
    """The feed of an identity an administrator revokes ends with `revoked`; a new one is 403."""
    sub = f"feed-{uuid.uuid4().hex[:6]}"
    async with feed(api, sub) as events:
        assert (await anext(events))["event"] == "ready"
        r = await api.client.post(
            f"{api.url}/v1/admin/revocations",
            json={"issuer": LOCAL_ISS, "subject": sub},
            headers=api.auth("root-admin", ADMIN),
        )
        assert r.status_code == 201, r.text
        async with asyncio.timeout(30):
            last = [event async for event in events][-1]
    assert last["event"] == "revoked"
    r = await api.client.get(f"{api.url}/v1/jobs/events", headers=api.auth(sub))
    assert r.status_code == 403 and r.json()["type"].endswith("identity-revoked")


async def test_a_deleted_handle_ends_its_open_stream(api: Api) -> None:
    """A handle's `/events` of a running job ends with `revoked` once the handle is deleted
    (the stream asks the store every few seconds), and the job goes on."""
    r = await api.submit({"host": "local", "argv": ["sleep", "60"]}, wait=0)
    job_id = r.json()["id"]
    await api.wait_state(job_id, ("running",))
    made = (await make_handle(api, job_id, {"ttl": 600})).json()
    url = f"{api.url}/v1/jobs/{job_id}"
    async with api.client.stream("GET", f"{url}/events", headers=bearer(made["handle"])) as r:
        events = sse_events(r)
        assert (await anext(events))["event"] == "state"
        gone = await api.client.delete(f"{url}/handles/{made['id']}", headers=api.auth())
        assert gone.status_code == 204
        async with asyncio.timeout(60):
            last = [event async for event in events][-1]
    assert last["event"] == "revoked" and "handle" in last["data"]["detail"]
    assert (await api.job(job_id))["state"] == "running"
    await api.client.delete(url, headers=api.auth())
