"""The researcher's client (api/client.py) and the `sshapi run|jobs` commands, against the real
API and local host. The sync Client runs in a thread: the server shares the test's event loop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_helpers import SSHAPI, Api

from api.client import AsyncClient, Client, Forbidden, NotFound, RateLimited

FILES = "jobs:read jobs:write files:read files:write"


def env_for(api: Api, sub: str = "alice") -> dict[str, str]:
    return {
        **os.environ,
        "SSHAPI_URL": api.url,
        "SSHAPI_TOKEN": api.token(sub, FILES),
        "SSHAPI_CLIENT_CONFIG": "/nonexistent/client.toml",
    }


async def sshapi(api: Api, *args: str, cwd: Path | None = None) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        SSHAPI,
        *args,
        cwd=cwd,
        env=env_for(api),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out, err


@pytest.mark.parametrize(
    ("command", "code"),
    [("echo hi", 0), ("echo oops >&2; exit 3", 3), ("kill -TERM $$", 128 + signal.SIGTERM)],
)
async def test_sshapi_run_exits_with_the_remote_status(api: Api, command: str, code: int) -> None:
    """`sshapi run` exits 0, the command's status, or 128+n for a signal, and prints the output."""
    rc, out, err = await sshapi(api, "run", "local", "--", "sh", "-c", command)
    assert rc == code, err
    if code == 0:
        assert out == b"hi\n"
    if code == 3:
        assert err.startswith(b"oops\n")


