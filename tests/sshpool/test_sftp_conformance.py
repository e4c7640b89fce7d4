"""One conformance suite for SFTP over the three SSH backends against real sshd (OpenSSH's
internal-sftp), and the pool's SFTP lease. Parametrized like test_backend_conformance.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from sshpool import (
    ConnectionLost,
    Pool,
    PoolTimeout,
    RemoteFileError,
    RemoteFileFailure,
    RemoteNotFound,
    RemotePermissionDenied,
    RemoteUnsupported,
)
from sshpool.backends import BACKENDS as REGISTRY
from sshpool.backends import Backend, Connection, load_backend
from sshpool.backends.base import SFTPSession
from sshpool.devhost import LocalHost

MakeHost = Callable[..., LocalHost]
BACKENDS = list(REGISTRY)  # every backend the registry knows


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    return load_backend(request.param)


@pytest.fixture
async def conn(backend: Backend, stock_host: LocalHost) -> AsyncIterator[Connection]:
    connection = await backend.connect(stock_host.target())
    yield connection
    await connection.close()


@pytest.fixture
async def fs(conn: Connection) -> AsyncIterator[SFTPSession]:
    session = await conn.sftp()
    yield session
    await session.close()


@pytest.fixture
async def tmpdir(fs: SFTPSession, stock_host: LocalHost) -> AsyncIterator[str]:
    """A fresh directory in the account's home (shared by every test run: hence unique)."""
    home = await fs.realpath(".")
    path = f"{home}/sftp-conf-{uuid.uuid4().hex[:10]}"
    await fs.mkdir(path)
    yield path
    stock_host.run_local(["chmod", "-R", "u+rwx", path])
    stock_host.run_local(["rm", "-rf", path])


async def put(fs: SFTPSession, path: str, data: bytes, *, exclusive: bool = True) -> None:
    f = await fs.open_write(path, exclusive=exclusive)
    try:
        await f.write(data)
    finally:
        await f.close()


async def get(fs: SFTPSession, path: str, offset: int = 0, chunk: int = 1 << 20) -> bytes:
    f = await fs.open_read(path, offset)
    parts = []
    try:
        while data := await f.read(chunk):
            parts.append(data)
    finally:
        await f.close()
    return b"".join(parts)


async def test_written_bytes_read_back_whole_and_from_an_offset(
    fs: SFTPSession, tmpdir: str
) -> None:
    """What is written comes back byte for byte, from the start and from any offset."""
    data = os.urandom(3 * (1 << 20) + 12345)
    await put(fs, f"{tmpdir}/a.bin", data)
    assert await get(fs, f"{tmpdir}/a.bin") == data
    assert await get(fs, f"{tmpdir}/a.bin", offset=1_000_001, chunk=70_000) == data[1_000_001:]
    assert (await fs.stat(f"{tmpdir}/a.bin")).size == len(data)


async def test_writes_behind_each_other_are_all_there_after_flush(
    fs: SFTPSession, tmpdir: str
) -> None:
    """Several writes in a row (each may return with its last requests unanswered), then
    flush: every byte is on the host, in order, before the file is closed; other calls of the
    session in between (a stat) keep it in step."""
    blocks = [os.urandom((1 << 20) + i * 4099) for i in range(4)]
    f = await fs.open_write(f"{tmpdir}/behind.bin")
    try:
        await f.write(blocks[0])
        await f.write(blocks[1])
        assert (await fs.stat(f"{tmpdir}/behind.bin")).type == "file"
        await f.write(blocks[2])
        await f.write(blocks[3])
        await f.flush()
        assert (await fs.stat(f"{tmpdir}/behind.bin")).size == sum(map(len, blocks))
    finally:
        await f.close()
    assert await get(fs, f"{tmpdir}/behind.bin") == b"".join(blocks)


async def test_a_failed_write_is_reported_by_close_at_the_latest(fs: SFTPSession) -> None:
    """Writes to /dev/full fail on the host (ENOSPC): however far behind the answers come,
    the failure is raised (by a write, flush or close), never lost; the session goes on."""
    with pytest.raises(RemoteFileError):
        f = await fs.open_write("/dev/full", exclusive=False, mode=0o666)
        try:
            for _ in range(3):
                await f.write(os.urandom(1 << 20))
            await f.flush()
        finally:
            await f.close()
    assert (await fs.stat("/dev/null")).type == "other"


