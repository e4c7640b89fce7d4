"""/v1/hosts/{host}/files: list, stat, download (ranges), upload (streamed, or resumable in
chunks: /uploads), delete, mkdir, move, checksum. Each calls the file service (api/files/) and
turns its answer into HTTP; none touches the SFTP session. docs/files.md has the contract."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Header, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from api.auth import Principal
from api.deps import FileReader, FileWriter, Svc
from api.files import MAX_PATH, UploadState, parse_digest
from api.numbers import read_count
from api.problems import MEDIA_TYPE, Problem, revoked
from api.sending import DeadlineResponse
from api.services import Services

router = APIRouter(prefix="/v1/hosts/{host}/files", tags=["files"])

Path = Annotated[str, Query(min_length=1, max_length=MAX_PATH, description="Path on the host.")]


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
    download = await svc.files.download(who, host, path, range_, if_none_match)
    if download.status == 304:
        return Response(status_code=304, headers=download.headers)
    # A client that stops reading is let go of after send_timeout (api/sending.py): it would
    # hold the SFTP channel and the transfer slot for as long as it keeps the connection.
    return DeadlineResponse(
        download.body(),
        release=download.aclose,
        send_timeout=svc.settings.send_timeout,
        what="download",
        # A revocation ends it before its next piece, on whichever replica serves it.
        stop=svc.revocations.stops(who),
        status_code=download.status,
        headers=download.headers,
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
    # Read from the request, not declared as a parameter: the server validated it already.
    declared = read_count(request.headers.get("content-length", ""), saturate=True)
    body = _body(request, svc.revocations.stops(who))
    uploaded = await svc.files.upload(who, host, path, body, declared, if_match, if_none_match)
    response.status_code = 200 if uploaded.replaced else 201
    response.headers["ETag"] = uploaded.etag
    return {"path": path, "size": uploaded.size, "sha256": uploaded.sha256}


async def _body(request: Request, stop: Callable[[], bool]) -> AsyncIterator[bytes]:
    """The request's body as it arrives; a client that goes away midway is a 400, one revoked
    midway (`stop`) a 403 at its next piece (the temporary file is removed: nothing lands)."""
    try:
        async for data in request.stream():
            if stop():
                raise revoked()
            yield data
    except ClientDisconnect:
        raise Problem(400, "client-disconnected", "The upload was cut off") from None


# ---- resumable uploads (draft-ietf-httpbis-resumable-upload; docs/files.md)

UploadId = Annotated[
    str, PathParam(pattern="^[0-9a-f]{32}$", description="The upload's id (its `Location`).")
]
UPLOAD_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    400: _problem(
        "`digest-mismatch` (the chunk does not match its `Content-Digest`: nothing of it "
        "counts), `digest-invalid-value`, `digest-unsupported-algorithms`, "
        "`inconsistent-upload-length`, `completed-upload`, `client-disconnected`."
    ),
    404: _problem("No such upload of yours (expired, cancelled, another identity's)."),
    409: _problem(
        "`mismatching-upload-offset`: `Upload-Offset` is not where the upload stands; the "
        "answer's `Upload-Offset` (and `expected-offset`) says where."
    ),
    503: _problem("`upload-busy`: another chunk of this upload is being written (`Retry-After`)."),
}


def _header_count(value: str | None, name: str) -> int | None:
    """A structured-field Integer header (`Upload-Length`, `Upload-Offset`), or None."""
    if value is None:
        return None
    count = read_count(value.strip())
    if count is None:
        raise Problem(422, "invalid-header", f"Invalid {name}", "a non-negative integer")
    return count


def _upload_headers(state: UploadState, svc: Services, who: Principal) -> dict[str, str]:
    """What the draft's answers carry: the offset, whether complete, the length, the limits."""
    grant, _ = svc.files.grant(who, state.host)
    api = svc.config.api
    chunk = min(api.max_upload_chunk, grant.rule.max_transfer_bytes)
    expires = max(0, int(state.expires_at - svc.files.uploads.clock()))
    return {
        "Upload-Offset": str(state.offset),
        "Upload-Complete": "?1" if state.complete else "?0",
        "Upload-Length": str(state.length),
        "Upload-Limit": f"max-size={grant.rule.max_file_size}, max-append-size={chunk}, "
        f"expires={expires}",
        "Cache-Control": "no-store",
    }