async def test_sshapi_run_prints_output_before_the_command_ends(api: Api) -> None:
    """The first line reaches the terminal while the remote command still runs."""
    proc = await asyncio.create_subprocess_exec(
        SSHAPI, "run", "local", "--", "sh", "-c", "echo first; sleep 2; echo last",
        env=env_for(api), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    first = await asyncio.wait_for(proc.stdout.readline(), 30)
    at_first = time.monotonic()
    rest = await proc.stdout.read()
    assert (first, rest) == (b"first\n", b"last\n")
    assert time.monotonic() - at_first > 1.0
    assert await proc.wait() == 0


async def test_ctrl_c_on_sshapi_run_cancels_the_remote_job(api: Api) -> None:
    """SIGINT to `sshapi run` cancels the job on the server and exits 130."""
    word = f"ctrlc-{uuid.uuid4().hex[:8]}"
    proc = await asyncio.create_subprocess_exec(
        SSHAPI, "run", "local", "--", "sh", "-c", f"echo started; sleep 30 # {word}",
        env=env_for(api), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"started\n"
    proc.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(proc.wait(), 30) == 130
    r = await api.client.get(f"{api.url}/v1/jobs?limit=5", headers=api.auth())
    job = next(j for j in r.json()["items"] if word in j["argv"][-1])
    assert job["state"] == "cancelled"


async def test_jobs_commands_list_show_and_logs(api: Api) -> None:
    """`sshapi jobs list/show/logs` print what the API has, `--json` the API's JSON."""
    r = await api.submit({"host": "local", "argv": ["echo", "logged"]}, wait=30)
    job_id = r.json()["id"]
    rc, out, _ = await sshapi(api, "jobs", "list", "--limit", "3")
    assert rc == 0 and job_id.encode() in out
    rc, out, _ = await sshapi(api, "jobs", "show", job_id, "--json")
    assert rc == 0 and b'"state": "succeeded"' in out
    rc, out, _ = await sshapi(api, "jobs", "logs", job_id, "-f")
    assert (rc, out) == (0, b"logged\n")
    rc, _, err = await sshapi(api, "jobs", "show", str(uuid.uuid4()))
    assert rc == 255 and b"job-not-found" in err


async def test_client_run_returns_the_finished_job_and_raises_typed_errors(api: Api) -> None:
    """Client.run waits past the server's wait; problems are raised as their class."""

    def work() -> tuple[Any, ...]:
        with Client(api.url, api.token()) as c:
            job = c.run("local", ["sh", "-c", "sleep 1; echo done; exit 4"], timeout=30)
            with pytest.raises(NotFound) as missing:
                c.get(str(uuid.uuid4()))
            with pytest.raises(Forbidden) as forbidden:
                c.run("secret", ["true"])
            return job, missing.value, forbidden.value

    job, missing, forbidden = await asyncio.to_thread(work)
    assert (job.state, job.exit_status, job.stdout) == ("failed", 4, "done\n")
    assert (missing.status, missing.kind) == (404, "job-not-found")
    assert forbidden.status == 403


class DropFirstResponse(httpx.AsyncBaseTransport):
    """Sends every request to the server, but loses the answer of the first POST, as a
    connection dropped after the request went out would."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.posts: list[str | None] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.method == "POST":
            self.posts.append(request.headers.get("Idempotency-Key"))
            if len(self.posts) == 1:
                await response.aclose()
                raise httpx.RemoteProtocolError("connection dropped", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_retry_after_a_dropped_connection_replays_instead_of_rerunning(
    api: Api, tmp_path: Any
) -> None:
    """The retry carries the same Idempotency-Key: the command ran once, the job is replayed."""
    marker = f"/tmp/sshapi-client-{uuid.uuid4().hex}"
    transport = DropFirstResponse()
    async with AsyncClient(api.url, api.token(), transport=transport) as c:
        job = await c.run("local", ["sh", "-c", f"echo ran >> {marker}; cat {marker}"])
    assert len(transport.posts) == 2 and transport.posts[0] == transport.posts[1] is not None
    assert (job.state, job.stdout) == ("succeeded", "ran\n")
    check = await api.submit({"host": "local", "argv": ["cat", marker]}, wait=30)
    assert check.json()["stdout"] == "ran\n"  # one line: it ran once
    await api.submit({"host": "local", "argv": ["rm", "-f", marker]}, wait=30)


async def test_client_retries_429_after_retry_after(api: Api) -> None:
    """Past the rate limit the client waits Retry-After (with jitter) and gets through; with no
    retries left it raises RateLimited."""
    async with AsyncClient(api.url, api.token("slow"), retries=0) as c:
        for _ in range(2):  # the burst
            await c.submit("local", ["true"])
        with pytest.raises(RateLimited) as info:
            await c.submit("local", ["true"])
        assert info.value.retry_after is not None
    async with AsyncClient(api.url, api.token("slow"), max_retry_wait=10) as c:
        started = time.monotonic()
        job = await c.run("local", ["echo", "through"])
    assert job.stdout == "through\n"
    assert time.monotonic() - started >= 1.0


async def test_async_events_follow_a_job_to_its_end(api: Api) -> None:
    """AsyncClient.events yields state and output events live and stops at `end`."""
    async with AsyncClient(api.url, api.token()) as c:
        job = await c.submit("local", ["sh", "-c", "echo a; sleep 0.5; echo b >&2"])
        events = [e async for e in c.events(job.id)]
    kinds = [e.event for e in events]
    assert kinds[0] == "state" and kinds[-1] == "end"
    text = {s: "".join(e.data["text"] for e in events if e.event == "output"
                       and e.data["stream"] == s) for s in ("stdout", "stderr")}  # fmt: skip
    assert text == {"stdout": "a\n", "stderr": "b\n"}


async def test_sshapi_files_put_ls_get_rm_round_trip_byte_exact(api: Api, tmp_path: Path) -> None:
    """`sshapi files put` uploads, `ls --json` lists it with its size, `get` writes the same
    bytes back, `rm` deletes it."""
    data = os.urandom(3 << 20)
    source = tmp_path / "input.bin"
    source.write_bytes(data)
    remote = f"sshapi-cli-{uuid.uuid4().hex[:8]}.bin"
    rc, out, err = await sshapi(api, "files", "put", "local", str(source), remote, "--json")
    assert rc == 0, err
    assert json.loads(out)["size"] == len(data)
    rc, out, _ = await sshapi(api, "files", "ls", "local", "--json")
    entry = next(e for e in json.loads(out)["items"] if e["name"] == remote)
    assert (entry["type"], entry["size"]) == ("file", len(data))
    rc, out, err = await sshapi(api, "files", "ls", "local")
    assert rc == 0 and remote.encode() in out, err
    rc, _, err = await sshapi(api, "files", "get", "local", remote, cwd=tmp_path)
    assert rc == 0, err
    assert (tmp_path / remote).read_bytes() == data
    assert not (tmp_path / f"{remote}.part").exists()
    rc, _, err = await sshapi(api, "files", "rm", "local", remote)
    assert rc == 0, err
    rc, _, err = await sshapi(api, "files", "ls", "local", remote)
    assert rc == 255 and b"file-not-found" in err


class DropDownloadMidway(httpx.BaseTransport):
    """Passes every request on, but cuts the first file download after 1 MiB of its body, as
    a dropped connection would; records each download's Range header."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.ranges: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.method != "GET" or not request.url.path.endswith("/files/content"):
            return response
        self.ranges.append(request.headers.get("range"))
        if len(self.ranges) > 1:
            return response
        inner = response.stream
        assert isinstance(inner, httpx.SyncByteStream)

        class Cut(httpx.SyncByteStream):
            def __iter__(self) -> Iterator[bytes]:
                sent = 0
                for chunk in inner:
                    yield chunk
                    sent += len(chunk)
                    if sent >= 1 << 20:
                        raise httpx.ReadError("connection dropped", request=request)

            def close(self) -> None:
                inner.close()

        return httpx.Response(response.status_code, headers=response.headers, stream=Cut())

    def close(self) -> None:
        self.inner.close()


async def test_an_interrupted_download_resumes_by_range_without_fetching_again(
    api: Api, tmp_path: Path
) -> None:
    """A download cut after 1 MiB goes on with `Range: bytes=<received>-` and ends byte-exact."""
    data = os.urandom(4 << 20)
    remote = f"sshapi-resume-{uuid.uuid4().hex[:8]}.bin"
    token = api.token("alice", FILES)
    transport = DropDownloadMidway()

    def work() -> int:
        with Client(api.url, token) as c:
            (tmp_path / "up.bin").write_bytes(data)
            c.upload("local", tmp_path / "up.bin", remote)
        with Client(api.url, token, transport=transport) as c:
            size = c.download("local", remote, tmp_path / "down.bin")
            c.delete_file("local", remote)
            return size

    assert await asyncio.to_thread(work) == len(data)
    assert (tmp_path / "down.bin").read_bytes() == data
    assert transport.ranges[0] is None
    assert len(transport.ranges) == 2
    resumed_at = int(str(transport.ranges[1]).removeprefix("bytes=").removesuffix("-"))
    assert 1 << 20 <= resumed_at < len(data)


async def test_async_client_lists_reads_output_follows_and_moves_files(
    api: Api, tmp_path: Path
) -> None:
    """AsyncClient has the sync client's list, output, follow and files methods."""
    data = os.urandom(1 << 20)
    (tmp_path / "up.bin").write_bytes(data)
    remote = f"sshapi-async-{uuid.uuid4().hex[:8]}.bin"
    async with AsyncClient(api.url, api.token("alice", FILES)) as c:
        job = await c.submit("local", ["sh", "-c", "echo one; sleep 0.5; echo two"])
        chunks = [chunk async for chunk in c.follow(job.id)]
        assert b"".join(chunks) == b"one\ntwo\n"
        assert await c.output(job.id) == b"one\ntwo\n"
        assert job.id in [j.id for j in await c.list(limit=5)]
        answer = await c.upload("local", tmp_path / "up.bin", remote)
        assert answer["size"] == len(data)
        assert (await c.stat("local", remote))["size"] == len(data)
        listed = await c.list_files("local")
        assert remote in [e["name"] for e in listed["items"]]
        assert await c.download("local", remote, tmp_path / "down.bin") == len(data)
        await c.delete_file("local", remote)
        with pytest.raises(NotFound):
            await c.stat("local", remote)
    assert (tmp_path / "down.bin").read_bytes() == data
