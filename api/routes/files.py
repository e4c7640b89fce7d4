"""/v1/hosts/{host}/files: list, stat, download (ranges), upload (streamed), delete, mkdir,
move, checksum. The logic and the confinement live in api/files.py; docs/files.md has the
contract."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncGenerator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Header, Query, Request, Response
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from api.deps import FileReader, FileWriter, Svc
from api.files import (
    CHUNK,
    MAX_PATH,
    NEW_FILE_MODE,
    Files,
    Place,
    Preconditions,
    Upload,
    describe,
    etag_of,
    file_problem,
    http_date,
    temp_name,
)
from api.numbers import read_count
from api.problems import MEDIA_TYPE, Problem
from api.sending import DeadlineResponse
from sshpool import ConnectionLost, RemoteFileFailure, SSHPoolError

router = APIRouter(prefix="/v1/hosts/{host}/files", tags=["files"])

Path = Annotated[str, Query(min_length=1, max_length=MAX_PATH, description="Path on the host.")]
RANGE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$")


def _problem(description: str) -> dict[str, Any]:
    return {"description": description, "content": {MEDIA_TYPE: {}}}


ERRORS: dict[int | str, dict[str, Any]] = {
    401: _problem("Missing or invalid token."),
    403: _problem(
        "Scope or host not allowed, path outside your roots, a protected path (~/.ssh, shell "
        "start-up files) or a root written to, or the host refused."
    ),
    404: _problem("No such file or directory."),
    409: _problem("Not a file / not a directory / exists / not empty."),
    429: _problem("Rate limit or too many transfers at once: see `Retry-After`."),
    422: _problem("Invalid path: NUL, over 4096 bytes, a name over 255 bytes."),
    501: _problem("The host's SSH backend cannot do file operations."),
    502: _problem("The SSH connection failed or dropped."),
    503: _problem("Host saturated or down, or another upload committing: see `Retry-After`."),
}


class MkdirRequest(BaseModel):
    path: str = Field(min_length=1, max_length=MAX_PATH)


class MoveRequest(BaseModel):
    source: str = Field(min_length=1, max_length=MAX_PATH)
    destination: str = Field(min_length=1, max_length=MAX_PATH)
    overwrite: bool = False


@router.get("", responses=ERRORS, summary="A directory's entries (paged) or one entry's stat")
async def list_or_stat(
    host: str,
    path: Path,
    who: FileReader,
    svc: Svc,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
    cursor: Annotated[str | None, Query(max_length=1024, description="`next_cursor`.")] = None,
) -> dict[str, Any]:
    return await svc.files.list_dir(who, host, path, limit, cursor)


def _range(header: str | None, size: int) -> tuple[int, int] | None:
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


@router.get(
    "/content",
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The bytes."},
        206: {"description": "The requested range (`Content-Range`)."},
        304: {"description": "`If-None-Match` matched."},
        416: _problem("Range outside the file."),
        **ERRORS,
    },
    response_class=Response,
    summary="Download a file (streamed; Range, ETag, If-None-Match)",
)
async def download(
    host: str,
    path: Path,
    who: FileReader,
    svc: Svc,
    range_: Annotated[str | None, Header(alias="Range")] = None,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    service = svc.files
    stack = contextlib.AsyncExitStack()
    try:
        files = await stack.enter_async_context(service.open(who, host))
        place = await files.resolve(path)
        attrs = await files.fs.stat(place.path)
        if attrs.type != "file":
            raise Problem(409, "not-a-file", "Not a regular file", f"{path!r} is a {attrs.type}")
        etag = etag_of(attrs)
        headers = {
            "ETag": etag,
            "Last-Modified": http_date(attrs.mtime),
            "Accept-Ranges": "bytes",
        }
        if if_none_match is not None and (
            if_none_match.strip() == "*" or etag in [t.strip() for t in if_none_match.split(",")]
        ):
            await stack.aclose()
            return Response(status_code=304, headers=headers)
        span = _range(range_, attrs.size)
        start, end = span or (0, attrs.size)
        service.cap(files.grant, end - start, "download")
        await stack.enter_async_context(service.transfer(who, files.grant, "download"))
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
    counter = svc.metrics.file_bytes.labels("download")

    async def body() -> AsyncGenerator[bytes, None]:
        remaining = end - start
        ahead: asyncio.Future[bytes] | None = None
        try:
            while remaining > 0:
                data = await (ahead or remote.read(min(CHUNK, remaining)))
                if not data:
                    # The file shrank since the stat: the client sees a short body and knows.
                    raise ConnectionLost("file shrank during download", started=True)
                remaining -= len(data)
                # The next chunk is read from the host while this one goes to the client (one
                # chunk ahead at most); alternating, each side sat idle while the other worked.
                ahead = (
                    asyncio.ensure_future(remote.read(min(CHUNK, remaining))) if remaining else None
                )
                counter.inc(len(data))
                yield data
        finally:
            # A read ahead the client never took: stopped, or its error marked as seen.
            if ahead is not None and not ahead.cancel() and not ahead.cancelled():
                ahead.exception()
            await stack.aclose()

    # A client that stops reading is let go of after send_timeout (api/sending.py): it would
    # hold the SFTP channel and the transfer slot for as long as it keeps the connection.
    return DeadlineResponse(
        body(),
        release=stack.aclose,
        send_timeout=svc.settings.send_timeout,
        what="download",
        status_code=status,
        headers=headers,
        media_type="application/octet-stream",
    )


@router.put(
    "/content",
    status_code=201,
    responses={
        200: {"description": "Replaced an existing file."},
        201: {"description": "Created."},
        412: _problem("`If-Match` (an ETag, or `*`: any file) / `If-None-Match: *` not met."),
        413: _problem("Body larger than max_file_size or max_transfer_bytes."),
        507: _problem("No space left on the host."),
        **ERRORS,
    },
    summary="Upload a file (streamed to a temporary name, renamed into place when complete)",
)
async def upload(
    host: str,
    path: Path,
    who: FileWriter,
    svc: Svc,
    request: Request,
    response: Response,
    if_match: Annotated[str | None, Header()] = None,
    if_none_match: Annotated[str | None, Header()] = None,
) -> dict[str, Any]:
    service = svc.files
    conditions = Preconditions.parse(if_match, if_none_match)
    async with service.open(who, host) as files:
        grant = files.grant
        limit = min(grant.rule.max_file_size, grant.rule.max_transfer_bytes)
        # Read from the request, not declared as a parameter: the server validated it already.
        declared = read_count(request.headers.get("content-length", ""), saturate=True)
        if declared is not None and declared > limit:
            raise Problem(413, "too-large", "File too large", f"at most {limit} bytes")
        place = await files.resolve_name(path)
        await files.guard(place)
        existing = await files.lstat(place)
        conditions.check(path, existing)  # early, before any byte moves
        temp = temp_name(place.path)
        # A replacement never asks for more than the file it replaces allows (the umask may
        # take more): its bytes are no more readable while they arrive than they will be.
        mode = existing.mode & 0o777 if existing is not None else NEW_FILE_MODE
        async with service.transfer(who, grant, "upload"):
            remote = await files.fs.open_write(temp, exclusive=True, mode=mode)
            upload = Upload(limit, remote, svc.metrics.file_bytes.labels("upload"))
            done = False
            try:
                async for data in request.stream():
                    await upload.add(data)
                await upload.finish()
                await remote.close()
                async with service.commit_lock(host, place.path):
                    replaced = await _commit(files, conditions, place, temp, path)
                    attrs = await files.fs.stat(place.path)
                done = True
            except ClientDisconnect:
                raise Problem(400, "client-disconnected", "The upload was cut off") from None
            finally:
                if not done:
                    await upload.abort()
                    await _discard(files, remote, temp)
    response.status_code = 200 if replaced else 201
    response.headers["ETag"] = etag_of(attrs)
    return {"path": path, "size": upload.size, "sha256": upload.sha256.hexdigest()}


async def _commit(
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


async def _discard(files: Any, remote: Any, temp: str) -> None:
    """Remove an upload's temporary file (best effort: a dead connection leaves it; its name
    says what it is)."""
    with contextlib.suppress(SSHPoolError):
        await remote.close()
    with contextlib.suppress(SSHPoolError):
        await files.fs.remove(temp)


@router.delete("", status_code=204, responses=ERRORS, summary="Delete a file or empty directory")
async def delete(host: str, path: Path, who: FileWriter, svc: Svc) -> Response:
    async with svc.files.open(who, host) as files:
        place = await files.resolve_name(path)
        files.guard_roots(place, "delete")
        await files.guard(place)
        attrs = await files.fs.lstat(place.path)
        if attrs.type == "dir":
            await files.fs.rmdir(place.path)
        else:
            await files.fs.remove(place.path)
    return Response(status_code=204)


@router.post("/mkdir", status_code=201, responses=ERRORS, summary="Create a directory")
async def mkdir(
    host: str, body: Annotated[MkdirRequest, Body()], who: FileWriter, svc: Svc
) -> dict[str, Any]:
    async with svc.files.open(who, host) as files:
        place = await files.resolve_name(body.path)
        await files.guard(place)
        await files.fs.mkdir(place.path, 0o755)
        attrs = await files.fs.stat(place.path)
    return {"path": body.path, **describe(place.path.rsplit("/", 1)[-1], attrs)}


@router.post("/move", responses=ERRORS, summary="Rename or move within your roots")
async def move(
    host: str, body: Annotated[MoveRequest, Body()], who: FileWriter, svc: Svc
) -> dict[str, Any]:
    async with svc.files.open(who, host) as files:
        source = await files.resolve_name(body.source)
        destination = await files.resolve_name(body.destination)
        # Both ends are judged whole: a directory moved brings its contents along, and one
        # moved away takes them (a root, a protected path) with it.
        files.guard_roots(source, "move")
        files.guard_roots(destination, "replace")
        await files.guard(source, holding=True)
        await files.guard(destination, holding=True)
        await files.fs.lstat(source.path)
        await files.fs.rename(source.path, destination.path, overwrite=body.overwrite)
        attrs = await files.fs.lstat(destination.path)
    return {"path": body.destination, **describe(destination.path.rsplit("/", 1)[-1], attrs)}


@router.get("/checksum", responses=ERRORS, summary="A file's checksum, computed on the host")
async def checksum(
    host: str,
    path: Path,
    who: FileReader,
    svc: Svc,
    request: Request,
    algorithm: Literal["sha256"] = "sha256",
) -> dict[str, object]:
    # Starlette does not cancel a handler whose client left: the checksum is raced against
    # the disconnect, and cancelling it kills the remote sha256sum's process group.
    work = asyncio.ensure_future(svc.files.checksum(who, host, path))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise Problem(400, "client-disconnected", "The client left: the checksum was stopped")
    return work.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (a GET has no body: the next message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
