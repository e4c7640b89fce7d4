"""What the sync and async clients share: configuration, headers, the retry rule, the request
body of a job, Server-Sent Events, a job's exit code."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import ValidationError

from api.client.errors import TransportError, UnexpectedAnswer, _retry_after
from api.client.models import Job
from api.client.profile import _env_flag, load_profile, paired, server_url
from api.client.tls import loopback

T = TypeVar("T")

RETRY_STATUS = (429, 503)
# A connection that could not be made: nothing was sent.
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout)
WAIT = 30.0  # Prefer: wait=N on submit: a short command finishes in one request


@dataclass(frozen=True, slots=True)
class Event:
    """One Server-Sent Event of `/events`: `event` is state, output, gap, cutoff, revoked (the
    last one, then the next request is 403) or end."""

    event: str
    data: dict[str, Any]
    id: str | None = None


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


# The fields the client reads of each kind of event, and their types (the others it passes on).
EVENT_FIELDS: dict[str, dict[str, type]] = {
    "output": {"stream": str, "text": str},
    "gap": {"stream": str, "offset": int, "next_offset": int},
}


def _why(exc: Exception) -> str:
    """What is wrong with an answer, in a few words (never its content)."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"{'.'.join(map(str, first['loc'])) or 'the answer'}: {first['msg']}"
    if isinstance(exc, json.JSONDecodeError):
        return "not JSON"
    if isinstance(exc, KeyError):
        return f"no {exc}"
    return str(exc)[:200] or type(exc).__name__


def read_answer(response: httpx.Response, read: Callable[[Any], T]) -> T:
    """What `read` makes of an answer's JSON; a body of another shape (not JSON, a field
    missing or of another type) is an UnexpectedAnswer naming the call, in one line."""
    try:
        return read(response.json())
    except (ValueError, TypeError, KeyError) as exc:  # pydantic's ValidationError included
        request = response.request
        raise UnexpectedAnswer(
            f"{request.method} {request.url}: {response.status_code} with an answer this "
            f"client does not read ({_why(exc)})"
        ) from None


def an_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise TypeError("not a JSON object")
    return body


def a_job(body: Any) -> Job:
    return Job.model_validate(body)


def jobs(body: Any) -> list[Job]:
    items = an_object(body)["items"]
    if not isinstance(items, list):
        raise TypeError("items: not a list")
    return [Job.model_validate(item) for item in items]


def a_listing(body: Any) -> dict[str, Any]:
    """A page of a directory (`items`) or one entry: each entry an object with a `type`."""
    answer = an_object(body)
    entries = answer.get("items", [answer])
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("type"), str) for e in entries
    ):
        raise TypeError("not a list of entries, each with a type")
    return answer


def an_upload(body: Any) -> dict[str, Any]:
    answer = an_object(body)
    for key, kind in (("path", str), ("size", int), ("sha256", str)):
        if not isinstance(answer.get(key), kind):
            raise TypeError(f"{key}: not a {kind.__name__}")
    return answer


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
        kind = fields.get("event", "message")
        try:
            data = an_object(json.loads(fields["data"]))
            for key, type_ in EVENT_FIELDS.get(kind, {}).items():
                if not isinstance(data.get(key), type_):
                    raise TypeError(f"{key}: not a {type_.__name__}")
        except (ValueError, TypeError) as exc:
            why = _why(exc)
            raise UnexpectedAnswer(f"a {kind!r} event this client does not read ({why})") from None
        return Event(kind, data, fields.get("id"))


def _fresh(kw: dict[str, Any]) -> dict[str, Any]:
    """A request's arguments for one try: a `content` given as a function (an upload's
    stream) is called again, as a retry must send the body again from its start."""
    content = kw.get("content")
    return {**kw, "content": content()} if callable(content) else kw


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
        # A login (`sshapi login`) renews its token itself, request by request.
        self.auth: httpx.Auth | None = None
        # Where the URL came from, said when the server cannot be reached (a wrong URL).
        self.url_from = "the url given to the client" if url else ""
        if url is None or token is None:
            found = load_profile(profile)
            self.url_from = self.url_from or found.url_from
            url = url or found.url
            token = token or paired(found, url)
            allow_http = allow_http or found.allow_http
            if not token and found.login is not None:
                from api.client.login import LoginAuth

                self.auth = LoginAuth(found.login)
        secret = token or ("login" if self.auth else None)  # what server_url keeps safe
        self.url = server_url(url, secret, allow_http).rstrip("/")
        self.url_from = self.url_from or "no setting (the default: nothing named a server)"
        # A proxy from the environment (HTTP_PROXY, common on login nodes) would carry a request
        # for this machine's loopback, token in clear, to another machine, and on to the proxy's
        # own loopback. Only for other servers does the environment pick a proxy.
        self.trust_env = not loopback(httpx.URL(self.url).host)
        self.retries = retries
        self.max_retry_wait = max_retry_wait
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Whether the server has ever answered this client (set by the HTTP client's response
        # hook): until it has, a connection that cannot be made is a wrong URL or a server not
        # started, said at once; after, it is a restart, waited for (`_delay`).
        self.answered = False

    def _unreached(self, error: httpx.TransportError) -> bool:
        """`error` is a connection never made to a server that has never answered."""
        return not self.answered and isinstance(error, CONNECT_FAILURES)

    def _delay(
        self,
        attempt: int,
        response: httpx.Response | None,
        error: httpx.TransportError | None = None,
    ) -> float | None:
        """Seconds before the next try, or None: no more tries (or not retryable): after a
        `response` of 429 or 503, or an `error` unless `_unreached`."""
        if attempt >= self.retries or (error is not None and self._unreached(error)):
            return None
        if response is not None and response.status_code not in RETRY_STATUS:
            return None
        hinted = _retry_after(response.headers) if response is not None else None
        base = hinted if hinted is not None else min(0.2 * 2**attempt, 5.0)
        # Jitter: many clients told the same Retry-After must not come back at the same moment.
        return min(base * random.uniform(1.0, 1.5), self.max_retry_wait)

    def _delay_after(self, attempt: int, error: httpx.TransportError, where: str) -> float:
        """Seconds before the next try after a transport `error`; with no more tries (or an
        error not worth one), the TransportError that says `where` it happened."""
        delay = self._delay(attempt, None, error)
        if delay is None:
            raise TransportError(f"{where}: {error}") from error
        return delay

    @staticmethod
    def _post_headers(key: str | None, wait: float | None) -> dict[str, str]:
        headers = {"Idempotency-Key": key or str(uuid.uuid4())}
        if wait is not None:
            headers["Prefer"] = f"wait={wait:g}"
        return headers