async def test_a_read_past_the_end_returns_the_rest_and_the_session_stays_in_step(
    fs: SFTPSession, tmpdir: str
) -> None:
    """A read asking for far more than is left (many requests in flight past the end, as
    paramiko's pipelined reads send them) returns what is left, the next read b"", and the
    session answers the next operations in step."""
    data = os.urandom(5 * (1 << 20) + 777)
    await put(fs, f"{tmpdir}/b.bin", data)
    f = await fs.open_read(f"{tmpdir}/b.bin", 4 * (1 << 20))
    assert await f.read(8 << 20) == data[4 * (1 << 20) :]
    assert await f.read(8 << 20) == b""
    await f.close()
    assert (await fs.stat(f"{tmpdir}/b.bin")).size == len(data)
    assert await get(fs, f"{tmpdir}/b.bin") == data


async def test_listing_reports_files_dirs_and_symlinks_without_following(
    fs: SFTPSession, tmpdir: str
) -> None:
    """listdir gives each entry's own type, size and mode; a symlink is a symlink."""
    await put(fs, f"{tmpdir}/f", b"12345")
    await fs.mkdir(f"{tmpdir}/d", 0o700)
    os.symlink("/etc", f"{tmpdir}/link")
    entries = {e.name: e.attrs for e in await fs.listdir(tmpdir)}
    assert set(entries) == {"f", "d", "link"}
    assert (entries["f"].type, entries["f"].size) == ("file", 5)
    assert (entries["d"].type, entries["d"].mode) == ("dir", 0o700)
    assert entries["link"].type == "symlink"
    assert await fs.readlink(f"{tmpdir}/link") == "/etc"
    assert (await fs.stat(f"{tmpdir}/link")).type == "dir"
    assert (await fs.lstat(f"{tmpdir}/link")).type == "symlink"


async def test_scandir_streams_the_same_entries_as_listdir(fs: SFTPSession, tmpdir: str) -> None:
    """scandir yields every entry listdir gives (own attributes, no `.`/`..`), across many
    READDIR replies, and the session serves the next operation."""
    await put(fs, f"{tmpdir}/f", b"12345")
    await fs.mkdir(f"{tmpdir}/d", 0o700)
    os.symlink("/etc", f"{tmpdir}/link")
    for n in range(750):  # several replies: OpenSSH sends at most 100 names per READDIR
        os.close(os.open(f"{tmpdir}/n{n:04d}", os.O_CREAT | os.O_WRONLY, 0o644))
    async with contextlib.aclosing(fs.scandir(tmpdir)) as entries:
        streamed = {e.name: e.attrs async for e in entries}
    assert streamed == {e.name: e.attrs for e in await fs.listdir(tmpdir)}
    assert len(streamed) == 753
    assert (streamed["f"].type, streamed["f"].size) == ("file", 5)
    assert (streamed["d"].type, streamed["d"].mode) == ("dir", 0o700)
    assert streamed["link"].type == "symlink"
    assert (await fs.stat(f"{tmpdir}/f")).size == 5


async def test_scandir_stopped_early_closes_its_handle_and_the_session_goes_on(
    fs: SFTPSession, tmpdir: str
) -> None:
    """A caller that takes a few entries and closes the iterator leaves the session usable:
    the directory handle is closed, the next scandir and other operations work."""
    for n in range(500):
        os.close(os.open(f"{tmpdir}/n{n:04d}", os.O_CREAT | os.O_WRONLY, 0o644))
    for _ in range(3):
        taken = []
        async with contextlib.aclosing(fs.scandir(tmpdir)) as entries:
            async for e in entries:
                taken.append(e.name)
                if len(taken) == 10:
                    break
        assert len(taken) == 10
    assert len(await fs.listdir(tmpdir)) == 500
    await put(fs, f"{tmpdir}/after", b"ok")
    assert await get(fs, f"{tmpdir}/after") == b"ok"


async def test_scandir_of_a_missing_directory_is_not_found(fs: SFTPSession, tmpdir: str) -> None:
    """scandir raises RemoteNotFound for a missing path (on the first entry asked)."""
    with pytest.raises(RemoteNotFound):
        async with contextlib.aclosing(fs.scandir(f"{tmpdir}/nope")) as entries:
            async for _ in entries:
                pass
    assert await fs.listdir(tmpdir) == []


