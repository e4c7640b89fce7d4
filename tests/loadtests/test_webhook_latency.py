"""loadtests.webhook_latency runs end to end (its own host, API and receiver) and reports every
delivery once, signed: the benchmark's figure is only worth printing if that holds."""

from __future__ import annotations

import pytest

from loadtests import webhook_latency


@pytest.mark.timeout(180)
def test_the_webhook_benchmark_delivers_each_job_once(capsys: pytest.CaptureFixture[str]) -> None:
    webhook_latency.main(["--jobs", "10", "--concurrency", "5"])
    out = capsys.readouterr().out
    assert "10/10 delivered, 0 duplicate(s), 0 bad signature(s)" in out
    assert "webhook delivery latency from the state change, 10 deliveries, 1 replica(s)" in out
