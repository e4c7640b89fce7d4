"""Transfers: an upload's protocol (a temporary name opened exclusively, the bytes streamed
into it, the preconditions checked again under the path's commit lock, the rename into place)
and a download's body (one chunk read ahead of the client), with the HTTP pieces both speak:
ETags, `Range`, dates."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import posixpath
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from prometheus_client import Counter

from api.files.confine import Files, Place
from api.numbers import read_count
from api.problems import Problem
from sshpool import ConnectionLost, FileAttrs, RemoteFile, RemoteFileFailure, SSHPoolError

# Bytes per SFTP read or write the API issues; an upload or a download holds at most two of
# them at once (one moving on each side). 4 MiB is what asyncssh keeps in flight per call (16
# requests of OpenSSH's 255 KiB): with 1 MiB (5 requests) the SFTP pipe drained between chunks,
# for a few MiB more memory per transfer (the figures: docs/benchmarks.md, "Figures behind the
# code").
CHUNK = 4 << 20
# Bytes of an upload's name kept in its temporary name: with the dot, `.sshapi-`, 12 hex digits
# and `.part`, the temporary name stays within NAME_MAX.
TEMP_KEEP = 200
# An upload's commit (check, rename) holds its path's lock at most this long (the lock lapses
# after it if the process dies), and waits at most COMMIT_WAIT seconds for it.
COMMIT_TTL = 60.0
COMMIT_WAIT = 10.0
# The permission bits a new upload asks for: the account's umask takes its share, as for any
# file a program of that account creates (0644 with the usual 022).
NEW_FILE_MODE = 0o666
RANGE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$")


def chunk_of(remote: RemoteFile) -> int:
    """Bytes per read or write call for `remote`: a file on the transfer lane says how many
    its path wants (a long round trip wants more: sshpool.lane `wan_sizes`), else CHUNK."""
    chunk: int = getattr(remote, "chunk", CHUNK)
    return chunk


def etag_of(attrs: FileAttrs) -> str:
    return f'"{attrs.size:x}-{attrs.mtime:x}"'


def http_date(ts: int) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """One `bytes=` range as [start, end) within `size`; None: the whole file. Several ranges
    or another unit are ignored (RFC 9110 allows it): the whole file is sent."""
    if header is None:
        return None
    m = RANGE.match(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    # ASCII digits (the pattern), and past MAX_DIGITS read as "beyond any file", never
    # converted: int() refuses over 4,300 digits (a 500).
    first, last = m.group(1), m.group(2)
    if not first:
        n = read_count(last, saturate=True) or 0
        start, end = max(0, size - n), size
    else:
        start = read_count(first, saturate=True) or 0
        end = min(size, (read_count(last, saturate=True) or 0) + 1) if last else size
    if start >= size or start >= end:
        raise Problem(
            416,
            "range-not-satisfiable",
            "Range not satisfiable",
            f"the file has {size} bytes",
            headers={"Content-Range": f"bytes */{size}"},
        )
    return start, end


def not_modified(if_none_match: str | None, etag: str) -> bool:
    """`If-None-Match` names the file's ETag (or is `*`)."""
    return if_none_match is not None and (
        if_none_match.strip() == "*" or etag in [t.strip() for t in if_none_match.split(",")]
    )


def temp_name(path: str) -> str:
    """The upload's temporary name, in the final name's directory (so the rename is atomic):
    the name's first TEMP_KEEP bytes of UTF-8, cut on a character boundary, so that it stays
    within NAME_MAX whatever the name (a 240-byte name of emoji included)."""
    parent, base = posixpath.split(path)
    kept = base.encode()[:TEMP_KEEP].decode(errors="ignore")
    return posixpath.join(parent, f".{kept}.sshapi-{uuid.uuid4().hex[:12]}.part")