async def test_realpath_removes_dotdot_and_follows_symlinks(fs: SFTPSession, tmpdir: str) -> None:
    """realpath is the canonical path: `..` gone, symlinks resolved, relative to home."""
    await fs.mkdir(f"{tmpdir}/d")
    os.symlink(f"{tmpdir}/d", f"{tmpdir}/link")
    assert await fs.realpath(f"{tmpdir}/d/../d/./") == f"{tmpdir}/d"
    assert await fs.realpath(f"{tmpdir}/link") == f"{tmpdir}/d"
    home = await fs.realpath(".")
    assert await fs.realpath(tmpdir.removeprefix(home + "/")) == tmpdir


async def test_realpaths_answers_each_path_in_order_and_none_where_it_does_not_resolve(
    fs: SFTPSession, tmpdir: str, stock_host: LocalHost
) -> None:
    """realpaths is realpath of many paths at once: each answer in its place, None for a path
    under a missing or unsearchable directory, and the session usable afterwards."""
    await fs.mkdir(f"{tmpdir}/d")
    await fs.mkdir(f"{tmpdir}/shut")
    os.symlink(f"{tmpdir}/d", f"{tmpdir}/link")
    stock_host.run_local(["chmod", "000", f"{tmpdir}/shut"])
    paths = [
        f"{tmpdir}/link",
        f"{tmpdir}/missing/deeper",
        f"{tmpdir}/d/../d/new-name",  # a missing last name resolves (OpenSSH's realpath)
        f"{tmpdir}/shut/inside/more",
        ".",
    ]
    home = await fs.realpath(".")
    assert await fs.realpaths(paths) == [f"{tmpdir}/d", None, f"{tmpdir}/d/new-name", None, home]
    assert await fs.realpaths([]) == []
    assert await fs.realpath(f"{tmpdir}/link") == f"{tmpdir}/d"


async def test_realpaths_raises_connection_lost_when_the_connection_drops(
    conn: Connection, fs: SFTPSession, tmpdir: str
) -> None:
    """A connection gone under a batch is one ConnectionLost, not a list of Nones."""
    await conn.close()
    with pytest.raises(ConnectionLost):
        await fs.realpaths([tmpdir, f"{tmpdir}/a", f"{tmpdir}/b"])


async def test_exclusive_create_refuses_an_existing_file(fs: SFTPSession, tmpdir: str) -> None:
    """open_write(exclusive) fails when the name exists; without it, the file is replaced."""
    await put(fs, f"{tmpdir}/f", b"old")
    with pytest.raises(RemoteFileFailure):
        await fs.open_write(f"{tmpdir}/f", exclusive=True)
    await put(fs, f"{tmpdir}/f", b"new", exclusive=False)
    assert await get(fs, f"{tmpdir}/f") == b"new"


async def test_open_resume_overwrites_from_its_offset_and_keeps_what_is_before(
    fs: SFTPSession, tmpdir: str
) -> None:
    """open_resume writes from its offset over what is there (a resumable upload's chunk after
    a cut one), keeps the bytes before it, never truncates, and never creates the file."""
    head, junk, tail = os.urandom(1 << 20), os.urandom(70_000), os.urandom((1 << 20) + 5)
    await put(fs, f"{tmpdir}/r.bin", head + junk)
    f = await fs.open_resume(f"{tmpdir}/r.bin", len(head))
    try:
        await f.write(tail)
    finally:
        await f.close()
    assert await get(fs, f"{tmpdir}/r.bin") == head + tail
    f = await fs.open_resume(f"{tmpdir}/r.bin", 3)
    await f.write(b"xyz")
    await f.close()
    assert (await get(fs, f"{tmpdir}/r.bin"))[:9] == head[:3] + b"xyz" + head[6:9]
    assert (await fs.stat(f"{tmpdir}/r.bin")).size == len(head + tail)
    with pytest.raises(RemoteNotFound):
        await fs.open_resume(f"{tmpdir}/missing", 0)


