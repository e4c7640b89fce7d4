"""GENERATED from _async.py by scripts/gen_sync_client.py (`make unasync`):
edit _async.py, never this file. `Client`, the synchronous client."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from time import monotonic, sleep
from typing import Any

import httpx

from api.client._sync_files import SyncFiles
from api.client.base import (
    WAIT,
    Event,
    SSEParser,
    _fresh,
    a_job,
    an_object,
    job_body,
    jobs,
    objects,
    read_answer,
)
from api.client.errors import (
    InvalidRequest,
    JobFailed,
    TransportError,
    raise_for_problem,
)
from api.client.models import FINAL, Job, Stream
from api.client.tls import verify_for


class Client(SyncFiles):
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
        transport: httpx.BaseTransport | None = None,
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
        self.http = httpx.Client(
            base_url=self.url,
            headers=self.headers,
            auth=self.auth,
            timeout=timeout,
            transport=transport,
            verify=verify_for(self.url),
            trust_env=self.trust_env,
            event_hooks={"response": [self._answer]},
        )

    def _answer(self, response: httpx.Response) -> None:
        self.answered = True

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One API call with the retries; raises the call's ProblemError or TransportError."""
        attempt = 0
        while True:
            try:
                response = self.http.request(method, path, **_fresh(kw))
            except httpx.TransportError as exc:
                delay = self._delay_after(attempt, exc, f"{method} {self.url}{path}")
            else:
                retry = self._delay(attempt, response)
                if retry is None:
                    raise_for_problem(response)
                    return response
                delay = retry
            sleep(delay)
            attempt += 1

    def submit(
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
        response = self.request("POST", "/v1/jobs", json=body, headers=headers)
        return read_answer(response, a_job)

    def run(
        self, host: str, argv: Sequence[str] | None = None, *, check: bool = False, **options: Any
    ) -> Job:
        """Run a command and return its finished job (`stdout`, `stderr`, `exit_status`)."""
        job = self.wait(self.submit(host, argv, wait=WAIT, **options))
        if check and job.state != "succeeded":
            raise JobFailed(job)
        return job

    def wait(self, job: Job | str, timeout: float | None = None) -> Job:
        """Poll until the job is final (backing off to 2 s); `timeout`: give up, return it."""
        current = job if isinstance(job, Job) else self.get(job)
        deadline = None if timeout is None else monotonic() + timeout
        delay = 0.1
        while current.state not in FINAL:
            if deadline is not None and monotonic() >= deadline:
                break
            sleep(delay)
            delay = min(delay * 2, 2.0)
            current = self.get(current.id)
        return current

    def whoami(self) -> dict[str, Any]:
        """Who the server takes this client's token for: `subject`, `issuer`, `scopes`,
        `admin`, `account` (the token's claim), `hosts` (each one's `name` and the `account`
        you run as there, where it is yours to know)."""
        return read_answer(self.request("GET", "/v1/whoami"), an_object)

    def hosts(self) -> list[dict[str, Any]]:
        """The hosts you may use (`name`, `health`, `shell`, `description`, ...)."""
        return read_answer(self.request("GET", "/v1/hosts"), objects)

    def add_webhook(self, url: str, events: Sequence[str]) -> dict[str, Any]:
        """POST /v1/webhooks: have your jobs' state changes (`job.succeeded`, `job.failed`,
        `job.running`, ...) POSTed to `url`, signed (docs/portals.md). The answer's `secret`
        (`whsec_...`) is shown this once: keep it to verify the deliveries."""
        body = {"url": url, "events": list(events)}
        return read_answer(self.request("POST", "/v1/webhooks", json=body), an_object)

    def webhooks(self) -> list[dict[str, Any]]:
        """Your webhooks, each with `delivered`, `failed`, `pending` and `last_delivery`."""
        response = self.request("GET", "/v1/webhooks")
        return read_answer(response, lambda body: objects(an_object(body)["items"]))

    def webhook(self, webhook_id: str) -> dict[str, Any]:
        return read_answer(self.request("GET", f"/v1/webhooks/{webhook_id}"), an_object)

    def remove_webhook(self, webhook_id: str) -> None:
        """DELETE /v1/webhooks/{id}: no more deliveries, the pending ones dropped."""
        self.request("DELETE", f"/v1/webhooks/{webhook_id}")

    def get(self, job_id: str) -> Job:
        response = self.request("GET", f"/v1/jobs/{job_id}")
        return read_answer(response, a_job)

    def list(
        self, *, state: str | None = None, host: str | None = None, limit: int = 50
    ) -> list[Job]:
        params = {k: v for k, v in {"state": state, "host": host, "limit": limit}.items() if v}
        response = self.request("GET", "/v1/jobs", params=params)
        return read_answer(response, jobs)

    def cancel(self, job_id: str) -> Job:
        response = self.request("DELETE", f"/v1/jobs/{job_id}")
        return read_answer(response, a_job)

    def output(self, job_id: str, stream: Stream = "stdout", offset: int = 0) -> bytes:
        """A byte range of the output from `offset` (the server's read limit)."""
        params = {"stream": stream, "offset": offset}
        response = self.request("GET", f"/v1/jobs/{job_id}/output", params=params)
        return response.content

    def follow(self, job_id: str, stream: Stream = "stdout", offset: int = 0) -> Iterator[bytes]:
        """The stream's bytes as they arrive until the job is final, reconnecting from the
        offset reached after a cut-off or a dropped connection; bytes the server did not keep
        (past `max_output`, out of the live window) are skipped."""
        final = False  # the job was final before this pass: a pass with nothing new ends it
        while True:
            got = 0
            try:
                with self.http.stream(
                    "GET",
                    f"/v1/jobs/{job_id}/output",
                    params={"stream": stream, "offset": offset, "follow": "true"},
                    timeout=httpx.Timeout(60, read=None),
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise_for_problem(response)
                    for chunk in response.iter_bytes():
                        offset += len(chunk)
                        got += len(chunk)
                        yield chunk
            except httpx.TransportError as exc:
                if self._unreached(exc):
                    raise TransportError(f"GET {self.url}/v1/jobs/{job_id}/output: {exc}") from exc
                sleep(0.2)  # dropped: resume from the offset reached
            except InvalidRequest as exc:
                resume = exc.body.get("next_offset")
                if exc.kind != "output-not-kept" or not isinstance(resume, int):
                    raise
                offset = resume
                continue
            if final and got == 0:
                return
            current = self.get(job_id)
            final = current.state in FINAL

    def events(self, job_id: str, last_event_id: str | None = None) -> Iterator[Event]:
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
                with self.http.stream(
                    "GET",
                    f"/v1/jobs/{job_id}/events",
                    headers=headers,
                    timeout=httpx.Timeout(60, read=None),
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise_for_problem(response)
                    parser = SSEParser()
                    for line in response.iter_lines():
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
                sleep(self._delay_after(attempt, exc, where))
                attempt += 1
                continue
            if progressed:
                continue  # a cut-off, or a stream that ended after events: at once
            # Not a stream of events (a proxy's empty answer, a server that closes at once):
            # paced by the retries instead of reconnecting in a tight loop.
            delay = self._delay(attempt, None)
            if delay is None:
                raise TransportError(f"{where}: the stream ended {attempt + 1} times with no event")
            sleep(delay)
            attempt += 1

    def watch(self, last_event_id: str | None = None) -> Iterator[Event]:
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
                with self.http.stream(
                    "GET", "/v1/jobs/events", headers=headers, timeout=httpx.Timeout(60, read=None)
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise_for_problem(response)
                    parser = SSEParser()
                    for line in response.iter_lines():
                        if (event := parser.feed(line)) is None:
                            continue
                        last_event_id = event.id or last_event_id
                        attempt = 0
                        yield event
                        if event.event == "revoked":
                            return
            except httpx.TransportError as exc:
                sleep(self._delay_after(attempt, exc, where))
                attempt += 1
                continue
            delay = self._delay(attempt, None)  # the server ended the stream: paced
            if delay is None:
                raise TransportError(f"{where}: the stream ended {attempt + 1} times")
            sleep(delay)
            attempt += 1

    # ---- job handles (docs/portals.md)

    def create_handle(self, job_id: str, ttl: float, *, cancel: bool = False) -> dict[str, Any]:
        """A handle of the job: `handle` (the bearer token, shown once: give it to whatever
        follows the job, as `token=` of a client), `id` (to delete it), `expires_at`."""
        body = {"ttl": ttl, "cancel": cancel}
        response = self.request("POST", f"/v1/jobs/{job_id}/handles", json=body)
        return read_answer(response, an_object)

    def handles(self, job_id: str) -> Sequence[dict[str, Any]]:
        """The job's handles (without their tokens)."""
        response = self.request("GET", f"/v1/jobs/{job_id}/handles")
        return read_answer(response, lambda body: objects(an_object(body)["items"]))

    def delete_handle(self, job_id: str, handle_id: str) -> None:
        """Revoke a handle: its next request is 401."""
        self.request("DELETE", f"/v1/jobs/{job_id}/handles/{handle_id}")
