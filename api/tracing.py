"""Traces (docs/operations.md "Seeing inside"): OpenTelemetry's SDK, configured by the standard
OTEL_* environment variables only, off when none asks for an exporter.

On (`enabled`): an OTLP endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) or `OTEL_TRACES_EXPORTER` names an exporter (`otlp`,
`console`); `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keeps it off. Everything
else is the SDK's own reading of the environment: the sampler (`OTEL_TRACES_SAMPLER`, `_ARG`),
the batch processor's bounded queue and timeouts (`OTEL_BSP_*`), the exporter's endpoint,
headers and timeout (`OTEL_EXPORTER_OTLP_*`), the resource (`OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`; by default `service.name` sshapi and `service.instance.id` the
replica's name). The exporter is OTLP over HTTP with protobuf; spans leave through the SDK's
batch processor, in its own thread, so an endpoint that hangs costs the jobs nothing (the
queue is bounded: spans beyond it are dropped).

Off, nothing of the SDK is loaded and every hook here is one `is None` check.

One trace per job: the request's server span (`RequestContext`, continuing the caller's W3C
`traceparent`), its admission and store writes, and a `job` span that lives until the job's
outcome is recorded, with the pool's spans under it (sshpool.tracing: queue wait, handshake,
channel open or executor START, the command, its first output byte). The job's span context is
stored with the job (`traceparent`), so another replica's cancel joins the same trace; the
job's JSON carries `trace_id`, and log lines written in a traced context end with
`trace_id=...`.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("sshapi.tracing")

# A W3C traceparent is 55 characters (version 00), a tracestate at most 512 (its spec): a
# header beyond these is ignored whole (a new trace starts) instead of parsed.
MAX_TRACEPARENT = 128
MAX_TRACESTATE = 512

TRACER = trace.get_tracer("sshapi")
_PROPAGATOR = TraceContextTextMapPropagator()
# What the hooks return when there is nothing to trace: one shared null context.
NOTHING: AbstractContextManager[None] = nullcontext()
# Set by `configure` once the SDK is installed: this process traces.
_on = False
# The root sampler's bound when it is a trace-id ratio (`OTEL_TRACES_SAMPLER` traceidratio or
# parentbased_traceidratio): `server_span` then decides a root request itself (`_DrawnIds`).
_root_bound: int | None = None
_TRACE_ID_LIMIT = (1 << 64) - 1


def on() -> bool:
    return _on


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Do the OTEL_* variables ask for traces (module docstring)?"""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    return bool(exporter or endpoint)


def configure(replica: str, environ: Mapping[str, str] | None = None) -> bool:
    """Install the SDK as the process's tracer provider when `enabled` (once per process: a
    second app in the same process shares it); True when traces are on."""
    global _on
    env = os.environ if environ is None else environ
    if not enabled(env):
        return False
    from opentelemetry.sdk.trace import TracerProvider

    _on = True
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return True
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    attributes = {"service.instance.id": replica}
    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    if not named:
        attributes["service.name"] = "sshapi"
    global _IDS
    _IDS = _DrawnIds()
    resource = Resource.create(attributes)

    class _Resource(Resource):
        """The exporter groups every span by its resource in a dict: Resource's own hash
        serialises its attributes to JSON each time (about 15 % of encoding a batch, by
        py-spy); this one is immutable, so its hash is computed once."""

        _hash = hash(resource)

        def __hash__(self) -> int:
            return self._hash

        def __eq__(self, other: object) -> bool:
            return other is self or super().__eq__(other)

    provider = TracerProvider(
        resource=_Resource(resource.attributes, resource.schema_url), id_generator=_IDS
    )
    _root_ratio(provider.sampler)
    exporters: list[SpanExporter] = []
    for name in (env.get("OTEL_TRACES_EXPORTER") or "otlp").split(","):
        name = name.strip().lower()
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif name == "otlp":
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            if protocol != "http/protobuf":
                log.warning("OTLP protocol %r is not installed: exporting http/protobuf", protocol)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name:
            log.warning("traces exporter %r is not available: use otlp or console", name)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True


