"""The load suite in Locust's web UI: the shape's options as a person types them, and each run's
verdict and report where the person looks.

Locust's own Start handler converts a list option's field by splitting on commas only, so
`burst_sizes=10 50` (the command line's spelling) raised ValueError inside it: HTTP 500 and no
run. Here the shape's options (those `ui_option` marked) are parsed first, with their own
argparse types, nargs and choices, commas or spaces between values; a value that does not parse
is refused with Locust's own answer for a bad field (`success: false` and a message the page
shows), and the options are set before Locust's handler runs, which then leaves them alone.

The verdict (VALID, or INVALID and why) and the report's path were printed on the terminal only;
a tab "sshapi runs" lists every run of this process with both (Locust's extended tabs: the table
rides on /stats/requests, which the page polls). Imported by loadtests/harness.py inside Locust.
"""

from __future__ import annotations

import json
import re
from typing import Any

from flask import Response, jsonify, request
from locust.env import Environment
from werkzeug.datastructures import ImmutableMultiDict

TAB = "sshapi-runs"
# The table's columns: (key, title). One-word keys: the page camel-cases the keys it reads.
COLUMNS = (
    ("started", "Started"),
    ("verdict", "Verdict"),
    ("requests", "Measured requests"),
    ("failed", "Failed"),
    ("latency", "Latency ms p50 / p99"),
    ("report", "Report"),
)
# dest -> the argparse action of each option the web UI shows (loadtests.harness.ui_option).
UI_OPTIONS: dict[str, Any] = {}


def parse_field(action: Any, value: str) -> Any:
    """The option's value from its form field, as its command-line option would parse it.
    ValueError names the field and why."""
    words = [w for w in re.split(r"[,\s]+", value.strip()) if w]
    convert = action.type or str
    try:
        values = [convert(w) for w in words]
    except (TypeError, ValueError):
        kind = getattr(convert, "__name__", "value")
        raise ValueError(f"{action.dest}: {value!r} is not {kind} values") from None
    if action.choices is not None and (bad := [v for v in values if v not in action.choices]):
        raise ValueError(f"{action.dest}: {bad[0]!r} is not one of {list(action.choices)}")
    if action.nargs in ("+", "*"):
        if action.nargs == "+" and not values:
            raise ValueError(f"{action.dest}: at least one value")
        return values
    if len(values) != 1:
        raise ValueError(f"{action.dest}: one value, not {value!r}")
    return values[0]


def install(environment: Environment, runs: list[dict[str, Any]]) -> None:
    """Hook the web UI of `environment` (if it has one); `runs` is the list the harness appends
    each finished run's row to (see `row`)."""
    web_ui = environment.web_ui
    if web_ui is None or web_ui.app is None:
        return
    web_ui.template_args["extended_tabs"] = [{"title": "sshapi runs", "key": TAB}]
    web_ui.template_args["extended_tables"] = [
        {"key": TAB, "structure": [{"key": k, "title": t} for k, t in COLUMNS]}
    ]
    app = web_ui.app

    def _shape_options() -> Response | None:
        if request.path != "/swarm" or request.method != "POST":
            return None
        parsed: dict[str, Any] = {}
        for key in request.form:
            if key in UI_OPTIONS:
                try:
                    parsed[key] = parse_field(UI_OPTIONS[key], request.form[key])
                except ValueError as exc:
                    answer: Response = jsonify(
                        {"success": False, "message": str(exc), "host": environment.host}
                    )
                    return answer
        for key, value in parsed.items():
            setattr(environment.parsed_options, key, value)
        # Locust's handler sees the other fields only (it would convert these again, by commas).
        rest = [(k, v) for k, v in request.form.items(multi=True) if k not in parsed]
        request.form = ImmutableMultiDict(rest)
        return None

    def _runs_table(response: Response) -> Response:
        if request.path != "/stats/requests" or response.status_code != 200:
            return response
        body = json.loads(response.get_data())
        body["extended_stats"] = [{"key": TAB, "data": list(reversed(runs))}]
        response.set_data(json.dumps(body))
        return response

    # Registered by calls, not as decorators: Flask's are untyped for mypy here.
    app.before_request(_shape_options)
    app.after_request(_runs_table)


def row(summary: dict[str, Any], report: str) -> dict[str, Any]:
    """A finished run as the tab shows it (newest first)."""
    v = summary["validity"]
    verdict = "VALID" if v["valid"] else "INVALID: " + "; ".join(v["reasons"])
    verdict += "".join(f"; LIMITED: {reason}" for reason in v.get("limited", []))
    lat = summary["latency_ms"]
    return {
        "started": summary["meta"].get("started", "-"),
        "verdict": verdict,
        "requests": summary["requests"],
        "failed": summary["failed"],
        "latency": f"{lat['p50']} / {lat['p99']}",
        "report": report,
    }
