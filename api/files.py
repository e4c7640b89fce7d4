"""Files on a host over SFTP on the pooled connections: confinement, transfers, their limits.

Confinement. A policy rule gives `file_roots` per host pattern. For each request the roots are
resolved on the host (SFTP realpath: `~`, `{account}`, `{sub}` substituted, symlinks followed),
then the caller's path:

- read-like operations (stat, list, download, checksum) resolve the whole path with realpath,
  symlinks followed, and act on the *resolved* path;
- name-changing operations (upload, mkdir, delete, move) resolve the parent directory and act
  on `<resolved parent>/<basename>`: the final component is never followed (a symlink there is
  removed or renamed itself, and an upload onto one is refused);

and the resolved path must be a root or lie under one, else 403 `outside-roots`. A path whose
parent does not exist is judged lexically (normalised) before answering 404, so a 404 never
confirms what exists outside the roots. Residual race: the account itself (a job of the same
user) could swap a directory of an already resolved path for a symlink between the check and
the use; nobody else can, and that account can read those files by running a job anyway.

Limits per identity: one rate token per SSH-backed operation (the jobs' bucket), at most
`max_transfers` uploads and downloads at once, `max_transfer_bytes` per request,
`max_file_size` per uploaded file; all in the first matching policy rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import posixpath
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from fnmatch import fnmatchcase

from prometheus_client import Counter

from api.auth import Principal
from api.config import Config
from api.metrics import Metrics
from api.policy import Grant, Policy
from api.problems import Problem, ssh_problem
from api.quota import Quota
from sshpool import ConnectionLost, Pool, RemoteFileError, RemoteNotFound, SSHPoolError
from sshpool.backends.base import FileAttrs, RemoteFile, SFTPSession

# Bytes per SFTP read or write the API issues; an upload or a download holds at most two of
# them at once (one moving on each side). 4 MiB is what asyncssh keeps in flight per call (16
# requests of OpenSSH's 255 KiB): with 1 MiB (5 requests) the SFTP pipe drained between chunks.
# Measured (loadtests.files_bench, 384 MiB, load 1.2-4, interleaved): upload 101/121/116 MB/s
# against 92/79/103 with 1 MiB, download 103/114/106 against 105/93/85; RSS growth per transfer
# +22 MiB against +8 (the 50 MiB bound of tests/loadtests/test_files_bench.py holds).
CHUNK = 4 << 20
MAX_PATH = 4096
# The most entries a directory listing reads from the host.
MAX_ENTRIES = 100_000
# A transfer counts against max_transfers for at most this long if its process dies.
TRANSFER_TTL = 24 * 3600.0
SUB_SAFE = re.compile(r"^[A-Za-z0-9@._+-]{1,128}$")


def outside(given: str) -> Problem:
    return Problem(
        403, "outside-roots", "Path outside your file roots", f"{given!r} is not under your roots"
    )


def file_problem(exc: SSHPoolError) -> Problem:
    """The problem for an SSH failure during a file operation, without the host's details
    (absolute paths, account names): the title says what happened."""
    if isinstance(exc, ConnectionLost):
        return Problem(
            502,
            "connection-lost",
            "The SSH connection to the host dropped",
            "the operation may be incomplete; an upload never leaves a partial file under its name",
        )
    problem = ssh_problem(exc)
    if isinstance(exc, RemoteFileError):
        problem.detail = None
    return problem


def etag_of(attrs: FileAttrs) -> str:
    return f'"{attrs.size:x}-{attrs.mtime:x}"'


def http_date(ts: int) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")


def iso(ts: int) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def describe(name: str, attrs: FileAttrs, target: str | None = None) -> dict[str, object]:
    entry: dict[str, object] = {
        "name": name,
        "type": attrs.type,
        "size": attrs.size,
        "mode": f"{attrs.mode:04o}",
        "mtime": iso(attrs.mtime),
    }
    if target is not None:
        entry["target"] = target
    return entry


def _within(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _check_path(given: str) -> str:
    if not given or len(given) > MAX_PATH or "\0" in given:
        raise Problem(422, "invalid-path", "Invalid path", f"1 to {MAX_PATH} characters, no NUL")
    return given


@dataclass(slots=True)
class Place:
    """A confined location on the host: `path` is what operations use (resolved)."""

    given: str
    path: str
    roots: list[str]

    @property
    def is_root(self) -> bool:
        return self.path in self.roots


class Files:
    """One caller's file operations on one host, over one held SFTP session."""

    def __init__(self, fs: SFTPSession, grant: Grant, who: Principal, roots: list[str]) -> None:
        self.fs = fs
        self.grant = grant
        self.who = who
        self.roots = roots
        self.home = ""

    async def start(self) -> None:
        self.home = await self.fs.realpath(".")
        resolved = []
        for pattern in self.roots:
            root = self._expand(pattern)
            if root is None:
                continue
            # A root that does not exist (yet) confines nothing; it is looked up again next time.
            with contextlib.suppress(RemoteFileError):
                resolved.append(await self.fs.realpath(root))
        self.roots = resolved

    def _expand(self, pattern: str) -> str | None:
        if "{sub}" in pattern and not SUB_SAFE.match(self.who.subject):
            return None  # a subject with '/' or '..' must never widen a root
        if self.who.subject in (".", ".."):
            return None
        root = pattern.replace("{sub}", self.who.subject)
        root = root.replace("{account}", self.grant.target.username)
        return self._absolute(root)

    def _absolute(self, path: str) -> str:
        if path == "~" or path.startswith("~/"):
            path = self.home + path[1:]
        elif not path.startswith("/"):
            path = f"{self.home}/{path}"
        return posixpath.normpath(path)

    async def resolve(self, given: str) -> Place:
        """The whole path resolved (symlinks followed), confined."""
        absolute = self._absolute(_check_path(given))
        try:
            real = await self.fs.realpath(absolute)
        except RemoteNotFound:
            if not _within(absolute, self.roots):
                raise outside(given) from None
            raise
        if not _within(real, self.roots):
            raise outside(given)
        return Place(given, real, self.roots)

    async def resolve_name(self, given: str) -> Place:
        """The parent resolved and confined, the final component kept as it is (not followed)."""
        absolute = self._absolute(_check_path(given))
        parent, base = posixpath.split(absolute)
        if base in ("", ".", ".."):
            if absolute in self.roots or not _within(absolute, self.roots):
                raise outside(given)
            raise Problem(422, "invalid-path", "Invalid path", "the path must name an entry")
        try:
            real_parent = await self.fs.realpath(parent)
        except RemoteNotFound:
            if not _within(absolute, self.roots):
                raise outside(given) from None
            raise
        path = posixpath.join(real_parent, base)
        if not _within(path, self.roots):
            raise outside(given)
        return Place(given, path, self.roots)

    async def lstat(self, place: Place) -> FileAttrs | None:
        try:
            return await self.fs.lstat(place.path)
        except RemoteNotFound:
            return None