class _DrawnIds:
    """The SDK's random ids (RandomIdGenerator's), except that a root trace id drawn by
    `server_span`'s sampling check is the one the SDK then uses: its sampler, deciding on that
    same id, agrees with the check. Only the event loop's thread starts root spans."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self._random = RandomIdGenerator()
        self.drawn = 0

    def generate_span_id(self) -> int:
        return self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        drawn, self.drawn = self.drawn, 0
        return drawn or self._random.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return True


_IDS: Any = None


def _root_ratio(sampler: object) -> None:
    """Keep the root sampler's bound when it decides by trace-id ratio (else the SDK decides
    every request, as it would)."""
    global _root_bound
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    root = getattr(sampler, "_root", None) if isinstance(sampler, ParentBased) else sampler
    _root_bound = root.bound if isinstance(root, TraceIdRatioBased) else None


def install_log_ids() -> None:
    """Every log record gets `trace` (" trace_id=<32 hex>" inside a traced context, else ""),
    which the server's log format prints (api/workers.py). Once per process."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "sshapi_trace", False):
        return

    def with_trace(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        ctx = trace.get_current_span().get_span_context()
        record.trace = f" trace_id={ctx.trace_id:032x}" if ctx.is_valid else ""
        return record

    with_trace.sshapi_trace = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(with_trace)


# ---- the request's span (api/middleware.py)


def server_span(headers: Mapping[bytes, bytes], method: str, path: str) -> Span | None:
    """The request's SERVER span, continuing the caller's `traceparent` when it is well formed
    and of a sane size (else a new trace). Named `METHOD` until the route is known (`ended`).

    None for a new trace that the root sampler's trace-id ratio leaves out, decided here on a
    trace id drawn as the SDK would (the SDK then uses that id, `_DrawnIds`): nine requests in
    ten at 10 % pay one random draw instead of the SDK's span start and sampler (docs/
    benchmarks.md "Traces: what they cost")."""
    parent = headers.get(b"traceparent")
    if parent is None and _root_bound is not None:
        drawn = random.getrandbits(128)
        if drawn & _TRACE_ID_LIMIT >= _root_bound:
            return None
        _IDS.drawn = drawn
    carrier: dict[str, str] = {}
    if parent is not None and len(parent) <= MAX_TRACEPARENT:
        carrier["traceparent"] = parent.decode("latin-1")
        state = headers.get(b"tracestate")
        if state is not None and len(state) <= MAX_TRACESTATE:
            carrier["tracestate"] = state.decode("latin-1")
    ctx = _PROPAGATOR.extract(carrier) if carrier else None
    made = TRACER.start_span(
        method,
        ctx,
        kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "url.path": path, "url.scheme": "http"},
    )
    if _IDS is not None:
        _IDS.drawn = 0  # used by that start, or by none (a current span was its parent)
    return made


def end_server_span(span: Span, method: str, route: str, status: int, request_id: str) -> None:
    span.update_name(f"{method} {route}")
    span.set_attribute("http.route", route)
    span.set_attribute("http.response.status_code", status)
    span.set_attribute("sshapi.request_id", request_id)
    if status >= 500:
        span.set_attribute("error.type", str(status))
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def attach(span: Span) -> object:
    """Make `span` current (and the parent of what the tasks started now make); `detach` undoes."""
    return otel_context.attach(trace.set_span_in_context(span))


def detach(token: object) -> None:
    otel_context.detach(token)  # type: ignore[arg-type]


def current_or_none(span: Span | None) -> AbstractContextManager[None]:
    """`span` (when not None) is the current span for the `with` body and the tasks it starts."""
    return NOTHING if span is None else _current(span)


@contextmanager
def _current(span: Span) -> Iterator[None]:
    token = attach(span)
    try:
        yield
    finally:
        detach(token)


# ---- spans of the API's own stages


def recording() -> bool:
    return trace.get_current_span().is_recording()


