"""Listings and checksums under a hostile user (issue 33, F2/F3/F17): listings stop reading at
the cap and page from one read under a per-identity cap; checksums count as jobs, end at their
own timeout or when the client leaves (the remote process with them), and hash what they
checked. The API runs in this process, so a wrapper around the real asyncssh SFTP session
counts what the host was asked for."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import subprocess
import threading
import time
import uuid
from asyncio.subprocess import PIPE
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_helpers import SSHAPI, Api, Keys, config_toml, eventually, make_settings, running_api

from api.files import SNAPSHOTS_PER_IDENTITY, FileService, Listings, Snapshot
from sshpool.backends.asyncssh import AsyncsshSFTP
from sshpool.backends.base import DirEntry, FileAttrs
from sshpool.devhost import LocalHost

CAP = 1000
API = f"""max_list_entries = {CAP}
list_timeout = 2
checksum_timeout = 1
checksum_max_timeout = 30
"""
POLICY = """
[[policy]]
subject = "lim-short-*"
issuer = "*"
hosts = ["local"]
shell_hosts = ["local"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }
max_concurrent = 2
max_timeout = 3
rate = 1000
burst = 1000

[[policy]]
subject = "lim-*"
issuer = "*"
hosts = ["local"]
shell_hosts = ["local"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }
max_listings = 1
rate = 1000
burst = 1000

"""
RW = "files:read files:write"
SPARSE = 20 << 30  # read as zeros at page-cache speed: sha256sum needs seconds for it


@pytest.fixture
async def api(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    text = config_toml(tuned_host, secret_file, keys).replace(
        "[[policy]]", POLICY + "[[policy]]", 1
    )
    text = text.replace("max_stdin_bytes = 1024\n", "max_stdin_bytes = 1024\n" + API, 1)
    path = tmp_path / "sshapi.toml"
    path.write_text(text)
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as running:
        yield running


class User:
    def __init__(self, api: Api, host: LocalHost, sub: str) -> None:
        self.api = api
        self.sub = sub
        self.root = Path(host.account.home) / "sshapi-files" / sub
        self.headers = api.auth(sub, RW)
        self.base = f"{api.url}/v1/hosts/local/files"

    async def ls(self, path: str | Path, **params: object) -> httpx.Response:
        return await self.api.client.get(
            self.base, params={"path": str(path), **params}, headers=self.headers
        )

    async def checksum(self, path: str | Path, timeout: float = 30) -> httpx.Response:
        return await self.api.client.get(
            f"{self.base}/checksum",
            params={"path": str(path)},
            headers=self.headers,
            timeout=timeout,
        )


@contextlib.contextmanager
def make_user(api: Api, host: LocalHost, prefix: str = "lim") -> Iterator[User]:
    user = User(api, host, f"{prefix}-{uuid.uuid4().hex[:10]}")
    host.run_local(["mkdir", "-p", str(user.root)])
    try:
        yield user
    finally:
        subprocess.run(["rm", "-rf", str(user.root)], check=False)


@pytest.fixture
def user(api: Api, tuned_host: LocalHost) -> Iterator[User]:
    with make_user(api, tuned_host) as u:
        yield u


def fill(folder: Path, n: int) -> None:
    folder.mkdir()
    for i in range(n):
        os.close(os.open(folder / f"e{i:06d}", os.O_CREAT | os.O_WRONLY, 0o644))


class Reads:
    """What listings asked of the host: directory reads started and entries handed over."""

    def __init__(self) -> None:
        self.reads = 0
        self.entries = 0
        self.delay = 0.0


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    seen = Reads()
    listdir, scandir = AsyncsshSFTP.listdir, AsyncsshSFTP.scandir

    async def counted_listdir(self: AsyncsshSFTP, path: str) -> list[DirEntry]:
        seen.reads += 1
        await asyncio.sleep(seen.delay)
        entries = await listdir(self, path)
        seen.entries += len(entries)
        return entries

    async def counted_scandir(self: AsyncsshSFTP, path: str) -> AsyncGenerator[DirEntry, None]:
        seen.reads += 1
        await asyncio.sleep(seen.delay)  # a slow directory (NFS, a busy metadata server)
        async with contextlib.aclosing(scandir(self, path)) as entries:
            async for e in entries:
                seen.entries += 1
                yield e

    monkeypatch.setattr(AsyncsshSFTP, "listdir", counted_listdir)
    monkeypatch.setattr(AsyncsshSFTP, "scandir", counted_scandir)
    return seen


# ---- listings


async def test_a_listing_over_the_cap_stops_reading_at_one_more_entry(
    user: User, reads: Reads
) -> None:
    """A directory of 5x the cap answers 413 after the host handed over at most cap + 1
    entries: the rest is never read."""
    fill(user.root / "big", 5 * CAP)
    r = await user.ls(user.root / "big")
    assert r.status_code == 413, r.text
    assert r.json()["type"].endswith(":too-large")
    assert reads.reads == 1
    assert reads.entries <= CAP + 1


async def test_pages_come_from_one_read_of_the_directory(user: User, reads: Reads) -> None:
    """Paging through a directory reads it once: every page after the first comes from its
    snapshot, in name order, without gaps or repeats."""
    fill(user.root / "d", 900)
    names: list[str] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, object] = {"limit": 200}
        if cursor is not None:
            params["cursor"] = cursor
        r = await user.ls(user.root / "d", **params)
        assert r.status_code == 200, r.text
        names += [e["name"] for e in r.json()["items"]]
        pages += 1
        cursor = r.json()["next_cursor"]
        if cursor is None:
            break
    assert pages == 5
    assert names == sorted(os.listdir(user.root / "d"))
    assert reads.reads == 1
    assert reads.entries == 900


async def test_a_cursor_whose_snapshot_is_gone_reads_again_and_goes_on_after_it(
    user: User, reads: Reads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cursor another replica made (or whose snapshot expired) reads the directory again and
    goes on after its name: the pages still cover every entry once, in order."""
    fill(user.root / "d", 450)
    monkeypatch.setattr(Listings, "get", lambda *args: None)
    names: list[str] = []
    params: dict[str, object] = {"limit": 200}
    while True:
        body = (await user.ls(user.root / "d", **params)).json()
        names += [e["name"] for e in body["items"]]
        if body["next_cursor"] is None:
            break
        params["cursor"] = body["next_cursor"]
    assert names == sorted(os.listdir(user.root / "d"))
    assert reads.reads == 3


