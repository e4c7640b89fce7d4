"""Files on a host over SFTP on the pooled connections: confinement, transfers, their limits.

Confinement. A policy rule gives `file_roots` per host pattern (none: no file access). The roots
are resolved on the host once per host, account and rule (SFTP realpath: `~`, `{account}`,
`{sub}` substituted, symlinks followed; FileService keeps them), then each caller's path:

- read-like operations (stat, list, download, checksum) resolve the whole path with realpath,
  symlinks followed, and act on the *resolved* path;
- name-changing operations (upload, mkdir, delete, move) resolve the parent directory and act
  on `<resolved parent>/<basename>`: the final component is never followed (a symlink there is
  removed or renamed itself, and an upload onto one is refused);

and the resolved path must be a root or lie under one, else 403 `outside-roots`. A path that
does not resolve is judged by where it would lead (`Files._physical`), so neither a 404 nor a
403 tells what exists outside the roots. Writes never touch the host's protected paths (~/.ssh,
shell start-up files: 403 `protected-path`), and move/delete never act on a root or what holds
one (403 `root-refused`). Residual race: the account itself (a job of the same user) could swap
a directory of an already resolved path for a symlink between the check and the use; nobody
else can, and that account can read those files by running a job anyway.

Limits per identity: one rate token per SSH-backed operation (the jobs' bucket), at most
`max_transfers` uploads and downloads at once, `max_transfer_bytes` per request,
`max_file_size` per uploaded file; all in the first matching policy rule.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import bisect
import contextlib
import hashlib
import json
import posixpath
import re
import secrets
import sys
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from fnmatch import fnmatchcase

from prometheus_client import Counter

from api.auth import Principal
from api.config import Config
from api.metrics import Metrics
from api.policy import Grant, Policy
from api.problems import Problem, retry_after, ssh_problem
from api.quota import Quota
from sshpool import (
    CommandTimeout,
    ConnectionLost,
    FileAttrs,
    FileType,
    Pool,
    RemoteFile,
    RemoteFileError,
    RemoteNotFound,
    SFTPSession,
    SSHPoolError,
)

# Bytes per SFTP read or write the API issues; an upload or a download holds at most two of
# them at once (one moving on each side). 4 MiB is what asyncssh keeps in flight per call (16
# requests of OpenSSH's 255 KiB): with 1 MiB (5 requests) the SFTP pipe drained between chunks.
# Measured (loadtests.files_bench, 384 MiB, load 1.2-4, interleaved): upload 101/121/116 MB/s
# against 92/79/103 with 1 MiB, download 103/114/106 against 105/93/85; RSS growth per transfer
# +22 MiB against +8 (the 50 MiB bound of tests/loadtests/test_files_bench.py holds).
CHUNK = 4 << 20
MAX_PATH = 4096
# The longest name (one path component) Linux filesystems take, in bytes.
NAME_MAX = 255
# Symlinks followed when judging where a path that does not resolve would lead.
SYMLINK_HOPS = 8
# Confinements (home and roots per host, account and rule) kept at most; the oldest go first.
MAX_CONFINEMENTS = 10_000
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

# Snapshots of listings kept per identity (its least recently used go first beyond).
SNAPSHOTS_PER_IDENTITY = 4
TYPES: tuple[FileType, ...] = ("file", "dir", "symlink", "other")
# A transfer counts against max_transfers for at most this long if its process dies.
TRANSFER_TTL = 24 * 3600.0
SUB_SAFE = re.compile(r"^[A-Za-z0-9@._+-]{1,128}$")


def outside(given: str) -> Problem:
    return Problem(
        403, "outside-roots", "Path outside your file roots", f"{given!r} is not under your roots"
    )


def protected(given: str) -> Problem:
    return Problem(
        403,
        "protected-path",
        "Will not write where sshd or a login shell reads",
        f"{given!r} is (or holds, or lies in) a path the host's sshd or shells run or trust",
    )


def root_refused(given: str, what: str) -> Problem:
    return Problem(
        403, "root-refused", f"Will not {what} a file root", f"{given!r} is or holds a file root"
    )


def file_problem(exc: SSHPoolError, host: str | None = None) -> Problem:
    """The problem for an SSH failure during a file operation, without the host's details
    (absolute paths, account names): the title says what happened; a 503 names `host` (the
    configured name the caller used)."""
    if isinstance(exc, ConnectionLost):
        return Problem(
            502,
            "connection-lost",
            "The SSH connection to the host dropped",
            "the operation may be incomplete; an upload never leaves a partial file under its name",
        )
    problem = ssh_problem(exc, host=host)
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


def _holds(path: str, others: list[str]) -> bool:
    """`path` is one of `others` or an ancestor of one."""
    return any(o == path or o.startswith(path.rstrip("/") + "/") for o in others)


def _check_path(given: str) -> str:
    if not given or len(given) > MAX_PATH or "\0" in given:
        raise Problem(422, "invalid-path", "Invalid path", f"1 to {MAX_PATH} characters, no NUL")
    try:
        encoded = given.encode()
    except UnicodeEncodeError:
        raise Problem(422, "invalid-path", "Invalid path", "not valid UTF-8") from None
    if len(encoded) > MAX_PATH:
        raise Problem(422, "invalid-path", "Invalid path", f"at most {MAX_PATH} bytes in UTF-8")
    if any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        raise Problem(
            422,
            "name-too-long",
            "A name in the path is too long",
            f"at most {NAME_MAX} bytes per name in UTF-8 (the host's NAME_MAX)",
        )
    return given


@dataclass(slots=True)
class Place:
    """A confined location on the host: `path` is what operations use (resolved)."""

    given: str
    path: str


@dataclass(slots=True)
class Root:
    """One file root on the host, in the three forms a path can take to reach it."""

    # The pattern expanded (`~`, `{account}`, `{sub}`), absolute and normalised.
    written: str
    # Its parent resolved, its own name kept: what a name operation (move, delete) acts on.
    named: str
    # Its realpath, what paths must lie under; None while it does not exist.
    resolved: str | None

    @property
    def forms(self) -> list[str]:
        return [f for f in (self.written, self.named, self.resolved) if f is not None]


@dataclass(slots=True)
class Confinement:
    """An account's home and one rule's roots on one host, resolved once per configuration
    (FileService keeps them): a root re-resolved per request would follow whatever its path
    points to at that moment, a symlink swapped by a move included."""

    home: str
    roots: list[Root]
    # The host's protected paths, lexical and resolved; None until the first write needs them.
    protected: list[str] | None = None


class Files:
    """One caller's file operations on one host, over one held SFTP session."""

    def __init__(
        self, fs: SFTPSession, grant: Grant, who: Principal, confinement: Confinement
    ) -> None:
        self.fs = fs
        self.grant = grant
        self.who = who
        self.confinement = confinement

    @property
    def home(self) -> str:
        return self.confinement.home

    @property
    def roots(self) -> list[str]:
        return [r.resolved for r in self.confinement.roots if r.resolved is not None]

    @staticmethod
    async def confine(
        fs: SFTPSession, grant: Grant, who: Principal, patterns: list[str]
    ) -> Confinement:
        """The home and the roots of `patterns` resolved on the host."""
        home = await fs.realpath(".")
        found = Confinement(home, [])
        for pattern in patterns:
            written = _expand(home, pattern, grant, who)
            if written is None:
                continue
            parent, base = posixpath.split(written)
            named = written
            if base:
                with contextlib.suppress(RemoteFileError):
                    named = posixpath.join(await fs.realpath(parent), base)
            found.roots.append(Root(written, named, None))
        await Files.resolve_roots(fs, found)
        return found

    @staticmethod
    async def resolve_roots(fs: SFTPSession, found: Confinement) -> None:
        """Resolve the roots not resolved yet. A root that does not exist (yet) confines nothing
        and is looked up again at the next request; once it exists it is kept as resolved."""
        for root in found.roots:
            if root.resolved is None:
                with contextlib.suppress(RemoteFileError):
                    real = await fs.realpath(root.written)
                    with contextlib.suppress(RemoteFileError):
                        await fs.stat(real)  # OpenSSH resolves a missing last name too
                        root.resolved = real

    def _absolute(self, path: str) -> str:
        return _absolute(self.home, path)

    async def resolve(self, given: str) -> Place:
        """The whole path resolved (symlinks followed), confined."""
        absolute = self._absolute(_check_path(given))
        try:
            real = await self.fs.realpath(absolute)
        except RemoteFileError:
            # Missing, or a directory on the way the account may not search: either way, the
            # answer must not depend on what exists outside the roots.
            await self._judge_missing(given, absolute)
            raise
        if not _within(real, self.roots):
            raise outside(given)
        return Place(given, real)

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
        except RemoteFileError:
            where = await self._judge_missing(given, parent)
            # Every caller of this one writes: a protected path is refused as such, whether
            # or not its parent exists yet.
            await self.guard(Place(given, posixpath.join(where, base)))
            raise
        path = posixpath.join(real_parent, base)
        if not _within(path, self.roots):
            raise outside(given)
        return Place(given, path)

    async def _judge_missing(self, given: str, absolute: str) -> str:
        """For a path that does not resolve (a missing component on the way): 403 when it
        would lead outside the roots, so a 404 never depends on what exists outside them;
        else where it would lead."""
        where = await self._physical(absolute, SYMLINK_HOPS)
        if where is None or not _within(where, self.roots):
            raise outside(given)
        return where

    async def _physical(self, path: str, hops: int) -> str | None:
        """Where `path` (absolute, normalised) leads, as if its missing components existed as
        plain directories: the longest prefix that resolves (a binary search: a handful of
        realpath calls, whatever the depth), a dangling symlink right after it followed, the
        rest appended. None after `hops` symlinks (a loop)."""
        parts = [p for p in path.split("/") if p]
        if not parts:
            return "/"
        # The whole path does not resolve (why we are here); parts[:low] does, to `real`.
        low, high, real = 0, len(parts) - 1, "/"
        while low < high:
            middle = (low + high + 1) // 2
            try:
                candidate = await self.fs.realpath("/" + "/".join(parts[:middle]))
            except RemoteFileError:
                high = middle - 1
            else:
                low, real = middle, candidate
        following = posixpath.join(real, parts[low])
        rest = parts[low + 1 :]
        try:
            attrs = await self.fs.lstat(following)
        except RemoteFileError:
            return posixpath.normpath(posixpath.join(following, *rest))
        if attrs.type != "symlink":
            return posixpath.normpath(posixpath.join(following, *rest))
        if hops == 0:
            return None
        try:
            target = await self.fs.readlink(following)
        except RemoteFileError:
            return None
        led = posixpath.normpath(posixpath.join(real, target, *rest))
        try:
            return await self.fs.realpath(led)
        except RemoteFileError:
            return await self._physical(led, hops - 1)

    async def lstat(self, place: Place) -> FileAttrs | None:
        try:
            return await self.fs.lstat(place.path)
        except RemoteNotFound:
            return None

    async def guard(self, place: Place, *, holding: bool = False) -> None:
        """403 protected-path when `place` is, or lies in, one of the host's protected paths
        (with `holding`, also when it holds one: a move of a directory would bring its
        contents there, or take them away). Judged on the resolved path, so `..` and symlinks
        on the way do not get around it; the protected paths are resolved too (a `.bashrc`
        that is a link into a dotfiles repository protects its target)."""
        found = self.confinement.protected
        if found is None:
            found = await self._protected_paths()
            self.confinement.protected = found
        path = place.path
        if _within(path, found) or (holding and _holds(path, found)):
            raise protected(place.given)

    async def _protected_paths(self) -> list[str]:
        found: list[str] = []
        for entry in self.grant.host.protected_paths:
            lexical = posixpath.join(self.home, entry)
            found.append(lexical)
            try:
                real: str | None = await self.fs.realpath(lexical)
            except RemoteFileError:
                real = await self._physical(lexical, SYMLINK_HOPS)
            if real is not None and real != lexical:
                found.append(real)
        return found

    def guard_roots(self, place: Place, what: str) -> None:
        """403 root-refused when `place` is a root or holds one, in any of its forms: as
        written (a symlink that is a root's path included), as a name operation sees it, as
        resolved."""
        forms = [f for root in self.confinement.roots for f in root.forms]
        if _holds(place.path, forms):
            raise root_refused(place.given, what)


