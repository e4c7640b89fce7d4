"""/v1/jobs: submit, read, list, cancel."""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Header, Query, Response
from fastapi.responses import StreamingResponse

from api.config import NAME, ApiConfig
from api.deps import Canceller, Reader, Svc, Writer
from api.output import MAX_READ
from api.policy import host_details
from api.problems import MEDIA_TYPE, Problem, error_problem, retry_after
from api.routes.live import follow_output
from api.schemas import REQUEST_EXAMPLES, Job, JobList, JobRequest, JobSummary
from api.states import FINAL, State
from api.store import JobRow
from api.timing import TIMING

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

# ASCII digits only: [0-9], not \d (which matches other scripts' digits too).
PREFER_WAIT = re.compile(r"(?:^|[;,\s])wait\s*=\s*\"?([0-9]+(?:\.[0-9]+)?)\"?", re.IGNORECASE)


def _problem(description: str) -> dict[str, Any]:
    return {"description": description, "content": {MEDIA_TYPE: {}}}


ERRORS: dict[int | str, dict[str, Any]] = {
    401: _problem("Missing or invalid token (`WWW-Authenticate` says why)."),
    403: _problem("Scope, host, raw shell line or template not allowed."),
    404: _problem("No such job (or not yours)."),
}
SUBMIT_ERRORS: dict[int | str, dict[str, Any]] = {
    202: {"model": Job, "description": "Still running after `Prefer: wait`; poll `Location`."},
    401: ERRORS[401],
    403: ERRORS[403],
    413: _problem("Body, stdin or command too large."),
    422: _problem("Invalid body, unknown host or template, Idempotency-Key reused."),
    429: _problem("Rate limit or concurrent-job cap: see `Retry-After`."),
    502: _problem("SSH failed before the command started (auth, host key, connection)."),
    503: _problem("Host saturated or down: see `Retry-After`. Nothing ran."),
    504: _problem("Connecting to the host timed out. Nothing ran."),
}


def wait_seconds(prefer: str | None, api: ApiConfig) -> float | None:
    """RFC 7240 `Prefer: wait=N`, capped by configuration; None when absent."""
    match = PREFER_WAIT.search(prefer or "")
    return min(float(match.group(1)), api.wait_max) if match else None


def job_response(
    row: JobRow, details: bool, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """The job as JSON, serialized once: `Job.of` validates what the service built, and a
    returned Response skips FastAPI's second pass (dump to dict, validate against the response
    model, serialize), which cost as much as the first. The response_model on each route still
    documents the body. `details`: `host_details`."""
    body = Job.of(row, details).model_dump_json()
    return Response(body, status, headers, media_type="application/json")


def etag_of(body: bytes) -> str:
    """A strong validator: the body's bytes decide it (the same bytes, the same ETag)."""
    return '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


def matches(if_none_match: str | None, etag: str) -> bool:
    """RFC 9110 If-None-Match: weak comparison (W/ ignored), a list, or `*`."""
    if if_none_match is None:
        return False
    if if_none_match.strip() == "*":
        return True
    wanted = etag.removeprefix("W/")
    return any(t.strip().removeprefix("W/") == wanted for t in if_none_match.split(","))


def conditional(body: bytes, if_none_match: str | None) -> Response:
    """200 with the body and its ETag, or 304 (no body) when the client has those bytes."""
    etag = etag_of(body)
    headers = {"ETag": etag, "Cache-Control": "private, no-cache"}
    if matches(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    return Response(body, 200, headers, media_type="application/json")


IfNoneMatch = Annotated[
    str | None,
    Header(max_length=4096, description="ETags you hold: 304 when the answer is one of them."),
]


def answer(row: JobRow, details: bool, headers: dict[str, str]) -> Response:
    """201 when finished, 202 while queued or running (+ Location); a job that could not start
    is the SSH failure's problem, naming the job."""
    location = f"/v1/jobs/{row.id}"
    if row.state == "error":
        problem = error_problem(row)
        problem.headers["Location"] = location
        raise problem
    timing = TIMING.get()
    if timing is not None and row.timings:
        timing.add_ms(row.timings)
    headers["Location"] = location
    return job_response(row, details, 201 if row.state in FINAL else 202, headers)


@router.post(
    "",
    status_code=201,
    response_model=Job,
    responses=SUBMIT_ERRORS,
    summary="Run a command on a host",
)
async def submit(
    body: Annotated[JobRequest, Body(openapi_examples=REQUEST_EXAMPLES)],
    who: Writer,
    svc: Svc,
    prefer: Annotated[
        str | None,
        Header(description="`wait=N`: seconds to hold the request before answering 202."),
    ] = None,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=255,
            description="Same key + same body replays the job; another body is 422.",
        ),
    ] = None,
) -> Response:
    asked = wait_seconds(prefer, svc.config.api)
    wait = asked if asked is not None else svc.config.api.wait_default
    row, replayed = await svc.jobs.submit(who, body, idempotency_key)
    # Without Prefer, a batch job is answered once the scheduler has it, not when it ends.
    row = await svc.jobs.wait(row, wait, batch_until_final=asked is not None)
    headers = {"Preference-Applied": f"wait={wait:g}"}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return answer(row, host_details(who, svc.config.api), headers)


