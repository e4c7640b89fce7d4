"""Live output against the real API and local host: `output?follow=true` and `/events`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
from api_helpers import Api, sse_events

TICKS = "for i in 1 2 3 4 5; do echo tick$i; sleep 0.3; done"


async def start(api: Api, command: str, sub: str = "alice") -> str:
    r = await api.submit({"host": "local", "command": command}, sub=sub, wait=0)
    assert r.status_code == 202, r.text
    job_id: str = r.json()["id"]
    return job_id


async def test_follow_streams_bytes_before_the_job_ends(api: Api) -> None:
    """output?follow=true delivers the first line while the command still runs, then all of it."""
    job_id = await start(api, TICKS)
    got: list[tuple[bytes, float]] = []
    url = f"{api.url}/v1/jobs/{job_id}/output?follow=true"
    async with api.client.stream("GET", url, headers=api.auth()) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/octet-stream"
        async for chunk in r.aiter_bytes():
            got.append((chunk, time.monotonic()))
    ended = time.monotonic()
    assert b"".join(c for c, _ in got) == b"".join(f"tick{i}\n".encode() for i in range(1, 6))
    assert ended - got[0][1] > 0.8  # the first bytes came ~1.2 s before the end
    assert (await api.job(job_id))["state"] == "succeeded"


async def test_events_carry_states_and_output_and_end(api: Api) -> None:
    """/events sends state changes, output with byte offsets as ids, and `end` once final."""
    job_id = await start(api, TICKS + "; echo oops >&2; exit 3")
    events = []
    async with api.client.stream(
        "GET", f"{api.url}/v1/jobs/{job_id}/events", headers=api.auth()
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        async for event in sse_events(r):
            events.append(event)
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "end" and events[-1]["data"]["state"] == "failed"
    states = [e["data"]["state"] for e in events if e["event"] == "state"]
    assert states[-1] == "failed" and "running" in states
    final = next(e for e in events if e["event"] == "state" and e["data"]["state"] == "failed")
    assert final["data"]["exit_status"] == 3
    out = "".join(e["data"]["text"] for e in events if e["event"] == "output"
                  and e["data"]["stream"] == "stdout")  # fmt: skip
    assert out == "".join(f"tick{i}\n" for i in range(1, 6))
    assert events[-1]["id"] == f"{len(out)}-5"


async def test_last_event_id_resumes_without_loss_or_duplicates(api: Api) -> None:
    """Reconnecting with Last-Event-ID after a drop continues exactly where it stopped."""
    job_id = await start(api, TICKS)
    url = f"{api.url}/v1/jobs/{job_id}/events"
    first: list[dict[str, Any]] = []
    async with api.client.stream("GET", url, headers=api.auth()) as r:
        async for event in sse_events(r):
            first.append(event)
            if event["event"] == "output":
                break  # the client drops the connection after its first output
    last_id = first[-1]["id"]
    rest: list[dict[str, Any]] = []
    headers = {**api.auth(), "Last-Event-ID": last_id}
    async with api.client.stream("GET", url, headers=headers) as r:
        async for event in sse_events(r):
            rest.append(event)
    text = "".join(e["data"]["text"] for e in first + rest if e["event"] == "output")
    assert text == "".join(f"tick{i}\n" for i in range(1, 6))
    assert rest[0]["event"] == "state"


async def test_follower_disconnect_leaves_the_job_running(api: Api) -> None:
    """A follower that goes away mid-job does not cancel or slow it."""
    job_id = await start(api, TICKS)
    url = f"{api.url}/v1/jobs/{job_id}/output?follow=true"
    async with api.client.stream("GET", url, headers=api.auth()) as r:
        async for _ in r.aiter_bytes():
            break
    job = await api.until_final(job_id)
    assert (job["state"], job["stdout"]) == (
        "succeeded",
        "".join(f"tick{i}\n" for i in range(1, 6)),
    )


async def test_slow_follower_is_cut_off_and_never_slows_the_command(api: Api) -> None:
    """Two followers and one that never reads: the command runs as fast as alone, the fast ones
    get every byte, the stalled one gets a `cutoff` event when it finally reads."""
    # 16 MB at a few MB/s: a reading follower keeps up, a stalled one fills its socket buffers
    # and then falls out of the live window. The pause per 40 kB keeps the command slower than
    # a reading follower even on a loaded box (without it, a follower starved of CPU for a
    # moment fell out of the window in a full-suite run), while 16 MB still overflow the window.
    size = 400 * 40_000
    command = (
        "sleep 0.5; for i in $(seq 400); do head -c 40000 /dev/zero | tr '\\0' x; sleep 0.01; done"
    )
    alone = await api.submit({"host": "local", "command": command}, wait=30)
    alone_ms = alone.json()["timings"]["exec"]
    job_id = await start(api, command)
    url = f"{api.url}/v1/jobs/{job_id}/events"
    stalled_events: list[str] = []

    async def fast() -> int:
        n = 0
        follow = f"{api.url}/v1/jobs/{job_id}/output?follow=true"
        async with (
            httpx.AsyncClient(timeout=60) as c,
            c.stream("GET", follow, headers=api.auth()) as r,
        ):
            async for chunk in r.aiter_bytes():
                n += len(chunk)
        return n

    async def stalled() -> None:
        async with (
            httpx.AsyncClient(timeout=60) as c,
            c.stream("GET", url, headers=api.auth()) as r,
        ):
            await api.until_final(job_id, timeout=60)  # reads nothing while the job runs
            async for event in sse_events(r):
                stalled_events.append(event["event"])

    counts = await asyncio.gather(fast(), fast(), stalled())
    assert counts[:2] == [size, size]
    assert stalled_events[-1] == "cutoff"
    job = await api.job(job_id)
    assert job["stdout_bytes"] == size and job["stdout_truncated"]
    # Not a timing goal: a follower that blocked the drain would hold the job until it read.
    assert job["timings"]["exec"] < alone_ms + 5000


async def test_past_the_cap_followers_see_everything_and_the_job_counts_it(api: Api) -> None:
    """Output past max_output streams live in full; the job keeps the head and counts it all."""
    size = 200_000  # the test policy keeps 65536 bytes
    job_id = await start(api, f"sleep 0.3; head -c {size} /dev/zero | tr '\\0' y")
    url = f"{api.url}/v1/jobs/{job_id}/output?follow=true"
    async with api.client.stream("GET", url, headers=api.auth()) as r:
        body = b"".join([c async for c in r.aiter_bytes()])
    assert body == b"y" * size
    job = await api.job(job_id)
    assert (len(job["stdout"]), job["stdout_bytes"], job["stdout_truncated"]) == (
        65536,
        size,
        True,
    )


async def test_an_offset_that_was_not_kept_is_416_with_the_next_offset(api: Api) -> None:
    """Following a finished job from past its kept head names where output resumes."""
    r = await api.submit({"host": "local", "command": "head -c 100000 /dev/zero"}, wait=30)
    job_id = r.json()["id"]
    r = await api.client.get(
        f"{api.url}/v1/jobs/{job_id}/output?follow=true&offset=70000", headers=api.auth()
    )
    assert r.status_code == 416
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"].endswith("output-not-kept")


async def test_follower_cap_per_identity_is_429(api: Api) -> None:
    """Past max_followers live followers the next one is refused; others are unaffected."""
    job_id = await start(api, "sleep 5")
    url = f"{api.url}/v1/jobs/{job_id}/events"
    cap = api.config.api.max_followers
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(cap):
            r = await stack.enter_async_context(api.client.stream("GET", url, headers=api.auth()))
            assert r.status_code == 200
        r = await api.client.get(url, headers=api.auth())
        assert (r.status_code, r.json()["type"]) == (429, "urn:sshapi:problem:too-many-followers")
        assert "Retry-After" in r.headers
        other = await api.client.get(
            f"{api.url}/v1/jobs/{job_id}/output?follow=true", headers=api.auth("bob")
        )
        assert other.status_code == 404  # bob may not see alice's job: no follower slot used
    # Released on disconnect: a new follower is admitted again.
    r = await api.client.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth())
    async with api.client.stream("GET", url, headers=api.auth()) as r:
        assert r.status_code == 200


async def test_bad_last_event_id_is_422(api: Api) -> None:
    """A malformed Last-Event-ID is a 422 problem, not a silent restart."""
    job_id = await start(api, "true")
    r = await api.client.get(
        f"{api.url}/v1/jobs/{job_id}/events", headers={**api.auth(), "Last-Event-ID": "x-1"}
    )
    assert r.status_code == 422
