"""The pool's stages as OpenTelemetry spans, through the OpenTelemetry API only (a no-op until an
application installs an SDK: the API does, docs/operations.md "Seeing inside").

Spans are made only under a recording span of the caller's (a traced job of the API): a library
user without one, a job that was not sampled, or an API with tracing off pays one
`trace.get_current_span().is_recording()` per command and nothing else.

A connection is shared by many commands and made in a task of the host pool's, so its handshake
is not traced as it happens: the connect path stamps its stages (`Stages`: wall-clock
nanoseconds of the certificate's minting, the TCP connect, the key exchange, the authentication,
the executor's start) and the command that waited for that connection (its first lease) turns
them into spans of its own trace afterwards (`handshake_spans`); a failed connect's stamps ride
on its error to the commands it fails.

What a span may carry (attributes after OpenTelemetry's semantic conventions): `server.address`,
`server.port`, the account (`user.name`), the backend, the exec mode, counts and sizes,
`error.type` (the class of the sshpool error). Never a command line, its arguments, a file's
path or contents, a key or a certificate.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Protocol, TypeVar

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from sshpool.errors import SSHPoolError


class Target(Protocol):
    """What a span says of a `sshpool.target.Target` (which imports this module)."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def username(self) -> str: ...
    @property
    def exec_mode(self) -> str: ...


TRACER = trace.get_tracer("sshpool")


def recording() -> bool:
    """Is the caller inside a recording span (only then does the pool make spans)?"""
    return trace.get_current_span().is_recording()


def target_attributes(target: Target) -> dict[str, str | int]:
    return {
        "server.address": target.host,
        "server.port": target.port,
        "user.name": target.username,
        "sshpool.exec_mode": target.exec_mode,
    }


def failed(span: Span, exc: BaseException) -> None:
    """Mark `span` failed with `exc`'s class as `error.type` (never its message: it may hold a
    path or a host's words)."""
    span.set_attribute("error.type", type(exc).__name__)
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))


def span(name: str, target: Target | None = None) -> AbstractContextManager[Span | None]:
    """A child span of the current one for the `with` body (with `target`'s attributes), or None
    (nothing made, through a shared null context) when the current span is not recording. The
    body's exception marks it failed (`failed`)."""
    return _span(name, target) if recording() else _NOTHING


_NOTHING: AbstractContextManager[None] = nullcontext()


@contextmanager
def _span(name: str, target: Target | None) -> Iterator[Span]:
    attributes = None if target is None else target_attributes(target)
    with TRACER.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as s:
        try:
            yield s
        except BaseException as exc:
            failed(s, exc)
            raise


class Stages:
    """Wall-clock stamps (time.time_ns) of one connect's stages, in the order they happened:
    (name, start, end). Filled by the connect path and the backends (`mark`), read by
    `handshake_spans`. Cheap enough to keep for every connect (a handful per connection)."""

    __slots__ = ("end", "marks", "start")

    def __init__(self) -> None:
        self.start = time.time_ns()
        self.end: int | None = None
        self.marks: list[tuple[str, int, int]] = []

    def mark(self, name: str, start: int | None = None) -> None:
        """Stage `name` ended now; it began at `start`, or where the last stage ended."""
        if start is None:
            start = self.marks[-1][2] if self.marks else self.start
        self.marks.append((name, start, time.time_ns()))


_STAGES: ContextVar[Stages | None] = ContextVar("sshpool_stages", default=None)


def stages() -> Stages | None:
    """The stamps of the connect in progress in this context (None outside a connect)."""
    return _STAGES.get()


@contextmanager
def stamping(into: Stages) -> Iterator[Stages]:
    """Let the connect made in the body stamp its stages into `into`."""
    token = _STAGES.set(into)
    try:
        yield into
    finally:
        _STAGES.reset(token)


def handshake_spans(
    stamps: Stages, target: Target, backend: str, error: BaseException | None = None
) -> None:
    """The handshake the current command waited for, as an `ssh.handshake` span with one child
    per stage, under the current span (when recording)."""
    if not recording():
        return
    attributes = {**target_attributes(target), "sshpool.backend": backend}
    end = stamps.end or time.time_ns()
    outer = TRACER.start_span("ssh.handshake", attributes=attributes, start_time=stamps.start)
    if error is not None:
        failed(outer, error)
    context = trace.set_span_in_context(outer)
    for name, start, stop in stamps.marks:
        TRACER.start_span(f"ssh.{name}", context, start_time=start).end(stop)
    outer.end(end)


def exec_spans(
    agent: bool,
    start: int,
    started: int | None,
    first_output: int | None,
    exit_status: int | None,
    error: BaseException | None,
) -> None:
    """One command's spans under the current one (the caller checked `recording()`): the
    channel's open up to the wrapper's marker line (`ssh.channel_open`), or the executor's START
    up to its answer (`ssh.agent_start`, agent mode); then the command until it exits
    (`ssh.command`) with its first output byte (`ssh.first_output`, from its start)."""
    end = time.time_ns()
    opened = TRACER.start_span("ssh.agent_start" if agent else "ssh.channel_open", start_time=start)
    if started is None:
        if error is not None:
            failed(opened, error)
        opened.end(end)
        return
    opened.end(started)
    command = TRACER.start_span("ssh.command", start_time=started)
    if exit_status is not None:
        command.set_attribute("process.exit.code", exit_status)
    if first_output is not None:
        context = trace.set_span_in_context(command)
        TRACER.start_span("ssh.first_output", context, start_time=started).end(first_output)
    if error is not None:
        failed(command, error)
    command.end(end)


class Leased(Protocol):
    """A pooled connection as `waited` sees it (`sshpool.lease.PooledConn`)."""

    @property
    def leases(self) -> int: ...

    @property
    def stages(self) -> Stages | None: ...


C = TypeVar("C", bound=Leased)


def waiting(acquiring: Awaitable[C], target: Target, backend: str) -> Awaitable[C]:
    """`acquiring` (a slot's acquisition), traced by `waited` inside a recording span."""
    return waited(acquiring, target, backend) if recording() else acquiring


async def waited(acquiring: Awaitable[C], target: Target, backend: str) -> C:
    """A slot's acquisition as an `ssh.pool.wait` span (the queue wait), with the handshake of
    the connection it waited for (its first lease) or of the connect that failed it."""
    with span("ssh.pool.wait", target):
        try:
            c = await acquiring
        except SSHPoolError as exc:
            if exc.stages is not None:
                handshake_spans(exc.stages, target, backend, exc)
            raise
        if c.leases == 0 and c.stages is not None:
            handshake_spans(c.stages, target, backend)
        return c
