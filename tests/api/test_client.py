"""The researcher's client (`api.client`) and the `sshapi run|jobs` commands, against the real
API and local host. The sync Client runs in a thread: the server shares the test's event loop."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from api_helpers import SSHAPI, Api
from typer.testing import CliRunner

from api import schemas, states
from api.batchspec import BatchOptions
from api.cli import app
from api.client import (
    AsyncClient,
    Client,
    Forbidden,
    InsecureHTTPWarning,
    NotFound,
    RateLimited,
    SSEParser,
    SshapiError,
    TransportError,
    UnexpectedAnswer,
)
from api.client import models as client_models
from api.client import profile as client_profile
from loadtests.server import free_port
from sshpool.devhost.host import host_account

FILES = "jobs:read jobs:write files:read files:write"


def env_for(api: Api, sub: str = "alice") -> dict[str, str]:
    return {
        **os.environ,
        "SSHAPI_URL": api.url,
        "SSHAPI_TOKEN": api.token(sub, FILES),
        "SSHAPI_CLIENT_CONFIG": "/nonexistent/client.toml",
    }


async def sshapi(
    api: Api, *args: str, cwd: Path | None = None, stdin: bytes | None = None, **env: str
) -> tuple[int, bytes, bytes]:
    """`sshapi ARGS` as a user runs it; `stdin`: piped to it (else /dev/null); `env`: set."""
    proc = await asyncio.create_subprocess_exec(
        SSHAPI,
        *args,
        cwd=cwd,
        env={**env_for(api), **env},
        stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    assert proc.returncode is not None
    return proc.returncode, out, err


def test_the_clients_job_reads_what_the_servers_job_writes() -> None:
    """The client's own Job (it imports nothing of the server) has the server's fields in the
    server's order, and a job of each kind, every field set, reads back to the same JSON: what
    `--json` prints is what the server sent. The state vocabulary is the server's."""
    assert get_args(client_models.State) == get_args(states.State)
    assert client_models.FINAL == states.FINAL
    pairs = [
        (client_models.Job, schemas.Job),
        (client_models.BatchOptions, BatchOptions),
        (client_models.SchedulerInfo, schemas.SchedulerInfo),
    ]
    for mine, theirs in pairs:
        assert list(mine.model_fields) == list(theirs.model_fields), mine
    example = schemas.Job.model_config["json_schema_extra"]["examples"][0]  # type: ignore[index]
    command = schemas.Job.model_validate({**example, "exit_signal": "TERM", "error": "why",
                                          "stdout_truncated": True, "template": "t",
                                          "params": {"n": 1}, "command": "c"})  # fmt: skip
    batch = schemas.Job.model_validate(
        {
            **example,
            "kind": "batch",
            "batch": {"name": "n", "partition": "p", "time_limit": 60, "nodes": 1, "ntasks": 2,
                      "workdir": "/w", "env": {"A": "b"}},
            "scheduler": {"job_id": "42", "state": "PENDING", "reason": "Priority"},
            "timeout": None,
        }
    )  # fmt: skip
    for job in (command, batch):
        wire = job.model_dump_json()
        assert client_models.Job.model_validate_json(wire).model_dump_json() == wire


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


async def test_sshapi_run_sends_piped_stdin_to_the_command(api: Api) -> None:
    """`printf 'a\nb\nc\n' | sshapi run local -- wc -l` counts 3 lines, as over ssh (it
    printed 0: stdin was dropped); `-n` sends none. Past the server's cap (1024 bytes in the
    tests' configuration) it is one line saying so and nothing runs, never a cut stdin."""
    rc, out, err = await sshapi(api, "run", "local", "--", "wc", "-l", stdin=b"a\nb\nc\n")
    assert (rc, out.strip()) == (0, b"3"), err
    rc, out, err = await sshapi(api, "run", "-n", "local", "--", "wc", "-l", stdin=b"a\nb\n")
    assert (rc, out.strip()) == (0, b"0"), err
    word = f"stdin-{uuid.uuid4().hex[:8]}"
    rc, out, err = await sshapi(api, "run", "local", "--", "sh", "-c", f"cat # {word}",
                                stdin=b"x" * 2000)  # fmt: skip
    lines = err.decode().splitlines()
    assert rc == 255 and out == b"", err
    assert len(lines) == 1 and lines[0].startswith("sshapi: stdin: 2000 bytes, more than"), lines
    assert "at most 1024 bytes" in lines[0] and "nothing ran" in lines[0]
    r = await api.client.get(f"{api.url}/v1/jobs?limit=5", headers=api.auth())
    assert not [j for j in r.json()["items"] if word in " ".join(j["argv"] or [])]


