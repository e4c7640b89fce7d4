"""Resumable uploads (POST .../files/uploads, then PATCH chunks) against the real sshd: chunks
with digests, resuming after a cut, offsets, owners, caps, preconditions at the commit, expiry,
a second API process sharing the store. Each test has its own subject `up-<id>`, whose root is
~/sshapi-files/up-<id> (the host is this machine: the tests look at its files directly)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from api_helpers import (
    Api,
    Keys,
    OwnHostApi,
    config_toml,
    eventually,
    make_settings,
    replicas,
    running_api,
)

from api.client import AsyncClient
from api.client.files import UploadRecord
from api.client.localfile import SyncFile
from sshpool.devhost import LocalHost

POLICY = """
[[policy]]
subject = "up-small-*"
issuer = "*"
hosts = ["local"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }
max_file_size = 100000
max_transfer_bytes = 40000
rate = 1000
burst = 1000

[[policy]]
subject = "up-*"
issuer = "*"
hosts = ["local"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }
rate = 1000
burst = 1000

"""
RW = "files:read files:write"
MIB = 1 << 20


def config_text(host: LocalHost, secret_file: Path, keys: Keys, api_extra: str = "") -> str:
    text = config_toml(host, secret_file, keys).replace("[[policy]]", POLICY + "[[policy]]", 1)
    return text.replace(
        "[api]\n", f"[api]\nmax_open_uploads = 3\nmax_upload_chunk = {8 * MIB}\n{api_extra}", 1
    )


@pytest.fixture
async def api(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    path = tmp_path / "sshapi.toml"
    path.write_text(config_text(tuned_host, secret_file, keys))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as running:
        yield running


def _temp_of(host: LocalHost, name: str) -> Path:
    """The temporary file of the upload of `name` in the account's home."""
    return next(Path(host.account.home).glob(f".{name}.sshapi-*.part"))


def digest(data: bytes) -> str:
    return "sha-256=:" + base64.b64encode(hashlib.sha256(data).digest()).decode() + ":"


class User:
    def __init__(self, api: Api, root: Path, sub: str) -> None:
        self.api = api
        self.sub = sub
        self.root = root
        self.headers = api.auth(sub, RW)
        self.base = f"{api.url}/v1/hosts/local/files"

    def on(self, api: Api) -> User:
        """The same identity through another API process."""
        return User(api, self.root, self.sub)

    async def create(self, path: str, length: int, **headers: str) -> httpx.Response:
        return await self.api.client.post(
            f"{self.base}/uploads",
            params={"path": path},
            headers={**self.headers, "Upload-Length": str(length), **headers},
        )

    async def start(self, name: str, length: int, **headers: str) -> str:
        r = await self.create(f"{self.root}/{name}", length, **headers)
        assert r.status_code == 201, r.text
        assert r.headers["upload-offset"] == "0"
        return f"{self.api.url}{r.headers['location']}"

    async def patch(
        self, url: str, offset: int, data: bytes, *, last: bool = False, sign: bool = True
    ) -> httpx.Response:
        headers = {
            **self.headers,
            "Upload-Offset": str(offset),
            "Upload-Complete": "?1" if last else "?0",
            "Content-Type": "application/partial-upload",
        }
        if sign:
            headers["Content-Digest"] = digest(data)
        return await self.api.client.patch(url, content=data, headers=headers)

    async def patch_when_free(
        self, url: str, offset: int, data: bytes, *, last: bool = False
    ) -> httpx.Response:
        """`patch`, again while 503 `upload-busy`: a chunk cut off holds the upload's lease
        until the API has dealt with the cut (a barrier, not a timing)."""
        async with asyncio.timeout(60):
            while (r := await self.patch(url, offset, data, last=last)).status_code == 503:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        return r

    async def offset(self, url: str) -> int:
        r = await self.api.client.head(url, headers=self.headers)
        assert r.status_code == 204, r.status_code
        return int(r.headers["upload-offset"])

    def temps(self) -> list[str]:
        return [n for n in os.listdir(self.root) if n.endswith(".part")]


