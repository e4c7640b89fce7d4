"""Live followers of batch jobs under a hostile user (F6 of issue 33): a follower whose client
reads nothing stops the SSH reads of the job's output files, and a follower's reads take its
identity's read tokens (beyond its rate, a slower stream). Against the real Slurm host, with an
API of this test's own (in process), so that the SSH command count is only these jobs'."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from api_helpers import Api, Keys, make_settings, running_api, sse_events, write_batch_config

from sshpool.devhost import LocalHost

pytestmark = pytest.mark.timeout(120)

POLICY = """[[policy]]
issuer = "*"
subject = "fl-fast"
hosts = ["local"]
shell_hosts = ["local"]
rate = 1000
burst = 1000

[[policy]]
issuer = "*"
subject = "fl-slow"
hosts = ["local"]
shell_hosts = ["local"]
rate = 2
burst = 2

"""
MiB = 1 << 20


@pytest.fixture
async def api(
    slurm_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    path = write_batch_config(tmp_path / "sshapi.toml", slurm_host, secret_file, keys)
    path.write_text(path.read_text().replace("[[policy]]", POLICY + "[[policy]]", 1))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        yield api


async def finished_batch(api: Api, sub: str, workdir: str, script: str) -> str:
    body = {"host": "local", "batch": {"script": "#!/bin/sh\n" + script, "workdir": workdir}}
    r = await api.submit(body, sub=sub)
    assert r.status_code == 202, r.text
    job = await api.until_final(r.json()["id"], sub=sub, timeout=60)
    assert job["state"] == "succeeded", job
    return str(job["id"])


async def ssh_commands(api: Api) -> float:
    text = (await api.client.get(f"{api.url}/metrics")).text
    return sum(float(v) for v in re.findall(r"^sshpool_commands_total\{.*\} (\S+)$", text, re.M))


async def test_a_follower_that_reads_nothing_stops_the_reads_of_a_large_output(
    api: Api, workdir: str
) -> None:
    """A finished job with 1 GiB of (sparse) stdout, followed by a raw socket that reads the
    answer's header and then nothing: the reads stop once the connection's buffers are full
    (a few MiB), instead of going on through the whole GiB."""
    job_id = await finished_batch(api, "fl-fast", workdir, "truncate -s 1G /dev/stdout\n")
    host, port = api.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    token = api.auth("fl-fast")["Authorization"]
    before = await ssh_commands(api)
    sock.sendall(
        f"GET /v1/jobs/{job_id}/output?follow=true HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: {token}\r\n\r\n".encode()
    )
    try:
        head = await asyncio.to_thread(lambda: sock.recv(4096))
        assert head.startswith(b"HTTP/1.1 200"), head
        await asyncio.sleep(1.5)  # the buffers fill (at 1 MiB per read)
        settled = await ssh_commands(api)
        await asyncio.sleep(3.0)
        after = await ssh_commands(api)
    finally:
        sock.close()
    print(f"SSH commands: {settled - before:.0f} in the first 1.5 s, {after - settled:.0f} in 3 s")
    # The buffers of one loopback connection hold a few MiB: that many 1 MiB reads, then none.
    assert settled - before <= 24, settled - before
    assert after - settled <= 1, after - settled


async def test_a_follower_beyond_its_rate_gets_a_slower_stream(api: Api, workdir: str) -> None:
    """`fl-slow` may make 2 reads a second (burst 2): following 64 MiB of finished output as
    fast as it can, its follower makes no more SSH reads than its tokens allow, and its answer
    goes on (no error, no end) at about 1 MiB per token instead of ending at once."""
    job_id = await finished_batch(api, "fl-slow", workdir, "truncate -s 64M /dev/stdout\n")
    url = f"{api.url}/v1/jobs/{job_id}/output?follow=true"
    received = 0
    before = await ssh_commands(api)
    async with api.client.stream("GET", url, headers=api.auth("fl-slow")) as body:
        assert body.status_code == 200
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(4.0):
                async for chunk in body.aiter_bytes():
                    received += len(chunk)
        elapsed = time.monotonic() - start
    reads = await ssh_commands(api) - before
    print(f"fl-slow: {reads:.0f} SSH reads, {received / MiB:.1f} MiB in {elapsed:.1f} s")
    assert reads <= 2 + 2 * elapsed + 1, reads  # burst + rate x time, and one in flight
    assert 2 * MiB <= received <= reads * MiB  # it moves, at up to 1 MiB per read


async def test_followers_at_different_speeds_each_get_the_whole_output(
    api: Api, workdir: str
) -> None:
    """Two followers of a finished 6 MiB output: one reads at once, the other falls behind it
    (out of the feed's window, so it reads from the file itself); both get every byte."""
    job_id = await finished_batch(api, "fl-fast", workdir, "seq 1 800000\n")
    expected = "".join(f"{n}\n" for n in range(1, 800001)).encode()
    url = f"{api.url}/v1/jobs/{job_id}/output?follow=true"

    async def follower(pause: float) -> bytes:
        parts: list[bytes] = []
        async with api.client.stream("GET", url, headers=api.auth("fl-fast")) as body:
            assert body.status_code == 200
            async for chunk in body.aiter_bytes():
                parts.append(chunk)
                if pause and len(parts) == 1:
                    await asyncio.sleep(pause)
        return b"".join(parts)

    fast, slow = await asyncio.wait_for(asyncio.gather(follower(0), follower(1.5)), 60)
    assert len(expected) > 5 * MiB
    assert fast == expected
    assert slow == expected


async def events(api: Api, job_id: str, sub: str) -> list[dict[str, Any]]:
    """Every SSE event of following `job_id` to its end."""
    url = f"{api.url}/v1/jobs/{job_id}/events"
    async with api.client.stream("GET", url, headers=api.auth(sub)) as body:
        assert body.status_code == 200
        return [e async for e in sse_events(body)]


async def test_events_of_a_finished_batch_job_end_with_every_byte(api: Api, workdir: str) -> None:
    """/events of a finished job with 2 MiB on stdout and a line on stderr: output events carry
    both streams whole, then `end`."""
    job_id = await finished_batch(api, "fl-fast", workdir, "seq 1 300000; echo oops >&2\n")
    got = await asyncio.wait_for(events(api, job_id, "fl-fast"), 60)
    text: dict[str, str] = {"stdout": "", "stderr": ""}
    for e in got:
        if e.get("event") == "output":
            text[e["data"]["stream"]] += e["data"]["text"]
    assert text["stdout"] == "".join(f"{n}\n" for n in range(1, 300001))
    assert text["stderr"] == "oops\n"
    assert got[-1]["event"] == "end"


async def test_following_a_finished_command_ends_with_its_output(api: Api) -> None:
    """A command finished before its follower came: the follow gives its kept output and ends
    (each stream of such a feed is complete)."""
    r = await api.submit({"host": "local", "argv": ["echo", "hi"]}, sub="fl-fast")
    assert r.status_code == 201 and r.json()["state"] == "succeeded", r.text
    url = f"{api.url}/v1/jobs/{r.json()['id']}/output?follow=true"
    async with asyncio.timeout(10):
        r = await api.client.get(url, headers=api.auth("fl-fast"))
    assert (r.status_code, r.content) == (200, b"hi\n")
