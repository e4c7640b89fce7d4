"""Files over SFTP through the API, against the real sshd: transfers, confinement, limits,
failures. Each test has its own subject `fs-<id>`, whose root is ~/sshapi-files/fs-<id>."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from api_helpers import (
    Api,
    Keys,
    OwnHostApi,
    config_toml,
    eventually,
    host_toml,
    make_settings,
    running_api,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.files import file_problem
from sshpool import RemoteUnsupported
from sshpool.devhost import LocalHost

FILES_POLICY = """
[[policy]]
subject = "fs-small-*"
issuer = "*"
hosts = ["local"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }
max_file_size = 100000
max_transfers = 1
rate = 1000
burst = 1000

[[policy]]
subject = "fs-*"
issuer = "*"
hosts = ["local", "tiny", "viassh2"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }
rate = 1000
burst = 1000

"""
RW = "files:read files:write"


@pytest.fixture
async def api(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    # `viassh2`: the same sshd through the ssh2-python (libssh2) backend.
    ssh2 = host_toml("viassh2", tuned_host, max_connections=1, max_sessions=4).replace(
        "[hosts.viassh2.limits]", 'backend = "ssh2"\n[hosts.viassh2.limits]'
    )
    text = config_toml(tuned_host, secret_file, keys).replace(
        "[[policy]]", ssh2 + FILES_POLICY + "[[policy]]", 1
    )
    path = tmp_path / "sshapi.toml"
    path.write_text(text)
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as running:
        yield running


class User:
    def __init__(self, api: Api, host: LocalHost, sub: str, via: str = "local") -> None:
        self.api = api
        self.sub = sub
        self.root = Path(host.account.home) / "sshapi-files" / sub
        self.headers = api.auth(sub, RW)
        self.base = f"{api.url}/v1/hosts/{via}/files"

    async def put(self, path: str, data: bytes, **headers: str) -> httpx.Response:
        return await self.api.client.put(
            f"{self.base}/content",
            params={"path": path},
            content=data,
            headers={**self.headers, **headers},
        )

    async def get(self, path: str, **headers: str) -> httpx.Response:
        return await self.api.client.get(
            f"{self.base}/content", params={"path": path}, headers={**self.headers, **headers}
        )

    async def meta(self, path: str, **params: object) -> httpx.Response:
        return await self.api.client.get(
            self.base, params={"path": path, **params}, headers=self.headers
        )


def make_user(api: Api, host: LocalHost, prefix: str = "fs", via: str = "local") -> Iterator[User]:
    sub = f"{prefix}-{uuid.uuid4().hex[:10]}"
    user = User(api, host, sub, via)
    host.run_local(["mkdir", "-p", str(user.root)])
    try:
        yield user
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(user.root)], check=False)
        subprocess.run(["rm", "-rf", str(user.root)], check=False)


@pytest.fixture
def user(api: Api, tuned_host: LocalHost) -> Iterator[User]:
    yield from make_user(api, tuned_host)


@pytest.fixture
def ssh2_user(api: Api, tuned_host: LocalHost) -> Iterator[User]:
    yield from make_user(api, tuned_host, via="viassh2")


@pytest.fixture
def small(api: Api, tuned_host: LocalHost) -> Iterator[User]:
    yield from make_user(api, tuned_host, "fs-small")


# The host is this machine: tests look at its files directly (sync helpers, sub-millisecond).
def exists(path: str | Path) -> bool:
    return Path(path).exists()


def real(path: str) -> str:
    return os.path.realpath(os.path.normpath(path))


def run(*argv: str) -> None:
    subprocess.run(argv, check=True)


def temps(home: str, name: str) -> list[Path]:
    return list(Path(home).glob(f".{name}.sshapi-*"))


def leftovers(user: User) -> list[str]:
    return sorted(n for n in os.listdir(user.root) if ".sshapi-" in n)


async def test_upload_then_download_whole_and_by_range(user: User) -> None:
    """A PUT answers 201 with size and sha256; GET returns the bytes, a Range gives 206."""
    data = os.urandom(3 * (1 << 20) + 7)
    r = await user.put(f"{user.root}/in.bin", data)
    assert r.status_code == 201, r.text
    assert r.json() == {
        "path": f"{user.root}/in.bin",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    assert (user.root / "in.bin").read_bytes() == data
    r = await user.get(f"{user.root}/in.bin")
    assert r.status_code == 200 and r.content == data
    assert r.headers["content-length"] == str(len(data))
    etag = r.headers["etag"]
    r = await user.get(f"{user.root}/in.bin", Range="bytes=1000-1999")
    assert r.status_code == 206 and r.content == data[1000:2000]
    assert r.headers["content-range"] == f"bytes 1000-1999/{len(data)}"
    r = await user.get(f"{user.root}/in.bin", Range="bytes=-10")
    assert r.status_code == 206 and r.content == data[-10:]
    r = await user.get(f"{user.root}/in.bin", Range=f"bytes={len(data)}-")
    assert r.status_code == 416
    assert (await user.get(f"{user.root}/in.bin", **{"If-None-Match": etag})).status_code == 304
    assert leftovers(user) == []


async def test_relative_paths_resolve_against_home(user: User) -> None:
    """`sshapi-files/<sub>/x` and `~/sshapi-files/<sub>/x` name the same file."""
    rel = f"sshapi-files/{user.sub}/rel.txt"
    assert (await user.put(rel, b"hello")).status_code == 201
    r = await user.get(f"~/{rel}")
    assert r.status_code == 200 and r.content == b"hello"


async def test_overwrite_answers_200_and_conditions_are_honoured(user: User) -> None:
    """A second PUT replaces (200); If-None-Match: * and a stale If-Match are refused 412."""
    path = f"{user.root}/f.txt"
    first = await user.put(path, b"one")
    assert first.status_code == 201
    assert (await user.put(path, b"two", **{"If-None-Match": "*"})).status_code == 412
    assert (await user.put(path, b"two", **{"If-Match": '"0-0"'})).status_code == 412
    r = await user.put(path, b"two", **{"If-Match": first.headers["etag"]})
    assert r.status_code == 200, r.text
    assert (user.root / "f.txt").read_bytes() == b"two"
    assert leftovers(user) == []


async def test_listing_is_paged_and_shows_types_and_symlink_targets(user: User) -> None:
    """GET files lists entries by name with type, size, mode, mtime; pages follow next_cursor;
    a file path gives its stat."""
    for i in range(5):
        (user.root / f"f{i}").write_bytes(b"x" * i)
    (user.root / "d").mkdir()
    os.symlink("f1", user.root / "link")
    r = await user.meta(str(user.root), limit=4)
    assert r.status_code == 200, r.text
    page = r.json()
    assert [e["name"] for e in page["items"]] == ["d", "f0", "f1", "f2"]
    r = await user.meta(str(user.root), limit=4, cursor=page["next_cursor"])
    rest = r.json()
    assert [e["name"] for e in rest["items"]] == ["f3", "f4", "link"]
    assert rest["next_cursor"] is None
    link = rest["items"][-1]
    assert (link["type"], link["target"]) == ("symlink", "f1")
    stat = (await user.meta(f"{user.root}/f3")).json()
    assert (stat["type"], stat["size"], stat["mode"]) == ("file", 3, "0644")


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "~/.profile",
        "{root}/../../.profile",
        "{root}/out/passwd",
        "{root}/out",
        "/",
        "..",
        "{root}/nope/../../../etc/hostname",
        "/etc/no-such-dir/x",
    ],
)
async def test_paths_outside_the_roots_are_refused(user: User, path: str) -> None:
    """`..`, absolute paths, and symlinks pointing out are 403 for reads and writes alike; no
    file appears outside. (Deleting the symlink `out` itself is allowed: it lies inside.)"""
    os.symlink("/etc", user.root / "out")
    p = path.replace("{root}", str(user.root))
    answers = [
        await user.get(p),
        await user.meta(p),
        await user.put(p, b"x"),
        await user.put(f"{p}/new", b"x"),
    ]
    if not p.endswith("/out"):
        answers.append(
            await user.api.client.delete(user.base, params={"path": p}, headers=user.headers)
        )
    for r in answers:
        assert r.status_code == 403, (p, r.status_code, r.text)
        assert r.json()["type"].endswith(("outside-roots", "symlink-refused")), r.text
        assert "sshapi-hpc" not in r.text.replace(p, "")  # only the caller's own words
    assert not exists("/etc/new")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    parts=st.lists(
        st.sampled_from(["..", ".", "out", "in", "link-in", "link-out", "//", "x", "~"]),
        min_size=1,
        max_size=6,
    ),
    absolute=st.booleans(),
)
async def test_hostile_paths_never_escape_the_roots(
    user: User, parts: list[str], absolute: bool
) -> None:
    """Any mix of `..`, `.`, symlinks in and out: the API answers only 2xx/403/404/409/422, and
    whatever it answers 2xx for resolves inside the root."""
    if not (user.root / "in").exists():
        (user.root / "in").mkdir()
        (user.root / "in" / "x").write_bytes(b"in")
        os.symlink("/etc", user.root / "out")
        os.symlink(str(user.root / "in"), user.root / "link-in")
        os.symlink("/tmp", user.root / "link-out")
    path = "/".join(parts)
    path = f"{user.root}/{path}" if absolute else f"sshapi-files/{user.sub}/{path}"
    for r in (await user.meta(path), await user.get(path)):
        assert r.status_code in (200, 403, 404, 409, 422), (path, r.status_code, r.text)
        if r.status_code == 200 and "items" in r.text:
            assert "passwd" not in r.text and "hostname" not in r.text
    r = await user.put(path, b"written")
    assert r.status_code in (201, 200, 403, 404, 409, 422), (path, r.status_code, r.text)
    if r.status_code in (200, 201):
        where = real(path if absolute else f"{user.root.parent.parent}/{path}")
        assert where == str(user.root) or where.startswith(f"{user.root}/"), where
        os.unlink(where)


async def test_not_found_and_permission_denied(user: User) -> None:
    """A missing file is 404, an unreadable one 403 from the host; neither names host paths."""
    r = await user.get(f"{user.root}/missing")
    assert r.status_code == 404 and r.json()["type"].endswith("file-not-found")
    (user.root / "secret").write_bytes(b"s")
    (user.root / "secret").chmod(0)
    os.chown(user.root / "secret", os.stat(user.root).st_uid, os.stat(user.root).st_gid)
    r = await user.get(f"{user.root}/secret")
    assert r.status_code == 403 and r.json()["type"].endswith("file-permission-denied"), r.text
    assert "sshapi-hpc" not in r.text


async def test_delete_mkdir_and_move(user: User) -> None:
    """mkdir 201 (409 when it exists), move 200 (409 onto an existing name unless overwrite),
    delete 204 (a symlink itself, never its target; 409 for a non-empty directory)."""
    c, base, h = user.api.client, user.base, user.headers
    r = await c.post(f"{base}/mkdir", json={"path": f"{user.root}/d"}, headers=h)
    assert r.status_code == 201 and r.json()["type"] == "dir"
    assert (
        await c.post(f"{base}/mkdir", json={"path": f"{user.root}/d"}, headers=h)
    ).status_code == 409
    await user.put(f"{user.root}/d/a", b"A")
    await user.put(f"{user.root}/b", b"B")
    move = {"source": f"{user.root}/d/a", "destination": f"{user.root}/b"}
    assert (await c.post(f"{base}/move", json=move, headers=h)).status_code == 409
    r = await c.post(f"{base}/move", json={**move, "overwrite": True}, headers=h)
    assert r.status_code == 200, r.text
    assert (user.root / "b").read_bytes() == b"A"
    await user.put(f"{user.root}/d/c", b"C")
    assert (await c.delete(base, params={"path": f"{user.root}/d"}, headers=h)).status_code == 409
    os.symlink("/etc/hostname", user.root / "ln")
    assert (await c.delete(base, params={"path": f"{user.root}/ln"}, headers=h)).status_code == 204
    assert exists("/etc/hostname") and not exists(user.root / "ln")
    assert (await c.delete(base, params={"path": str(user.root)}, headers=h)).status_code == 403


async def test_checksum_is_computed_on_the_host(user: User) -> None:
    """GET checksum answers the file's sha256."""
    data = os.urandom(100_000)
    (user.root / "c.bin").write_bytes(data)
    r = await user.api.client.get(
        f"{user.base}/checksum", params={"path": f"{user.root}/c.bin"}, headers=user.headers
    )
    assert r.status_code == 200, r.text
    assert r.json()["checksum"] == hashlib.sha256(data).hexdigest()


