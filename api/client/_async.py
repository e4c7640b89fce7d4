"""The client's one source: `AsyncClient` here, and `Client` in _sync.py generated from this file
by unasync (`make unasync`, scripts/unasync.py; tests/test_unasync.py fails when the two differ).
Edit this file, never _sync.py. The rules: `async`/`await` go, `AsyncClient` -> `Client` (ours
and httpx's), `aclose`/`aread`/`aiter_*`/`anext` -> their sync names, asyncio's `sleep` ->
time's, `AsyncIterator` -> `Iterator`, `AsyncFile` -> `SyncFile` (localfile.py: local file I/O,
in a thread here, the plain calls there: the one difference besides waiting)."""

from __future__ import annotations

import os
from asyncio import sleep
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from time import monotonic
from typing import Any

import httpx

from api.client.base import (
    WAIT,
    Event,
    SSEParser,
    _Base,
    _fresh,
    a_checksum,
    a_job,
    a_listing,
    an_object,
    an_upload,
    job_body,
    jobs,
    objects,
    read_answer,
)
from api.client.errors import (
    Conflict,
    InvalidRequest,
    JobFailed,
    NotFound,
    ProblemError,
    TransportError,
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
from api.client.models import FINAL, Job, Stream
from api.client.tls import verify_for


class AsyncClient(_Base):
    """The client: `Client` calls and returns, a context manager (closes its connections);
    `AsyncClient` has the same methods as coroutines (`follow`, `events` and `list_pages` as
    async iterators), an async context manager."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        profile: str | None = None,
        retries: int = 5,
        max_retry_wait: float = 30.0,
        timeout: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
        allow_http: bool = False,
    ) -> None:
        super().__init__(
            url,
            token,
            profile=profile,
            retries=retries,
            max_retry_wait=max_retry_wait,
            allow_http=allow_http,
        )
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers=self.headers,
            auth=self.auth,
            timeout=timeout,
            transport=transport,
            verify=verify_for(self.url),
            trust_env=self.trust_env,
            event_hooks={"response": [self._answer]},
        )

    async def _answer(self, response: httpx.Response) -> None:
        self.answered = True

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One API call with the retries; raises the call's ProblemError or TransportError."""
        attempt = 0
        while True:
            try:
                response = await self.http.request(method, path, **_fresh(kw))
            except httpx.TransportError as exc:
                delay = self._delay_after(attempt, exc, f"{method} {self.url}{path}")
            else:
                retry = self._delay(attempt, response)
                if retry is None:
                    raise_for_problem(response)
                    return response
                delay = retry
            await sleep(delay)
            attempt += 1

    async def submit(
        self,
        host: str,
        argv: Sequence[str] | None = None,
        *,
        wait: float | None = 0,
        idempotency_key: str | None = None,
        **options: Any,
    ) -> Job:
        """POST /v1/jobs (argv, or command=, template= + params=, batch=; stdin=, timeout=);
        the job as the server answered it, finished or not. Retries replay, never re-run."""
        body = job_body(host, argv, **options)
        headers = self._post_headers(idempotency_key, wait)
        response = await self.request("POST", "/v1/jobs", json=body, headers=headers)
        return read_answer(response, a_job)

    async def run(
        self, host: str, argv: Sequence[str] | None = None, *, check: bool = False, **options: Any
    ) -> Job:
        """Run a command and return its finished job (`stdout`, `stderr`, `exit_status`)."""
        job = await self.wait(await self.submit(host, argv, wait=WAIT, **options))
        if check and job.state != "succeeded":
            raise JobFailed(job)
        return job

    async def wait(self, job: Job | str, timeout: float | None = None) -> Job:
        """Poll until the job is final (backing off to 2 s); `timeout`: give up, return it."""
        current = job if isinstance(job, Job) else await self.get(job)
        deadline = None if timeout is None else monotonic() + timeout
        delay = 0.1
        while current.state not in FINAL:
            if deadline is not None and monotonic() >= deadline:
                break
            await sleep(delay)
            delay = min(delay * 2, 2.0)
            current = await self.get(current.id)
        return current

    async def whoami(self) -> dict[str, Any]:
        """Who the server takes this client's token for: `subject`, `issuer`, `scopes`,
        `admin`, `account` (the token's claim), `hosts` (each one's `name` and the `account`
        you run as there, where it is yours to know)."""
        return read_answer(await self.request("GET", "/v1/whoami"), an_object)

    async def hosts(self) -> list[dict[str, Any]]:
        """The hosts you may use (`name`, `health`, `shell`, `description`, ...)."""
        return read_answer(await self.request("GET", "/v1/hosts"), objects)

    async def add_webhook(self, url: str, events: Sequence[str]) -> dict[str, Any]:
        """POST /v1/webhooks: have your jobs' state changes (`job.succeeded`, `job.failed`,
        `job.running`, ...) POSTed to `url`, signed (docs/portals.md). The answer's `secret`
        (`whsec_...`) is shown this once: keep it to verify the deliveries."""
        body = {"url": url, "events": list(events)}
        return read_answer(await self.request("POST", "/v1/webhooks", json=body), an_object)

    async def webhooks(self) -> list[dict[str, Any]]:
        """Your webhooks, each with `delivered`, `failed`, `pending` and `last_delivery`."""
        response = await self.request("GET", "/v1/webhooks")
        return read_answer(response, lambda body: objects(an_object(body)["items"]))

    async def webhook(self, webhook_id: str) -> dict[str, Any]:
        return read_answer(await self.request("GET", f"/v1/webhooks/{webhook_id}"), an_object)

    async def remove_webhook(self, webhook_id: str) -> None:
        """DELETE /v1/webhooks/{id}: no more deliveries, the pending ones dropped."""
        await self.request("DELETE", f"/v1/webhooks/{webhook_id}")

    async def get(self, job_id: str) -> Job:
        response = await self.request("GET", f"/v1/jobs/{job_id}")
        return read_answer(response, a_job)

    async def list(
        self, *, state: str | None = None, host: str | None = None, limit: int = 50
    ) -> list[Job]:
        params = {k: v for k, v in {"state": state, "host": host, "limit": limit}.items() if v}
        response = await self.request("GET", "/v1/jobs", params=params)
        return read_answer(response, jobs)

    async def cancel(self, job_id: str) -> Job:
        response = await self.request("DELETE", f"/v1/jobs/{job_id}")
        return read_answer(response, a_job)

    async def output(self, job_id: str, stream: Stream = "stdout", offset: int = 0) -> bytes:
        """A byte range of the output from `offset` (the server's read limit)."""
        params = {"stream": stream, "offset": offset}
        response = await self.request("GET", f"/v1/jobs/{job_id}/output", params=params)
        return response.content

    async def follow(
        self, job_id: str, stream: Stream = "stdout", offset: int = 0
    ) -> AsyncIterator[bytes]:
        """The stream's bytes as they arrive until the job is final, reconnecting from the
        offset reached after a cut-off or a dropped connection; bytes the server did not keep
        (past `max_output`, out of the live window) are skipped."""
        final = False  # the job was final before this pass: a pass with nothing new ends it
        while True:
            got = 0
            try:
                async with self.http.stream(
                    "GET",
                    f"/v1/jobs/{job_id}/output",
                    params={"stream": stream, "offset": offset, "follow": "true"},
                    timeout=httpx.Timeout(60, read=None),
                ) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        raise_for_problem(response)
                    async for chunk in response.aiter_bytes():
                        offset += len(chunk)
                        got += len(chunk)
                        yield chunk
            except httpx.TransportError as exc:
                if self._unreached(exc):
                    raise TransportError(f"GET {self.url}/v1/jobs/{job_id}/output: {exc}") from exc
                await sleep(0.2)  # dropped: resume from the offset reached
            except InvalidRequest as exc:
                resume = exc.body.get("next_offset")
                if exc.kind != "output-not-kept" or not isinstance(resume, int):
                    raise
                offset = resume
                continue
            if final and got == 0:
                return
            current = await self.get(job_id)
            final = current.state in FINAL

    async def events(self, job_id: str, last_event_id: str | None = None) -> AsyncIterator[Event]:
        """The job's Server-Sent Events until `end`, reconnecting with Last-Event-ID after a
        cut-off or a dropped connection (no event lost or repeated). Reconnects after failures,
        and after a stream that ended with no event, take the retries (`_delay`), counted afresh
        after each event: a server gone for good, or one that keeps ending the stream empty,
        ends it with TransportError, as any call."""
        attempt = 0
        where = f"GET {self.url}/v1/jobs/{job_id}/events"
        while True:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            progressed = False
            try:
                async with self.http.stream(
                    "GET",
                    f"/v1/jobs/{job_id}/events",
                    headers=headers,
                    timeout=httpx.Timeout(60, read=None),
                ) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        raise_for_problem(response)
                    parser = SSEParser()
                    async for line in response.aiter_lines():
                        if (event := parser.feed(line)) is None:
                            continue
                        last_event_id = event.id or last_event_id
                        attempt = 0  # progress: the retries count afresh
                        progressed = True
                        if event.event == "cutoff":
                            break
                        yield event
                        if event.event == "end":
                            return
            except httpx.TransportError as exc:
                await sleep(self._delay_after(attempt, exc, where))
                attempt += 1
                continue
            if progressed:
                continue  # a cut-off, or a stream that ended after events: at once
            # Not a stream of events (a proxy's empty answer, a server that closes at once):
            # paced by the retries instead of reconnecting in a tight loop.
            delay = self._delay(attempt, None)
            if delay is None:
                raise TransportError(f"{where}: the stream ended {attempt + 1} times with no event")
            await sleep(delay)
            attempt += 1

    async def watch(self, last_event_id: str | None = None) -> AsyncIterator[Event]:
        """Your jobs' state changes, from the change feed (`GET /v1/jobs/events`), for as long
        as you iterate: `job.<state>` events (`data["data"]` is the job), after a `ready` (and a
        `reset` when `last_event_id` is older than the server keeps). Reconnects with
        Last-Event-ID after a dropped connection, so no change is lost or repeated; failures
        take the retries as any call (`_delay`), counted afresh after each event."""
        attempt = 0
        where = f"GET {self.url}/v1/jobs/events"
        while True:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            try:
                async with self.http.stream(
                    "GET", "/v1/jobs/events", headers=headers, timeout=httpx.Timeout(60, read=None)
                ) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        raise_for_problem(response)
                    parser = SSEParser()
                    async for line in response.aiter_lines():
                        if (event := parser.feed(line)) is None:
                            continue
                        last_event_id = event.id or last_event_id
                        attempt = 0
                        yield event
                        if event.event == "revoked":
                            return
            except httpx.TransportError as exc:
                await sleep(self._delay_after(attempt, exc, where))
                attempt += 1
                continue
            delay = self._delay(attempt, None)  # the server ended the stream: paced
            if delay is None:
                raise TransportError(f"{where}: the stream ended {attempt + 1} times")
            await sleep(delay)
            attempt += 1

    # ---- job handles (docs/portals.md)

    async def create_handle(
        self, job_id: str, ttl: float, *, cancel: bool = False
    ) -> dict[str, Any]:
        """A handle of the job: `handle` (the bearer token, shown once: give it to whatever
        follows the job, as `token=` of a client), `id` (to delete it), `expires_at`."""
        body = {"ttl": ttl, "cancel": cancel}
        response = await self.request("POST", f"/v1/jobs/{job_id}/handles", json=body)
        return read_answer(response, an_object)

    async def handles(self, job_id: str) -> Sequence[dict[str, Any]]:
        """The job's handles (without their tokens)."""
        response = await self.request("GET", f"/v1/jobs/{job_id}/handles")
        return read_answer(response, lambda body: objects(an_object(body)["items"]))

    async def delete_handle(self, job_id: str, handle_id: str) -> None:
        """Revoke a handle: its next request is 401."""
        await self.request("DELETE", f"/v1/jobs/{job_id}/handles/{handle_id}")

    # ---- files (docs/files.md)

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
        try:
            response = await self.request("PUT", files_path(host, "/content"), **put)
        except NotFound:
            # Its directory is missing: make it and send the file again, as asked.
            parent = _parent(path)
            if not parents or parent is None:
                raise
            await self.mkdir(host, parent, parents=True)
            response = await self.request("PUT", files_path(host, "/content"), **put)
        return read_answer(response, an_upload)

    async def upload_resumable(
        self,
        host: str,
        source: str | os.PathLike[str],
        path: str,
        *,
        chunk_size: int = UPLOAD_CHUNK,
        create_only: bool = False,
        progress: Progress | None = None,
        records: str | os.PathLike[str] | None = None,
    ) -> dict[str, Any]:
        """Upload a local file to `path` in chunks of `chunk_size` bytes, each with its sha-256
        digest (a resumable upload: docs/files.md). A lost connection costs at most the chunk it
        cut: the client asks where the upload stands (HEAD) and goes on. The upload is recorded
        in `records` (default `upload_records()`) until it ends, so a call for the same file
        and path after this process was stopped goes on from there too. The host's sha256 of
        the whole file is checked against the local file's. Answers `path`, `size`, `sha256`."""
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
            created = await self.request(
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