async def test_sshapi_whoami_says_who_the_server_takes_you_for(api: Api, tmp_path: Path) -> None:
    """`sshapi whoami` prints the subject, issuer and scopes the server read from the token and
    where the token came from; with a login kept beside an exported SSHAPI_TOKEN, every command
    warns that SSHAPI_TOKEN wins (before: `sshapi login` said "signed in" and nothing told)."""
    rc, out, err = await sshapi(api, "whoami")
    lines = out.decode().splitlines()
    assert rc == 0, err
    assert "subject  alice" in lines and "token    from SSHAPI_TOKEN" in lines, lines
    assert "scopes   files:read files:write jobs:read jobs:write" in lines, lines
    assert any(line.startswith("host     local: as ") for line in lines), lines
    assert b"warning" not in err
    rc, out, _ = await sshapi(api, "whoami", "--json")
    me = json.loads(out)
    assert (me["subject"], me["admin"], me["account"]) == ("alice", False, None)
    assert "local" in [h["name"] for h in me["hosts"]]
    # The shared account is the operator's business, as in /v1/hosts: admins only.
    account = host_account().name  # sshapi-hpc, or a parallel worker's own (tests/conftest.py)
    for sub, scopes, shown in (("alice", FILES, None), ("boss", "admin", account)):
        auth = {"Authorization": f"Bearer {api.token(sub, scopes)}"}
        r = await api.client.get(f"{api.url}/v1/whoami", headers=auth)
        local = next(h for h in r.json()["hosts"] if h["name"] == "local")
        assert local["account"] == shown, r.text
        assert shown is not None or account not in r.text
    (tmp_path / "logins").mkdir()
    (tmp_path / "logins" / "default.json").write_text("{}")
    config = str(tmp_path / "client.toml")
    rc, out, err = await sshapi(api, "jobs", "list", SSHAPI_CLIENT_CONFIG=config)
    assert rc == 0, err
    assert err.decode().startswith(
        f"sshapi: warning: SSHAPI_TOKEN is set, so it is sent, not the login {tmp_path}/logins/"
    ), err


async def test_sshapi_run_prints_output_before_the_command_ends(api: Api) -> None:
    """The first line reaches the terminal while the remote command still runs."""
    proc = await asyncio.create_subprocess_exec(
        SSHAPI, "run", "local", "--", "sh", "-c", "echo first; sleep 2; echo last",
        env=env_for(api), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
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
        env=env_for(api), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
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


# What the `sshapi` commands a researcher runs most must not load: the server (a client-only
# install has none of it), what httpx and httpcore bring when installed but no such command
# uses, and asyncio (the commands use the sync client); each costs start-up (docs/benchmarks.md,
# CLI start-up).
SERVER_MODULES = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "asyncssh", "sshpool", "jwt",
                  "pydantic_settings", "api.settings", "api.config", "api.app")  # fmt: skip
UNUSED_MODULES = ("trio", "click", "pygments", "httpx._main", "rich", "asyncio")