class FileService:
    def __init__(
        self, config: Config, policy: Policy, pool: Pool, quota: Quota, metrics: Metrics
    ) -> None:
        self.config = config
        self.policy = policy
        self.pool = pool
        self.quota = quota
        self.metrics = metrics

    def grant(self, who: Principal, host: str) -> tuple[Grant, list[str]]:
        grant = self.policy.grant(who, host)
        roots = next((r for p, r in grant.rule.file_roots.items() if fnmatchcase(host, p)), None)
        if not roots:
            raise Problem(403, "files-forbidden", "No file access", f"no file roots on {host!r}")
        return grant, roots

    async def spend(self, who: Principal, grant: Grant) -> None:
        """One rate token per SSH-backed file operation, from the caller's job bucket."""
        await self.quota.take((who.issuer, who.subject), grant.rule.rate, grant.rule.burst)

    @contextlib.asynccontextmanager
    async def open(self, who: Principal, host: str) -> AsyncIterator[Files]:
        """A confined SFTP view for `who` on `host`, the rate token spent; SSH errors before
        and during become their problems (RemoteFileError: 404/403/507/409, connection: 502)."""
        grant, roots = self.grant(who, host)
        await self.spend(who, grant)
        try:
            async with self.pool.sftp(
                grant.target,
                acquire_timeout=self.config.api.queue_timeout,
                tenant=(who.issuer, who.subject),  # in turns with the caller's jobs
            ) as fs:
                files = Files(fs, grant, who, list(roots))
                await files.start()
                yield files
        except SSHPoolError as exc:
            raise file_problem(exc) from exc

    @contextlib.asynccontextmanager
    async def transfer(self, who: Principal, grant: Grant, direction: str) -> AsyncIterator[None]:
        """Counts one transfer against the identity's max_transfers and the active gauge."""
        key = (f"files\0{who.issuer}", who.subject)  # its own set, apart from active jobs
        tid = uuid.uuid4().hex
        await self.quota.enter(key, tid, grant.rule.max_transfers, TRANSFER_TTL)
        gauge = self.metrics.file_transfers.labels(direction)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()
            await self.quota.leave(key, tid)

    def cap(self, grant: Grant, size: int, what: str) -> None:
        limit = grant.rule.max_transfer_bytes
        if size > limit:
            raise Problem(
                413, "too-large", "Transfer too large", f"{what}: at most {limit} bytes per request"
            )

    async def checksum(self, who: Principal, host: str, given: str) -> dict[str, object]:
        """sha256 computed on the host (sha256sum over exec, the resolved path as one argv
        element), not by downloading."""
        async with self.open(who, host) as files:
            place = await files.resolve(given)
            attrs = await files.fs.stat(place.path)
            grant = files.grant
        if attrs.type != "file":
            raise Problem(409, "not-a-file", "Not a regular file", f"{given!r} is a {attrs.type}")
        await self.spend(who, grant)
        try:
            result = await self.pool.run(
                grant.target,
                ["sha256sum", "--", place.path],
                timeout=grant.rule.max_timeout,
                acquire_timeout=self.config.api.queue_timeout,
                max_output=4096,
            )
        except SSHPoolError as exc:
            raise file_problem(exc) from exc
        digest = result.stdout[:64].decode("ascii", "replace")
        if result.exit_status != 0 or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise Problem(502, "checksum-failed", "The host could not compute the checksum", None)
        return {"path": given, "algorithm": "sha256", "checksum": digest, "size": attrs.size}