async def test_files_need_the_files_scopes(user: User) -> None:
    """A jobs-only token gets 403 insufficient-scope; files:read cannot upload."""
    jobs = user.api.auth(user.sub, "jobs:read jobs:write")
    r = await user.api.client.get(user.base, params={"path": "~"}, headers=jobs)
    assert r.status_code == 403
    reader = user.api.auth(user.sub, "files:read")
    assert (
        await user.api.client.get(user.base, params={"path": str(user.root)}, headers=reader)
    ).status_code == 200
    r = await user.api.client.put(
        f"{user.base}/content", params={"path": f"{user.root}/x"}, content=b"x", headers=reader
    )
    assert r.status_code == 403


async def test_upload_over_max_file_size_is_413_and_leaves_nothing(small: User) -> None:
    """Declared or streamed past max_file_size: 413, no file, no temporary file."""
    r = await small.put(f"{small.root}/big", b"x" * 100_001)
    assert r.status_code == 413

    async def body() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b"y" * 10_000

    r = await small.api.client.put(
        f"{small.base}/content",
        params={"path": f"{small.root}/big"},
        content=body(),
        headers=small.headers,
    )
    assert r.status_code == 413, r.text
    assert os.listdir(small.root) == []


async def test_client_disconnect_mid_upload_removes_the_temporary_file(user: User) -> None:
    """A client that goes away mid-upload leaves neither the file nor its temporary."""
    sent = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield os.urandom(1 << 20)
        sent.set()
        await asyncio.sleep(60)
        yield b"never"

    async def upload() -> None:
        await user.api.client.put(
            f"{user.base}/content",
            params={"path": f"{user.root}/cut.bin"},
            content=body(),
            headers={**user.headers, "Content-Length": str(10 << 20)},
        )

    task = asyncio.create_task(upload())
    await sent.wait()
    for _ in range(100):
        if leftovers(user):
            break
        await asyncio.sleep(0.05)
    assert leftovers(user), "the upload should be writing its temporary file"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if not leftovers(user):
            break
        await asyncio.sleep(0.05)
    assert os.listdir(user.root) == []


