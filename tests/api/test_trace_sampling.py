"""Sampling at a trace-id ratio (issue 42, docs/operations.md "Seeing inside: traces"): the API
decides a new trace's sampling itself before any span is made (api/tracing.py `server_span`),
and must decide as the SDK's `OTEL_TRACES_SAMPLER` would: every trace it keeps is one the SDK
records, by the same trace-id rule, near the configured share, and a caller's `traceparent`
still decides for its own trace.

The SDK's tracer provider is per process, so each case runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from api import tracing

assert tracing.configure("replica-a")
limit, bound = (1 << 64) - 1, round(float(sys.argv[1]) * (1 << 64))
out = {"kept": 0, "recording": 0, "by_rule": 0, "ids": set()}
for _ in range(4000):
    span = tracing.server_span({}, "POST", "/v1/jobs")  # never ended: nothing is exported
    if span is None:
        continue
    ctx = span.get_span_context()
    out["kept"] += 1
    out["recording"] += span.is_recording()
    out["by_rule"] += (ctx.trace_id & limit) < bound
    out["ids"].add(ctx.trace_id)
out["distinct"] = len(out.pop("ids"))
for flag in ("01", "00"):
    header = f"00-{'ab' * 16}-{'cd' * 8}-{flag}".encode()
    span = tracing.server_span({b"traceparent": header}, "POST", "/v1/jobs")
    ctx = span.get_span_context()
    out[flag] = [span.is_recording(), f"{ctx.trace_id:032x}"]
print(json.dumps(out))
"""


def sample(sampler: str, ratio: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {
        # Nothing is ever sent (no span ends); the endpoint only turns traces on.
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces",
        "OTEL_TRACES_SAMPLER": sampler,
        "OTEL_TRACES_SAMPLER_ARG": ratio,
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, ratio or "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize("sampler", ["parentbased_traceidratio", "traceidratio"])
def test_a_ratio_keeps_its_share_of_new_traces_by_the_sdks_own_rule(sampler: str) -> None:
    out = sample(sampler, "0.1")
    kept = out["kept"]
    assert isinstance(kept, int)
    # 4000 draws at 10 %: 400 expected, sd 19; 250-550 is beyond 7 sd either side.
    assert 250 <= kept <= 550
    # Each kept trace is recorded by the SDK (its sampler agrees), under the id drawn.
    assert out["recording"] == kept
    assert out["by_rule"] == kept
    assert out["distinct"] == kept


def test_the_callers_traceparent_decides_under_a_parent_based_ratio() -> None:
    out = sample("parentbased_traceidratio", "0.1")
    assert out["01"] == [True, "ab" * 16]
    assert out["00"] == [False, "ab" * 16]


def test_another_sampler_is_left_to_the_sdk() -> None:
    out = sample("parentbased_always_on", "")
    assert out["kept"] == out["recording"] == out["distinct"] == 4000