def temp_name(path: str) -> str:
    """The upload's temporary name, in the final name's directory (so the rename is atomic)."""
    parent, base = posixpath.split(path)
    return posixpath.join(parent, f".{base[:100]}.sshapi-{uuid.uuid4().hex[:12]}.part")


class Upload:
    """An upload's bytes on their way to the open temporary file: counted as they arrive (the
    size caps enforced there), gathered into CHUNK-sized writes, each hashed and written while
    the next one is read from the client.

    At most one chunk is in flight (one being written, one being gathered: RSS stays flat, and
    a slow host slows the client down through TCP). Writing a chunk while reading the next one
    keeps the SFTP channel and the HTTP connection busy at once; strictly alternating, each
    sat idle while the other worked. The hash runs in a thread (hashlib lets go of the GIL on
    large buffers), beside the event loop that drives both connections."""

    def __init__(self, limit: int, remote: RemoteFile, counter: Counter) -> None:
        self.limit = limit
        self.remote = remote
        self.counter = counter
        self.size = 0
        self.sha256 = hashlib.sha256()
        self._pieces: list[bytes] = []
        self._gathered = 0
        self._pending: asyncio.Future[None] | None = None

    async def add(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise Problem(413, "too-large", "File too large", f"at most {self.limit} bytes")
        self._pieces.append(data)
        self._gathered += len(data)
        if self._gathered >= CHUNK:
            await self._flush()

    async def finish(self) -> None:
        """Write what is left and wait for every write: the file is complete on return."""
        if self._pieces:
            await self._flush()
        await self._settle()

    async def abort(self) -> None:
        """Let a write in flight end (it is at most CHUNK bytes) before the temporary file is
        removed, so no request on that handle outlives it; its error, if any, is moot."""
        with contextlib.suppress(Exception):
            await self._settle()

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