def _expand(home: str, pattern: str, grant: Grant, who: Principal) -> str | None:
    if "{sub}" in pattern and not SUB_SAFE.match(who.subject):
        return None  # a subject with '/' or '..' must never widen a root
    if who.subject in (".", ".."):
        return None
    root = pattern.replace("{sub}", who.subject)
    root = root.replace("{account}", grant.target.username)
    return _absolute(home, root)


def _absolute(home: str, path: str) -> str:
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    elif not path.startswith("/"):
        path = f"{home}/{path}"
    return posixpath.normpath(path)


Owner = tuple[str, str]


class Snapshot:
    """A directory's entries read once, sorted by name, for the listing's next pages: names in a
    list, the attributes in flat arrays (about 80 bytes an entry with a 20-character name,
    where a DirEntry with its FileAttrs takes about 250)."""

    __slots__ = (
        "given",
        "host",
        "kinds",
        "modes",
        "mtimes",
        "names",
        "nbytes",
        "owner",
        "path",
        "sizes",
        "used",
    )

    def __init__(self, owner: Owner, host: str, given: str, path: str) -> None:
        self.owner = owner
        self.host = host
        self.given = given
        self.path = path
        self.names: list[str] = []
        self.kinds = bytearray()
        self.sizes = array("q")
        self.modes = array("H")
        self.mtimes = array("q")
        self.nbytes = 0
        self.used = time.monotonic()

    def add(self, name: str, attrs: FileAttrs) -> None:
        self.names.append(name)
        self.kinds.append(TYPES.index(attrs.type))
        self.sizes.append(min(attrs.size, (1 << 63) - 1))
        self.modes.append(attrs.mode & 0o7777)
        self.mtimes.append(attrs.mtime)

    def sort(self) -> None:
        """Sort by name (code point order), the order the pages promise."""
        order = sorted(range(len(self.names)), key=self.names.__getitem__)
        self.names = [self.names[i] for i in order]
        self.kinds = bytearray(self.kinds[i] for i in order)
        self.sizes = array("q", (self.sizes[i] for i in order))
        self.modes = array("H", (self.modes[i] for i in order))
        self.mtimes = array("q", (self.mtimes[i] for i in order))
        self.nbytes = sum(map(sys.getsizeof, self.names)) + 27 * len(self.names) + 512

    def __len__(self) -> int:
        return len(self.names)

    def after(self, name: str | None) -> int:
        """The index of the first entry after `name` (0 for None)."""
        return 0 if name is None else bisect.bisect_right(self.names, name)

    def attrs(self, i: int) -> FileAttrs:
        return FileAttrs(TYPES[self.kinds[i]], self.sizes[i], self.modes[i], self.mtimes[i])


