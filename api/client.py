"""The researcher's client for the sshapi HTTP API, sync and async, on httpx.

In a notebook:

    from api.client import Client
    client = Client("http://127.0.0.1:8000", token=TOKEN)  # or Client(): SSHAPI_URL, SSHAPI_TOKEN
    print(client.run("local", ["hostname"]).stdout)

`AsyncClient` has the same methods as coroutines (and async iterators for `follow`/`events`).
Files (docs/files.md): `list_files`, `stat`, `download` (resumed by Range), `upload` (streamed),
`delete_file`.

What the client does for you: an `Idempotency-Key` on every POST, so that a retry (after a 429,
a 503 or a dropped connection) replays the job instead of running the command twice; retries of
429/503 honouring `Retry-After`, with jitter; waiting for a job to finish; following output
across cut-offs and reconnects (offsets, `Last-Event-ID`).

Errors, one tree (as httpx's): every problem answer is raised as the class of its status, the
problem's fields on it.

    SshapiError
    ├── TransportError      the server could not be reached or dropped the connection (after
    │                       the retries)
    └── ProblemError        the API answered a problem: .status .type .title .detail .job_id
        ├── Unauthorized    401: no token, or not valid (expired, wrong audience...)
        ├── Forbidden       403: scope, host, raw shell line or template not allowed
        ├── NotFound        404: no such job (or not yours)
        ├── Conflict        409: the job already finished (cancel), not submitted yet
        ├── InvalidRequest  413, 416, 422: the request is wrong; retrying it will not help
        ├── RateLimited     429: rate limit, job cap or follower cap (after the retries)
        ├── Unavailable     503: the host is saturated or down (after the retries); nothing ran
        └── SSHFailed       502, 504: SSH failed before the command started; nothing ran

A command that ran and exited non-zero is not an error: `run` returns its job (state `failed`,
`exit_status`); pass `check=True` to raise `JobFailed` (a ProblemError-free SshapiError) instead.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import random
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, BinaryIO, Literal, NoReturn

import httpx

from api.schemas import Job
from api.states import FINAL
from api.tls import tls_context

Stream = Literal["stdout", "stderr"]
# A transfer's progress: (bytes done, bytes in all).
Progress = Callable[[int, int], None]
# Where `sshapi dev` listens: only ever a suggestion in an error message, and the URL of a client
# made without a token (nothing to leak). A token is sent only to a URL somebody wrote down.
DEFAULT_URL = "http://127.0.0.1:8000"
CHUNK = 1 << 20  # bytes per upload read (the server writes to the host in 1 MiB writes too)
RETRY_STATUS = (429, 503)
WAIT = 30.0  # Prefer: wait=N on submit: a short command finishes in one request


class SshapiError(Exception):
    """Base of every error this client raises."""


class TransportError(SshapiError):
    """The server could not be reached, or dropped the connection, after the retries."""


class InsecureHTTPWarning(UserWarning):
    """A token goes over plain HTTP to another host than this one, as opted in to."""


class JobFailed(SshapiError):
    """`run(check=True)`: the job ended in another state than `succeeded`."""

    def __init__(self, job: Job) -> None:
        super().__init__(f"job {job.id} {job.state} (exit status {job.exit_status})")
        self.job = job


class ProblemError(SshapiError):
    """The API answered an `application/problem+json` error."""

    def __init__(self, status: int, body: Mapping[str, Any], headers: Mapping[str, str]) -> None:
        self.status = status
        self.type: str = str(body.get("type", "about:blank"))
        self.kind = self.type.rsplit(":", 1)[-1]  # "rate-limited", "job-not-found", ...
        self.title: str = str(body.get("title", ""))
        self.detail: str | None = body.get("detail")
        self.job_id: str | None = body.get("job_id")
        self.body = dict(body)
        self.retry_after = _retry_after(headers)
        super().__init__(f"{status} {self.kind}: {self.detail or self.title}")


class Unauthorized(ProblemError):
    """401: no token, or one the server does not accept."""


class Forbidden(ProblemError):
    """403: the token's scopes or the policy do not allow it."""


class NotFound(ProblemError):
    """404: no such job (or not yours)."""


class Conflict(ProblemError):
    """409: the job is not in a state that allows it (finished, not submitted yet)."""


class InvalidRequest(ProblemError):
    """413, 416, 422: the request itself is wrong."""


