"""The researcher's client for the sshapi HTTP API, sync and async, on httpx.

In a notebook:

    from api.client import Client
    client = Client("http://127.0.0.1:8000", token=TOKEN)  # or Client(): SSHAPI_URL, SSHAPI_TOKEN
    print(client.run("local", ["hostname"]).stdout)

`AsyncClient` has the same methods as coroutines (and async iterators for `follow`/`events`).
Files (docs/files.md): `list_files`, `stat`, `download` (resumed by Range), `upload` (streamed,
`parents=True` as `mkdir -p`), `mkdir`, `delete_file`.

What the client does for you: an `Idempotency-Key` on every POST, so that a retry (after a 429,
a 503 or a dropped connection) replays the job instead of running the command twice; retries of
429/503 honouring `Retry-After`, with jitter; waiting for a job to finish; following output
across cut-offs and reconnects (offsets, `Last-Event-ID`).

Errors, one tree (as httpx's): every problem answer is raised as the class of its status, the
problem's fields on it.

    SshapiError
    ├── TransportError      the server could not be reached or dropped the connection (after
    │                       the retries; at once when it has never answered this client)
    ├── UnexpectedAnswer    the server answered JSON of another shape than this client reads
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

The package (its face is this module: import from `api.client`, not from its modules):

    errors.py    the tree above, `raise_for_problem`
    models.py    a job as the API answers it (`Job`, the states), `exit_code`
    profile.py   URL and token: SSHAPI_URL / SSHAPI_TOKEN, the configuration file's profiles
    base.py      what both clients share: configuration, the retry rule, a job's body, SSE
    files.py     paths, upload headers, the part file of a resumable download
    _async.py    `AsyncClient`: the one source of both clients
    _sync.py     `Client`, generated from _async.py by unasync (`make unasync`): never edited
    localfile.py local file I/O, the one difference: in a thread (async), plain calls (sync)
    tls.py       the one TLS context of the process (the server's httpx clients use it too),
                 `loopback`: the one host plain HTTP may carry a secret to
    cli.py       the `sshapi run|jobs|batch|files` commands (registered by api/cli.py)

It may import nothing of `api` outside `api.client` (tests/test_layout.py): the server may use
the client, never the reverse, so that a notebook loads the client alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from api.client._async import AsyncClient
    from api.client._sync import Client
    from api.client.base import RETRY_STATUS, WAIT, Event, SSEParser, job_body
    from api.client.errors import (
        BY_STATUS,
        Conflict,
        Forbidden,
        InsecureHTTPWarning,
        InvalidRequest,
        JobFailed,
        NotFound,
        ProblemError,
        RateLimited,
        SshapiError,
        SSHFailed,
        TransportError,
        Unauthorized,
        Unavailable,
        UnexpectedAnswer,
        raise_for_problem,
    )
    from api.client.files import (
        CHUNK,
        SETTLED,
        Partial,
        Progress,
        files_path,
        resumable,
        settled,
    )
    from api.client.models import (
        FINAL,
        BatchOptions,
        Job,
        SchedulerInfo,
        State,
        Stream,
        exit_code,
    )
    from api.client.profile import (
        DEFAULT_URL,
        PROFILE_KEYS,
        Profile,
        load_profile,
        paired,
        server_url,
    )
    from api.client.tls import tls_context

# Each public name and the module it lives in, loaded on first use (PEP 562): `sshapi` imports
# `api.client.cli`, and so this package, on every call, while httpx and pydantic are needed only
# by the commands that talk to a server (api/cli.py: start-up time).
_MODULES = {
    "_async": ["AsyncClient"],
    "_sync": ["Client"],
    "base": ["RETRY_STATUS", "WAIT", "Event", "SSEParser", "job_body"],
    "errors": [
        "BY_STATUS", "Conflict", "Forbidden", "InsecureHTTPWarning", "InvalidRequest",
        "JobFailed", "NotFound", "ProblemError", "RateLimited", "SshapiError", "SSHFailed",
        "TransportError", "Unauthorized", "Unavailable", "UnexpectedAnswer",
        "raise_for_problem",
    ],
    "files": ["CHUNK", "SETTLED", "Partial", "Progress", "files_path", "resumable", "settled"],
    "models": ["FINAL", "BatchOptions", "Job", "SchedulerInfo", "State", "Stream", "exit_code"],
    "profile": ["DEFAULT_URL", "PROFILE_KEYS", "Profile", "load_profile", "paired", "server_url"],
    "tls": ["tls_context"],
}  # fmt: skip
_WHERE = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup is a plain one
    return value


__all__ = [
    "BY_STATUS",
    "CHUNK",
    "DEFAULT_URL",
    "FINAL",
    "PROFILE_KEYS",
    "RETRY_STATUS",
    "SETTLED",
    "WAIT",
    "AsyncClient",
    "BatchOptions",
    "Client",
    "Conflict",
    "Event",
    "Forbidden",
    "InsecureHTTPWarning",
    "InvalidRequest",
    "Job",
    "JobFailed",
    "NotFound",
    "Partial",
    "ProblemError",
    "Profile",
    "Progress",
    "RateLimited",
    "SSEParser",
    "SSHFailed",
    "SchedulerInfo",
    "SshapiError",
    "State",
    "Stream",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "UnexpectedAnswer",
    "exit_code",
    "files_path",
    "job_body",
    "load_profile",
    "paired",
    "raise_for_problem",
    "resumable",
    "server_url",
    "settled",
    "tls_context",
]
