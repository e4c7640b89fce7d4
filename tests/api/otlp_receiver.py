"""A small OTLP/HTTP trace receiver for the tests: what a collector or Jaeger would receive from
the API's standard exporter (POST /v1/traces, protobuf `ExportTraceServiceRequest`), decoded
with opentelemetry-proto and kept in memory, by trace id. No trace backend can be installed
here from the package registries (Jaeger and the OpenTelemetry Collector are Go programs built
from Go modules; Debian, npm and PyPI ship no receiver): docs/operations.md "Seeing inside".

`hang` makes it accept requests and never answer (an exporter endpoint that hangs)."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start: int
    end: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: int
    links: list[str] = field(default_factory=list)


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


class Receiver:
    """Spans received, by trace id (hex)."""

    def __init__(self) -> None:
        self.traces: dict[str, list[Span]] = defaultdict(list)
        self.requests = 0
        self.hang = threading.Event()
        self.released = threading.Event()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if receiver.hang.is_set():
                    receiver.released.wait(60)
                    return
                receiver.add(body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self._lock:
            self.requests += 1
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.traces[s.trace_id.hex()].append(
                            Span(
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_id=s.parent_span_id.hex(),
                                name=s.name,
                                kind=s.kind,
                                start=s.start_time_unix_nano,
                                end=s.end_time_unix_nano,
                                attributes={a.key: _value(a.value) for a in s.attributes},
                                resource=resource,
                                status=s.status.code,
                                links=[link.span_id.hex() for link in s.links],
                            )
                        )

    def spans(self, trace_id: str) -> list[Span]:
        with self._lock:
            return list(self.traces.get(trace_id, []))

    def names(self, trace_id: str) -> set[str]:
        return {s.name for s in self.spans(trace_id)}

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
