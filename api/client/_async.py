"""The asyncio client."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from api.client.base import WAIT, Event, SSEParser, _Base, _fresh, job_body
from api.client.errors import InvalidRequest, JobFailed, TransportError, _raise, raise_for_problem
from api.client.files import CHUNK, Partial, Progress, _upload_headers, files_path, resumable
from api.client.models import FINAL, Job, Stream
from api.client.tls import tls_context


class AsyncClient(_Base):
    """The asyncio client: `Client`'s methods as coroutines. An async context manager."""

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
            timeout=timeout,
            transport=transport,
            verify=tls_context(),
            trust_env=self.trust_env,
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = await self.http.request(method, path, **_fresh(kw))
            except httpx.TransportError as exc:
                delay = self._delay(attempt, None)
                if delay is None:
                    raise TransportError(f"{method} {path}: {exc}") from exc
            else:
                delay = self._delay(attempt, response)
                if delay is None:
                    raise_for_problem(response)
                    return response
            await asyncio.sleep(delay)
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
        body = job_body(host, argv, **options)
        headers = self._post_headers(idempotency_key, wait)
        response = await self.request("POST", "/v1/jobs", json=body, headers=headers)
        return Job.model_validate(response.json())

    async def run(
        self, host: str, argv: Sequence[str] | None = None, *, check: bool = False, **options: Any
    ) -> Job:
        job = await self.wait(await self.submit(host, argv, wait=WAIT, **options))
        if check and job.state != "succeeded":
            raise JobFailed(job)
        return job

    async def wait(self, job: Job | str, timeout: float | None = None) -> Job:
        current = job if isinstance(job, Job) else await self.get(job)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.1
        while current.state not in FINAL:
            if deadline is not None and time.monotonic() >= deadline:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            current = await self.get(current.id)
        return current

    async def get(self, job_id: str) -> Job:
        return Job.model_validate((await self.request("GET", f"/v1/jobs/{job_id}")).json())

    async def cancel(self, job_id: str) -> Job:
        return Job.model_validate((await self.request("DELETE", f"/v1/jobs/{job_id}")).json())

    async def list(
        self, *, state: str | None = None, host: str | None = None, limit: int = 50
    ) -> list[Job]:
        """As `Client.list`."""
        params = {k: v for k, v in {"state": state, "host": host, "limit": limit}.items() if v}
        items = (await self.request("GET", "/v1/jobs", params=params)).json()["items"]
        return [Job.model_validate(i) for i in items]

    async def output(self, job_id: str, stream: Stream = "stdout", offset: int = 0) -> bytes:
        """As `Client.output`."""
        params = {"stream": stream, "offset": offset}
        return (await self.request("GET", f"/v1/jobs/{job_id}/output", params=params)).content

    async def follow(
        self, job_id: str, stream: Stream = "stdout", offset: int = 0
    ) -> AsyncIterator[bytes]:
        """As `Client.follow`."""
        final = False
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
            except httpx.TransportError:
                await asyncio.sleep(0.2)
            except InvalidRequest as exc:
                if exc.kind != "output-not-kept":
                    raise
                offset = int(exc.body["next_offset"])
                continue
            if final and got == 0:
                return
            final = (await self.get(job_id)).state in FINAL

    async def events(self, job_id: str, last_event_id: str | None = None) -> AsyncIterator[Event]:
        """As `Client.events`."""
        while True:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
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
                        if event.event == "cutoff":
                            break
                        yield event
                        if event.event == "end":
                            return
            except httpx.TransportError:
                await asyncio.sleep(0.2)

    # ---- files

    async def list_files(self, host: str, path: str = "~") -> dict[str, Any]:
        """As `Client.list_files`."""
        params: dict[str, Any] = {"path": path, "limit": 1000}
        answer: dict[str, Any] = (await self.request("GET", files_path(host), params=params)).json()
        while answer.get("next_cursor"):
            params["cursor"] = answer["next_cursor"]
            more = (await self.request("GET", files_path(host), params=params)).json()
            answer["items"] += more["items"]
            answer["next_cursor"] = more["next_cursor"]
        return answer

    async def stat(self, host: str, path: str) -> dict[str, Any]:
        """As `Client.stat`."""
        params = {"path": path, "limit": 1}
        answer = (await self.request("GET", files_path(host), params=params)).json()
        return {k: v for k, v in answer.items() if k not in ("items", "next_cursor")}

    async def download(
        self,
        host: str,
        path: str,
        dest: str | os.PathLike[str],
        *,
        progress: Progress | None = None,
    ) -> int:
        """As `Client.download` (the local file is written in a thread)."""
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
                    if status == 416 and offset:
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
                            async for chunk in response.aiter_bytes():
                                await asyncio.to_thread(out.write, chunk)
                                done += len(chunk)
                                attempt = 0
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
                delay = self._delay(attempt, None)
                if delay is None:
                    raise TransportError(f"GET {path}: {exc}") from exc
            await asyncio.sleep(delay)
            attempt += 1

    async def upload(
        self,
        host: str,
        source: str | os.PathLike[str],
        path: str,
        *,
        create_only: bool = False,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """As `Client.upload` (the local file is read in a thread)."""
        size = (await asyncio.to_thread(os.stat, source)).st_size

        async def chunks() -> AsyncIterator[bytes]:
            done = 0
            f = await asyncio.to_thread(Path(source).open, "rb")
            try:
                while data := await asyncio.to_thread(f.read, CHUNK):
                    done += len(data)
                    if progress is not None:
                        progress(done, size)
                    yield data
            finally:
                f.close()

        response = await self.request(
            "PUT",
            files_path(host, "/content"),
            params={"path": path},
            content=chunks,
            headers=_upload_headers(size, create_only),
            timeout=httpx.Timeout(60, write=300),
        )
        result: dict[str, Any] = response.json()
        return result

    async def delete_file(self, host: str, path: str) -> None:
        """As `Client.delete_file`."""
        await self.request("DELETE", files_path(host), params={"path": path})