async def test_a_cursor_answers_only_its_owner_and_must_be_one(
    api: Api, tuned_host: LocalHost, user: User
) -> None:
    """Another identity's use of a cursor reads nothing of the owner's (its own roots apply);
    a cursor that is not one the API gave is 422, not a name to start after."""
    fill(user.root / "d", 300)
    first = (await user.ls(user.root / "d", limit=100)).json()
    assert first["next_cursor"] is not None
    with make_user(api, tuned_host) as other:
        r = await other.ls(user.root / "d", cursor=first["next_cursor"])
        assert r.status_code == 403, r.text
        assert r.json()["type"].endswith(":outside-roots")
    for junk in ("e000150", "bm90IGEgY3Vyc29y", "W10", "%%%"):
        r = await user.ls(user.root / "d", cursor=junk)
        assert r.status_code == 422, (junk, r.text)
        assert r.json()["type"].endswith(":invalid-cursor")
    r = await user.ls(user.root / "d", limit=100, cursor=first["next_cursor"])
    assert [e["name"] for e in r.json()["items"]][:1] == ["e000100"]


async def test_concurrent_listings_beyond_max_listings_get_429_and_others_go_on(
    api: Api, tuned_host: LocalHost, user: User, reads: Reads
) -> None:
    """With max_listings = 1, a second listing while a slow one reads gets 429
    too-many-listings with Retry-After; another identity lists meanwhile; once the first is
    done the next one is admitted."""
    fill(user.root / "d", 10)
    reads.delay = 0.5
    slow = asyncio.create_task(user.ls(user.root / "d"))
    await eventually(lambda: reads.reads == 1)
    r = await user.ls(user.root / "d")
    assert r.status_code == 429, r.text
    assert r.json()["type"].endswith(":too-many-listings")
    assert int(r.headers["Retry-After"]) >= 1
    with make_user(api, tuned_host) as other:
        fill(other.root / "d", 3)
        assert (await other.ls(other.root / "d")).status_code == 200
    assert (await slow).status_code == 200
    reads.delay = 0.0
    assert (await user.ls(user.root / "d")).status_code == 200


