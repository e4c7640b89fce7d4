"""The file service: what the routes call, each operation confined, counted and capped.

Limits per identity: one rate token per SSH-backed operation (the jobs' bucket), at most
`max_transfers` uploads and downloads at once, `max_transfer_bytes` per request,
`max_file_size` per uploaded file, `max_listings` directory reads at once; all in the first
matching policy rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from fnmatch import fnmatchcase

from api import tracing
from api.accounts import AccountLookups
from api.auth import Principal
from api.config import Config
from api.files import checksum as checksums
from api.files.confine import Confinements, Files, Place
from api.files.errors import file_problem, too_many_listings
from api.files.listings import (
    TYPES,
    Listings,
    Owner,
    Snapshot,
    decode_cursor,
    describe,
    encode_cursor,
)
from api.files.resumable import Resumable
from api.files.transfers import (
    COMMIT_TTL,
    COMMIT_WAIT,
    Download,
    Preconditions,
    Uploaded,
    byte_range,
    etag_of,
    http_date,
    not_modified,
    store,
)
from api.metrics import Metrics
from api.policy import Grant, Policy
from api.problems import Problem
from api.quota import Quota
from sshpool import Pool, RemoteFileError, SSHPoolError

# A transfer counts against max_transfers for at most this long if its process dies.
TRANSFER_TTL = 24 * 3600.0


class FileService:
    def __init__(
        self,
        config: Config,
        policy: Policy,
        pool: Pool,
        quota: Quota,
        metrics: Metrics,
        accounts: AccountLookups,
    ) -> None:
        self.config = config
        self.policy = policy
        self.accounts = accounts
        self.pool = pool
        self.quota = quota
        self.metrics = metrics
        self.confinements = Confinements()
        # Resumable uploads (api/files/resumable.py): set where the store is (api/services.py).
        self.resumable: Resumable | None = None

        api = config.api
        self.listings = Listings(api.list_snapshot_ttl, api.list_snapshot_bytes)

    @property
    def uploads(self) -> Resumable:
        if self.resumable is None:
            raise Problem(501, "not-supported", "Resumable uploads are not set up here", None)
        return self.resumable

    def grant(self, who: Principal, host: str) -> tuple[Grant, list[str]]:
        grant = self.policy.grant(who, host)
        roots = next((r for p, r in grant.rule.file_roots.items() if fnmatchcase(host, p)), None)
        if not roots:
            raise Problem(403, "files-forbidden", "No file access", f"no file roots on {host!r}")
        return grant, roots

    async def spend(self, who: Principal, grant: Grant) -> None:
        """One rate token per SSH-backed file operation, from the caller's job bucket."""
        await self.quota.take(who.key, grant.rule.rate, grant.rule.burst)

    @contextlib.asynccontextmanager
    async def open(self, who: Principal, host: str, bulk: bool = False) -> AsyncIterator[Files]:
        """A confined SFTP view for `who` on `host`, the rate token spent; SSH errors before
        and during become their problems (RemoteFileError: 404/403/507/409, connection: 502).
        `bulk` (downloads, uploads): on the pool's transfer lane, when it has one."""
        grant, roots = self.grant(who, host)
        await self.spend(who, grant)
        await self.accounts.check(grant)
        try:
            async with self.pool.sftp(
                grant.target,
                acquire_timeout=self.config.api.queue_timeout,
                tenant=who.key,  # in turns with the caller's jobs
                bulk=bulk,
            ) as fs:
                confinement = await self.confinements.get(fs, grant, who, roots)
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
        target = grant.target
        where: dict[str, str | int] = {"server.address": target.host, "server.port": target.port}
        try:
            # Traced as its direction and host: never the file's path or contents.
            with tracing.detached(f"sftp {direction}", where):
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
                    files = await stack.enter_async_context(self.open(who, host, bulk=True))
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
        api = self.config.api
        timeout = checksums.timeout_for(api, grant, attrs.size)
        owner = who.key
        cid = uuid.uuid4().hex
        # The same admission as a job's (api/jobs/): a place under max_concurrent until done.
        await self.quota.enter(
            owner, cid, grant.rule.max_concurrent, api.queue_timeout + timeout + 60
        )
        try:
            digest = await checksums.compute(
                self.pool,
                grant,
                host,
                given,
                place.path,
                timeout=timeout,
                acquire_timeout=api.queue_timeout,
                tenant=owner,
            )
        finally:
            await self.quota.leave(owner, cid)
        return {"path": given, "algorithm": "sha256", "checksum": digest, "size": attrs.size}

    # ---- transfers

    async def download(
        self, who: Principal, host: str, given: str, range_: str | None, if_none_match: str | None
    ) -> Download:
        """A download of the file at `given` (one `Range`, `If-None-Match`), holding a session
        and a transfer slot until its body ends or it is closed; a 304 holds nothing."""
        stack = contextlib.AsyncExitStack()
        try:
            files = await stack.enter_async_context(self.open(who, host, bulk=True))
            place = await files.resolve(given)
            attrs = await files.fs.stat(place.path)
            if attrs.type != "file":
                raise Problem(
                    409, "not-a-file", "Not a regular file", f"{given!r} is a {attrs.type}"
                )
            etag = etag_of(attrs)
            headers = {
                "ETag": etag,
                "Last-Modified": http_date(attrs.mtime),
                "Accept-Ranges": "bytes",
            }
            if not_modified(if_none_match, etag):
                await stack.aclose()
                return Download(304, headers, stack)
            span = byte_range(range_, attrs.size)
            start, end = span or (0, attrs.size)
            self.cap(files.grant, end - start, "download")
            await stack.enter_async_context(self.transfer(who, files.grant, "download"))
            remote = await files.fs.open_read(place.path, start)
            stack.push_async_callback(remote.close)
        except SSHPoolError as exc:
            await stack.aclose()
            raise file_problem(exc, host) from exc
        except BaseException:
            await stack.aclose()
            raise
        headers["Content-Length"] = str(end - start)
        status = 200
        if span is not None:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{attrs.size}"
        counter = self.metrics.file_bytes.labels("download")
        return Download(status, headers, stack, remote, end - start, counter)

    async def upload(
        self,
        who: Principal,
        host: str,
        given: str,
        body: AsyncIterable[bytes],
        declared: int | None,
        if_match: str | None,
        if_none_match: str | None,
    ) -> Uploaded:
        """Store `body` at `given`: refused early when its declared length is over the caps or
        its preconditions fail, streamed to a temporary name, renamed into place (see
        `transfers.store`)."""
        conditions = Preconditions.parse(if_match, if_none_match)
        async with self.open(who, host, bulk=True) as files:
            grant = files.grant
            limit = min(grant.rule.max_file_size, grant.rule.max_transfer_bytes)
            if declared is not None and declared > limit:
                raise Problem(413, "too-large", "File too large", f"at most {limit} bytes")
            place = await files.resolve_name(given)
            await files.guard(place)
            existing = await files.lstat(place)
            conditions.check(given, existing)  # early, before any byte moves
            async with self.transfer(who, grant, "upload"):
                return await store(
                    files,
                    place,
                    given,
                    conditions,
                    existing,
                    body,
                    limit,
                    self.metrics.file_bytes.labels("upload"),
                    lambda: self.commit_lock(host, place.path),
                )

    # ---- names

    async def delete(self, who: Principal, host: str, given: str) -> None:
        async with self.open(who, host) as files:
            place = await files.resolve_name(given)
            files.guard_roots(place, "delete")
            await files.guard(place)
            attrs = await files.fs.lstat(place.path)
            if attrs.type == "dir":
                await files.fs.rmdir(place.path)
            else:
                await files.fs.remove(place.path)

    async def mkdir(self, who: Principal, host: str, given: str) -> dict[str, object]:
        async with self.open(who, host) as files:
            place = await files.resolve_name(given)
            await files.guard(place)
            await files.fs.mkdir(place.path, 0o755)
            attrs = await files.fs.stat(place.path)
        return {"path": given, **describe(_name(place), attrs)}

    async def move(
        self, who: Principal, host: str, source: str, destination: str, overwrite: bool
    ) -> dict[str, object]:
        async with self.open(who, host) as files:
            src = await files.resolve_name(source)
            dst = await files.resolve_name(destination)
            # Both ends are judged whole: a directory moved brings its contents along, and one
            # moved away takes them (a root, a protected path) with it.
            files.guard_roots(src, "move")
            files.guard_roots(dst, "replace")
            await files.guard(src, holding=True)
            await files.guard(dst, holding=True)
            await files.fs.lstat(src.path)
            await files.fs.rename(src.path, dst.path, overwrite=overwrite)
            attrs = await files.fs.lstat(dst.path)
        return {"path": destination, **describe(_name(dst), attrs)}


def _name(place: Place) -> str:
    return place.path.rsplit("/", 1)[-1]