async def test_the_researchers_commands_load_neither_the_server_nor_unused_packages(
    api: Api, tmp_path: Path
) -> None:
    """`sshapi --help` and `sshapi jobs list` against the real API, run as the installed console
    script (`runpy`, with an exit hook that writes the modules loaded): nothing of the server,
    nor trio, click, pygments, httpx's own CLI, rich or asyncio (this venv has them all, so the
    test fails when one comes back); `--help` not even httpx or pydantic."""
    await api.submit({"host": "local", "argv": ["true"]}, wait=30)
    report = tmp_path / "modules.json"
    probe = (
        "import atexit, json, runpy, sys\n"
        "def report():\n"
        "    loaded = [n for n, m in sys.modules.items() if m is not None]\n"
        f"    open({str(report)!r}, 'w').write(json.dumps(loaded))\n"
        "atexit.register(report)\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )

    async def loaded(*args: str) -> set[str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", probe, SSHAPI, *args, env=env_for(api),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err
        return set(json.loads(report.read_text()))

    def found(modules: set[str], names: tuple[str, ...]) -> list[str]:
        return sorted(m for m in modules for n in names if m == n or m.startswith(f"{n}."))

    listed = await loaded("jobs", "list")
    assert {"httpx", "api.client._sync", "api.client.models"} <= listed  # it did its work
    assert found(listed, SERVER_MODULES + UNUSED_MODULES) == []
    helped = await loaded("--help")
    assert found(helped, SERVER_MODULES + UNUSED_MODULES + ("httpx", "pydantic")) == []


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


async def test_sshapi_files_put_resumable_killed_goes_on_when_run_again(
    api: Api, tmp_path: Path
) -> None:
    """`sshapi files put --resumable` SIGKILLed once its upload's first 16 MiB chunk is on the
    host: the same command again finishes that upload (its temporary file, not a second one),
    the file is byte-exact, and the record on disk is gone."""
    data = os.urandom(64 << 20)
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    remote = f"sshapi-res-{uuid.uuid4().hex[:8]}/big.bin"
    home = Path(host_account().home)
    state = {"XDG_STATE_HOME": str(tmp_path / "state")}
    args = ("files", "put", "--resumable", "--parents", "local", str(source), remote)
    proc = await asyncio.create_subprocess_exec(
        SSHAPI, *args, env={**env_for(api), **state},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip

    def first_chunk_landed() -> bool:
        parts = list((home / remote).parent.glob(".big.bin.sshapi-*.part"))
        return bool(parts) and parts[0].stat().st_size >= 16 << 20

    try:
        async with asyncio.timeout(60):
            while not first_chunk_landed():
                assert proc.returncode is None, "the upload ended before it could be stopped"
                await asyncio.sleep(0.01)
    finally:
        proc.kill()
        await proc.wait()
    assert not (home / remote).exists()
    rc, out, err = await sshapi(api, *args, "--json", **state)
    assert rc == 0, err
    assert json.loads(out)["sha256"] == hashlib.sha256(data).hexdigest()
    assert (home / remote).read_bytes() == data
    assert list((home / remote).parent.glob("*.part")) == []  # the first upload's, finished
    assert list((tmp_path / "state" / "sshapi" / "uploads").iterdir()) == []
    rc, _, err = await sshapi(api, "files", "rm", "local", remote, remote.split("/")[0])
    assert rc == 0, err


async def test_sshapi_hosts_list_run_shell_jobs_wait_files_mv_and_checksum(
    api: Api, tmp_path: Path
) -> None:
    """The commands the API had and `sshapi` lacked: `hosts list`, `run --shell` (a pipe in
    one line), `jobs wait` (exits with the job's status, as `sshapi run`), `files mv`, and
    `files checksum` (as sha256sum prints it)."""
    rc, out, err = await sshapi(api, "hosts", "list")
    assert rc == 0, err
    assert any(line.split()[:1] == ["local"] for line in out.decode().splitlines()), out
    rc, out, err = await sshapi(api, "run", "local", "--shell", "printf 'a\\nb\\n' | wc -l")
    assert (rc, out.strip()) == (0, b"2"), err
    r = await api.submit({"host": "local", "argv": ["sh", "-c", "sleep 1; exit 3"]}, wait=0)
    rc, out, err = await sshapi(api, "jobs", "wait", r.json()["id"])
    assert rc == 3 and b"failed" in out, (out, err)
    data = os.urandom(5000)
    (tmp_path / "m.bin").write_bytes(data)
    remote = f"sshapi-mv-{uuid.uuid4().hex[:8]}"
    rc, _, err = await sshapi(api, "files", "put", "local", str(tmp_path / "m.bin"), remote)
    assert rc == 0, err
    rc, _, err = await sshapi(api, "files", "mv", "local", remote, f"{remote}.moved")
    assert rc == 0, err
    rc, out, err = await sshapi(api, "files", "checksum", "local", f"{remote}.moved", remote)
    digest = hashlib.sha256(data).hexdigest()
    assert rc == 1 and out.decode() == f"{digest}  {remote}.moved\n", (out, err)
    assert f"local:{remote} (remote): 404".encode() in err
    rc, _, err = await sshapi(api, "files", "rm", "local", f"{remote}.moved")
    assert rc == 0, err


async def test_sshapi_files_ls_shows_0_for_an_empty_file(api: Api) -> None:
    """`files ls` prints a 0-byte file's size as 0 (before: blank, as for a directory)."""
    name = f"sshapi-empty-{uuid.uuid4().hex[:8]}"
    r = await api.submit({"host": "local", "argv": ["touch", name]}, wait=30)
    assert r.json()["state"] == "succeeded", r.text
    rc, out, err = await sshapi(api, "files", "ls", "local", name)
    assert rc == 0, err
    assert out.decode().split()[:3][2] == "0", out
    rc, _, err = await sshapi(api, "files", "rm", "local", name)
    assert rc == 0, err


async def test_ctrl_c_during_files_get_says_how_to_resume(api: Api, tmp_path: Path) -> None:
    """Ctrl-C during `sshapi files get` says how many bytes the `.part` keeps and that the same
    command resumes (before: a bare traceback-free exit, nothing said), and it does."""
    size = 64 << 20
    name = f"sshapi-ctrlc-{uuid.uuid4().hex[:8]}.bin"
    make = f"head -c {size} /dev/zero > {name}"
    r = await api.submit({"host": "local", "argv": ["sh", "-c", make]}, wait=60)
    assert r.json()["state"] == "succeeded", r.text
    part = tmp_path / f"{name}.part"
    proc = await asyncio.create_subprocess_exec(
        SSHAPI, "files", "get", "local", name, cwd=tmp_path, env=env_for(api),
        stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (part.exists() and part.stat().st_size > 0):
            assert time.monotonic() < deadline and proc.returncode is None
            await asyncio.sleep(0.005)
        # Frozen while we look: the download is under way (far from its end) when SIGINT lands.
        proc.send_signal(signal.SIGSTOP)
        assert part.stat().st_size < size - (8 << 20) and not (tmp_path / name).exists()
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 130, err
    said = err.decode().strip().splitlines()[-1]
    assert said.startswith("sshapi: interrupted: ") and f"kept in {part.name};" in said, said
    assert "the same `sshapi files get` again resumes from there" in said
    rc, _, err = await sshapi(api, "files", "get", "local", name, cwd=tmp_path)
    assert rc == 0 and (tmp_path / name).stat().st_size == size, err
    rc, _, err = await sshapi(api, "files", "rm", "local", name)
    assert rc == 0, err


async def test_sshapi_files_name_the_side_make_directories_and_rm_goes_on(
    api: Api, tmp_path: Path
) -> None:
    """A put into a missing directory names the host and path and says `--parents`; with it,
    the directories appear; `mkdir -p` is idempotent; a missing local file and an unwritable
    local destination name the local path; `rm a missing b` deletes a and b, reports the
    missing one, exits 1."""
    top = f"sshapi-cli-{uuid.uuid4().hex[:8]}"
    source = tmp_path / "results.csv"
    source.write_text("a,b\n")
    rc, _, err = await sshapi(api, "files", "put", "local", str(source), f"{top}/runs/r.csv")
    assert rc == 255 and f"local:{top}/runs/r.csv (remote): 404".encode() in err, err
    assert b"--parents" in err
    rc, _, err = await sshapi(api, "files", "put", "local", f"{source}.missing", "r.csv")
    assert rc == 2 and f"'source': file '{source}.missing' does not exist".encode() in err, err
    rc, _, err = await sshapi(
        api, "files", "put", "--parents", "local", str(source), f"{top}/runs/r.csv"
    )
    assert rc == 0, err
    for _ in range(2):
        rc, _, err = await sshapi(api, "files", "mkdir", "-p", "local", f"{top}/x/y")
        assert rc == 0, err
    rc, _, err = await sshapi(api, "files", "mkdir", "local", f"{top}/x")
    assert rc == 1 and f"local:{top}/x (remote): 409".encode() in err, err
    rc, _, err = await sshapi(
        api, "files", "get", "local", f"{top}/runs/r.csv", str(tmp_path / "no" / "r.csv")
    )
    assert rc == 255 and f"{tmp_path}/no/r.csv (local): No such file".encode() in err, err
    paths = [f"{top}/runs/r.csv", f"{top}/missing", f"{top}/x/y", f"{top}/x", f"{top}/runs"]
    rc, _, err = await sshapi(api, "files", "rm", "local", *paths)
    assert rc == 1 and err.count(b"(remote)") == 1 and f"{top}/missing".encode() in err, err
    rc, _, err = await sshapi(api, "files", "rm", "local", top)
    assert rc == 0, err


class DropDownloadMidway(httpx.BaseTransport):
    """Passes every request on, but cuts the first file download after 1 MiB of its body, as
    a dropped connection would; records each download's Range header."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.ranges: list[str | None] = []
        self.if_ranges: list[str | None] = []
        self.etags: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.method != "GET" or not request.url.path.endswith("/files/content"):
            return response
        self.ranges.append(request.headers.get("range"))
        self.if_ranges.append(request.headers.get("if-range"))
        self.etags.append(response.headers.get("etag"))
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
    """A download cut after 1 MiB goes on with `Range: bytes=<received>-` and `If-Range: <the
    ETag of the bytes received>` and ends byte-exact (a file last written a minute ago: its
    ETag names one content)."""
    data = os.urandom(4 << 20)
    remote = f"sshapi-resume-{uuid.uuid4().hex[:8]}.bin"
    token = api.token("alice", FILES)
    transport = DropDownloadMidway()
    await put_file(api, tmp_path, remote, data, int(time.time()) - 60)

    def work() -> int:
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
    assert transport.if_ranges == [None, transport.etags[0]]


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


# ---- the token goes only where it was sent (F12)


class Listener:
    """A tiny HTTP server on a free loopback port that answers every request with `body` (an
    empty job list) and records the Authorization header of each request (None: none came)."""

    def __init__(self, port: int = 0, body: bytes = b'{"items": []}') -> None:
        seen: list[str | None] = []
        self.seen = seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append(self.headers.get("Authorization"))
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_PUT = do_DELETE = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Listener:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def client_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No URL, token, profile or opt-in from the environment; the configuration file to write
    (empty, mode 0600, which writing it keeps: a file holding a token must be private)."""
    for name in ("SSHAPI_URL", "SSHAPI_TOKEN", "SSHAPI_PROFILE", "SSHAPI_ALLOW_HTTP"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "client.toml"
    config.touch(mode=0o600)
    monkeypatch.setenv("SSHAPI_CLIENT_CONFIG", str(config))
    return config


def test_a_token_is_not_sent_to_a_default_nobody_chose(
    client_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With only SSHAPI_TOKEN set, `sshapi jobs list` sends nothing to the default URL (here a
    listener on a free port: on a shared login node, whoever got the port first) and says which
    URL it did not use and how to name one; named with SSHAPI_URL or a profile, it is sent."""
    with Listener() as listener:
        monkeypatch.setattr(client_profile, "DEFAULT_URL", listener.url)
        monkeypatch.setenv("SSHAPI_TOKEN", "secret-token")
        result = CliRunner().invoke(app, ["jobs", "list"])
        assert listener.seen == []
        assert result.exit_code == 255, result.output
        assert listener.url in result.stderr and "SSHAPI_URL" in result.stderr, result.stderr
        with pytest.raises(SshapiError, match="SSHAPI_URL"):
            Client(token="secret-token")
        assert listener.seen == []

        monkeypatch.setenv("SSHAPI_URL", listener.url)  # named: this machine's loopback
        result = CliRunner().invoke(app, ["jobs", "list"])
        assert result.exit_code == 0, result.output
        monkeypatch.delenv("SSHAPI_URL")
        monkeypatch.delenv("SSHAPI_TOKEN")
        client_env.write_text(f'default = "dev"\n[profiles.dev]\nurl = "{listener.url}"\n'
                              'token = "profile-token"\n')  # fmt: skip
        result = CliRunner().invoke(app, ["jobs", "list"])
        assert result.exit_code == 0, result.output
    assert listener.seen == ["Bearer secret-token", "Bearer profile-token"]


def test_a_token_goes_over_plain_http_only_to_loopback_unless_opted_in(
    client_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain http to another machine is refused when there is a token to send (nothing is
    sent: the client is not even made); https is fine; the opt-in (argument, SSHAPI_ALLOW_HTTP,
    a profile's allow_http) lets it through with a warning."""
    remote = "http://192.0.2.10:8000"  # TEST-NET-1: nothing is sent there
    with pytest.raises(SshapiError, match="plain HTTP") as refused:
        Client(remote, "secret-token")
    assert "https://" in str(refused.value) and "SSHAPI_ALLOW_HTTP" in str(refused.value)
    Client(remote).close()  # no token: nothing to leak
    Client("https://192.0.2.10", "secret-token").close()
    Client("http://[::1]:8000", "secret-token").close()
    with pytest.warns(InsecureHTTPWarning, match="plain HTTP"):
        Client(remote, "secret-token", allow_http=True).close()
    monkeypatch.setenv("SSHAPI_ALLOW_HTTP", "1")
    with pytest.warns(InsecureHTTPWarning):
        Client(remote, "secret-token").close()
    monkeypatch.delenv("SSHAPI_ALLOW_HTTP")
    client_env.write_text(
        f'[profiles.lab]\nurl = "{remote}"\ntoken = "t"\nallow_http = true\n'
        '[profiles.bad]\nurl = "ftp://example.org"\ntoken = "t"\n'
    )
    with pytest.warns(InsecureHTTPWarning):
        Client(profile="lab").close()
    with pytest.raises(SshapiError, match="not an http"):
        Client(profile="bad")
    result = CliRunner().invoke(app, ["jobs", "list", "--profile", "bad"])
    assert result.exit_code == 255 and "ftp://example.org" in result.stderr


def test_a_configured_token_goes_only_to_the_server_it_was_configured_for(
    client_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile's token is not sent to SSHAPI_URL when that points elsewhere (a dev session's
    export left in the shell, then `--profile cluster`), nor SSHAPI_TOKEN to another URL given
    to Client(): each refused before anything is sent; a token set without a server goes to the
    one named (before: the listener got both tokens)."""
    client_env.write_text('[profiles.cluster]\nurl = "https://hpc-api.example.org"\n'
                          'token = "cluster-token"\n')  # fmt: skip
    with Listener() as listener:
        monkeypatch.setenv("SSHAPI_URL", listener.url)
        result = CliRunner().invoke(app, ["jobs", "list", "--profile", "cluster"])
        assert result.exit_code == 255, result.output
        assert "profile 'cluster'" in result.stderr and listener.url in result.stderr
        monkeypatch.setenv("SSHAPI_URL", "https://hpc-api.example.org")
        monkeypatch.setenv("SSHAPI_TOKEN", "home-token")
        with pytest.raises(SshapiError, match="SSHAPI_TOKEN is for https://hpc-api"):
            Client(listener.url).list()
        assert listener.seen == []
        monkeypatch.delenv("SSHAPI_URL")
        with Client(listener.url) as c:  # SSHAPI_TOKEN alone: for the server named
            c.list()
    assert listener.seen == ["Bearer home-token"]


def test_a_loopback_server_is_reached_without_the_environment_s_proxy(
    client_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With HTTP_PROXY set (as on many login nodes) a request for this machine's loopback goes
    straight there, not through the proxy with the token in clear (here the proxy is a second
    listener; before: it got `Bearer secret-token`)."""
    with Listener() as proxy, Listener() as server:
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, proxy.url)
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        with Client(server.url, "secret-token") as c:
            c.list()
    assert (proxy.seen, server.seen) == ([], ["Bearer secret-token"])


def test_a_profile_s_static_token_file_keeps_working_beside_logins(
    client_env: Path, tmp_path: Path
) -> None:
    """A profile's `token_file` (a static token, as before `sshapi login`) is sent, read afresh
    by each client, and wins over a login file kept for the same profile."""
    token_file = tmp_path / "dev.token"
    token_file.write_text("static-token\n")
    logins = client_env.parent / "logins"
    logins.mkdir(mode=0o700)
    (logins / "dev.json").write_text('{"access_token": "login-token"}')
    (logins / "dev.json").chmod(0o600)
    with Listener() as listener:
        client_env.write_text(f'default = "dev"\n[profiles.dev]\nurl = "{listener.url}"\n'
                              f'token_file = "{token_file}"\n')  # fmt: skip
        result = CliRunner().invoke(app, ["jobs", "list"])
        assert result.exit_code == 0, result.output
        token_file.write_text("rotated-token\n")
        with Client() as c:
            c.list()
    assert listener.seen == ["Bearer static-token", "Bearer rotated-token"]


def test_a_login_is_made_and_used_only_for_a_named_server(
    client_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sshapi login` with no server named stops before asking any provider (before: it signed
    in and kept `"url": null`); a login kept with no server (as it did) sends its token to no
    URL named later, from the commands or Client() (before: to any)."""
    with Listener() as provider, Listener() as elsewhere:
        result = CliRunner().invoke(app, ["login", "--issuer", provider.url])
        assert result.exit_code == 255, result.output
        assert "no server URL" in result.stderr and "SSHAPI_URL" in result.stderr
        logins = client_env.parent / "logins"
        assert provider.seen == [] and not logins.exists()
        logins.mkdir(mode=0o700)
        kept = logins / "default.json"
        login = {"access_token": "login-token", "url": None, "expires_at": time.time() + 3600}
        kept.write_text(json.dumps(login))
        kept.chmod(0o600)
        monkeypatch.setenv("SSHAPI_URL", elsewhere.url)
        result = CliRunner().invoke(app, ["jobs", "list"])
        assert result.exit_code == 255, result.output
        assert f"the login {kept} names no server" in result.stderr, result.stderr
        with pytest.raises(SshapiError, match="names no server"):
            Client(elsewhere.url)
    assert elsewhere.seen == []


def test_a_client_configuration_holding_a_token_others_may_read_is_refused(
    client_env: Path, tmp_path: Path
) -> None:
    """A client.toml with a token in it, readable by others (mode 644): refused, as an exposed
    login file is, with nothing sent (before: used without a word); once 600 it is used. One
    without a token (its token in a token_file) may stay 644."""
    with Listener() as listener:
        client_env.write_text(f'default = "dev"\n[profiles.dev]\nurl = "{listener.url}"\n'
                              'token = "profile-token"\n')  # fmt: skip
        client_env.chmod(0o644)
        result = CliRunner().invoke(app, ["jobs", "list"])
        assert result.exit_code == 255, result.output
        assert f"{client_env} is readable by others (mode 644)" in result.stderr
        assert f"chmod 600 {client_env}" in result.stderr
        with pytest.raises(SshapiError, match="readable by others"):
            Client()
        assert listener.seen == []
        client_env.chmod(0o600)
        assert CliRunner().invoke(app, ["jobs", "list"]).exit_code == 0
        token_file = tmp_path / "dev.token"
        token_file.write_text("file-token\n")
        client_env.write_text(f'default = "dev"\n[profiles.dev]\nurl = "{listener.url}"\n'
                              f'token_file = "{token_file}"\n')  # fmt: skip
        client_env.chmod(0o644)
        assert CliRunner().invoke(app, ["jobs", "list"]).exit_code == 0
    assert listener.seen == ["Bearer profile-token", "Bearer file-token"]


# Answers of another shape than the client reads, each to the commands that read it.
JOB_ID = "01933c4e-8a5b-7c1e-9f00-2b6d5e1a7c3d"
ODD_ANSWERS: list[tuple[bytes, list[str]]] = [
    (b'{"items": "x"}', ["jobs", "list"]),
    (b'{"items": [{"id": 1}]}', ["jobs", "list"]),
    (b"[]", ["jobs", "list"]),
    (b"<html>a proxy's page</html>", ["jobs", "list"]),
    (b"{}", ["jobs", "list"]),
    (b'{"id": "x"}', ["jobs", "show", JOB_ID]),
    (b"null", ["jobs", "cancel", JOB_ID]),
    (b'{"items": [1]}', ["files", "ls", "local"]),
    (b'{"items": {"a": 1}}', ["files", "ls", "--json", "local"]),
    (b'{"path": "x"}', ["files", "put", "local", "SOURCE", "x"]),
    (b'{"items": []}', ["run", "local", "--", "true"]),
]


@pytest.mark.parametrize(("body", "args"), ODD_ANSWERS, ids=lambda v: repr(v)[:40])
def test_an_answer_of_another_shape_is_one_line_and_exit_255(
    client_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, body: bytes, args: list[str]
) -> None:
    """A server (a proxy's page, another version) answering JSON of another shape, or no JSON:
    each command says so in one line naming the call and exits 255 (before: a traceback)."""
    source = tmp_path / "source.txt"
    source.write_text("data")
    args = [str(source) if a == "SOURCE" else a for a in args]
    with Listener(body=body) as server:
        monkeypatch.setenv("SSHAPI_URL", server.url)
        monkeypatch.setenv("SSHAPI_TOKEN", "secret-token")
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 255, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sshapi: "), lines
    assert "client does not read" in lines[0] and server.url in lines[0], lines


def test_an_event_of_another_shape_is_an_unexpected_answer() -> None:
    """The events a command reads (`output`, `gap`) are checked as they come: not JSON, not an
    object, a field missing or of another type is UnexpectedAnswer; others pass."""
    for kind, data in (
        ("output", "not json"),
        ("output", "[]"),
        ("output", '{"stream": "stdout"}'),
        ("gap", '{"stream": "stdout", "offset": "0", "next_offset": 5}'),
    ):
        parser = SSEParser()
        parser.feed(f"event: {kind}")
        parser.feed(f"data: {data}")
        with pytest.raises(UnexpectedAnswer, match=f"a '{kind}' event"):
            parser.feed("")
    parser = SSEParser()
    for line in ("event: state", 'data: {"state": "running", "extra": [1]}', ""):
        event = parser.feed(line)
    assert event is not None and event.data["extra"] == [1]


def test_a_wrong_url_is_said_at_once_naming_it_and_where_it_came_from(
    client_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port nobody listens on (a wrong SSHAPI_URL, a server not started): `sshapi jobs list`
    exits 255 at once, naming the URL tried, where it came from and how to set it; the clients
    and a follow of events give up at once too (before: 5 retries, 9 s, and `events` retried
    for ever). Nothing was ever sent, so no retry could help."""
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("SSHAPI_URL", url)
    monkeypatch.setenv("SSHAPI_TOKEN", "secret-token")
    started = time.monotonic()
    result = CliRunner().invoke(app, ["jobs", "list"])
    took = time.monotonic() - started
    assert result.exit_code == 255, result.output
    assert f"GET {url}/v1/jobs" in result.stderr and "Connection refused" in result.stderr
    assert f"{url} came from SSHAPI_URL" in result.stderr, result.stderr
    assert "profile" in result.stderr, result.stderr
    # No retries: their schedule takes 9 s; a refused connect takes milliseconds, the rest of
    # the bound is the loaded box's (it was 1.0 s, which load alone broke).
    assert took < 5, took
    monkeypatch.delenv("SSHAPI_URL")
    monkeypatch.delenv("SSHAPI_TOKEN")
    client_env.write_text(f'default = "dev"\n[profiles.dev]\nurl = "{url}"\ntoken = "t"\n')
    result = CliRunner().invoke(app, ["jobs", "list"])
    assert f"{url} came from the url of profile 'dev' in {client_env}" in result.stderr

    async def follow() -> None:
        async with AsyncClient(url, "secret-token") as c:
            async for _ in c.events("some-job"):
                pass

    started = time.monotonic()
    with Client(url, "secret-token") as c, pytest.raises(TransportError, match=url):
        c.list()
    with pytest.raises(TransportError, match=url):
        asyncio.run(asyncio.wait_for(follow(), 5))
    assert time.monotonic() - started < 5 + 4  # the follow's own bound, and no 9 s of retries


def test_events_of_a_server_gone_for_good_end_once_the_retries_are_spent(
    client_env: Path,
) -> None:
    """After the server answered, `events` reconnects through the retries but not for ever: a
    server gone for good ends it with TransportError (before: it reconnected every 0.2 s for
    ever, and `sshapi run`, which follows events, hung)."""
    port = free_port()

    async def follow() -> None:
        async with AsyncClient(f"http://127.0.0.1:{port}", "secret-token", retries=2) as c:
            with Listener(port):
                await c.list()
            async for _ in c.events("some-job"):
                pass

    started = time.monotonic()
    with pytest.raises(TransportError, match="/events"):
        asyncio.run(asyncio.wait_for(follow(), 20))
    assert time.monotonic() - started < 5


def test_events_from_a_server_that_ends_every_stream_empty_give_up_paced(
    client_env: Path,
) -> None:
    """A server that answers /events with no event at all (a proxy's empty 200, a server closing
    at once) is retried at the client's pace and then given up with TransportError (before:
    `events` reconnected at once, in a tight loop, for ever)."""
    with Listener() as server:

        async def follow() -> None:
            async with AsyncClient(server.url, "secret-token", retries=2) as c:
                async for _ in c.events("some-job"):
                    pass

        started = time.monotonic()
        with pytest.raises(TransportError, match="3 times with no event"):
            asyncio.run(asyncio.wait_for(follow(), 10))
        took = time.monotonic() - started
    assert len(server.seen) == 3, server.seen  # the first try and two retries
    assert 0.2 + 0.4 <= took < 5, took  # the retries' back-off, not a tight loop


def test_a_server_that_answered_once_is_waited_for_through_a_restart(
    client_env: Path,
) -> None:
    """Once the server has answered, a refused connection is a restart: the client retries
    (its back-off) and the call goes through when the server is back, 0.5 s later."""
    port = free_port()
    with Client(f"http://127.0.0.1:{port}", "secret-token") as c:
        with Listener(port) as first:
            c.list()
        back: list[Listener] = []
        timer = threading.Timer(0.5, lambda: back.append(Listener(port).__enter__()))
        timer.start()
        try:
            assert c.list() == []
        finally:
            timer.join()
            for listener in back:
                listener.__exit__()
    assert first.seen == ["Bearer secret-token"] and back[0].seen == ["Bearer secret-token"]


# ---- a resumed download continues the same file, or starts again (F13)


class Stop(Exception):
    """Stands for Ctrl-C in the middle of a download."""


def download_cut(url: str, token: str, remote: str, dest: Path) -> None:
    """Download `remote` to `dest` and stop after 1 MiB of it, leaving `dest.part` behind."""

    def progress(done: int, total: int) -> None:
        if done >= 1 << 20:
            raise Stop

    with Client(url, token) as c, pytest.raises(Stop):
        c.download("local", remote, dest, progress=progress)
    assert 1 << 20 <= (dest.parent / f"{dest.name}.part").stat().st_size < 4 << 20


async def put_file(api: Api, tmp_path: Path, remote: str, data: bytes, mtime: int | None) -> None:
    """Upload `data` as `remote` and, given `mtime`, set its modification time to it."""
    local = tmp_path / f"up-{uuid.uuid4().hex[:8]}"
    local.write_bytes(data)
    token = api.token("alice", FILES)

    def work() -> None:
        with Client(api.url, token) as c:
            c.upload("local", local, remote)

    await asyncio.to_thread(work)
    if mtime is not None:
        touch = ["touch", "-d", f"@{mtime}", remote]
        r = await api.submit({"host": "local", "argv": touch}, wait=30)
        assert r.json()["state"] == "succeeded", r.text


async def test_a_file_rewritten_in_the_second_it_was_written_is_not_spliced(
    api: Api, tmp_path: Path
) -> None:
    """A file rewritten at the same size within the second of its last write keeps its ETag
    (size, modification second). A `get` cut while it was that fresh leaves a part that the next
    `get` does not resume: it fetches the new content whole (before: the old head and the new
    tail, exit 0). The modification time one second ahead stands for "this second" however
    slow this machine is."""
    remote = f"sshapi-fresh-{uuid.uuid4().hex[:8]}.bin"
    old, new = os.urandom(4 << 20), os.urandom(4 << 20)
    second = int(time.time()) + 1
    await put_file(api, tmp_path, remote, old, second)
    dest = tmp_path / "fresh.bin"
    await asyncio.to_thread(download_cut, api.url, api.token("alice", FILES), remote, dest)
    await put_file(api, tmp_path, remote, new, second)  # same size, same second: same ETag
    rc, _, err = await sshapi(api, "files", "get", "local", remote, str(dest))
    assert rc == 0, err
    assert dest.read_bytes() == new
    assert not (tmp_path / "fresh.bin.part").exists()
    await sshapi(api, "files", "rm", "local", remote)


async def test_a_part_of_another_file_is_not_resumed(api: Api, tmp_path: Path) -> None:
    """Two files of the same size and modification time have the same ETag: a part of one left
    at a destination is not continued with the other's bytes (before: spliced, exit 0)."""
    first, second = (f"sshapi-twin-{uuid.uuid4().hex[:8]}.bin" for _ in range(2))
    a, b = os.urandom(4 << 20), os.urandom(4 << 20)
    an_hour_ago = int(time.time()) - 3600
    await put_file(api, tmp_path, first, a, an_hour_ago)
    await put_file(api, tmp_path, second, b, an_hour_ago)
    dest = tmp_path / "twin.bin"
    await asyncio.to_thread(download_cut, api.url, api.token("alice", FILES), first, dest)
    rc, _, err = await sshapi(api, "files", "get", "local", second, str(dest))
    assert rc == 0, err
    assert dest.read_bytes() == b
    await sshapi(api, "files", "rm", "local", first, second)


async def test_two_downloads_resuming_one_part_never_leave_a_corrupt_file(
    api: Api, tmp_path: Path
) -> None:
    """Two `get`s run at once into the same place both append to its part: the finished part
    must have the file's size, else the download ends in an error and removes it; no file with
    other bytes than the remote one is left (before: the first to finish renamed a part with
    the rest twice into place, no error)."""
    remote = f"sshapi-twice-{uuid.uuid4().hex[:8]}.bin"
    data = os.urandom(4 << 20)
    await put_file(api, tmp_path, remote, data, int(time.time()) - 60)
    dest = tmp_path / "twice.bin"
    token = api.token("alice", FILES)
    await asyncio.to_thread(download_cut, api.url, token, remote, dest)
    both_writing = threading.Barrier(2, timeout=30)

    def work() -> int | SshapiError:
        first = True

        def progress(done: int, total: int) -> None:
            nonlocal first
            if first:
                first = False
                both_writing.wait()

        with Client(api.url, token) as c:
            try:
                return c.download("local", remote, dest, progress=progress)
            except SshapiError as exc:
                return exc

    results = await asyncio.gather(asyncio.to_thread(work), asyncio.to_thread(work))
    failed = [r for r in results if isinstance(r, SshapiError)]
    assert failed and all("bytes where the file has" in str(r) for r in failed), results
    assert not dest.exists() or dest.read_bytes() == data
    assert not (tmp_path / "twice.bin.part").exists()
    await sshapi(api, "files", "rm", "local", remote)


# ---- what the server sends is printed escaped (F14)


def read_all(fd: int) -> bytes:
    """Everything written to a pty's other end until it closes."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:  # EIO: the other end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


async def test_sshapi_files_ls_escapes_control_characters_in_names(api: Api) -> None:
    """A name or a symlink target with terminal escapes (a title-setting OSC, clear screen,
    a carriage return, C1 CSI, DEL, a right-to-left override) reaches the terminal escaped,
    every byte visible; `--json` gives them exact."""
    tag = uuid.uuid4().hex[:8]
    name = f"evil-{tag}-\x1b]0;owned\x07-\x1b[2J-\r-\x9b31m-\x7f-\u202etxt.sh"
    link, target = f"link-{tag}", f"/tmp/\x1b[31mred-{tag}"
    script = 'touch -- "$1" && ln -s -- "$2" "$3"'
    r = await api.submit({"host": "local", "argv": ["sh", "-c", script, "sh", name, target, link]},
                         wait=30)  # fmt: skip
    assert r.json()["state"] == "succeeded", r.text
    controller, terminal = os.openpty()
    try:
        proc = await asyncio.create_subprocess_exec(
            SSHAPI, "files", "ls", "local", env=env_for(api), stdout=terminal,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        os.close(terminal)
        out = await asyncio.to_thread(read_all, controller)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        os.close(controller)
    lines = [line.rstrip(b"\r") for line in out.split(b"\n") if tag.encode() in line]
    assert len(lines) == 2, out
    for line in lines:
        for raw in (b"\x1b", b"\x07", b"\r", b"\xc2\x9b", b"\x7f", "\u202e".encode()):
            assert raw not in line, line
    shown = b"\n".join(lines)
    escaped = rb"-\x1b]0;owned\x07-\x1b[2J-\x0d-\x9b31m-\x7f-\u202etxt.sh"
    assert b"evil-" + tag.encode() + escaped in shown
    assert f"{link} -> /tmp/\\x1b[31mred-{tag}".encode() in shown
    rc, out, _ = await sshapi(api, "files", "ls", "local", "--json")
    items = {e["name"]: e for e in json.loads(out)["items"]}
    assert name in items and items[link]["target"] == target
    rc, _, err = await sshapi(api, "files", "rm", "local", name, link)
    assert rc == 0, err