async def test_a_listing_that_reads_too_long_ends_with_504(user: User, reads: Reads) -> None:
    """A directory the host lists slower than list_timeout answers 504 listing-timeout, and
    its place under max_listings is given back."""
    fill(user.root / "d", 10)
    reads.delay = 5.0
    started = time.monotonic()
    r = await user.ls(user.root / "d")
    assert r.status_code == 504, r.text
    assert r.json()["type"].endswith(":listing-timeout")
    assert time.monotonic() - started < 4
    reads.delay = 0.0
    assert (await user.ls(user.root / "d")).status_code == 200


async def test_sshapi_files_ls_prints_each_page_as_it_comes(
    api: Api, user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sshapi files ls` prints a big directory's first page while the next ones are still
    being fetched (each page after the first held back 0.4 s here), and every entry once."""
    fill(user.root / "d", 1000)
    page = FileService._page

    async def slow_page(self: FileService, *args: Any) -> dict[str, object]:
        if args[3] is not None:  # a page from a snapshot: after the first
            await asyncio.sleep(0.4)
        return await page(self, *args)

    monkeypatch.setattr(FileService, "_page", slow_page)
    env = {
        **os.environ,
        "SSHAPI_URL": api.url,
        "SSHAPI_TOKEN": api.token(user.sub, RW),
        "SSHAPI_CLIENT_CONFIG": "/nonexistent/client.toml",
    }
    proc = await asyncio.create_subprocess_exec(
        SSHAPI, "files", "ls", "local", str(user.root / "d"), env=env, stdout=PIPE
    )
    assert proc.stdout is not None
    seen: list[float] = []
    async with asyncio.timeout(60):
        while line := await proc.stdout.readline():
            assert line.rstrip().endswith(f"e{len(seen):06d}".encode()), line
            seen.append(time.monotonic())
        assert await proc.wait() == 0
    assert len(seen) == 1000
    # Five pages of 200: the first printed at least three slow pages before the last.
    assert seen[-1] - seen[0] > 1.2


# ---- checksums


def holders(host: LocalHost, marker: str) -> list[int]:
    """The host account's processes about a path (its unique directory name in their argv)
    or with a file open in it."""
    found = set(host.processes(marker))
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if marker in os.readlink(f"/proc/{pid}/fd/{fd}"):
                        found.add(int(pid))
    return sorted(found)


def sparse(path: Path, size: int = SPARSE) -> None:
    with path.open("wb") as f:
        f.truncate(size)


async def test_checksums_count_as_jobs_and_end_at_their_own_timeout(
    api: Api, tuned_host: LocalHost
) -> None:
    """With max_concurrent = 2 and a 3 s max_timeout: two long checksums run, a third one
    and a job get 429 too-many-jobs; both end with 504 checksum-timeout within the limit,
    their remote processes gone, and the caller's places are given back."""
    with make_user(api, tuned_host, "lim-short") as user:
        sparse(user.root / "big")
        started = time.monotonic()
        running = [asyncio.create_task(user.checksum(user.root / "big")) for _ in range(2)]
        await eventually(lambda: len(holders(tuned_host, user.sub)) >= 2)
        r = await user.checksum(user.root / "big")
        assert r.status_code == 429, r.text
        assert r.json()["type"].endswith(":too-many-jobs")
        job = await api.client.post(
            f"{api.url}/v1/jobs",
            json={"host": "local", "argv": ["true"]},
            headers=api.auth(user.sub, "jobs:write"),
        )
        assert job.status_code == 429, job.text
        for done in await asyncio.gather(*running):
            assert done.status_code == 504, done.text
            assert done.json()["type"].endswith(":checksum-timeout")
        assert time.monotonic() - started < 3 + 4
        await eventually(lambda: not holders(tuned_host, user.sub), timeout=5)
        (user.root / "small").write_bytes(b"abc")
        r = await user.checksum(user.root / "small")
        assert r.status_code == 200, r.text
        assert r.json()["checksum"] == hashlib.sha256(b"abc").hexdigest()


async def test_a_checksum_stops_when_its_client_leaves(
    api: Api, tuned_host: LocalHost, user: User
) -> None:
    """A client that gives up on a long checksum takes its remote process with it: no
    sha256sum goes on reading after the disconnect."""
    sparse(user.root / "big")
    with pytest.raises(httpx.ReadTimeout):
        async with httpx.AsyncClient(timeout=1.0) as client:
            await client.get(
                f"{user.base}/checksum",
                params={"path": str(user.root / "big")},
                headers=user.headers,
            )
    left = time.monotonic()
    await eventually(lambda: not holders(tuned_host, user.sub), timeout=10)
    assert time.monotonic() - left < 3


async def test_checksum_of_names_with_a_newline_or_a_backslash(user: User) -> None:
    """Names sha256sum would escape in its output are hashed like any other (was 502)."""
    for name in ("new\nline", "back\\slash", "both\\n\n", "-dash"):
        data = name.encode() * 3
        (user.root / name).write_bytes(data)
        r = await user.checksum(user.root / name)
        assert r.status_code == 200, (name, r.text)
        assert r.json()["checksum"] == hashlib.sha256(data).hexdigest()


async def test_a_file_swapped_for_a_fifo_never_holds_a_checksum(
    api: Api, tuned_host: LocalHost, user: User
) -> None:
    """While the caller's own process swaps a file and a FIFO under one name, every checksum
    ends within its short timeout: the right digest of the file, 409 not-a-file, or 504; none
    is left on the host, and another identity's job runs meanwhile."""
    data = b"the file, not the fifo\n"
    name = user.root / "swapped"
    stop = threading.Event()

    def swap() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            temp = user.root / f".t{n}"
            if n % 2:
                os.mkfifo(temp)
            else:
                temp.write_bytes(data)
            os.rename(temp, name)
            time.sleep(0.003)

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    try:
        started = time.monotonic()
        answers: list[httpx.Response] = []
        for _ in range(4):
            answers += await asyncio.gather(*(user.checksum(name, timeout=10) for _ in range(6)))
        other = await api.client.post(
            f"{api.url}/v1/jobs",
            json={"host": "local", "argv": ["echo", "bystander"]},
            headers=api.auth(f"by-{uuid.uuid4().hex[:8]}", "jobs:write"),
        )
    finally:
        stop.set()
        swapper.join()
    assert other.status_code == 201, other.text
    assert other.json()["stdout"] == "bystander\n"
    kinds: dict[Any, int] = {}
    for r in answers:
        key = (r.status_code, r.json().get("detail", "")[-16:])
        kinds[key] = kinds.get(key, 0) + 1
        assert r.status_code in (200, 409, 504), r.text
        if r.status_code == 200:
            assert r.json()["checksum"] == hashlib.sha256(data).hexdigest()
    print("fifo swap answers by status:", kinds)
    assert time.monotonic() - started < 4 * (1 + 3)
    await eventually(lambda: not holders(tuned_host, user.sub), timeout=5)


def snapshot(owner: str, n: int = 100) -> Snapshot:
    snap = Snapshot((owner, owner), "local", "d", "/d")
    for i in range(n):
        snap.add(f"name-{i:05d}", FileAttrs("file", i, 0o644, 0))
    snap.sort()
    return snap


def test_snapshots_expire_after_their_ttl_and_keep_to_their_budget() -> None:
    """Snapshots go after `ttl` seconds unused, the least recently used first beyond the byte
    budget, and an identity keeps at most SNAPSHOTS_PER_IDENTITY; each answers its owner only."""
    one = snapshot("alice")
    listings = Listings(ttl=0.3, budget=3 * one.nbytes + 1)
    sids = [listings.put(snapshot(f"u{i}")) for i in range(3)]
    assert listings.get(sids[0], ("u0", "u0"), "local", "d") is not None  # now the most recent
    assert listings.get(sids[0], ("u1", "u1"), "local", "d") is None  # not its owner
    assert listings.get(sids[0], ("u0", "u0"), "local", "other") is None  # not its path
    listings.put(snapshot("u3"))  # over the budget: u1's, the least recently used, goes
    assert listings.get(sids[1], ("u1", "u1"), "local", "d") is None
    assert listings.get(sids[0], ("u0", "u0"), "local", "d") is not None
    assert listings.nbytes <= listings.budget
    time.sleep(0.4)
    assert listings.get(sids[0], ("u0", "u0"), "local", "d") is None
    assert listings.nbytes == 0
    roomy = Listings(ttl=60, budget=1 << 30)
    mine = [roomy.put(snapshot("bob")) for _ in range(SNAPSHOTS_PER_IDENTITY + 2)]
    kept = [roomy.get(s, ("bob", "bob"), "local", "d") is not None for s in mine]
    assert kept == [False, False] + [True] * SNAPSHOTS_PER_IDENTITY