@router.post(
    "/uploads",
    status_code=201,
    responses={
        201: {"description": "Created: `Location` is the upload, `Upload-Offset: 0`."},
        412: _problem("`If-Match` / `If-None-Match: *` not met (checked again at the commit)."),
        413: _problem("`Upload-Length` over max_file_size."),
        429: _problem("Rate limit, or `too-many-uploads` (max_open_uploads open at once)."),
        **UPLOAD_ERRORS,
    },
    summary="Start a resumable upload (its chunks follow by PATCH)",
)
async def create_upload(
    host: str,
    path: Path,
    who: FileWriter,
    svc: Svc,
    request: Request,
    response: Response,
    upload_length: Annotated[
        str | None, Header(description="The file's size in bytes (required).")
    ] = None,
    if_match: Annotated[str | None, Header()] = None,
    if_none_match: Annotated[str | None, Header()] = None,
) -> dict[str, Any]:
    length = _header_count(upload_length, "Upload-Length")
    state = await svc.files.uploads.create(who, host, path, length, if_match, if_none_match)
    response.headers.update(_upload_headers(state, svc, who))
    response.headers["Location"] = f"{request.url.path}/{state.id}"
    return state.describe()


@router.head(
    "/uploads/{upload_id}",
    status_code=204,
    responses=UPLOAD_ERRORS,
    summary="Where a resumable upload stands (`Upload-Offset`: read on the host)",
)
async def upload_offset(host: str, upload_id: UploadId, who: FileWriter, svc: Svc) -> Response:
    state = await svc.files.uploads.state(who, host, upload_id)
    return Response(status_code=204, headers=_upload_headers(state, svc, who))


@router.get(
    "/uploads/{upload_id}",
    responses=UPLOAD_ERRORS,
    summary="A resumable upload's state, and once complete its file's size and sha256",
)
async def upload_state(
    host: str, upload_id: UploadId, who: FileWriter, svc: Svc, response: Response
) -> dict[str, Any]:
    state = await svc.files.uploads.state(who, host, upload_id)
    response.headers.update(_upload_headers(state, svc, who))
    return state.describe()


@router.patch(
    "/uploads/{upload_id}",
    status_code=204,
    responses={
        200: {"description": "The final chunk: the file replaced an existing one."},
        201: {"description": "The final chunk: the file was created."},
        204: {"description": "Chunk written: `Upload-Offset` is where the next one starts."},
        412: _problem("The final chunk: `If-Match` / `If-None-Match: *` no longer met."),
        413: _problem("Chunk over max_upload_chunk / max_transfer_bytes."),
        **UPLOAD_ERRORS,
    },
    summary="Append a chunk at `Upload-Offset` (`Upload-Complete: ?1` on the last)",
)
async def append_upload(
    host: str,
    upload_id: UploadId,
    who: FileWriter,
    svc: Svc,
    request: Request,
    upload_offset: Annotated[str | None, Header(description="Where the chunk starts.")] = None,
    upload_complete: Annotated[
        str | None, Header(description="`?1` on the final chunk, else `?0` (the default).")
    ] = None,
    content_digest: Annotated[
        str | None, Header(description="RFC 9530 `sha-256=:<base64>:` of this chunk.")
    ] = None,
) -> Response:
    offset = _header_count(upload_offset, "Upload-Offset")
    complete = (upload_complete or "?0").strip()
    if complete not in ("?0", "?1"):
        raise Problem(422, "invalid-header", "Invalid Upload-Complete", "`?1` or `?0`")
    digest = parse_digest(content_digest)
    declared = read_count(request.headers.get("content-length", ""), saturate=True)
    body = _body(request, svc.revocations.stops(who))
    state = await svc.files.uploads.append(
        who, host, upload_id, offset, complete == "?1", declared, digest, body
    )
    headers = _upload_headers(state, svc, who)
    if state.result is None:
        return Response(status_code=204, headers=headers)
    headers["ETag"] = state.result.etag
    return JSONResponse(
        {"path": state.path, "size": state.result.size, "sha256": state.result.sha256},
        status_code=200 if state.result.replaced else 201,
        headers=headers,
    )


@router.delete(
    "/uploads/{upload_id}",
    status_code=204,
    responses=UPLOAD_ERRORS,
    summary="Cancel a resumable upload (its temporary file removed)",
)
async def cancel_upload(host: str, upload_id: UploadId, who: FileWriter, svc: Svc) -> Response:
    await svc.files.uploads.cancel(who, host, upload_id)
    return Response(status_code=204)


@router.delete("", status_code=204, responses=ERRORS, summary="Delete a file or empty directory")
async def delete(host: str, path: Path, who: FileWriter, svc: Svc) -> Response:
    await svc.files.delete(who, host, path)
    return Response(status_code=204)


@router.post("/mkdir", status_code=201, responses=ERRORS, summary="Create a directory")
async def mkdir(
    host: str, body: Annotated[MkdirRequest, Body()], who: FileWriter, svc: Svc
) -> dict[str, Any]:
    return await svc.files.mkdir(who, host, body.path)


@router.post("/move", responses=ERRORS, summary="Rename or move within your roots")
async def move(
    host: str, body: Annotated[MoveRequest, Body()], who: FileWriter, svc: Svc
) -> dict[str, Any]:
    return await svc.files.move(who, host, body.source, body.destination, body.overwrite)


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