async def test_no_space_is_507_and_leaves_nothing(user: User, tuned_host: LocalHost) -> None:
    """An upload onto a full filesystem (a 1 MiB tmpfs) answers 507 and removes its temporary."""
    full = user.root / "full"
    full.mkdir()
    run("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full))
    try:
        os.chown(full, tuned_host.account.uid, tuned_host.account.gid)
        r = await user.put(f"{full}/big.bin", os.urandom(3 << 20))
        assert r.status_code == 507, r.text
        assert os.listdir(full) == []
    finally:
        run("umount", str(full))


async def test_transfers_show_in_metrics(user: User) -> None:
    """Bytes moved are counted by direction in /metrics."""
    await user.put(f"{user.root}/m.bin", b"z" * 12345)
    await user.get(f"{user.root}/m.bin")
    text = (await user.api.client.get(f"{user.api.url}/metrics")).text
    assert 'sshapi_file_bytes_total{direction="upload"} 12345.0' in text
    assert 'sshapi_file_bytes_total{direction="download"} 12345.0' in text
    assert 'sshapi_file_transfers_active{direction="upload"} 0.0' in text


async def test_connection_lost_mid_upload_is_502_and_no_partial_file(
    api_with_own_host: OwnHostApi,
) -> None:
    """The host's sessions killed during an upload: 502 connection-lost, nothing under the final
    name (the temporary cannot be removed while the host is down: it is named `.*.sshapi-*`)."""
    async with api_with_own_host("flaky") as (api, host):
        name = f"lost-{uuid.uuid4().hex[:10]}.bin"
        final = Path(host.account.home) / name
        killed = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            for i in range(40):
                if i == 4:
                    # Once the upload is writing on the host:
                    await eventually(lambda: temps(host.account.home, name))
                    host.stop(kill_sessions=True)
                    killed.set()
                    await asyncio.sleep(0.5)
                yield os.urandom(1 << 20)

        try:
            r = await api.client.put(
                f"{api.url}/v1/hosts/flaky/files/content",
                params={"path": name},
                content=body(),
                headers=api.auth("anyhost", RW),
            )
            assert killed.is_set()
            assert r.status_code == 502, r.text
            assert r.json()["type"].endswith("connection-lost")
            assert not final.exists()
        finally:
            final.unlink(missing_ok=True)
            for left in temps(host.account.home, name):
                left.unlink()


async def test_the_ssh2_backend_serves_the_same_file_operations(ssh2_user: User) -> None:
    """On a host with backend = "ssh2" (libssh2): upload, replace (posix-rename), a listing with
    a symlink's target (readlink), a range download, a move over a file, a delete."""
    user = ssh2_user
    data = os.urandom(2 * (1 << 20) + 3)
    r = await user.put(f"{user.root}/a.bin", data)
    assert r.status_code == 201, r.text
    assert r.json()["sha256"] == hashlib.sha256(data).hexdigest()
    r = await user.put(f"{user.root}/a.bin", data[::-1])
    assert r.status_code == 200, r.text
    assert (user.root / "a.bin").read_bytes() == data[::-1]
    os.symlink("a.bin", user.root / "link")
    r = await user.meta(str(user.root))
    assert r.status_code == 200, r.text
    items = {i["name"]: i for i in r.json()["items"]}
    assert (items["a.bin"]["size"], items["link"]["target"]) == (len(data), "a.bin")
    r = await user.get(f"{user.root}/a.bin", Range="bytes=100-")
    assert r.status_code == 206 and r.content == data[::-1][100:]
    assert (await user.put(f"{user.root}/b.bin", b"b")).status_code == 201
    move = {"source": f"{user.root}/b.bin", "destination": f"{user.root}/a.bin"}
    r = await user.api.client.post(f"{user.base}/move", json=move, headers=user.headers)
    assert r.status_code == 409, r.text
    r = await user.api.client.post(
        f"{user.base}/move", json={**move, "overwrite": True}, headers=user.headers
    )
    assert r.status_code == 200, r.text
    assert (user.root / "a.bin").read_bytes() == b"b"
    r = await user.api.client.delete(
        user.base, params={"path": f"{user.root}/a.bin"}, headers=user.headers
    )
    assert r.status_code == 204
    assert sorted(os.listdir(user.root)) == ["link"]


def test_an_operation_the_backend_cannot_do_is_501_not_supported() -> None:
    """RemoteUnsupported (a backend whose library lacks an operation) answers 501
    `not-supported`, not a misleading 409, and without the backend's detail or the path."""
    problem = file_problem(RemoteUnsupported("libssh2 lacks posix-rename", "/home/x/secret"))
    assert (problem.status, problem.kind, problem.detail) == (501, "not-supported", None)