@dataclass(frozen=True, slots=True)
class Preconditions:
    """An upload's `If-Match` (`*`: any existing file; else one or more strong ETags) and
    `If-None-Match: *` (create only), checked against the file in place before the upload and
    again, under the path's lock, right before the rename."""

    match: frozenset[str] | None
    create_only: bool

    @classmethod
    def parse(cls, if_match: str | None, if_none_match: str | None) -> Preconditions:
        if if_none_match is not None and if_none_match.strip() != "*":
            raise Problem(422, "invalid-header", "Invalid If-None-Match", "only `*` is supported")
        match = None
        if if_match is not None:
            match = frozenset(t.strip() for t in if_match.split(",") if t.strip())
            if not match:
                raise Problem(422, "invalid-header", "Invalid If-Match", "`*` or ETags")
        return cls(match, if_none_match is not None)

    def check(self, given: str, existing: FileAttrs | None) -> None:
        if existing is not None and existing.type == "symlink":
            raise Problem(403, "symlink-refused", "Will not write through a symlink", given)
        if existing is not None and existing.type != "file":
            raise Problem(
                409, "not-a-file", "Not a regular file", f"{given!r} is a {existing.type}"
            )
        if self.create_only and existing is not None:
            raise Problem(412, "exists", "File exists", f"{given!r} exists (If-None-Match: *)")
        if self.match is not None:
            if existing is None:
                raise Problem(412, "etag-mismatch", "No such file", "If-Match: the file is gone")
            if "*" not in self.match and etag_of(existing) not in self.match:
                raise Problem(412, "etag-mismatch", "File changed", "If-Match did not match")


class Hasher(Protocol):
    """hashlib's sha256 as an upload uses it (api/files/uploads.py's `Both` is one too)."""

    def update(self, data: bytes, /) -> None: ...
    def digest(self) -> bytes: ...
    def hexdigest(self) -> str: ...


