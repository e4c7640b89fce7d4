"""Load shedding and SSH failures: 429, 503, 502 with Retry-After and a job that says why."""

from __future__ import annotations

import asyncio

from api_helpers import Api, OwnHostApi


async def test_rate_limit_is_429_with_retry_after(api: Api) -> None:
    """A subject past its token bucket (burst 2, 0.2/s) gets 429 and Retry-After; others don't."""
    codes = [(await api.submit({"host": "local", "argv": ["true"]}, sub="slow")) for _ in range(3)]
    assert [r.status_code for r in codes] == [201, 201, 429]
    assert int(codes[2].headers["Retry-After"]) >= 1
    assert codes[2].json()["type"].endswith("rate-limited")
    assert (await api.submit({"host": "local", "argv": ["true"]})).status_code == 201


async def test_concurrent_job_cap_is_429(api: Api) -> None:
    """With max_concurrent = 1, a second job while the first runs is 429; after it, fine."""
    first = await api.submit({"host": "local", "command": "sleep 30"}, sub="solo", wait=0)
    assert first.status_code == 202
    second = await api.submit({"host": "local", "argv": ["true"]}, sub="solo")
    assert second.status_code == 429
    assert second.json()["type"].endswith("too-many-jobs")
    url = f"{api.url}/v1/jobs/{first.json()['id']}"
    assert (await api.client.delete(url, headers=api.auth("solo"))).status_code == 200
    assert (await api.submit({"host": "local", "argv": ["true"]}, sub="solo")).status_code == 201


async def waiters(api: Api, host: str) -> int:
    r = await api.client.get(f"{api.url}/v1/hosts/{host}", headers=api.auth("ops", "admin"))
    return sum(p["waiters"] for p in r.json()["pool"])


async def test_saturated_host_is_503_with_retry_after_naming_the_job(api: Api) -> None:
    """`tiny` has one channel and one waiter slot: with both taken, the next job is 503 +
    Retry-After, the problem names the job, and the job reads back as `error`."""
    running = await api.submit({"host": "tiny", "command": "sleep 30"}, wait=0)
    await api.wait_state(running.json()["id"], ("running",))
    queued = await api.submit({"host": "tiny", "command": "sleep 30"}, wait=0)
    async with asyncio.timeout(10):
        while await waiters(api, "tiny") < 1:  # noqa: ASYNC110 (polling the API)
            await asyncio.sleep(0.05)
    r = await api.submit({"host": "tiny", "argv": ["true"]})
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) >= 1
    problem = r.json()
    assert problem["type"].endswith("pool-full")
    assert r.headers["Location"] == f"/v1/jobs/{problem['job_id']}"
    job = await api.until_final(problem["job_id"])
    assert job["state"] == "error"
    for job_id in (running.json()["id"], queued.json()["id"]):
        await api.client.delete(f"{api.url}/v1/jobs/{job_id}", headers=api.auth())


async def test_unreachable_host_is_502_then_503_once_the_breaker_opens(api: Api) -> None:
    """A refused connection is 502 naming the job (state `error`, nothing ran); the breaker
    (threshold 1) then answers 503 + Retry-After at once."""
    r = await api.submit({"host": "down", "argv": ["true"]}, key="retry-me")
    assert r.status_code == 502, r.text
    first_id = r.json()["job_id"]
    assert (await api.until_final(first_id))["state"] == "error"
    r = await api.submit({"host": "down", "argv": ["true"]}, key="retry-me")
    # Nothing ran, so the key was released: the retry is a new job, not a replay of the error.
    assert r.status_code == 503, r.text
    assert r.json()["job_id"] != first_id
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["type"].endswith("host-unavailable")
    hosts = await api.client.get(f"{api.url}/v1/hosts/down", headers=api.auth())
    assert hosts.json()["health"] == "down"


async def test_connection_dropped_after_start_is_lost(api_with_own_host: OwnHostApi) -> None:
    """The host dies (sshd and its sessions killed) while a command runs: the job ends `lost`
    (answered as a job, 201), because it may have had effects; it is never re-run."""
    async with api_with_own_host("fragile") as (api, fragile):
        r = await api.submit({"host": "fragile", "command": "sleep 30"}, sub="anyhost", wait=0)
        job_id = r.json()["id"]
        await api.wait_state(job_id, ("running",), sub="anyhost")
        fragile.stop(kill_sessions=True)
        job = await api.until_final(job_id, sub="anyhost")
        assert job["state"] == "lost"
        assert "after the command started" in job["error"]
