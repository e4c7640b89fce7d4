"""One record per request (or dropped arrival), error kinds, and the `Server-Timing` parser."""

from __future__ import annotations

import contextlib
import errno
import json
import socket
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Kind = Literal["open", "closed", "burst"]
Connection = Literal["keep-alive", "new"]

DROPPED = "dropped"  # an arrival not sent because the in-flight cap was reached


@dataclass(slots=True)
class Record:
    """`latency_ms` is what the run is judged by: from the intended send time (open model and
    bursts: no coordinated omission) or from the actual send (closed model, as Locust does).
    `service_ms` always runs from before the connection is made until the last byte is read."""

    kind: Kind
    t: float  # intended send time, Unix seconds
    latency_ms: float
    service_ms: float
    lateness_ms: float  # how late the generator sent it after the intended time
    ok: bool
    status: int  # HTTP status, 0 when there was no answer
    error: str  # "" when ok, else an error kind (see error_kind)
    stage: int  # profile stage, or burst index
    warmup: bool
    rate: float  # offered rate of the stage (0 for bursts)
    burst_size: int  # 0 outside bursts
    connection: Connection
    worker: int
    server: dict[str, float] = field(default_factory=dict)  # Server-Timing stages, ms


def parse_server_timing(header: str | None) -> dict[str, float]:
    """`auth;dur=0.12, exec;dur=3.4` -> {"auth": 0.12, "exec": 3.4}; metrics without a
    duration or with a malformed one are skipped (the header is advisory)."""
    out: dict[str, float] = {}
    for metric in (header or "").split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if name and key.strip().lower() == "dur":
                with contextlib.suppress(ValueError):
                    out[name] = out.get(name, 0.0) + float(value.strip().strip('"'))
    return out


def error_kind(exc: BaseException) -> str:
    """A short, stable name for a failed request's exception: timeout, reset, refused, or the
    exception's class. Wrapped causes (requests wraps urllib3 wraps socket errors) are unwound."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if (
            isinstance(current, TimeoutError | socket.timeout)
            or "Timeout" in type(current).__name__
        ):
            return "timeout"
        if isinstance(current, ConnectionResetError) or (
            isinstance(current, OSError) and current.errno == errno.ECONNRESET
        ):
            return "reset"
        if isinstance(current, ConnectionRefusedError):
            return "refused"
        if "RemoteDisconnected" in type(current).__name__:
            return "reset"
        nested = current.args[0] if current.args else None
        current = (
            nested
            if isinstance(nested, BaseException)
            else getattr(current, "reason", None) or current.__cause__ or current.__context__
        )
        if not isinstance(current, BaseException):
            current = None
    return type(exc).__name__


def write_jsonl(path: Path, records: Iterable[Record]) -> None:
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")


def read_jsonl(path: Path) -> Iterator[Record]:
    with path.open() as f:
        for line in f:
            yield Record(**json.loads(line))


def to_wire(records: list[Record]) -> list[list[object]]:
    """Compact form for worker -> master messages (field order of Record)."""
    return [list(asdict(r).values()) for r in records]


def from_wire(rows: list[list[object]]) -> list[Record]:
    return [Record(*row) for row in rows]  # type: ignore[arg-type]