class Upload:
    """An upload's bytes on their way to the open temporary file: counted as they arrive (the
    size caps enforced there), gathered into CHUNK-sized writes, each hashed and written while
    the next one is read from the client.

    At most one chunk is in flight here (one being written, one being gathered: RSS stays
    flat, and a slow host slows the client down through TCP); the file's write may return
    with the last of its requests unanswered, and the next chunk's go out behind them
    (`RemoteFile.write`), so the SFTP pipe stays full across chunks on a long path. Writing a
    chunk while reading the next one keeps the SFTP channel and the HTTP connection busy at
    once; strictly alternating, each sat idle while the other worked. The hash runs in a
    thread (hashlib lets go of the GIL on large buffers), beside the event loop that drives
    both connections."""

    def __init__(
        self, limit: int, remote: RemoteFile, counter: Counter, sha256: Hasher | None = None
    ) -> None:
        self.limit = limit
        self.remote = remote
        self.chunk = chunk_of(remote)
        self.counter = counter
        self.size = 0
        # What hashes the bytes (a resumable upload's chunk: the chunk's and the file's).
        self.sha256: Hasher = sha256 or hashlib.sha256()
        self._pieces: list[bytes] = []
        self._gathered = 0
        self._pending: asyncio.Future[None] | None = None

    async def add(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise Problem(413, "too-large", "File too large", f"at most {self.limit} bytes")
        self._pieces.append(data)
        self._gathered += len(data)
        if self._gathered >= self.chunk:
            await self._flush()

    async def finish(self) -> None:
        """Write what is left and wait for every write: the file is complete on return."""
        if self._pieces:
            await self._flush()
        await self._settle()
        await self.remote.flush()

    async def abort(self) -> None:
        """Let the writes in flight end (at most two chunks) before the temporary file is
        removed, so no request on that handle outlives it; their errors, if any, are moot."""
        with contextlib.suppress(Exception):
            await self._settle()
        with contextlib.suppress(Exception):
            await self.remote.flush()

    async def _flush(self) -> None:
        chunk = b"".join(self._pieces)
        self._pieces.clear()
        self._gathered = 0
        await self._settle()
        self._pending = asyncio.ensure_future(self._store(chunk))

    async def _settle(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            await pending

    async def _store(self, chunk: bytes) -> None:
        await asyncio.gather(asyncio.to_thread(self.sha256.update, chunk), self.remote.write(chunk))
        self.counter.inc(len(chunk))


@dataclass(frozen=True, slots=True)
class Uploaded:
    """A complete upload: whether it replaced a file, and the new file's ETag, size, sha256."""

    replaced: bool
    etag: str
    size: int
    sha256: str


async def store(
    files: Files,
    place: Place,
    given: str,
    conditions: Preconditions,
    existing: FileAttrs | None,
    body: AsyncIterable[bytes],
    limit: int,
    counter: Counter,
    commit_lock: Callable[[], AbstractAsyncContextManager[None]],
) -> Uploaded:
    """Stream `body` into a temporary name beside `place` (opened exclusively), then rename it
    into place under `commit_lock`; the temporary file is removed whatever way it fails.
    `existing` is the file in place when the upload began (its conditions checked)."""
    temp = temp_name(place.path)
    # A replacement never asks for more than the file it replaces allows (the umask may
    # take more): its bytes are no more readable while they arrive than they will be.
    mode = existing.mode & 0o777 if existing is not None else NEW_FILE_MODE
    remote = await files.fs.open_write(temp, exclusive=True, mode=mode)
    upload = Upload(limit, remote, counter)
    done = False
    try:
        async for data in body:
            await upload.add(data)
        await upload.finish()
        await remote.close()
        async with commit_lock():
            replaced = await commit(files, conditions, place, temp, given)
            attrs = await files.fs.stat(place.path)
        done = True
    finally:
        if not done:
            await upload.abort()
            await discard(files, remote, temp)
    return Uploaded(replaced, etag_of(attrs), upload.size, upload.sha256.hexdigest())


async def commit(
    files: Files, conditions: Preconditions, place: Place, temp: str, given: str
) -> bool:
    """Rename the complete temporary file onto its name, under the path's commit lock: the
    conditions checked again against what is there now (another upload may have replaced it
    meanwhile), a replaced file's permission bits kept, and its ETag made to change. True when
    a file was replaced."""
    current = await files.lstat(place)
    conditions.check(given, current)
    if current is not None:
        written = await files.fs.lstat(temp)
        mode = current.mode & 0o777  # never setuid, setgid or sticky from an upload
        # Same size within the same second would keep the ETag, and a client holding the old
        # one could replace this version unseen: move the time on by a second then.
        mtime = current.mtime + 1 if etag_of(written) == etag_of(current) else None
        if mode != written.mode or mtime is not None:
            await files.fs.setstat(temp, mode=None if mode == written.mode else mode, mtime=mtime)
    try:
        await files.fs.rename(temp, place.path, overwrite=not conditions.create_only)
    except RemoteFileFailure:
        raise Problem(412, "exists", "File exists", f"{given!r} appeared meanwhile") from None
    return current is not None


async def discard(files: Files, remote: RemoteFile, temp: str) -> None:
    """Remove an upload's temporary file (best effort: a dead connection leaves it; its name
    says what it is)."""
    with contextlib.suppress(SSHPoolError):
        await remote.close()
    with contextlib.suppress(SSHPoolError):
        await files.fs.remove(temp)


class Download:
    """A download under way: its status and headers, and its body read from the host one chunk
    ahead of the client. What it holds (the SFTP session, the transfer slot, the open file) is
    on `stack`, let go of by `aclose`, which the body calls when it ends; a 304 holds nothing
    and has no body."""

    def __init__(
        self,
        status: int,
        headers: dict[str, str],
        stack: contextlib.AsyncExitStack,
        remote: RemoteFile | None = None,
        length: int = 0,
        counter: Counter | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        self._stack = stack
        self._remote = remote
        self._length = length
        self._counter = counter

    async def aclose(self) -> None:
        await self._stack.aclose()

    async def body(self) -> AsyncGenerator[bytes, None]:
        remote, counter = self._remote, self._counter
        assert remote is not None and counter is not None, "a 304 has no body"
        remaining = self._length
        chunk = chunk_of(remote)
        ahead: asyncio.Future[bytes] | None = None
        try:
            while remaining > 0:
                data = await (ahead or remote.read(min(chunk, remaining)))
                if not data:
                    # The file shrank since the stat: the client sees a short body and knows.
                    raise ConnectionLost("file shrank during download", started=True)
                remaining -= len(data)
                # The next chunk is read from the host while this one goes to the client (one
                # chunk ahead at most); alternating, each side sat idle while the other worked.
                ahead = (
                    asyncio.ensure_future(remote.read(min(chunk, remaining))) if remaining else None
                )
                counter.inc(len(data))
                yield data
        finally:
            # A read ahead the client never took: stopped, or its error marked as seen.
            if ahead is not None and not ahead.cancel() and not ahead.cancelled():
                ahead.exception()
            await self._stack.aclose()
