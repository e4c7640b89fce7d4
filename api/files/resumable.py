"""Resumable uploads: one file sent in chunks, each its own request, so that an upload cut off
by a flaky network goes on from what the host holds instead of starting again.

The protocol is the IETF's "Resumable Uploads for HTTP" (draft-ietf-httpbis-resumable-upload:
`Upload-Offset`, `Upload-Complete`, `Upload-Length`, the offset read by HEAD, 409 with the
expected offset, DELETE to cancel) with RFC 9530's `Content-Digest` per chunk (tus's checksum
extension is the precedent: a chunk whose digest does not match is refused and the offset does
not move). docs/files.md has the contract; the choices that are ours:

- The bytes go where PUT's go: a temporary name beside the file, created (exclusively) when the
  upload is created, written chunk by chunk (`SFTPSession.open_resume`: no truncation), renamed
  into place by the final chunk under the path's commit lock, the preconditions checked again
  then (`transfers.commit`).
- The offset is `min(received, the temporary file's size)`: `received`, the bytes confirmed in
  the store (api/store/uploads.py), and the file's size, read on the host at each chunk and HEAD
  (the host is the truth if it lost bytes). Bytes on the host past `received` (a chunk that was
  cut off or refused, an API process that died mid-chunk) were never confirmed: the next chunk
  writes over them, from `received`, so nothing unconfirmed is ever counted.
- A chunk cut off mid-way: without a digest, what landed counts (the draft: the server keeps
  what it received); with one, nothing of it counts (it cannot be checked).
- The whole file's sha256: when every chunk came to this process in order and counted whole,
  the running hash of the bytes it wrote (as PUT's), kept in memory between chunks; otherwise
  (a chunk on another replica, a restart, a cut chunk) computed on the host (the checksum
  script of api/files/checksum.py) from the complete temporary file before the rename.
- One chunk at a time per upload (the row's lease), any replica; state in the store, so a chunk
  may land on another replica or after a restart. Expired uploads' temporary files are removed
  by the supervisor's `upload-expiry` task (`Resumable.loop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from api.auth import Principal
from api.config import ApiConfig
from api.files import checksum as checksums
from api.files.confine import Files, Place
from api.files.transfers import (
    NEW_FILE_MODE,
    Preconditions,
    Upload,
    Uploaded,
    commit,
    etag_of,
    temp_name,
)
from api.files.uploads import (
    SHA256,
    Both,
    FileOps,
    UploadRecord,
    UploadState,
    UploadTable,
    digest_header,
    inconsistent,
    mismatch,
    not_found,
)
from api.problems import Problem, retry_after
from sshpool import RemoteFile, RemoteNotFound, SSHPoolError

log = logging.getLogger("sshapi.files.uploads")

# A chunk's lease on its upload lasts this long and is renewed while its bytes keep coming: a
# process that dies mid-chunk blocks the upload's next chunk for this long at most.
LEASE = 30.0
RENEW = LEASE / 3
# Uploads whose whole file's running hash a process keeps at most (about 200 bytes each).
RUNNING = 4096
# Expired uploads the sweep takes per pass.
SWEEP_BATCH = 100


class Resumable:
    """Resumable uploads for the file service: create, append (a chunk), state (HEAD/GET),
    cancel, and the sweep of expired ones. Uses the service's confinement, limits and commit
    lock; keeps its state in `table`."""

    def __init__(
        self,
        service: FileOps,
        table: UploadTable,
        api: ApiConfig,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.service = service
        self.table = table
        self.api = api
        self.clock = clock
        # The whole file's running sha256 per upload whose chunks all came here in order:
        # upload id -> (the bytes it covers, the hash). Gone (a chunk elsewhere, a restart, a
        # cut): the commit hashes the file on the host instead. At most RUNNING, oldest first.
        self._running: OrderedDict[str, tuple[int, Any]] = OrderedDict()

    def _keep_running(self, upload_id: str, covered: int, whole: Any) -> None:
        self._running[upload_id] = (covered, whole)
        while len(self._running) > RUNNING:
            self._running.popitem(last=False)

    # ---- create, state, cancel

    async def create(
        self,
        who: Principal,
        host: str,
        given: str,
        length: int | None,
        if_match: str | None,
        if_none_match: str | None,
    ) -> UploadState:
        """A new upload of `length` bytes to `given`: its preconditions checked now (and again
        at its commit), its temporary file created on the host, its record in the store."""
        conditions = Preconditions.parse(if_match, if_none_match)
        if length is None:
            raise Problem(
                422, "invalid-header", "Upload-Length required", "the file's size in bytes"
            )
        service = self.service
        async with service.open(who, host, bulk=True) as files:
            limit = files.grant.rule.max_file_size
            if length > limit:
                raise Problem(413, "too-large", "File too large", f"at most {limit} bytes")
            place = await files.resolve_name(given)
            await files.guard(place)
            existing = await files.lstat(place)
            conditions.check(given, existing)
            now = self.clock()
            upload_id = uuid.uuid4().hex
            temp = temp_name(place.path)
            values: dict[str, object] = {
                "id": upload_id,
                "owner_iss": who.issuer,
                "owner_sub": who.subject,
                "owner_account": who.kept_account,
                "host": host,
                "path": given,
                "resolved": place.path,
                "temp": temp,
                "length": length,
                "received": 0,
                "if_match": if_match,
                "create_only": if_none_match is not None,
                "state": "open",
                "created_at": now,
                "expires_at": now + self.api.upload_ttl,
                # Leased while the temporary file is made: the sweep keeps off it meanwhile.
                "busy_until": now + LEASE,
                "busy_by": upload_id,
            }
            if not await self.table.create(values, self.api.max_open_uploads, now):
                raise Problem(
                    429,
                    "too-many-uploads",
                    "Too many open uploads",
                    f"at most {self.api.max_open_uploads} resumable uploads open at once: "
                    "finish or cancel (DELETE) one",
                    headers=retry_after(1),
                )
            mode = existing.mode & 0o777 if existing is not None else NEW_FILE_MODE
            try:
                remote = await files.fs.open_write(temp, exclusive=True, mode=mode)
                await remote.close()
            except BaseException:
                await self.table.delete(upload_id)
                raise
            await self.table.release(upload_id, upload_id)
        self._keep_running(upload_id, 0, hashlib.sha256())
        return UploadState(upload_id, host, given, length, 0, now + self.api.upload_ttl)

    async def _record(self, who: Principal, host: str, upload_id: str) -> UploadRecord:
        """The caller's upload on `host` (another identity's, or another host's, is a 404)."""
        service = self.service
        service.grant(who, host)  # 403 before anything else, as every file operation
        found = await self.table.get(upload_id, who.key, self.clock())
        if found is None or found.host != host:
            raise not_found(upload_id)
        return found

    def _state(self, row: UploadRecord, offset: int) -> UploadState:
        result = None
        if row.state == "complete":
            result = Uploaded(bool(row.replaced), row.etag or "", row.length, row.sha256 or "")
            offset = row.length
        return UploadState(row.id, row.host, row.path, row.length, offset, row.expires_at, result)

    async def _held(self, files: Files, row: UploadRecord) -> int:
        """The offset the upload stands at: the bytes confirmed, or fewer if the host's
        temporary file holds fewer. A temporary file gone (or replaced by something else)
        ends the upload: 404."""
        try:
            attrs = await files.fs.lstat(row.temp)
        except RemoteNotFound:
            attrs = None
        if attrs is None or attrs.type != "file":
            await self.table.delete(row.id)
            raise Problem(404, "upload-not-found", "The upload's temporary file is gone", None)
        return min(row.received, attrs.size)

    async def state(self, who: Principal, host: str, upload_id: str) -> UploadState:
        """Where the upload stands: the offset read on the host (HEAD and GET)."""
        row = await self._record(who, host, upload_id)
        if row.state == "complete":
            return self._state(row, row.length)
        async with self.service.open(who, host) as files:
            return self._state(row, await self._held(files, row))

    async def cancel(self, who: Principal, host: str, upload_id: str) -> None:
        """Forget the upload; an open one's temporary file is removed first."""
        row = await self._record(who, host, upload_id)
        self._running.pop(upload_id, None)
        if row.state == "complete":
            await self.table.delete(upload_id)
            return
        async with self._lease(row) as token, self.service.open(who, host) as files:
            with contextlib.suppress(RemoteNotFound):
                await files.fs.remove(row.temp)
            await self.table.delete(upload_id, token)

    @contextlib.asynccontextmanager
    async def _lease(self, row: UploadRecord) -> AsyncIterator[str]:
        """The upload's lease for one chunk (or a cancel); 503 `upload-busy` while another
        holds it. Given back as it was if the body raises (the caller records an outcome)."""
        token = uuid.uuid4().hex
        now = self.clock()
        if not await self.table.claim(row.id, token, now + LEASE, now):
            raise Problem(
                503,
                "upload-busy",
                "Another chunk of this upload is being written",
                "one chunk at a time: retry after the other ends (or its lease lapses)",
                headers=retry_after(1),
            )
        try:
            yield token
        except BaseException:
            # The lease given back; what the chunk confirmed (`record`) stays.
            with contextlib.suppress(Exception):
                await self.table.release(row.id, token)
            raise

    # ---- a chunk

    async def append(
        self,
        who: Principal,
        host: str,
        upload_id: str,
        offset: int | None,
        complete: bool,
        declared: int | None,
        digest: bytes | None,
        body: AsyncIterable[bytes],
    ) -> UploadState:
        """Write one chunk at `offset` (which must be where the upload stands: 409 with the
        right one otherwise); with `complete`, the chunk ends the file, which is then renamed
        into place."""
        if offset is None:
            raise Problem(422, "invalid-header", "Upload-Offset required", "where the chunk starts")
        row = await self._record(who, host, upload_id)
        if row.state == "complete":
            raise Problem(400, "completed-upload", "The upload is complete", None)
        grant, _ = self.service.grant(who, host)
        cap = min(self.api.max_upload_chunk, grant.rule.max_transfer_bytes)
        if declared is not None and declared > cap:
            raise Problem(413, "too-large", "Chunk too large", f"at most {cap} bytes a chunk")
        async with self._lease(row) as token, self.service.open(who, host, bulk=True) as files:
            held = await self._held(files, row)
            if offset != held:
                raise mismatch(held, offset)
            if declared is not None and (
                held + declared > row.length or (complete and held + declared != row.length)
            ):
                raise inconsistent(f"the upload is {row.length} bytes long")
            room = min(cap, row.length - held)
            async with self.service.transfer(who, files.grant, "upload"):
                written = await self._write(files, row, token, held, room, digest, body)
            received = held + written
            if not complete:
                await self.table.release(
                    upload_id, token, received=received, expires_at=self._expiry()
                )
                return self._state(row, received)
            # Confirmed before the commit: a commit that fails (a checksum timeout, a
            # precondition) leaves the bytes counted, and an empty final chunk can try again.
            await self.table.record(upload_id, token, received)
            if received != row.length:
                raise inconsistent(
                    f"Upload-Complete with {received} of the upload's {row.length} bytes"
                )
            result = await self._commit(files, row)
            await self.table.complete(
                upload_id,
                token,
                sha256=result.sha256,
                etag=result.etag,
                replaced=result.replaced,
                expires_at=self._expiry(),
            )
        return UploadState(row.id, host, row.path, row.length, row.length, self._expiry(), result)

    def _expiry(self) -> float:
        return self.clock() + self.api.upload_ttl

    async def _write(
        self,
        files: Files,
        row: UploadRecord,
        token: str,
        held: int,
        room: int,
        digest: bytes | None,
        body: AsyncIterable[bytes],
    ) -> int:
        """Stream the chunk onto the temporary file from `held`; the bytes that count. A chunk
        cut off keeps what landed (recorded before the error goes on) unless it has a digest;
        one whose digest does not match counts for nothing (400 `digest-mismatch`)."""
        counter = self.service.metrics.file_bytes.labels("upload")
        remote = await files.fs.open_resume(row.temp, held)
        # The file's running hash goes on only from exactly where it stopped, as a copy: kept
        # if the chunk counts whole, else the commit hashes the file on the host.
        covered, whole = self._running.pop(row.id, (-1, None))
        both = Both(whole.copy()) if covered == held else None
        upload = Upload(room, remote, counter, both)
        loop = asyncio.get_running_loop()
        renewed = loop.time()
        try:
            async for data in body:
                if upload.size + len(data) > room:
                    raise inconsistent(
                        f"the chunk goes past the upload's {row.length} bytes or the "
                        f"{self.api.max_upload_chunk}-byte chunk cap"
                    )
                await upload.add(data)
                if loop.time() - renewed > RENEW:
                    renewed = loop.time()
                    await self.table.renew(row.id, token, self.clock() + LEASE)
            await upload.finish()
            await remote.close()
        except Problem as cut:
            if cut.kind != "client-disconnected" or digest is not None:
                await upload.abort()
                await _close(remote)
                raise
            # Cut off, no digest: what arrived is written and counts.
            try:
                await upload.finish()
                await remote.close()
            except (SSHPoolError, Problem):
                raise cut from None
            await self.table.record(row.id, token, held + upload.size)
            raise
        except BaseException:
            await upload.abort()
            await _close(remote)
            raise
        if digest is not None and upload.sha256.digest() != digest:
            raise Problem(
                400,
                "digest-mismatch",
                "Content-Digest does not match the chunk",
                f"the chunk's {SHA256} is {digest_header(upload.sha256.digest())}: "
                "nothing of it counts, send it again",
                headers={"Upload-Offset": str(held)},
            )
        if both is not None:
            self._keep_running(row.id, held + upload.size, both.whole)
        return upload.size

    async def _commit(self, files: Files, row: UploadRecord) -> Uploaded:
        """The complete temporary file's sha256 (the running one of its chunks, else computed
        on the host), then the rename into place under the path's commit lock, its
        preconditions checked again (as PUT's)."""
        service = self.service
        grant = files.grant
        covered, whole = self._running.pop(row.id, (-1, None))
        if covered == row.length:
            sha256: str = whole.hexdigest()
        else:
            sha256 = await checksums.compute(
                service.pool,
                grant,
                row.host,
                row.path,
                row.temp,
                timeout=checksums.timeout_for(service.config.api, grant, row.length),
                acquire_timeout=service.config.api.queue_timeout,
                tenant=files.who.key,
            )
        conditions = Preconditions.parse(row.if_match, "*" if row.create_only else None)
        place = Place(row.path, row.resolved)
        async with service.commit_lock(row.host, row.resolved):
            replaced = await commit(files, conditions, place, row.temp, row.path)
            attrs = await files.fs.stat(row.resolved)
        return Uploaded(replaced, etag_of(attrs), attrs.size, sha256)

    # ---- expiry

    async def sweep(self) -> int:
        """Remove the temporary files of expired open uploads and forget expired records; how
        many were taken. An upload whose host cannot be reached now is left for a later pass
        (its lease lapses); one its owner may no longer write to is forgotten (logged)."""
        now = self.clock()
        token = uuid.uuid4().hex
        rows = await self.table.expired(now, token, now + LEASE, SWEEP_BATCH)
        for row in rows:
            if row.state == "open":
                try:
                    await self._remove_temp(row)
                except SSHPoolError:
                    log.info("upload %s expired; its host is unreachable, retried later", row.id)
                    continue
                except Problem as refused:
                    log.warning(
                        "upload %s expired; its temporary file %s on %s was not removed: %s",
                        row.id,
                        row.temp,
                        row.host,
                        refused.title,
                    )
            await self.table.delete(row.id, token)
        return len(rows)

    async def _remove_temp(self, row: UploadRecord) -> None:
        # As the owner (their grant and account), without spending their rate tokens.
        owner = Principal(row.owner_iss, row.owner_sub, frozenset(), row.owner_account)
        service = self.service
        grant, _ = service.grant(owner, row.host)
        async with service.pool.sftp(
            grant.target, acquire_timeout=service.config.api.queue_timeout, tenant=owner.key
        ) as fs:
            with contextlib.suppress(RemoteNotFound):
                await fs.remove(row.temp)

    async def loop(self) -> None:
        """The supervisor's `upload-expiry` task: a sweep every `upload_sweep` seconds."""
        while True:
            try:
                while await self.sweep() == SWEEP_BATCH:
                    pass
            except Exception:
                # A store or host down now: the next pass retries; the task never dies of it
                # (three deaths in a minute would take the whole process down).
                log.exception("upload sweep failed")
            await asyncio.sleep(self.api.upload_sweep)


async def _close(remote: RemoteFile) -> None:
    """Close a chunk's handle, best effort (the temporary file stays: the upload goes on)."""
    with contextlib.suppress(SSHPoolError):
        await remote.close()