async def test_rename_without_overwrite_refuses_and_with_overwrite_replaces(
    fs: SFTPSession, tmpdir: str
) -> None:
    """rename keeps an existing target unless asked to replace it (posix-rename)."""
    await put(fs, f"{tmpdir}/a", b"A")
    await put(fs, f"{tmpdir}/b", b"B")
    with pytest.raises(RemoteFileFailure):
        await fs.rename(f"{tmpdir}/a", f"{tmpdir}/b", overwrite=False)
    assert await get(fs, f"{tmpdir}/b") == b"B"
    await fs.rename(f"{tmpdir}/a", f"{tmpdir}/b", overwrite=True)
    assert await get(fs, f"{tmpdir}/b") == b"A"
    await fs.rename(f"{tmpdir}/b", f"{tmpdir}/c", overwrite=False)
    assert [e.name for e in await fs.listdir(tmpdir)] == ["c"]


async def test_remove_rmdir_and_mkdir(fs: SFTPSession, tmpdir: str) -> None:
    """Files and empty directories go away; a non-empty directory and an existing one fail."""
    await fs.mkdir(f"{tmpdir}/d")
    with pytest.raises(RemoteFileFailure):
        await fs.mkdir(f"{tmpdir}/d")
    await put(fs, f"{tmpdir}/d/f", b"x")
    with pytest.raises(RemoteFileFailure):
        await fs.rmdir(f"{tmpdir}/d")
    await fs.remove(f"{tmpdir}/d/f")
    await fs.rmdir(f"{tmpdir}/d")
    assert await fs.listdir(tmpdir) == []


async def test_setstat_sets_mode_and_mtime_whatever_the_umask(fs: SFTPSession, tmpdir: str) -> None:
    """setstat sets the permission bits as given (a mode at creation goes through the umask)
    and the modification time, separately or together."""
    path = f"{tmpdir}/s"
    f = await fs.open_write(path, mode=0o600)
    await f.close()
    await fs.setstat(path, mode=0o664)
    assert (await fs.stat(path)).mode == 0o664
    await fs.setstat(path, mtime=1_000_000_000)
    attrs = await fs.stat(path)
    assert (attrs.mode, attrs.mtime) == (0o664, 1_000_000_000)
    await fs.setstat(path, mode=0o640, mtime=1_000_000_007)
    attrs = await fs.stat(path)
    assert (attrs.mode, attrs.mtime) == (0o640, 1_000_000_007)


async def test_missing_paths_are_not_found(fs: SFTPSession, tmpdir: str) -> None:
    """Every operation on a missing path raises RemoteNotFound, and the session goes on."""
    missing = f"{tmpdir}/nope"
    for op in (fs.stat, fs.lstat, fs.listdir, fs.open_read, fs.remove, fs.rmdir):
        with pytest.raises(RemoteNotFound):
            await op(missing)
    with pytest.raises(RemoteNotFound):
        await fs.open_write(f"{missing}/f")
    assert await fs.listdir(tmpdir) == []


async def test_unreadable_and_unwritable_are_permission_denied(
    fs: SFTPSession, tmpdir: str
) -> None:
    """Mode 000 file and a read-only directory give RemotePermissionDenied."""
    await put(fs, f"{tmpdir}/secret", b"x")
    await fs.mkdir(f"{tmpdir}/ro", 0o500)
    os.chmod(f"{tmpdir}/secret", 0)
    with pytest.raises(RemotePermissionDenied):
        await fs.open_read(f"{tmpdir}/secret")
    with pytest.raises(RemotePermissionDenied):
        await fs.open_write(f"{tmpdir}/ro/f")


async def test_pool_sftp_holds_one_channel_slot_and_gives_it_back(
    backend: Backend, stock_host: LocalHost
) -> None:
    """A held SFTP session counts as a channel in use; a file error does not cost the
    connection; the slot is free again afterwards."""
    target = stock_host.target(max_connections=1, max_sessions=2)
    async with Pool(backend) as pool:
        async with pool.sftp(target, acquire_timeout=10) as fs:
            assert pool.stats()[target]["channels_in_use"] == 1
            home = await fs.realpath(".")
            with pytest.raises(RemoteNotFound):
                async with pool.sftp(target, acquire_timeout=10) as fs2:
                    await fs2.stat(f"{home}/no-such-{uuid.uuid4().hex}")
            assert pool.stats()[target]["channels_in_use"] == 1
        stats = pool.stats()[target]
        assert (stats["channels_in_use"], stats["connections"]) == (0, 1)
        assert stats["counters"]["sftp_sessions"] == 2
        assert (await pool.run(target, ["echo", "ok"], timeout=10)).stdout == b"ok\n"


