"""Several API replicas on one PostgreSQL schema (and Redis): any replica answers for any job,
an idempotency key runs once, limits hold across replicas. Two in-process uvicorn servers in
front of the real tuned sshd."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from api_helpers import (
    LOCAL_ISS,
    REDIS_URL,
    Api,
    Keys,
    eventually,
    free_port,
    make_settings,
    replicas,
    sse_events,
)
from api_helpers import running_api as run_one

from api.problems import Problem
from api.quota import PREFIX, RedisQuota
from sshpool.devhost import LocalHost


async def forget(*subjects: str) -> None:
    """Drop the Redis limits of these test subjects (an earlier run's bucket may not be full)."""
    r = aioredis.from_url(REDIS_URL)
    try:
        for sub in subjects:
            for kind in ("rate", "active"):
                await r.delete(f"{PREFIX}{kind}:{LOCAL_ISS}\0{sub}")
    finally:
        await r.aclose()


async def test_any_replica_reads_lists_and_cancels_a_running_job_of_another(
    tuned_host: LocalHost, config_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """A job started on replica a is read, listed and cancelled through replica b: b kills the
    remote process tree and a records `cancelled`."""
    word = f"replica-{uuid.uuid4().hex[:10]}"
    async with replicas(tmp_path, config_file, keys, secret) as (a, b):
        r = await a.submit({"host": "local", "command": f"sleep 60 # {word}"}, wait=0)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        assert (await b.wait_state(job_id, ("running",)))["id"] == job_id
        listed = await b.client.get(f"{b.url}/v1/jobs", headers=b.auth())
        assert job_id in [j["id"] for j in listed.json()["items"]]
        assert tuned_host.processes(word)
        r = await b.client.delete(f"{b.url}/v1/jobs/{job_id}", headers=b.auth())
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "cancelled"
        assert r.json()["error"] == "cancelled by alice"
        await eventually(lambda: not tuned_host.processes(word))
        assert (await a.job(job_id))["state"] == "cancelled"


async def test_a_job_queued_on_another_replica_is_cancelled_when_it_would_start(
    tuned_host: LocalHost, config_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """DELETE through b of a job waiting for a channel on a answers 202 at once; a kills the
    job the moment it starts (its command never gets past its first milliseconds) and records
    `cancelled`."""
    word = f"queued-{uuid.uuid4().hex[:10]}"
    async with replicas(tmp_path, config_file, keys, secret) as (a, b):
        blocker = (await a.submit({"host": "tiny", "command": f"sleep 60 # {word}"}, wait=0)).json()
        await a.wait_state(blocker["id"], ("running",))
        r = await a.submit({"host": "tiny", "command": f"sleep 5; echo ran > /tmp/{word}"}, wait=0)
        queued = r.json()
        assert queued["state"] == "queued"
        r = await b.client.delete(f"{b.url}/v1/jobs/{queued['id']}", headers=b.auth())
        assert r.status_code == 202, r.text
        assert r.json()["state"] == "queued"
        r = await a.client.delete(f"{a.url}/v1/jobs/{blocker['id']}", headers=a.auth())
        assert r.json()["state"] == "cancelled"
        job = await b.until_final(queued["id"])
        assert job["state"] == "cancelled"
        assert job["error"] == "cancelled by alice"
        assert not await asyncio.to_thread(Path(f"/tmp/{word}").exists)


async def test_idempotency_key_sent_to_two_replicas_at_once_runs_the_command_once(
    tuned_host: LocalHost, config_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """Ten concurrent requests with one key, alternating between replicas, answer one job, and
    the command ran once on the host."""
    ran = Path(f"/tmp/sshapi-idem-{uuid.uuid4().hex}")
    body = {"host": "local", "argv": ["sh", "-c", f"echo ran >> {ran}"]}
    try:
        async with replicas(tmp_path, config_file, keys, secret) as (a, b):
            answers = await asyncio.gather(
                *((a if i % 2 else b).submit(body, key="once") for i in range(10))
            )
            assert {r.status_code for r in answers} <= {200, 201, 202}, [r.text for r in answers]
            assert len({r.json()["id"] for r in answers}) == 1
            await a.until_final(answers[0].json()["id"])
        assert await asyncio.to_thread(ran.read_text) == "ran\n"
    finally:
        await asyncio.to_thread(ran.unlink, missing_ok=True)


async def test_rate_limit_and_job_cap_hold_across_replicas_with_redis(
    tuned_host: LocalHost, config_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """With SSHAPI_REDIS_URL, a burst of 2 spent on a is gone on b, and a running job on a
    counts against the cap of 1 on b until it ends."""
    await forget("slow", "solo")
    async with replicas(tmp_path, config_file, keys, secret, REDIS_URL) as (a, b):
        for api in (a, b):
            r = await api.submit({"host": "local", "argv": ["true"]}, sub="slow")
            assert r.status_code == 201, r.text
        r = await a.submit({"host": "local", "argv": ["true"]}, sub="slow")
        assert r.status_code == 429
        assert r.json()["type"].endswith(":rate-limited")
        assert int(r.headers["Retry-After"]) >= 1

        r = await a.submit({"host": "local", "command": "sleep 30"}, sub="solo", wait=0)
        running = r.json()["id"]
        r = await b.submit({"host": "local", "argv": ["true"]}, sub="solo")
        assert r.status_code == 429
        assert r.json()["type"].endswith(":too-many-jobs")
        await b.client.delete(f"{b.url}/v1/jobs/{running}", headers=b.auth("solo"))
        r = await b.submit({"host": "local", "argv": ["true"]}, sub="solo")
        assert r.status_code == 201, r.text


async def test_a_job_cancelled_through_another_replica_frees_its_place_before_the_answer(
    tuned_host: LocalHost,
    config_file: Path,
    keys: Keys,
    secret: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`solo` may run 1 job. Its job on a, cancelled through b, is answered `cancelled` by b
    only once a has given its place back: the next submission on b runs, even when Redis is
    slow to forget the job (3 s here, longer than b's DELETE takes). Before, a recorded the
    state first and b could answer the DELETE while the job still counted: the next
    submission met the cap (429)."""
    await forget("solo")
    leave = RedisQuota.leave
    slowed: list[str] = []

    async def slow_leave(self: RedisQuota, who: Any, job_id: str) -> None:
        if not slowed:  # the cancelled job's; the next job's leaves at once
            slowed.append(job_id)
            await asyncio.sleep(3.0)
        await leave(self, who, job_id)

    monkeypatch.setattr(RedisQuota, "leave", slow_leave)
    async with replicas(tmp_path, config_file, keys, secret, REDIS_URL) as (a, b):
        r = await a.submit({"host": "local", "command": "sleep 30"}, sub="solo", wait=0)
        running = r.json()["id"]
        await b.wait_state(running, ("running",), "solo")
        r = await b.client.delete(f"{b.url}/v1/jobs/{running}", headers=b.auth("solo"))
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "cancelled"
        r = await b.submit({"host": "local", "argv": ["true"]}, sub="solo")
        assert r.status_code == 201, r.text
    assert slowed == [running]


async def test_redis_down_falls_back_to_the_limits_of_each_replica(
    tuned_host: LocalHost, config_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """A Redis that does not answer costs no request: jobs run, and each replica still enforces
    the rate limit on its own."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    settings = make_settings(tmp_path, config_file, "sqlite", None)
    async with run_one(settings.model_copy(update={"redis_url": dead}), keys, secret) as api:
        for _ in range(2):
            r = await api.submit({"host": "local", "argv": ["true"]}, sub="slow")
            assert r.status_code == 201, r.text
        r = await api.submit({"host": "local", "argv": ["true"]}, sub="slow")
        assert r.status_code == 429
        assert r.json()["type"].endswith(":rate-limited")


async def test_redis_active_jobs_of_a_dead_replica_expire_at_their_deadline() -> None:
    """An active-job entry never released (its replica died) stops counting after its ttl."""
    who = (LOCAL_ISS, f"ghost-{uuid.uuid4().hex[:8]}")
    quota = RedisQuota(REDIS_URL)
    try:
        await quota.enter(who, "job-1", cap=1, ttl=0.3)
        with pytest.raises(Problem) as refused:
            await quota.enter(who, "job-2", cap=1, ttl=0.3)
        assert (refused.value.status, refused.value.kind) == (429, "too-many-jobs")
        await asyncio.sleep(0.4)
        await quota.enter(who, "job-2", cap=1, ttl=0.3)
    finally:
        await quota.leave(who, "job-2")
        await quota.close()


TICKS = "for i in $(seq 1 8); do echo tick$i; sleep 0.4; done"


async def read_events(
    api: Api, job_id: str, last_id: str | None = None, stop_after: int | None = None
) -> list[dict[str, Any]]:
    """The /events of a job through `api` (each with its arrival time), from `last_id`, until
    `end` or `stop_after` output events (then the connection is dropped)."""
    headers = api.auth() | ({"Last-Event-ID": last_id} if last_id else {})
    events: list[dict[str, Any]] = []
    url = f"{api.url}/v1/jobs/{job_id}/events"
    async with api.client.stream("GET", url, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for event in sse_events(r):
            events.append(event | {"at": time.monotonic()})
            outputs = sum(e["event"] == "output" for e in events)
            if event["event"] == "end" or (stop_after is not None and outputs >= stop_after):
                break
    return events


def stdout_of(events: list[dict[str, Any]]) -> tuple[str, list[int]]:
    outputs = [e["data"] for e in events if e["event"] == "output"]
    return "".join(o["text"] for o in outputs), [o["offset"] for o in outputs]


async def test_a_follower_on_another_replica_sees_output_live_and_resumes_by_event_id(
    tuned_host: LocalHost, config_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """With Redis, /events on replica b streams the output of a command running on a while it
    runs; a reconnect with Last-Event-ID continues with no byte lost or repeated."""
    async with replicas(tmp_path, config_file, keys, secret, REDIS_URL) as (a, b):
        r = await a.submit({"host": "local", "command": TICKS}, wait=0)
        job_id = r.json()["id"]
        first = await read_events(b, job_id, stop_after=2)
        assert (await a.job(job_id))["state"] == "running"  # the bytes came before the end
        rest = await read_events(b, job_id, last_id=first[-1]["id"])
        assert rest[-1]["event"] == "end" and rest[-1]["data"]["state"] == "succeeded"
        text, offsets = stdout_of(first + rest)
        assert text == "".join(f"tick{i}\n" for i in range(1, 9))
        assert offsets == sorted(set(offsets))  # no chunk twice
        assert rest[-1]["id"] == f"{len(text)}-0"


async def test_without_redis_a_follower_on_another_replica_gets_states_and_the_kept_output(
    tuned_host: LocalHost, config_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """Redis unreachable: a follower on b of a's command still gets the states and, once the
    job is final, all of its kept output (no live bytes, nothing lost)."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    async with replicas(tmp_path, config_file, keys, secret, dead) as (a, b):
        r = await a.submit({"host": "local", "command": TICKS}, wait=0)
        job_id = r.json()["id"]
        events = await read_events(b, job_id)
        final = (await a.job(job_id))["finished_at"]
        assert final is not None
        states = [e["data"]["state"] for e in events if e["event"] == "state"]
        assert states[-1] == "succeeded" and "running" in states
        assert stdout_of(events)[0] == "".join(f"tick{i}\n" for i in range(1, 9))