@contextlib.contextmanager
def user_of(api: Api, host: LocalHost, prefix: str = "up") -> Iterator[User]:
    sub = f"{prefix}-{uuid.uuid4().hex[:10]}"
    user = User(api, Path(host.account.home) / "sshapi-files" / sub, sub)
    host.run_local(["mkdir", "-p", str(user.root)])
    try:
        yield user
    finally:
        subprocess.run(["rm", "-rf", str(user.root)], check=False)


@pytest.fixture
def user(api: Api, tuned_host: LocalHost) -> Iterator[User]:
    with user_of(api, tuned_host) as u:
        yield u


@pytest.fixture
def other(api: Api, tuned_host: LocalHost) -> Iterator[User]:
    with user_of(api, tuned_host) as u:
        yield u


@pytest.fixture
def small(api: Api, tuned_host: LocalHost) -> Iterator[User]:
    with user_of(api, tuned_host, "up-small") as u:
        yield u


async def test_chunks_with_digests_make_the_file_byte_exact_and_answer_as_put(user: User) -> None:
    """Three chunks, each with its Content-Digest: 204 with the next offset each, the last 201
    with the path, size, sha256 (hashed on the host) and ETag; nothing temporary is left, and
    HEAD and GET then say complete."""
    data = os.urandom(5 * MIB + 123)
    url = await user.start("f.bin", len(data))
    assert len(user.temps()) == 1
    cuts = [0, 2 * MIB, 4 * MIB, len(data)]
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        r = await user.patch(url, a, data[a:b], last=b == len(data))
        if b < len(data):
            assert r.status_code == 204, r.text
            assert (r.headers["upload-offset"], r.headers["upload-complete"]) == (str(b), "?0")
            assert await user.offset(url) == b, i
    assert r.status_code == 201, r.text
    assert r.json() == {
        "path": f"{user.root}/f.bin",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    assert r.headers["etag"] and r.headers["upload-complete"] == "?1"
    assert (user.root / "f.bin").read_bytes() == data
    assert user.temps() == []
    state = await user.api.client.get(url, headers=user.headers)
    assert state.json()["complete"] and state.json()["sha256"] == hashlib.sha256(data).hexdigest()
    again = await user.patch(url, len(data), b"", last=True)
    assert again.status_code == 400 and again.json()["type"].endswith(":completed-upload")


async def test_a_chunk_whose_digest_does_not_match_is_refused_and_the_offset_stays(
    user: User,
) -> None:
    """A chunk with a wrong Content-Digest is 400 digest-mismatch and counts for nothing (the
    offset does not move); the same chunk sent right goes in."""
    data = os.urandom(3 * MIB)
    url = await user.start("d.bin", len(data))
    assert (await user.patch(url, 0, data[:MIB])).status_code == 204
    bad = await user.api.client.patch(
        url,
        content=data[MIB : 2 * MIB],
        headers={**user.headers, "Upload-Offset": str(MIB), "Content-Digest": digest(b"other")},
    )
    assert bad.status_code == 400 and bad.json()["type"].endswith(":digest-mismatch"), bad.text
    assert await user.offset(url) == MIB
    assert (await user.patch(url, MIB, data[MIB : 2 * MIB])).status_code == 204
    done = await user.patch(url, 2 * MIB, data[2 * MIB :], last=True)
    assert done.status_code == 201, done.text
    assert (user.root / "d.bin").read_bytes() == data
    md5 = {**user.headers, "Upload-Offset": "0", "Content-Digest": "md5=:x:"}
    unsupported = await user.api.client.patch(url, content=b"", headers=md5)
    assert unsupported.status_code == 400
    assert "sha-256" in unsupported.headers["want-content-digest"]


async def test_an_offset_other_than_the_uploads_is_409_with_the_right_one(user: User) -> None:
    """A chunk that does not start where the upload stands: 409 mismatching-upload-offset,
    `Upload-Offset` and `expected-offset` saying where it does; nothing written."""
    url = await user.start("o.bin", 10)
    r = await user.patch(url, 5, b"12345", last=True)
    assert r.status_code == 409, r.text
    assert r.headers["upload-offset"] == "0"
    assert (r.json()["expected-offset"], r.json()["provided-offset"]) == (0, 5)
    assert await user.offset(url) == 0


async def test_another_identitys_upload_is_404_to_every_method(user: User, other: User) -> None:
    """Another identity (or the owner on a made-up id) gets 404 for HEAD, GET, PATCH, DELETE;
    the owner's upload goes on untouched."""
    url = await user.start("mine.bin", 4)
    for method in ("HEAD", "GET", "DELETE"):
        r = await other.api.client.request(method, url, headers=other.headers)
        assert r.status_code == 404, method
    assert (await other.patch(url, 0, b"abcd", last=True)).status_code == 404
    made_up = url.rsplit("/", 1)[0] + "/" + uuid.uuid4().hex
    assert (await user.api.client.head(made_up, headers=user.headers)).status_code == 404
    assert (await user.patch(url, 0, b"abcd", last=True)).status_code == 201


async def _cut_chunk(user: User, url: str, offset: int, chunk: bytes, landed: int) -> None:
    """PATCH `chunk` at `offset` (no digest) over a raw connection, and close it once the
    host's temporary file holds `landed` bytes (the API read and wrote them): a client cut
    off mid-chunk."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = (
        f"PATCH {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Authorization: {user.headers['Authorization']}\r\n"
        f"Upload-Offset: {offset}\r\nUpload-Complete: ?0\r\n"
        f"Content-Length: {len(chunk)}\r\n\r\n"
    )
    writer.write(head.encode() + chunk[: landed + MIB])  # the chunk's end never comes
    await writer.drain()
    temp = user.root / user.temps()[0]
    await eventually(lambda: temp.stat().st_size >= landed)
    writer.close()
    await writer.wait_closed()
    del reader


async def test_a_chunk_cut_mid_way_keeps_what_landed_and_the_upload_completes(
    user: User,
) -> None:
    """A chunk without a digest cut off mid-way: HEAD then says what the host holds (more than
    the offset before, less than the chunk), and going on from there makes the file byte for
    byte."""
    data = os.urandom(8 * MIB)
    url = await user.start("cut.bin", len(data))
    await _cut_chunk(user, url, 0, data, 4 * MIB)

    async def offset_moved() -> int:
        # The API records what landed once it has seen the cut: a barrier, not a timing.
        async with asyncio.timeout(60):
            while not (found := await user.offset(url)):  # noqa: ASYNC110 (the host's state)
                await asyncio.sleep(0.05)
        return found

    held = await offset_moved()
    assert 4 * MIB <= held < len(data)
    assert (await user.patch_when_free(url, held, data[held:], last=True)).status_code == 201
    assert (user.root / "cut.bin").read_bytes() == data


async def test_a_cut_chunk_with_a_digest_counts_for_nothing(user: User) -> None:
    """A chunk with a Content-Digest cut off mid-way cannot be checked: none of it counts, and
    the same chunk sent again from the same offset goes in (the bytes that landed are written
    over)."""
    data = os.urandom(6 * MIB)
    url = await user.start("cutd.bin", len(data))
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(
        (
            f"PATCH {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: {user.headers['Authorization']}\r\nUpload-Offset: 0\r\n"
            f"Content-Digest: {digest(data)}\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode()
        + data[: 5 * MIB]
    )
    await writer.drain()
    temp = user.root / user.temps()[0]
    await eventually(lambda: temp.stat().st_size >= 4 * MIB)
    writer.close()
    await writer.wait_closed()
    del reader
    r = await user.patch_when_free(url, 0, data, last=True)
    assert r.status_code == 201, r.text  # not 409: the cut chunk moved nothing
    assert (user.root / "cutd.bin").read_bytes() == data


class Flaky(httpx.AsyncBaseTransport):
    """Loses the answer of the 2nd PATCH (the server wrote it) and of the last one (the
    server committed it), and the 3rd PATCH before it is sent."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.patches = 0
        self.heads = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "HEAD":
            self.heads += 1
        if request.method != "PATCH":
            return await self.inner.handle_async_request(request)
        self.patches += 1
        if self.patches == 3:
            raise httpx.ConnectError("refused", request=request)
        response = await self.inner.handle_async_request(request)
        if self.patches == 2 or request.headers.get("upload-complete") == "?1":
            await response.aread()
            await response.aclose()
            raise httpx.ReadError("connection dropped", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_the_client_resumes_after_lost_connections(user: User, tmp_path: Path) -> None:
    """`upload_resumable` goes on after an answer lost (HEAD: the chunk had landed), a chunk
    never sent (HEAD: it had not), and a lost final answer (HEAD: complete, GET: the
    result); the file is byte-exact and the sha256 the host's."""
    data = os.urandom(5 * MIB + 7)
    source = tmp_path / "src.bin"
    source.write_bytes(data)
    transport = Flaky()
    token = user.api.token(user.sub, RW)
    async with AsyncClient(user.api.url, token, transport=transport) as c:
        answer = await c.upload_resumable("local", source, f"{user.root}/c.bin", chunk_size=MIB)
    assert answer["sha256"] == hashlib.sha256(data).hexdigest()
    assert answer["size"] == len(data)
    assert (user.root / "c.bin").read_bytes() == data
    assert transport.heads >= 3 and user.temps() == []


class Stopped(Exception):
    """The client's process stopped mid-upload (a kill, a laptop lid closed)."""


def stop_after(chunks: int) -> Callable[[int, int], None]:
    """A progress callback that stops the upload once `chunks` chunks were confirmed."""
    seen: list[int] = []

    def progress(done: int, size: int) -> None:
        seen.append(done)
        if len(seen) == chunks:
            raise Stopped

    return progress


async def test_a_stopped_upload_goes_on_from_where_the_server_stands(
    user: User, tmp_path: Path
) -> None:
    """A client stopped after 2 of 6 chunks leaves its record on disk; another client (a new
    process: nothing shared in memory) asked for the same file and path sends only the 4 chunks
    left, and the record is gone once the file is whole."""
    data = os.urandom(5 * MIB + 7)
    source, records = tmp_path / "src.bin", tmp_path / "records"
    source.write_bytes(data)
    token = user.api.token(user.sub, RW)
    async with AsyncClient(user.api.url, token) as c:
        with pytest.raises(Stopped):
            await c.upload_resumable(
                "local", source, f"{user.root}/r.bin", chunk_size=MIB,
                progress=stop_after(2), records=records,
            )  # fmt: skip
    assert len(list(records.iterdir())) == 1 and not (user.root / "r.bin").exists()
    reported: list[int] = []
    async with AsyncClient(user.api.url, token) as c:
        answer = await c.upload_resumable(
            "local", source, f"{user.root}/r.bin", chunk_size=MIB,
            progress=lambda done, size: reported.append(done), records=records,
        )  # fmt: skip
    assert reported == [3 * MIB, 4 * MIB, 5 * MIB, 5 * MIB + 7]  # from 2 MiB on
    assert answer["sha256"] == hashlib.sha256(data).hexdigest()
    assert (user.root / "r.bin").read_bytes() == data
    assert list(records.iterdir()) == [] and user.temps() == []


async def test_a_changed_local_file_is_sent_anew_and_its_old_upload_cancelled(
    user: User, tmp_path: Path
) -> None:
    """The local file changed after a stopped upload: the next call cancels the recorded upload
    (its place among the identity's open uploads freed, its temporary file removed) and sends
    the new contents from the start."""
    source, records = tmp_path / "src.bin", tmp_path / "records"
    source.write_bytes(os.urandom(3 * MIB))
    token = user.api.token(user.sub, RW)
    async with AsyncClient(user.api.url, token) as c:
        with pytest.raises(Stopped):
            await c.upload_resumable(
                "local", source, f"{user.root}/n.bin", chunk_size=MIB,
                progress=stop_after(1), records=records,
            )  # fmt: skip
        new = os.urandom(2 * MIB + 1)
        source.write_bytes(new)
        reported: list[int] = []
        answer = await c.upload_resumable(
            "local", source, f"{user.root}/n.bin", chunk_size=MIB,
            progress=lambda done, size: reported.append(done), records=records,
        )  # fmt: skip
    assert reported[0] == MIB and answer["size"] == len(new)
    assert (user.root / "n.bin").read_bytes() == new
    assert list(records.iterdir()) == [] and user.temps() == []


class Recording(httpx.AsyncBaseTransport):
    """Passes every request on, keeping its URL."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.urls: list[httpx.URL] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.urls.append(request.url)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_an_edited_record_never_sends_the_file_elsewhere(user: User, tmp_path: Path) -> None:
    """A record whose Location names another server (edited on disk) is dropped: the client
    creates an upload on its own server, and no request goes anywhere else."""
    source, records = tmp_path / "src.bin", tmp_path / "records"
    source.write_bytes(b"mine")
    transport, token = Recording(), user.api.token(user.sub, RW)
    async with AsyncClient(user.api.url, token, transport=transport) as c:
        record = UploadRecord(records, c.url, "local", f"{user.root}/e.bin", source, False)
        elsewhere = "http://127.0.0.9:9/v1/hosts/local/files/uploads/" + "0" * 32
        record.save(elsewhere, SyncFile.identity(source))
        answer = await c.upload_resumable("local", source, f"{user.root}/e.bin", records=records)
    assert answer["size"] == 4 and (user.root / "e.bin").read_bytes() == b"mine"
    assert {u.host for u in transport.urls} == {urlsplit(user.api.url).hostname}
    assert list(records.iterdir()) == []


async def test_cancel_removes_the_temporary_file(user: User) -> None:
    """DELETE: 204, the temporary file gone, the upload 404 from then on."""
    url = await user.start("x.bin", 2 * MIB)
    assert (await user.patch(url, 0, os.urandom(MIB))).status_code == 204
    assert (await user.api.client.delete(url, headers=user.headers)).status_code == 204
    assert user.temps() == [] and not (user.root / "x.bin").exists()
    assert (await user.api.client.head(url, headers=user.headers)).status_code == 404


async def test_caps_length_chunk_and_open_uploads(user: User, small: User) -> None:
    """Upload-Length over max_file_size: 413 and nothing on the host; a chunk over
    max_transfer_bytes: 413; past max_open_uploads (3 here): 429 too-many-uploads, until one
    is cancelled."""
    r = await small.create(f"{small.root}/big", 100_001)
    assert r.status_code == 413 and small.temps() == []
    url = await small.start("s.bin", 90_000)
    assert (await small.patch(url, 0, b"x" * 40_001)).status_code == 413
    assert await small.offset(url) == 0
    missing = await user.api.client.post(
        f"{user.base}/uploads", params={"path": f"{user.root}/n"}, headers=user.headers
    )
    assert missing.status_code == 422
    urls = [await user.start(f"open{i}", 10) for i in range(3)]
    r = await user.create(f"{user.root}/one-more", 10)
    assert r.status_code == 429 and r.json()["type"].endswith(":too-many-uploads")
    assert (await user.api.client.delete(urls[0], headers=user.headers)).status_code == 204
    assert (await user.create(f"{user.root}/one-more", 10)).status_code == 201


async def test_preconditions_are_checked_again_at_the_commit(user: User) -> None:
    """`If-None-Match: *` holds when the upload starts but a file appears meanwhile: the final
    chunk is 412 and the file is untouched; an `If-Match` whose version was replaced: 412."""
    url = await user.start("p.txt", 3, **{"If-None-Match": "*"})
    (user.root / "p.txt").write_bytes(b"theirs")
    r = await user.patch(url, 0, b"abc", last=True)
    assert r.status_code == 412, r.text
    assert (user.root / "p.txt").read_bytes() == b"theirs"
    put = await user.api.client.put(
        f"{user.base}/content",
        params={"path": f"{user.root}/q.txt"},
        content=b"v1",
        headers=user.headers,
    )
    url = await user.start("q.txt", 2, **{"If-Match": put.headers["etag"]})
    (user.root / "q.txt").write_bytes(b"v2 longer")
    assert (await user.patch(url, 0, b"v3", last=True)).status_code == 412
    assert (user.root / "q.txt").read_bytes() == b"v2 longer"


async def test_an_expired_upload_loses_its_temporary_file(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """An upload no chunk reached for upload_ttl: the sweep removes its temporary file from
    the host and the upload is 404."""
    path = tmp_path / "sshapi.toml"
    extra = "upload_ttl = 1\nupload_sweep = 0.2\n"
    path.write_text(config_text(tuned_host, secret_file, keys, extra))
    settings = make_settings(tmp_path, path, "sqlite", None)
    async with running_api(settings, keys, secret) as api:
        with user_of(api, tuned_host) as user:
            url = await user.start("e.bin", 10)
            assert len(user.temps()) == 1
            await eventually(lambda: user.temps() == [])
            assert (await api.client.head(url, headers=user.headers)).status_code == 404


async def test_a_chunk_lands_on_another_api_process_sharing_the_store(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """Two API processes on one PostgreSQL store: an upload created on one takes its chunks on
    either, HEAD on either says the same offset, and the other commits it."""
    path = tmp_path / "sshapi.toml"
    path.write_text(config_text(tuned_host, secret_file, keys))
    async with replicas(tmp_path, path, keys, secret) as (a, b):
        with user_of(a, tuned_host) as user:
            data = os.urandom(3 * MIB)
            url = await user.start("r.bin", len(data))
            there = user.on(b)
            url_b = url.replace(a.url, b.url)
            assert (await there.patch(url_b, 0, data[:MIB])).status_code == 204
            assert await user.offset(url) == await there.offset(url_b) == MIB
            assert (await user.patch(url, MIB, data[MIB : 2 * MIB])).status_code == 204
            done = await there.patch(url_b, 2 * MIB, data[2 * MIB :], last=True)
            assert done.status_code == 201, done.text
            assert done.json()["sha256"] == hashlib.sha256(data).hexdigest()
            assert (user.root / "r.bin").read_bytes() == data


async def test_the_ssh_connection_lost_mid_chunk_leaves_the_confirmed_offset(
    api_with_own_host: OwnHostApi,
) -> None:
    """The host's sessions killed during a chunk: 502, and once the host is back HEAD says the
    offset the chunks before confirmed (the cut chunk's bytes on the host were never
    confirmed); going on from there makes the file byte for byte."""
    async with api_with_own_host("flaky") as (api, host):
        auth = api.auth("anyhost", RW)
        name = f"lost-{uuid.uuid4().hex[:10]}.bin"
        data = os.urandom(12 * MIB)
        base = f"{api.url}/v1/hosts/flaky/files"
        made = await api.client.post(
            f"{base}/uploads",
            params={"path": name},
            headers={**auth, "Upload-Length": str(len(data))},
        )
        assert made.status_code == 201, made.text
        url = f"{api.url}{made.headers['location']}"
        first = await api.client.patch(
            url, content=data[: 4 * MIB], headers={**auth, "Upload-Offset": "0"}
        )
        assert first.status_code == 204, first.text
        temp = _temp_of(host, name)

        async def body() -> AsyncIterator[bytes]:
            for n in range(4 * MIB, 12 * MIB, MIB):
                if n == 9 * MIB:  # once the chunk is writing on the host (4 MiB writes)
                    await eventually(lambda: temp.stat().st_size > 4 * MIB)
                    host.stop(kill_sessions=True)
                yield data[n : n + MIB]

        cut = await api.client.patch(
            url, content=body(), headers={**auth, "Upload-Offset": str(4 * MIB)}
        )
        assert cut.status_code == 502, cut.text
        host.start()
        async with asyncio.timeout(60):
            while (r := await api.client.head(url, headers=auth)).status_code != 204:  # noqa: ASYNC110
                await asyncio.sleep(0.2)  # the pool reconnecting after the host came back
        assert r.headers["upload-offset"] == str(4 * MIB)
        rest = {**auth, "Upload-Offset": str(4 * MIB), "Upload-Complete": "?1"}
        done = await api.client.patch(url, content=data[4 * MIB :], headers=rest)
        assert done.status_code == 201, done.text
        assert (Path(host.account.home) / name).read_bytes() == data
        assert done.json()["sha256"] == hashlib.sha256(data).hexdigest()