async def test_pool_sftp_waits_in_the_queue_and_times_out(
    backend: Backend, stock_host: LocalHost
) -> None:
    """With every slot held, another SFTP session (or command) waits, then PoolTimeout."""
    target = stock_host.target(max_connections=1, max_sessions=1)
    async with Pool(backend) as pool:
        async with pool.sftp(target, acquire_timeout=10) as fs:
            await fs.realpath(".")
            with pytest.raises(PoolTimeout):
                async with pool.sftp(target, acquire_timeout=0.3):
                    pass
            with pytest.raises(PoolTimeout):
                await pool.run(target, ["true"], acquire_timeout=0.3)
        async with pool.sftp(target, acquire_timeout=10) as fs:
            assert await fs.realpath(".")


async def test_a_lease_cancelled_mid_read_keeps_the_connection_unless_the_backend_cannot(
    backend: Backend, stock_host: LocalHost
) -> None:
    """A caller cancelled in the middle of a read (a client gone mid-download) frees its slot;
    the connection serves the next command without a new handshake, except on ssh2, whose
    interrupted session cannot close its channel (the pool retires that connection)."""
    target = stock_host.target(max_connections=1, max_sessions=2)
    path = os.path.join(stock_host.account.home, f"cancel-{uuid.uuid4().hex[:8]}")
    started = asyncio.Event()

    async def read_forever() -> None:
        async with pool.sftp(target, acquire_timeout=10) as fs:
            await put(fs, path, os.urandom(8 << 20), exclusive=False)
            started.set()
            while True:
                # Read the file again and again: at its end a backend may answer a read from
                # what it knows without a round trip (ssh2 does), so reading past the end in a
                # loop would never give the event loop back and the cancel would never come.
                f = await fs.open_read(path)
                while await f.read(1 << 20):
                    pass
                await f.close()

    try:
        async with Pool(backend) as pool:
            task = asyncio.create_task(read_forever())
            await asyncio.wait_for(started.wait(), 30)
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stats = pool.stats()[target]
            assert stats["channels_in_use"] == 0
            assert (await pool.run(target, ["echo", "ok"], timeout=10)).stdout == b"ok\n"
            connects = pool.stats()[target]["counters"]["connects"]
            assert connects == (2 if backend.name == "ssh2" else 1)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)  # the account's home is shared by the whole suite


async def test_connection_lost_mid_transfer_raises_connection_lost(
    backend: Backend, make_host: MakeHost
) -> None:
    """Killing the host's sessions during a read surfaces ConnectionLost, and the pool
    discards that connection."""
    host = make_host()
    target = host.target(max_connections=1, keepalive_interval=1, keepalive_count_max=2)
    path = os.path.join(host.account.home, f"big-{uuid.uuid4().hex[:8]}")
    async with Pool(backend) as pool:
        with pytest.raises(ConnectionLost):
            async with pool.sftp(target, acquire_timeout=10) as fs:
                await put(fs, path, os.urandom(1 << 20))
                f = await fs.open_read(path)
                await f.read(1 << 16)
                host.stop(kill_sessions=True)
                async with asyncio.timeout(30):
                    while await f.read(1 << 16):
                        pass
                    await f.close()
                    await fs.stat(path)
        assert pool.stats()[target]["connections"] == 0
    os.remove(path)  # the account's home is shared by the whole suite


async def test_ssh2_without_the_libssh2_extras_refuses_sftp_as_unsupported(
    stock_host: LocalHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ssh2-python build whose libssh2 lacks readlink/posix-rename refuses SFTP with
    RemoteUnsupported (the API's 501), and the pool's slot is free again."""
    from sshpool.backends import ssh2

    monkeypatch.setattr(ssh2, "_EXTRAS", None)
    target = stock_host.target(max_connections=1, max_sessions=1)
    async with Pool(load_backend("ssh2")) as pool:
        with pytest.raises(RemoteUnsupported):
            async with pool.sftp(target, acquire_timeout=10):
                pass
        assert pool.stats()[target]["channels_in_use"] == 0
        assert (await pool.run(target, ["echo", "ok"], timeout=10)).stdout == b"ok\n"