def encode_cursor(sid: str, name: str) -> str:
    raw = json.dumps([sid, name], ensure_ascii=False).encode("utf-8", "surrogatepass")
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[str, str]:
    """(snapshot id, the last name of the previous page); 422 for anything else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        sid, name = json.loads(raw.decode("utf-8", "surrogatepass"))
    except (ValueError, TypeError, binascii.Error):
        sid = name = None
    if not (isinstance(sid, str) and isinstance(name, str) and re.fullmatch(r"[0-9a-f]{32}", sid)):
        raise Problem(422, "invalid-cursor", "Invalid cursor", "pass `next_cursor` as it was given")
    return sid, name


class Listings:
    """The snapshots of this process's listings, for their next pages: a snapshot answers only
    its owner, for the host and path it was read from, until `ttl` seconds after its last page;
    all together stay within `budget` bytes (the least recently used dropped first), each
    identity keeps SNAPSHOTS_PER_IDENTITY. A cursor whose snapshot is gone (expired, dropped,
    or another replica's) reads the directory again and goes on after its name."""

    def __init__(self, ttl: float, budget: int) -> None:
        self.ttl = ttl
        self.budget = budget
        self.nbytes = 0
        self._snapshots: OrderedDict[str, Snapshot] = OrderedDict()

    def get(self, sid: str, owner: Owner, host: str, given: str) -> Snapshot | None:
        self._expire()
        snap = self._snapshots.get(sid)
        if snap is None or (snap.owner, snap.host, snap.given) != (owner, host, given):
            return None
        snap.used = time.monotonic()
        self._snapshots.move_to_end(sid)
        return snap

    def put(self, snap: Snapshot) -> str:
        self._expire()
        sid = secrets.token_hex(16)
        self._snapshots[sid] = snap
        self.nbytes += snap.nbytes
        mine = [k for k, v in self._snapshots.items() if v.owner == snap.owner]
        for key in mine[:-SNAPSHOTS_PER_IDENTITY]:
            self._drop(key)
        while self.nbytes > self.budget and self._snapshots:
            self._drop(next(iter(self._snapshots)))
        return sid

    def _drop(self, sid: str) -> None:
        self.nbytes -= self._snapshots.pop(sid).nbytes

    def _expire(self) -> None:
        # Least recently used first: stop at the first one still fresh.
        limit = time.monotonic() - self.ttl
        while self._snapshots:
            sid, snap = next(iter(self._snapshots.items()))
            if snap.used >= limit:
                break
            self._drop(sid)


def too_many_listings(cap: int) -> Problem:
    return Problem(
        429,
        "too-many-listings",
        "Too many listings at once",
        f"at most {cap} directory listings at once; their next pages are not counted",
        headers=retry_after(1),
    )


class FileService:
    def __init__(
        self, config: Config, policy: Policy, pool: Pool, quota: Quota, metrics: Metrics
    ) -> None:
        self.config = config
        self.policy = policy
        self.pool = pool
        self.quota = quota
        self.metrics = metrics
        self._confinements: OrderedDict[tuple[str, str, tuple[str, ...], str], Confinement] = (
            OrderedDict()
        )

        api = config.api
        self.listings = Listings(api.list_snapshot_ttl, api.list_snapshot_bytes)

    def grant(self, who: Principal, host: str) -> tuple[Grant, list[str]]:
        grant = self.policy.grant(who, host)
        roots = next((r for p, r in grant.rule.file_roots.items() if fnmatchcase(host, p)), None)
        if not roots:
            raise Problem(403, "files-forbidden", "No file access", f"no file roots on {host!r}")
        return grant, roots

    async def spend(self, who: Principal, grant: Grant) -> None:
        """One rate token per SSH-backed file operation, from the caller's job bucket."""
        await self.quota.take(who.key, grant.rule.rate, grant.rule.burst)

    async def confinement(
        self, fs: SFTPSession, grant: Grant, who: Principal, patterns: list[str]
    ) -> Confinement:
        """The home and roots for this host, account and rule (and subject, when a root names
        it), resolved on the first request and kept for the life of the process: a restart
        (a new configuration) resolves them again. A root that does not exist yet is looked
        up again at each request until it does."""
        subject = who.subject if any("{sub}" in p for p in patterns) else ""
        key = (grant.host_name, str(grant.target), tuple(patterns), subject)
        found = self._confinements.get(key)
        if found is None:
            found = await Files.confine(fs, grant, who, patterns)
            self._confinements[key] = found
            while len(self._confinements) > MAX_CONFINEMENTS:
                self._confinements.popitem(last=False)
        else:
            self._confinements.move_to_end(key)
            if any(r.resolved is None for r in found.roots):
                await Files.resolve_roots(fs, found)
        return found

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
                tenant=who.key,  # in turns with the caller's jobs
            ) as fs:
                confinement = await self.confinement(fs, grant, who, roots)
                yield Files(fs, grant, who, confinement)
        except SSHPoolError as exc:
            raise file_problem(exc, host) from exc

    @contextlib.asynccontextmanager
    async def transfer(self, who: Principal, grant: Grant, direction: str) -> AsyncIterator[None]:
        """Counts one transfer against the identity's max_transfers and the active gauge."""
        tid = uuid.uuid4().hex
        try:
            await self.quota.enter(
                who.key, tid, grant.rule.max_transfers, TRANSFER_TTL, space="transfers"
            )
        except Problem as refused:
            # The quota speaks of jobs; this set counts transfers, and says so.
            if refused.status != 429:
                raise
            raise Problem(
                429,
                "too-many-transfers",
                "Too many transfers at once",
                f"at most {grant.rule.max_transfers} uploads and downloads at once",
                headers=refused.headers,
            ) from None
        gauge = self.metrics.file_transfers.labels(direction)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()
            await self.quota.leave(who.key, tid, space="transfers")

    @contextlib.asynccontextmanager
    async def commit_lock(self, host: str, path: str) -> AsyncIterator[None]:
        """Held across an upload's last check of the file in place and its rename, so two
        uploads to one path commit one after the other (the second sees the first's file): an
        entry in the quota's active set for (host, resolved path) with a cap of one. Shared by
        the replicas and workers that share Redis (SSHAPI_REDIS_URL); without it, or while
        Redis is down, it holds within each process only."""
        key = (host, path)
        token = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        deadline = loop.time() + COMMIT_WAIT
        pause = 0.005
        while True:
            try:
                await self.quota.enter(key, token, 1, COMMIT_TTL, space="commits")
                break
            except Problem as busy:
                if busy.status != 429:
                    raise
            if loop.time() >= deadline:
                raise Problem(
                    503,
                    "file-busy",
                    "Another upload to this path is being committed",
                    None,
                    headers={"Retry-After": "1"},
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.2)
        try:
            yield
        finally:
            await self.quota.leave(key, token, space="commits")

    @contextlib.asynccontextmanager
    async def listing_slot(self, who: Principal, grant: Grant) -> AsyncIterator[None]:
        """Counts one directory read against the identity's max_listings."""
        lid = uuid.uuid4().hex
        cap = grant.rule.max_listings
        try:
            await self.quota.enter(
                who.key, lid, cap, self.config.api.list_timeout + 60, space="listings"
            )
        except Problem as exc:
            if exc.status != 429:
                raise
            raise too_many_listings(cap) from None
        try:
            yield
        finally:
            await self.quota.leave(who.key, lid, space="listings")

    async def list_dir(
        self, who: Principal, host: str, given: str, limit: int, cursor: str | None
    ) -> dict[str, object]:
        """A directory's page (or a non-directory's stat). The first page reads the directory
        once, streamed, stopping at max_list_entries + 1 (413), under the identity's
        max_listings; the next pages come from its snapshot (`Listings`) without reading the
        directory again."""
        api = self.config.api
        limit = min(limit, api.max_page)
        owner = who.key
        self.grant(who, host)  # 403 before anything else
        after: str | None = None
        if cursor is not None:
            sid, after = decode_cursor(cursor)
            snap = self.listings.get(sid, owner, host, given)
            if snap is not None:
                return await self._page(who, host, snap, sid, after, limit, None)
        async with self.open(who, host) as files:
            place = await files.resolve(given)
            attrs = await files.fs.stat(place.path)
            if attrs.type != "dir":
                return {"path": given, **describe(place.path.rsplit("/", 1)[-1], attrs)}
            async with self.listing_slot(who, files.grant):
                snap = await self._read(files, owner, host, place, api.max_list_entries)
            return await self._page(who, host, snap, None, after, limit, files)

    async def _read(
        self, files: Files, owner: Owner, host: str, place: Place, cap: int
    ) -> Snapshot:
        snap = Snapshot(owner, host, place.given, place.path)
        try:
            async with asyncio.timeout(self.config.api.list_timeout):
                async with contextlib.aclosing(files.fs.scandir(place.path)) as entries:
                    async for e in entries:
                        if len(snap) == cap:
                            raise Problem(
                                413, "too-large", "Directory too large", f"over {cap} entries"
                            )
                        snap.add(e.name, e.attrs)
        except TimeoutError:
            raise Problem(
                504,
                "listing-timeout",
                "The listing took too long",
                f"the host did not list the directory within {self.config.api.list_timeout:g} s",
            ) from None
        snap.sort()
        return snap

    async def _page(
        self,
        who: Principal,
        host: str,
        snap: Snapshot,
        sid: str | None,
        after: str | None,
        limit: int,
        files: Files | None,
    ) -> dict[str, object]:
        start = snap.after(after)
        end = min(start + limit, len(snap))
        links = [i for i in range(start, end) if TYPES[snap.kinds[i]] == "symlink"]
        targets: dict[int, str] = {}
        if links:
            async with contextlib.AsyncExitStack() as stack:
                if files is None:  # a page from a snapshot: a session only for its symlinks
                    files = await stack.enter_async_context(self.open(who, host))
                for i in links:
                    with contextlib.suppress(RemoteFileError):
                        targets[i] = await files.fs.readlink(f"{snap.path}/{snap.names[i]}")
        items = [describe(snap.names[i], snap.attrs(i), targets.get(i)) for i in range(start, end)]
        next_cursor = None
        if end < len(snap):
            if sid is None:
                sid = self.listings.put(snap)
            next_cursor = encode_cursor(sid, snap.names[end - 1])
        return {"path": snap.given, "type": "dir", "items": items, "next_cursor": next_cursor}

    def cap(self, grant: Grant, size: int, what: str) -> None:
        limit = grant.rule.max_transfer_bytes
        if size > limit:
            raise Problem(
                413, "too-large", "Transfer too large", f"{what}: at most {limit} bytes per request"
            )

    def checksum_timeout(self, grant: Grant, size: int) -> float:
        api = self.config.api
        scaled = api.checksum_timeout + size / api.checksum_min_rate
        return min(scaled, api.checksum_max_timeout, grant.rule.max_timeout)

    async def checksum(self, who: Principal, host: str, given: str) -> dict[str, object]:
        """sha256 computed on the host, not by downloading: the resolved path opened once onto
        sha256sum's stdin by CHECKSUM, which hashes it only if what it opened is a regular file
        the path still names. Counted as a job against the caller's max_concurrent, for at
        most `checksum_timeout` (scaled by the file's size); cancelling it (the client left)
        kills the remote process group."""
        async with self.open(who, host) as files:
            place = await files.resolve(given)
            attrs = await files.fs.stat(place.path)
            grant = files.grant
        if attrs.type != "file":
            raise Problem(409, "not-a-file", "Not a regular file", f"{given!r} is a {attrs.type}")
        await self.spend(who, grant)
        timeout = self.checksum_timeout(grant, attrs.size)
        owner = who.key
        cid = uuid.uuid4().hex
        # The same admission as a job's (api/jobs/): a place under max_concurrent until done.
        await self.quota.enter(
            owner, cid, grant.rule.max_concurrent, self.config.api.queue_timeout + timeout + 60
        )
        try:
            result = await self.pool.run(
                grant.target,
                ["sh", "-c", CHECKSUM, "sh", place.path],
                timeout=timeout,
                acquire_timeout=self.config.api.queue_timeout,
                max_output=4096,
                tenant=owner,
            )
        except CommandTimeout:
            raise Problem(
                504,
                "checksum-timeout",
                "The checksum took too long",
                f"stopped after {timeout:g} s (the limit for a file of this size)",
            ) from None
        except SSHPoolError as exc:
            raise file_problem(exc, host) from exc
        finally:
            await self.quota.leave(owner, cid)
        if result.exit_status == NOT_A_FILE:
            raise Problem(409, "not-a-file", "Not a regular file", f"{given!r} changed meanwhile")
        digest = result.stdout[:64].decode("ascii", "replace")
        if result.exit_status != 0 or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise Problem(502, "checksum-failed", "The host could not compute the checksum", None)
        return {"path": given, "algorithm": "sha256", "checksum": digest, "size": attrs.size}


# The checksum's remote script ($1: the resolved, confined path). The file is opened once, onto
# stdin, and hashed from there, so what is hashed is what was checked: a regular file, still
# named by the path (not a symlink, same device and inode), else exit NOT_A_FILE. Checked
# before the open too, because opening a FIFO blocks until a writer comes (sh has no
# O_NONBLOCK): only a swap within the microseconds between that check and the open still
# blocks, and then until the checksum's own timeout. sha256sum reading stdin prints `-` for a
# name: names with a newline or a backslash (which it escapes) need no parsing. One line and no
# `!`: a csh-family login shell takes it as it is (sshpool's command_line re-encodes others).
NOT_A_FILE = 65
CHECKSUM = "; ".join(
    [
        f'[ -h "$1" ] && exit {NOT_A_FILE}',
        f'[ -f "$1" ] || exit {NOT_A_FILE}',
        'exec <"$1"',
        f'[ -h "$1" ] && exit {NOT_A_FILE}',
        f'[ -f /dev/stdin ] && [ /dev/stdin -ef "$1" ] || exit {NOT_A_FILE}',
        "exec sha256sum",
    ]
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
