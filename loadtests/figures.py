"""The one result of a scenario run: `figures.json`, what it holds (`SCHEMA`), how it is checked
(`problems`) and how two compare (`compare`). Pure but for `environment` (it reads the machine).

A run's `figures.json` (schema 1):

| key | what |
|---|---|
| `schema` | 1 |
| `scenario`, `tags`, `arguments` | the scenario's name, its tags, the arguments it ran with |
| `started`, `finished` | ISO 8601 times, UTC |
| `versions` | `package` (sshapi), `python`, `openssh`, `ssh_library` ({name: version}) |
| `machine` | `cores`, `memory_bytes`, `cpu_model` |
| `load_average` | `start` and `end`: the 1, 5 and 15 minute load averages |
| `figures` | what the scenario measured (nested objects; numbers are what `compare` compares) |
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
DISTRIBUTIONS = {"asyncssh": "asyncssh", "paramiko": "paramiko", "ssh2": "ssh2-python"}

# Key -> the type its value has; a nested Mapping is an object with those keys.
SCHEMA: dict[str, Any] = {
    "schema": int,
    "scenario": str,
    "tags": list,
    "arguments": dict,
    "started": str,
    "finished": str,
    "versions": {"package": str, "python": str, "openssh": str, "ssh_library": dict},
    "machine": {"cores": int, "memory_bytes": int, "cpu_model": str},
    "load_average": {"start": list, "end": list},
    "figures": dict,
}


def plain(value: Any) -> Any:
    """`value` as JSON can hold it: dataclasses and mappings as objects, tuples and sets as
    lists, paths and anything else unknown as text, NaN and infinities as null."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment(backends: Iterable[str]) -> dict[str, Any]:
    """The versions and the machine a run measured on (`SCHEMA`'s `versions` and `machine`)."""
    from sshpool.devhost import sshd_version

    try:
        openssh = ".".join(map(str, sshd_version()))
    except Exception:  # no sshd here: the run measured a remote one, or none
        openssh = "none"
    return {
        "versions": {
            "package": _version("sshapi"),
            "python": platform.python_version(),
            "openssh": openssh,
            "ssh_library": {b: _version(DISTRIBUTIONS.get(b, b)) for b in backends},
        },
        "machine": {
            "cores": os.cpu_count() or 0,
            "memory_bytes": memory_bytes(),
            "cpu_model": cpu_model(),
        },
    }


def problems(doc: Any, schema: Mapping[str, Any] = SCHEMA, where: str = "") -> list[str]:
    """What makes `doc` not a `figures.json` of this schema ([] when it is one)."""
    if not isinstance(doc, dict):
        return [f"{where or 'the document'}: not an object"]
    out: list[str] = []
    for key, kind in schema.items():
        path = f"{where}{key}"
        if key not in doc:
            out.append(f"{path}: missing")
        elif isinstance(kind, Mapping):
            out += problems(doc[key], kind, f"{path}.")
        elif not isinstance(doc[key], kind) or (isinstance(doc[key], bool) and kind is int):
            out.append(f"{path}: not {kind.__name__}")
    if not where and not out:
        if doc["schema"] != SCHEMA_VERSION:
            out.append(f"schema: {doc['schema']}, this runner reads {SCHEMA_VERSION}")
        for when in ("start", "end"):
            average = doc["load_average"][when]
            if len(average) != 3 or not all(isinstance(x, int | float) for x in average):
                out.append(f"load_average.{when}: not three numbers")
    return out


def flat(value: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every number in `value` with its dotted path (`api.p99_ms`, `rows.0.rate`)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from flat(v, f"{prefix}{k}.")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from flat(v, f"{prefix}{i}.")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield prefix.rstrip("."), float(value)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """Each figure of two runs side by side with B / A (a figure in one run only shows `-`)."""
    left, right = dict(flat(a["figures"])), dict(flat(b["figures"]))
    names = list(left) + [n for n in right if n not in left]
    width = max([len(n) for n in names] + [6])
    lines = [
        f"A: {a['scenario']} {a['started']} (load {a['load_average']['start'][0]})",
        f"B: {b['scenario']} {b['started']} (load {b['load_average']['start'][0]})",
        "",
        f"{'figure':<{width}} {'A':>12} {'B':>12} {'B / A':>8}",
    ]
    for name in names:
        x, y = left.get(name), right.get(name)
        ratio = "-" if x is None or y is None or x == 0 else f"{y / x:.3f}"
        lines.append(f"{name:<{width}} {_cell(x):>12} {_cell(y):>12} {ratio:>8}")
    return "\n".join(lines)