def span(
    name: str, attributes: Mapping[str, str | int] | None = None
) -> AbstractContextManager[Span | None]:
    """A child span of the current one for the `with` body, or None (nothing made) when the
    current span is not recording (tracing off, or a trace not sampled): then a shared null
    context, the cheapest `with` there is (the off path runs for every job). The body's
    exception marks it failed with its class as `error.type` (never its message)."""
    if not trace.get_current_span().is_recording():
        return NOTHING
    return _span(name, attributes)


@contextmanager
def _span(name: str, attributes: Mapping[str, str | int] | None) -> Iterator[Span]:
    with TRACER.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as s:
        try:
            yield s
        except BaseException as exc:
            failed(s, exc)
            raise


@contextmanager
def detached(name: str, attributes: Mapping[str, str | int]) -> Iterator[Span | None]:
    """`span`, but not made current: for a span that begins and ends in different tasks (a
    download's transfer ends when its response body does), where a current span could not be
    detached. Children made meanwhile go to the span current before it."""
    if not trace.get_current_span().is_recording():
        yield None
        return
    s = TRACER.start_span(name, attributes=attributes)
    try:
        yield s
    except BaseException as exc:
        failed(s, exc)
        raise
    finally:
        s.end()


def failed(span: Span, exc: BaseException) -> None:
    span.set_attribute("error.type", getattr(exc, "type", None) or type(exc).__name__)
    span.set_status(Status(StatusCode.ERROR))


def store_span(operation: str, system: str) -> AbstractContextManager[Span | None]:
    """A store write as a span after the database conventions (the operation, never the
    query's values)."""
    if not trace.get_current_span().is_recording():
        return NOTHING
    return _span(f"store {operation}", {"db.operation.name": operation, "db.system.name": system})


def job_span(job_id: str, kind: str, host: str, replica: str) -> Span | None:
    """The job's span, under the current (request's) span, or None when that is not recording.
    It ends when the job's outcome is recorded (api/jobs/runner.py)."""
    if not trace.get_current_span().is_recording():
        return None
    return TRACER.start_span(
        "job",
        attributes={
            "sshapi.job.id": job_id,
            "sshapi.job.kind": kind,
            "sshapi.host": host,
            "sshapi.replica": replica,
        },
    )


def end_job_span(span: Span, state: str, error_kind: str | None, exit_status: int | None) -> None:
    """The job's outcome on its span: `sshapi.job.state`, the exit code, and for a job that
    could not run (`error`, `lost`) `error.type` (its error kind)."""
    span.set_attribute("sshapi.job.state", state)
    if exit_status is not None:
        span.set_attribute("process.exit.code", exit_status)
    if state in ("error", "lost"):
        span.set_attribute("error.type", error_kind or state)
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def traceparent(span: Span | None) -> str | None:
    """`span`'s context as a W3C traceparent (what the job row keeps), or None."""
    if span is None:
        return None
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def trace_id(parent: str | None) -> str | None:
    """The trace id of a stored traceparent (the job's JSON shows it)."""
    return parent[3:35] if parent else None


def job_context(parent: str | None) -> Any:
    """The context of a job's stored span (for another replica's work on that job, its
    cancel), or None."""
    if not parent:
        return None
    ctx = _PROPAGATOR.extract({"traceparent": parent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


@contextmanager
def in_job(parent: str | None, name: str, job_id: str) -> Iterator[Span | None]:
    """A span `name` of the job whose stored traceparent is `parent`, in the job's trace (when
    this process traces and the job was traced: sampled as the job was), linked to the current
    span (the request)."""
    ctx = job_context(parent) if _on else None
    if ctx is None:
        yield None
        return
    here = trace.get_current_span().get_span_context()
    with TRACER.start_as_current_span(
        name,
        ctx,
        links=[Link(here)] if here.is_valid else None,
        attributes={"sshapi.job.id": job_id},
        record_exception=False,
        set_status_on_exception=False,
    ) as s:
        try:
            yield s
        except BaseException as exc:
            failed(s, exc)
            raise
