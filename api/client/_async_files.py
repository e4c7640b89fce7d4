"""The files methods of the client (docs/files.md), apart from _async.py for its size, generated
the same way: `AsyncFiles` here, `SyncFiles` in _sync_files.py (`make unasync`). `AsyncClient`
has them all; they call its `request`, with its retries, and its `http` for a resumable
upload's chunks, whose refusals they read themselves."""

from __future__ import annotations

import os
from asyncio import sleep
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from api.client.base import (
    _Base,
    a_checksum,
    a_listing,
    an_object,
    an_upload,
    read_answer,
)
from api.client.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    ProblemError,
    _raise,
    raise_for_problem,
)
from api.client.files import (
    CHUNK,
    CHUNK_TIMEOUT,
    FINAL_REFUSALS,
    UPLOAD_CHUNK,
    Identity,
    Partial,
    Progress,
    Sent,
    UploadRecord,
    _check_sha256,
    _chunk_headers,
    _chunk_limit,
    _chunk_refused,
    _creation,
    _parent,
    _upload_headers,
    _upload_offset,
    files_path,
    resumable,
    upload_records,
)
from api.client.localfile import AsyncFile


class AsyncFiles(_Base):
    """The files methods; `AsyncClient` (_async.py) gives them `http` and `request`."""

    http: httpx.AsyncClient

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        raise NotImplementedError  # the client's own, in _async.py

    async def list_files(self, host: str, path: str = "~") -> dict[str, Any]:
        """A directory's entries (all pages: `items`), or one entry's stat when `path` is not a
        directory (`type`, `size`, `mode`, `mtime`...)."""
        pages = self.list_pages(host, path)
        answer = await anext(pages)
        async for more in pages:
            answer.setdefault("items", []).extend(more.get("items", []))
            answer["next_cursor"] = more.get("next_cursor")
        return answer

    async def list_pages(self, host: str, path: str = "~") -> AsyncIterator[dict[str, Any]]:
        """A directory's answers page by page as they come (`items` in each), or one entry's
        stat when `path` is not a directory."""
        params: dict[str, Any] = {"path": path, "limit": 1000}
        while True:
            response = await self.request("GET", files_path(host), params=params)
            answer = read_answer(response, a_listing)
            yield answer
            if not answer.get("next_cursor"):
                return
            params["cursor"] = answer["next_cursor"]

    async def stat(self, host: str, path: str) -> dict[str, Any]:
        """One entry: `type` (file, dir, symlink, other), and for a non-directory `size`,
        `mode`, `mtime`."""
        params = {"path": path, "limit": 1}
        response = await self.request("GET", files_path(host), params=params)
        entry = read_answer(response, a_listing)
        return {k: v for k, v in entry.items() if k not in ("items", "next_cursor")}

    async def download(
        self,
        host: str,
        path: str,
        dest: str | os.PathLike[str],
        *,
        progress: Progress | None = None,
    ) -> int:
        """Download a file to `dest`, streamed to `<dest>.part` and renamed when complete. A
        dropped connection resumes by Range from the bytes received, and so does a later call
        after an interrupted one (unless the file changed: then from the start). Its size."""
        partial = Partial(dest, {"url": self.url, "host": host, "path": path})
        attempt = 0
        while True:
            offset, etag = partial.offset()
            headers = partial.headers(offset, etag)
            try:
                async with self.http.stream(
                    "GET",
                    files_path(host, "/content"),
                    params={"path": path},
                    headers=headers,
                    timeout=httpx.Timeout(60, read=300),
                ) as response:
                    status = response.status_code
                    if status == 416 and offset:  # the part is longer than the file now
                        partial.discard()
                        continue
                    if status < 400:
                        resume = resumable(response, offset, etag)
                        if resume is None:
                            partial.discard()
                            continue
                        done = offset if resume else 0
                        total = done + int(response.headers.get("content-length", 0))
                        with partial.start(response, resume) as out:
                            local = AsyncFile(out)
                            async for chunk in response.aiter_bytes():
                                await local.write(chunk)
                                done += len(chunk)
                                attempt = 0  # progress: the retries count afresh
                                if progress is not None:
                                    progress(done, total)
                            if done != total:
                                raise httpx.ReadError("the body ended early")
                            partial.verify(out, total)
                        partial.done()
                        return total
                    await response.aread()
                    delay = self._delay(attempt, response)
                    if delay is None:
                        _raise(response)
            except httpx.TransportError as exc:
                delay = self._delay_after(attempt, exc, f"GET {path} from {self.url}")
            await sleep(delay)
            attempt += 1

    async def upload(
        self,
        host: str,
        source: str | os.PathLike[str],
        path: str,
        *,
        create_only: bool = False,
        parents: bool = False,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """Upload a local file to `path`, streamed (never held whole); the server renames it
        into place only when complete. `create_only`: 412 if `path` exists; `parents`: create
        its missing directories first (as `mkdir -p`). A retry sends the file again from its
        start (the same bytes: replacing is harmless). Answers `path`, `size`, `sha256`."""
        size = await AsyncFile.size(source)

        async def chunks() -> AsyncIterator[bytes]:
            done = 0
            local = await AsyncFile.open(source)
            try:
                while data := await local.read(CHUNK):
                    done += len(data)
                    if progress is not None:
                        progress(done, size)
                    yield data
            finally:
                local.close()

        put: dict[str, Any] = {
            "params": {"path": path},
            "content": chunks,
            "headers": _upload_headers(size, create_only),
            "timeout": httpx.Timeout(60, write=300),
        }
        response = await self._in_place(
            host, path, parents, "PUT", files_path(host, "/content"), **put
        )
        return read_answer(response, an_upload)

    async def _in_place(
        self, host: str, path: str, parents: bool, method: str, url: str, **kw: Any
    ) -> httpx.Response:
        """A request that puts a file at `path`; when its directory is missing (404) and
        `parents`, the directory made (as `mkdir -p`) and the request sent again."""
        try:
            return await self.request(method, url, **kw)
        except NotFound:
            parent = _parent(path)
            if not parents or parent is None:
                raise
            await self.mkdir(host, parent, parents=True)
            return await self.request(method, url, **kw)

    async def upload_resumable(
        self,
        host: str,
        source: str | os.PathLike[str],
        path: str,
        *,
        chunk_size: int = UPLOAD_CHUNK,
        create_only: bool = False,
        parents: bool = False,
        progress: Progress | None = None,
        records: str | os.PathLike[str] | None = None,
    ) -> dict[str, Any]:
        """Upload a local file to `path` in chunks of `chunk_size` bytes, each with its sha-256
        digest (a resumable upload: docs/files.md); `create_only` and `parents` as `upload`. A
        lost connection costs at most the chunk it cut: the client asks where the upload stands
        (HEAD) and goes on. The upload is recorded in `records` (default `upload_records()`)
        until it ends, so a call for the same file and path after this process was stopped goes
        on from there too. The host's sha256 of the whole file is checked against the local
        file's. Answers `path`, `size`, `sha256`."""
        identity = await AsyncFile.identity(source)
        size = identity[0]
        record = UploadRecord(
            Path(records) if records is not None else upload_records(),
            self.url,
            host,
            path,
            source,
            create_only,
        )
        location, offset, answer, limits = await self._resume(
            record, identity, files_path(host, "/uploads/")
        )
        if location is None:
            created = await self._in_place(
                host,
                path,
                parents,
                "POST",
                files_path(host, "/uploads"),
                params={"path": path},
                headers=_creation(size, create_only),
            )
            location, limits = created.headers["location"], created
            record.save(location, identity)
        assert limits is not None  # the creation's answer or the HEAD's: both carry them
        chunk_size = _chunk_limit(limits, chunk_size)
        local, sent = await AsyncFile.open(source), Sent()
        attempt = 0
        try:
            while answer is None:
                await local.seek(offset)
                data = await local.read(min(chunk_size, size - offset))
                last = offset + len(data) >= size
                headers, pieces = _chunk_headers(offset, data, last), AsyncFile.pieces(data)
                try:
                    response = await self.http.request(
                        "PATCH", location, content=pieces, headers=headers, timeout=CHUNK_TIMEOUT
                    )
                except httpx.TransportError as exc:
                    await sleep(self._delay_after(attempt, exc, f"PATCH {location}"))
                    attempt += 1
                    offset, answer, _ = await self._upload_stands(location)
                    continue
                moved, damaged = _chunk_refused(response)
                retry = self._delay(attempt, response)
                if retry is None and damaged and attempt < self.retries:
                    retry = 0.0  # the chunk was damaged on the way: send it again
                if moved is not None or retry is not None:
                    await sleep(retry or 0)
                    offset, attempt = (offset, attempt + 1) if moved is None else (moved, attempt)
                    continue
                raise_for_problem(response)
                sent.confirmed(offset, data)
                offset, attempt = offset + len(data), 0
                if progress is not None:
                    progress(offset, size)
                if last:
                    answer = read_answer(response, an_upload)
        except ProblemError as exc:
            if exc.status in FINAL_REFUSALS:
                record.drop()  # the upload cannot go on: the next call starts anew
            raise
        finally:
            local.close()
        record.drop()
        _check_sha256(answer, sent.hexdigest(size) or await AsyncFile.sha256(source), host, path)
        return answer

    async def _resume(
        self, record: UploadRecord, identity: Identity, prefix: str
    ) -> tuple[str | None, int, dict[str, Any] | None, httpx.Response | None]:
        """The recorded upload of the same local file, where it stands (Location, offset, the
        answer once complete, an answer carrying its limits); (None, 0, None, None) when there
        is none to go on with: a recorded upload of a file changed since is cancelled (it
        holds one of the identity's open uploads), or one the server has forgotten."""
        kept = record.load(prefix)
        if kept is None:
            record.drop()
            return None, 0, None, None
        location, then = kept
        try:
            if then != identity:
                await self.request("DELETE", location)
            else:
                return (location, *await self._upload_stands(location))
        except (NotFound, InvalidRequest):
            pass  # expired, cancelled, or already complete
        record.drop()
        return None, 0, None, None

    async def _upload_stands(
        self, location: str
    ) -> tuple[int, dict[str, Any] | None, httpx.Response]:
        """Where a resumable upload stands on the server (HEAD), and once complete its answer
        (GET): the chunk whose answer was lost may have been the last."""
        response = await self.request("HEAD", location)
        if response.headers.get("upload-complete") != "?1":
            return _upload_offset(response) or 0, None, response
        done = read_answer(await self.request("GET", location), an_upload)
        answer = {k: done[k] for k in ("path", "size", "sha256")}
        return _upload_offset(response) or 0, answer, response

    async def mkdir(self, host: str, path: str, *, parents: bool = False) -> dict[str, Any]:
        """Create a directory (409 Conflict if it exists, 404 NotFound if its parent does not).
        `parents`: as `mkdir -p`, create the missing parents too, and an existing directory
        is no error. Answers its entry (`path`, `type`, `mode`...)."""
        try:
            response = await self.request("POST", files_path(host, "/mkdir"), json={"path": path})
        except NotFound:
            parent = _parent(path)
            if not parents or parent is None:
                raise
            await self.mkdir(host, parent, parents=True)
            response = await self.request("POST", files_path(host, "/mkdir"), json={"path": path})
        except Conflict:
            if not parents:
                raise
            entry = await self.stat(host, path)
            if entry.get("type") != "dir":
                raise
            return {**entry, "path": path}
        return read_answer(response, an_object)

    async def move(
        self, host: str, source: str, destination: str, *, overwrite: bool = False
    ) -> dict[str, Any]:
        """Rename or move within your roots (409 Conflict if `destination` exists, unless
        `overwrite`: then replaced atomically). Answers the moved entry."""
        body = {"source": source, "destination": destination, "overwrite": overwrite}
        response = await self.request("POST", files_path(host, "/move"), json=body)
        return read_answer(response, an_object)

    async def checksum(self, host: str, path: str) -> str:
        """A file's sha256, computed on the host (nothing downloaded)."""
        params = {"path": path, "algorithm": "sha256"}
        response = await self.request("GET", files_path(host, "/checksum"), params=params)
        return read_answer(response, a_checksum)

    async def delete_file(self, host: str, path: str) -> None:
        """Delete a file, a symlink (not its target) or an empty directory."""
        await self.request("DELETE", files_path(host), params={"path": path})