class RateLimited(ProblemError):
    """429: a rate limit or a cap, still there after the retries."""


class Unavailable(ProblemError):
    """503: saturated or down, still after the retries; nothing ran."""


class SSHFailed(ProblemError):
    """502, 504: SSH failed before the command started; nothing ran."""


BY_STATUS: dict[int, type[ProblemError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: InvalidRequest,
    416: InvalidRequest,
    422: InvalidRequest,
    429: RateLimited,
    502: SSHFailed,
    503: Unavailable,
    504: SSHFailed,
}


def _retry_after(headers: Mapping[str, str]) -> float | None:
    try:
        return float(headers["retry-after"])
    except (KeyError, ValueError):
        return None


def raise_for_problem(response: httpx.Response) -> None:
    """Raise the ProblemError subclass of a 4xx/5xx answer."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = {"title": response.reason_phrase, "detail": response.text[:500]}
    if not isinstance(body, dict):
        body = {"title": response.reason_phrase}
    cls = BY_STATUS.get(response.status_code, ProblemError)
    raise cls(response.status_code, body, response.headers)


def _raise(response: httpx.Response) -> NoReturn:
    raise_for_problem(response)
    raise SshapiError(f"unexpected answer {response.status_code}")


@dataclass(frozen=True, slots=True)
class Event:
    """One Server-Sent Event of `/events`: `event` is state, output, gap, cutoff or end."""

    event: str
    data: dict[str, Any]
    id: str | None = None


@dataclass(frozen=True, slots=True)
class Profile:
    url: str | None  # None: nobody named a server
    token: str | None
    allow_http: bool = False
    # The server the token was configured for (SSHAPI_URL beside SSHAPI_TOKEN, a profile's url
    # beside its token), and where it came from; None: set without a server.
    token_url: str | None = None
    token_from: str = ""


# The keys a profile of the client configuration file may have, and the type of each.
PROFILE_KEYS: dict[str, type] = {"url": str, "token": str, "token_file": str, "allow_http": bool}


def load_profile(name: str | None = None, path: str | None = None) -> Profile:
    """The server URL and token: SSHAPI_URL / SSHAPI_TOKEN, else the named profile (or the
    file's `default`) of the client configuration file (SSHAPI_CLIENT_CONFIG, else
    ~/.config/sshapi/client.toml):

        default = "dev"
        [profiles.dev]
        url = "http://127.0.0.1:8000"
        token_file = "~/.config/sshapi/dev.token"   # or: token = "..."

    `url` is None when neither names a server: see `server_url`. `token_url` is the server the
    token was set up with (SSHAPI_URL beside SSHAPI_TOKEN, the profile's url beside its token):
    see `paired`.
    """
    import tomllib
    from pathlib import Path

    file = Path(
        path
        or os.environ.get("SSHAPI_CLIENT_CONFIG")
        or Path.home() / ".config" / "sshapi" / "client.toml"
    ).expanduser()
    entry: dict[str, Any] = {}
    wanted: Any = None
    if file.is_file():
        # A hand-written file: whatever is wrong in it is an SshapiError naming the file and
        # the key (one line from the commands), never a traceback.
        try:
            data = tomllib.loads(file.read_text())
        except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not TOML
            raise SshapiError(f"{file}: not a valid client configuration: {exc}") from None
        profiles = data.get("profiles", {})
        if not isinstance(profiles, dict):
            raise SshapiError(f"{file}: `profiles` must be tables [profiles.NAME]")
        wanted = name or os.environ.get("SSHAPI_PROFILE") or data.get("default")
        if wanted is not None:
            if not isinstance(wanted, str) or wanted not in profiles:
                raise SshapiError(f"no profile {wanted!r} in {file}")
            entry = profiles[wanted]
            if not isinstance(entry, dict):
                raise SshapiError(f"{file}: profiles.{wanted} must be a table")
            for key, value in entry.items():
                if key not in PROFILE_KEYS:
                    known = ", ".join(PROFILE_KEYS)
                    raise SshapiError(f"{file}: unknown key profiles.{wanted}.{key} ({known})")
                if not isinstance(value, PROFILE_KEYS[key]):
                    kind = "a boolean" if PROFILE_KEYS[key] is bool else "a string"
                    raise SshapiError(f"{file}: profiles.{wanted}.{key} must be {kind}")
    elif name is not None:
        raise SshapiError(f"no profile {name!r}: {file} does not exist")
    token = entry.get("token")
    if token is None and "token_file" in entry:
        token_file = Path(entry["token_file"]).expanduser()
        try:
            token = token_file.read_text().strip()
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else exc
            raise SshapiError(f"token_file {token_file}: {reason}") from None
    env_url = os.environ.get("SSHAPI_URL") or None
    if env_token := os.environ.get("SSHAPI_TOKEN"):
        token, token_url, token_from = env_token, env_url, "SSHAPI_TOKEN"
    else:
        token_url, token_from = entry.get("url"), f"profile {wanted!r} of {file}"
    return Profile(
        url=env_url or entry.get("url"),
        token=token,
        allow_http=entry.get("allow_http", False),
        token_url=token_url if token else None,
        token_from=token_from,
    )


def _origin(url: str) -> tuple[str, str, int | None]:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return ("", url, None)
    return (parsed.scheme, parsed.host, parsed.port)


def paired(found: Profile, url: str | None) -> str | None:
    """The configured token for a request to `url`, or an SshapiError when it was configured for
    another server (a profile's token with SSHAPI_URL set, SSHAPI_TOKEN with another URL given):
    a token goes to the server it was set up with, never on to another one."""
    if found.token is None or found.token_url is None or url is None:
        return found.token
    if _origin(found.token_url) != _origin(url):
        raise SshapiError(
            f"the token of {found.token_from} is for {found.token_url}, not {url}: give the "
            f"token for {url} (SSHAPI_TOKEN, token=) or unset what points elsewhere"
        )
    return found.token


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_url(url: str | None, token: str | None, allow_http: bool = False) -> str:
    """The base URL to talk to, or an SshapiError when a token would go where nobody chose.

    A token is a password: it goes only to a URL given (argument, SSHAPI_URL or a profile), never
    to the default, which on a shared login node is whoever listens on that port first; over
    plain HTTP only to this machine's loopback, unless `allow_http` (SSHAPI_ALLOW_HTTP=1, a
    profile's `allow_http = true`) says so, with a warning: anyone on the path reads it."""
    if url is None:
        if token:
            raise SshapiError(
                f"no server URL given: the token is not sent to {DEFAULT_URL}, a default nobody "
                f"chose; name the server: export SSHAPI_URL={DEFAULT_URL} (as `sshapi dev` "
                "prints), a profile's url (--profile), or Client(url)"
            )
        return DEFAULT_URL
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise SshapiError(f"{url!r}: not a URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise SshapiError(f"{url!r}: not an http:// or https:// URL (SSHAPI_URL, --profile)")
    if parsed.scheme == "http" and token and not _loopback(parsed.host):
        if not allow_http:
            raise SshapiError(
                f"{url}: the token is not sent over plain HTTP to another machine (anyone on "
                "the way reads it); use https://, or opt in with SSHAPI_ALLOW_HTTP=1 (a "
                "profile's allow_http = true)"
            )
        warnings.warn(
            f"the token goes over plain HTTP to {url}: anyone on the way can read it",
            InsecureHTTPWarning,
            stacklevel=4,
        )
    return url


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def job_body(
    host: str,
    argv: Sequence[str] | None = None,
    *,
    command: str | None = None,
    template: str | None = None,
    params: Mapping[str, Any] | None = None,
    batch: Mapping[str, Any] | None = None,
    stdin: str | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"host": host}
    for key, value in (
        ("argv", list(argv) if argv is not None else None),
        ("command", command),
        ("template", template),
        ("params", dict(params) if params is not None else None),
        ("batch", dict(batch) if batch is not None else None),
        ("stdin", stdin),
        ("timeout", timeout),
    ):
        if value is not None:
            body[key] = value
    return body


class SSEParser:
    """Server-Sent Events from text lines, one line at a time (comments, keep-alives skipped)."""

    def __init__(self) -> None:
        self.fields: dict[str, str] = {}

    def feed(self, line: str) -> Event | None:
        if line.startswith(":"):
            return None
        if line:
            name, _, value = line.partition(":")
            self.fields[name] = value.removeprefix(" ")
            return None
        fields, self.fields = self.fields, {}
        if "data" not in fields:
            return None
        return Event(fields.get("event", "message"), json.loads(fields["data"]), fields.get("id"))


def _fresh(kw: dict[str, Any]) -> dict[str, Any]:
    """A request's arguments for one try: a `content` given as a function (an upload's
    stream) is called again, as a retry must send the body again from its start."""
    content = kw.get("content")
    return {**kw, "content": content()} if callable(content) else kw


def _upload_headers(size: int, create_only: bool) -> dict[str, str]:
    # A declared length lets the server refuse a file over its cap before any byte is sent.
    headers = {"Content-Length": str(size), "Content-Type": "application/octet-stream"}
    if create_only:
        headers["If-None-Match"] = "*"
    return headers


def files_path(host: str, suffix: str = "") -> str:
    return f"/v1/hosts/{host}/files{suffix}"


# Seconds between a file's last modification and a download for its ETag (size and modification
# second) to name one content: RFC 9110's rule for a strong Last-Modified (a second), plus a second
# for the clocks of the API and the host to disagree.
SETTLED = 2.0


def _http_time(response: httpx.Response, header: str) -> float | None:
    try:
        return parsedate_to_datetime(response.headers[header]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None


def settled(response: httpx.Response) -> bool:
    """Whether the downloaded file was last modified SETTLED seconds or more before the answer
    (the server's Date, else this clock). One modified since may be rewritten within the same
    second at the same size: same ETag, other bytes, so its part must not be resumed."""
    modified = _http_time(response, "last-modified")
    now = _http_time(response, "date") or time.time()
    return modified is not None and now - modified >= SETTLED


def _range_start(response: httpx.Response) -> int | None:
    """The first byte of a 206's `Content-Range: bytes START-END/SIZE`."""
    unit, _, span = response.headers.get("content-range", "").partition(" ")
    first = span.partition("-")[0]
    return int(first) if unit == "bytes" and first.isascii() and first.isdigit() else None


class Partial:
    """A download in progress: `<dest>.part` holds the bytes so far and `<dest>.part.etag` what
    they are part of (server, host, path and the file's ETag), so that a download interrupted (a
    dropped connection, Ctrl-C) resumes by Range from where it stopped, and only then: not
    another file's part, not after the file changed (its ETag), not a file whose ETag could hide
    a change (modified just before the download began: `settled`)."""

    def __init__(self, dest: str | os.PathLike[str], source: Mapping[str, str]) -> None:
        self.dest = Path(dest)
        self.source = dict(source)
        self.part = self.dest.with_name(self.dest.name + ".part")
        self.tag = self.dest.with_name(self.dest.name + ".part.etag")

    def offset(self) -> tuple[int, str | None]:
        """Bytes already here and the ETag they were read under (0, None: start from the
        beginning)."""
        try:
            record = json.loads(self.tag.read_text())
            size = self.part.stat().st_size
        except (OSError, ValueError):  # none, or an older client's plain ETag
            return 0, None
        if not isinstance(record, dict) or not isinstance(record.get("etag"), str):
            return 0, None
        if any(record.get(key) != value for key, value in self.source.items()):
            return 0, None
        return size, record["etag"]

    def headers(self, offset: int, etag: str | None) -> dict[str, str]:
        """`Range` from the bytes here, and `If-Range`: a server that has another version
        answers the whole file (200) instead of the rest of a version these bytes are not of."""
        if not offset or etag is None:
            return {}
        return {"Range": f"bytes={offset}-", "If-Range": etag}

    def start(self, response: httpx.Response, resumed: bool) -> BinaryIO:
        """The part file to write to: appended to when resuming, else from empty, recorded as
        resumable only when the answer's ETag is one to trust (`settled`)."""
        if resumed:
            return self.part.open("ab")
        # The record goes after the truncation: never an old part under a new record.
        self.tag.unlink(missing_ok=True)
        out = self.part.open("wb")
        etag = response.headers.get("etag")
        if etag and settled(response):
            self.tag.write_text(json.dumps({**self.source, "etag": etag}))
        return out

    def verify(self, out: BinaryIO, total: int) -> None:
        """The part file has the file's size, as the server announced it: else something else
        wrote into it too (another download to the same place); it is removed."""
        out.flush()
        size = os.fstat(out.fileno()).st_size
        if size != total:
            self.discard()
            raise SshapiError(
                f"{self.part}: {size} bytes where the file has {total} (written to by something "
                "else too?); removed, run the download again"
            )

    def done(self) -> None:
        self.part.replace(self.dest)
        self.tag.unlink(missing_ok=True)

    def discard(self) -> None:
        self.part.unlink(missing_ok=True)
        self.tag.unlink(missing_ok=True)


def resumable(response: httpx.Response, offset: int, etag: str | None) -> bool | None:
    """Whether an answer to `Range: bytes=<offset>-` continues the part file (True), replaces
    it (False: a whole file, 200), or is not the continuation of the bytes here (None: start
    again): another ETag than theirs, or another first byte."""
    if offset == 0 or response.status_code == 200:
        return False
    if (
        response.status_code == 206
        and etag
        and response.headers.get("etag") == etag
        and _range_start(response) == offset
    ):
        return True
    return None


class _Base:
    """What the sync and async clients share: configuration, headers, the retry rule."""

    def __init__(
        self,
        url: str | None,
        token: str | None,
        *,
        profile: str | None,
        retries: int,
        max_retry_wait: float,
        allow_http: bool,
    ) -> None:
        allow_http = allow_http or _env_flag("SSHAPI_ALLOW_HTTP")
        if url is None or token is None:
            found = load_profile(profile)
            url = url or found.url
            token = token or paired(found, url)
            allow_http = allow_http or found.allow_http
        self.url = server_url(url, token, allow_http).rstrip("/")
        # A proxy from the environment (HTTP_PROXY, common on login nodes) would carry a request
        # for this machine's loopback, token in clear, to another machine, and on to the proxy's
        # own loopback. Only for other servers does the environment pick a proxy.
        self.trust_env = not _loopback(httpx.URL(self.url).host)
        self.retries = retries
        self.max_retry_wait = max_retry_wait
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def _delay(self, attempt: int, response: httpx.Response | None) -> float | None:
        """Seconds before the next try, or None: no more tries (or not retryable)."""
        if attempt >= self.retries:
            return None
        if response is not None and response.status_code not in RETRY_STATUS:
            return None
        hinted = _retry_after(response.headers) if response is not None else None
        base = hinted if hinted is not None else min(0.2 * 2**attempt, 5.0)
        # Jitter: many clients told the same Retry-After must not come back at the same moment.
        return min(base * random.uniform(1.0, 1.5), self.max_retry_wait)

    @staticmethod
    def _post_headers(key: str | None, wait: float | None) -> dict[str, str]:
        headers = {"Idempotency-Key": key or str(uuid.uuid4())}
        if wait is not None:
            headers["Prefer"] = f"wait={wait:g}"
        return headers


def exit_code(job: Job) -> int:
    """A shell's exit status for a job: the command's status, 128+n for a signal, 124 for a
    timeout (as timeout(1)), 130 cancelled, 255 when nothing ran or the outcome is unknown."""
    import signal

    if job.exit_signal:
        try:
            return 128 + signal.Signals[f"SIG{job.exit_signal}"].value
        except KeyError:
            return 255
    if job.state == "timed_out":
        return 124
    if job.state == "cancelled":
        return 130
    if job.exit_status is not None and job.exit_status >= 0:
        return job.exit_status
    return 255


class Client(_Base):
    """The synchronous client. A context manager (closes its connections)."""

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
            timeout=timeout,
            transport=transport,
            verify=tls_context(),
            trust_env=self.trust_env,
        )

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
                delay = self._delay(attempt, None)
                if delay is None:
                    raise TransportError(f"{method} {path}: {exc}") from exc
            else:
                delay = self._delay(attempt, response)
                if delay is None:
                    raise_for_problem(response)
                    return response
            time.sleep(delay)
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
        return Job.model_validate(
            self.request("POST", "/v1/jobs", json=body, headers=headers).json()
        )

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
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.1
        while current.state not in FINAL:
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
            current = self.get(current.id)
        return current

    def get(self, job_id: str) -> Job:
        return Job.model_validate(self.request("GET", f"/v1/jobs/{job_id}").json())

    def list(
        self, *, state: str | None = None, host: str | None = None, limit: int = 50
    ) -> list[Job]:
        params = {k: v for k, v in {"state": state, "host": host, "limit": limit}.items() if v}
        items = self.request("GET", "/v1/jobs", params=params).json()["items"]
        return [Job.model_validate(i) for i in items]

    def cancel(self, job_id: str) -> Job:
        return Job.model_validate(self.request("DELETE", f"/v1/jobs/{job_id}").json())

    def output(self, job_id: str, stream: Stream = "stdout", offset: int = 0) -> bytes:
        """A byte range of the output from `offset` (the server's read limit)."""
        params = {"stream": stream, "offset": offset}
        return self.request("GET", f"/v1/jobs/{job_id}/output", params=params).content

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
            except httpx.TransportError:
                time.sleep(0.2)  # dropped: resume from the offset reached
            except InvalidRequest as exc:
                if exc.kind != "output-not-kept":
                    raise
                offset = int(exc.body["next_offset"])
                continue
            if final and got == 0:
                return
            final = self.get(job_id).state in FINAL

    def events(self, job_id: str, last_event_id: str | None = None) -> Iterator[Event]:
        """The job's Server-Sent Events until `end`, reconnecting with Last-Event-ID after a
        cut-off or a dropped connection (no event lost or repeated)."""
        while True:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
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
                        if event.event == "cutoff":
                            break
                        yield event
                        if event.event == "end":
                            return
            except httpx.TransportError:
                time.sleep(0.2)

    # ---- files (docs/files.md)

    def list_files(self, host: str, path: str = "~") -> dict[str, Any]:
        """A directory's entries (all pages: `items`), or one entry's stat when `path` is not a
        directory (`type`, `size`, `mode`, `mtime`...)."""
        pages = self.list_pages(host, path)
        answer = next(pages)
        for more in pages:
            answer["items"] += more["items"]
            answer["next_cursor"] = more["next_cursor"]
        return answer

    def list_pages(self, host: str, path: str = "~") -> Iterator[dict[str, Any]]:
        """A directory's answers page by page as they come (`items` in each), or one entry's
        stat when `path` is not a directory."""
        params: dict[str, Any] = {"path": path, "limit": 1000}
        while True:
            answer: dict[str, Any] = self.request("GET", files_path(host), params=params).json()
            yield answer
            if not answer.get("next_cursor"):
                return
            params["cursor"] = answer["next_cursor"]

    def stat(self, host: str, path: str) -> dict[str, Any]:
        """One entry: `type` (file, dir, symlink, other), and for a non-directory `size`,
        `mode`, `mtime`."""
        answer = self.request("GET", files_path(host), params={"path": path, "limit": 1}).json()
        return {k: v for k, v in answer.items() if k not in ("items", "next_cursor")}

    def download(
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
                with self.http.stream(
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
                            for chunk in response.iter_bytes():
                                out.write(chunk)
                                done += len(chunk)
                                attempt = 0  # progress: the retries count afresh
                                if progress is not None:
                                    progress(done, total)
                            if done != total:
                                raise httpx.ReadError("the body ended early")
                            partial.verify(out, total)
                        partial.done()
                        return total
                    response.read()
                    delay = self._delay(attempt, response)
                    if delay is None:
                        _raise(response)
            except httpx.TransportError as exc:
                delay = self._delay(attempt, None)
                if delay is None:
                    raise TransportError(f"GET {path}: {exc}") from exc
            time.sleep(delay)
            attempt += 1

    def upload(
        self,
        host: str,
        source: str | os.PathLike[str],
        path: str,
        *,
        create_only: bool = False,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """Upload a local file to `path`, streamed (never held whole); the server renames it
        into place only when complete. `create_only`: 412 if `path` exists. A retry sends the
        file again from its start (the same bytes: replacing is harmless). Answers `path`,
        `size`, `sha256`."""
        size = os.path.getsize(source)

        def chunks() -> Iterator[bytes]:
            done = 0
            with open(source, "rb") as f:
                while data := f.read(CHUNK):
                    done += len(data)
                    if progress is not None:
                        progress(done, size)
                    yield data

        response = self.request(
            "PUT",
            files_path(host, "/content"),
            params={"path": path},
            content=chunks,
            headers=_upload_headers(size, create_only),
            timeout=httpx.Timeout(60, write=300),
        )
        result: dict[str, Any] = response.json()
        return result

    def delete_file(self, host: str, path: str) -> None:
        """Delete a file, a symlink (not its target) or an empty directory."""
        self.request("DELETE", files_path(host), params={"path": path})


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