CONDITIONAL: dict[int | str, dict[str, Any]] = {
    304: {"description": "Unchanged: your `If-None-Match` holds the current `ETag`."},
    **ERRORS,
}


@router.get("/{job_id}", response_model=Job, responses=CONDITIONAL, summary="One job")
async def get_job(
    job_id: str, who: Reader, svc: Svc, if_none_match: IfNoneMatch = None
) -> Response:
    row = await svc.jobs.get(who, job_id)
    body = Job.of(row, host_details(who, svc.config.api)).model_dump_json().encode()
    return conditional(body, if_none_match)


@router.get("", response_model=JobList, responses=CONDITIONAL, summary="Your jobs, newest first")
async def list_jobs(
    who: Reader,
    svc: Svc,
    if_none_match: IfNoneMatch = None,
    state: State | None = None,
    host: Annotated[str | None, Query(max_length=64, pattern=NAME)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    cursor: Annotated[str | None, Query(description="`next_cursor` of the previous page.")] = None,
) -> Response:
    if who.handle is not None:
        raise Problem(403, "handle-not-allowed", "Not with a handle",
                      "a job handle reads its job only; listing needs a token")  # fmt: skip
    if cursor is not None:
        try:
            uuid.UUID(cursor)
        except ValueError:
            raise Problem(422, "invalid-cursor", "Invalid cursor", "pass a next_cursor") from None
    limit = min(limit, svc.config.api.max_page)
    rows, next_cursor = await svc.jobs.list_jobs(
        who, state=state, host=host, limit=limit, cursor=cursor
    )
    details = host_details(who, svc.config.api)
    page = JobList(items=[JobSummary.of(r, details) for r in rows], next_cursor=next_cursor)
    return conditional(page.model_dump_json().encode(), if_none_match)


@router.get(
    "/{job_id}/output",
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "The bytes `[offset, offset + length)`; `X-Output-Size` is the whole "
            "size when read, `X-Output-Next-Offset` where to go on from.",
        },
        **ERRORS,
        404: _problem("No such job, or no output yet (then with `Retry-After`)."),
    },
    response_class=Response,
    summary="A byte range of a job's stdout or stderr",
)
async def job_output(
    job_id: str,
    who: Reader,
    svc: Svc,
    stream: Literal["stdout", "stderr"] = "stdout",
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_READ)] = 1 << 20,
    follow: Annotated[
        bool,
        Query(
            description="Stream the bytes from `offset` as they arrive (chunked) until the job "
            "is final; `limit` does not apply. 416 `output-not-kept` (with `next_offset`) for "
            "bytes past `max_output` no longer in the live window."
        ),
    ] = False,
) -> Response:
    """A batch job's output file (read from the login host: grows while the job runs), or a
    finished command's stored output (capped by the policy: see `stdout_truncated`); with
    `follow=true`, the live bytes (docs/http-api.md, live output)."""
    if follow:
        response: Response = await follow_output(svc, who, job_id, stream, offset)
        return response
    row, chunk = await svc.jobs.output(who, job_id, stream, offset, limit)
    if chunk.size is None:
        active = row.state not in FINAL
        raise Problem(
            404,
            "no-output-yet" if active else "no-output",
            "No output yet" if active else "No output",
            f"job {job_id} is {row.state}: no {stream} "
            + ("yet" if active else "file (deleted, or the job never started)"),
            headers=retry_after(2) if active else None,
        )
    return StreamingResponse(
        chunk.body,
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(chunk.length),
            "X-Output-Size": str(chunk.size),
            "X-Output-Offset": str(chunk.offset),
            "X-Output-Next-Offset": str(chunk.next_offset),
        },
    )


@router.delete(
    "/{job_id}",
    response_model=Job,
    responses={
        **ERRORS,
        202: {"description": "Another replica runs the job; the cancel is recorded, not done yet."},
        409: _problem("The job already finished."),
    },
    summary="Cancel a job: kill its remote process tree",
)
async def cancel_job(job_id: str, who: Canceller, svc: Svc) -> Response:
    row = await svc.jobs.cancel(who, job_id)
    # 202: another replica owns it and has not recorded the cancel yet (busy, or down).
    return job_response(row, host_details(who, svc.config.api), 200 if row.state in FINAL else 202)
