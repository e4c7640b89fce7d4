"""`python -m loadtests.bench` end to end with tiny durations: it ends by itself, prints the
table, and its bench.json holds every figure, consistent ratios and a verdict per target."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.bench import TARGETS, sustained, verdicts
from loadtests.schedule import PROFILES

REPO = Path(__file__).resolve().parents[2]


def rates(profile: str) -> set[str]:
    return {f"{s.rate:g}" for s in PROFILES[profile] if not s.warmup}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_smoke_run_writes_every_figure(tmp_path: Path) -> None:
    """One stock-sshd run: raw ceiling, CPU row, API and per-request sweeps, a burst, many
    accounts; figures add up."""
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench", "--sshd", "stock", "--duration-factor", "0.02",
         "--raw-duration", "0.5", "--burst-size", "50", "--burst-repeats", "1",
         "--accounts-size", "8", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    (run,) = tmp_path.glob("*-bench")
    assert f"figures: {run / 'bench.json'}" in output
    # The default exec mode, the API's own: auto.
    assert "| stock auto | raw sshpool |" in output
    (fig,) = json.loads((run / "bench.json").read_text())["figures"]

    raw = fig["raw"]
    assert raw["commands_per_s"] > 0 and raw["errors"] == 0
    assert raw["low_load_p50_ms"] > 0 and 0 < raw["p50_ms"] <= raw["p99_ms"]
    assert raw["low_rate_p50_ms"] > 0  # sshpool paced at the API's low rate
    for design, profile in (("api", "bench"), ("per_request", "bench-per-request")):
        assert set(fig[design]["stages"]) == rates(profile)
        for st in fig[design]["stages"].values():
            assert {"p50_ms", "p90_ms", "p99_ms", "failed", "achieved_per_s"} <= set(st)
            # The generator's share of each step's latency, printed with the step.
            assert 0 <= st["lateness_p50_ms"] < st["p50_ms"]
            assert isinstance(st["valid"], bool)
        knee = fig[design]["knee_per_s"]
        assert knee in {0.0, *map(float, rates(profile))}
        assert not knee or fig[design]["stages"][f"{knee:g}"]["valid"]
    # A fresh SSH connection per request costs a handshake: never cheaper than an exec on a
    # warm connection.
    assert fig["per_request"]["stages"]["5"]["p50_ms"] > raw["low_load_p50_ms"]
    assert "ms late (p50) |" in output
    # Where the low rate's latency went: the pool's stages and the rest, beside raw paced.
    low = fig["api"]["stages"]["10"]
    assert {"open", "exec", "store", "auth"} <= set(low["server_p50_ms"])
    assert 0 < low["untimed_p50_ms"] < low["p50_ms"]
    assert "| sshd | p50 | SSH | store | auth | untimed | sent late | raw sshpool paced |" in output

    b = fig["burst"]
    assert (b["size"], b["repeats"], b["requests"]) == (50, 1, 50)
    assert len(b["makespan_ms"]) == 1 and b["makespan_max_ms"] == b["makespan_ms"][0]
    assert len(b["p50_over_makespan"]) == 1 and 0 < b["p50_over_makespan"][0] <= 1

    # Where the CPU went, for the steady run and every other Locust run: each job costs the API,
    # the generator and sshd some CPU; the jobs counted are those the generator sent.
    assert "| API | generator | sshd + shells | rest |" in output
    runs = [fig["cpu"], fig["api"]["cpu"], fig["per_request"]["cpu"], *b["cpu"]]
    for cpu in runs:
        assert cpu["jobs"] > 0
        for key in ("api_ms_per_job", "generator_ms_per_job", "sshd_ms_per_job"):
            assert cpu[key] > 0, (key, cpu)
    assert b["cpu"][0]["jobs"] == 50

    # Many accounts, one job each through the API: the budget's row and the per-account one.
    many = fig["accounts"]
    for mode in ("budget", "per_account"):
        assert (many[mode]["accounts"], many[mode]["via"]) == (8, "api")
        assert sum(many[mode]["statuses"].values()) == 8 and many[mode]["handshakes"] > 0
    assert many["budget"]["failed"] == 0 and many["budget"]["sshd_drop_lines"] == 0
    assert "| stock | 8 accounts, per-account |" in output

    r = fig["ratios"]
    api, per = fig["api"], fig["per_request"]
    assert math.isclose(r["api_knee_over_raw_ceiling"], api["knee_per_s"] / raw["commands_per_s"])
    if per["knee_per_s"]:
        assert math.isclose(
            r["api_knee_over_per_request_knee"], api["knee_per_s"] / per["knee_per_s"]
        )
    assert math.isclose(
        r["api_overhead_low_load_ms"], api["stages"]["10"]["p50_ms"] - raw["low_load_p50_ms"]
    )
    assert math.isclose(
        r["api_overhead_at_same_rate_ms"], api["stages"]["10"]["p50_ms"] - raw["low_rate_p50_ms"]
    )
    assert [t["target"] for t in fig["targets"]] == [name for name, *_ in TARGETS]
    assert all(isinstance(t["met"], bool) for t in fig["targets"])


def _stage(rate: float, p99: float, valid: bool = True) -> dict[str, object]:
    pcts = {"p50": p99 / 2, "p90": p99 * 0.8, "p99": p99}
    return {
        "offered_rate": rate, "latency_ms": pcts, "failed": 0, "errors": {}, "throughput": rate,
        "lateness_ms": {"p50": 0.1}, "server_timing_ms": {}, "untimed_ms": {"p50": 1.0},
        "validity": {"valid": valid, "reasons": [] if valid else ["the generator fell behind"]},
    }  # fmt: skip


def test_the_knee_and_the_targets_count_only_stages_the_generator_kept_up_with() -> None:
    """A step whose own verdict failed (the generator fell behind) is not the knee however good
    its p99 looks, and a target read from such a step is not met; the steps before it count."""
    summary = {
        "stages": [_stage(10, 6.0), _stage(50, 8.0), _stage(90, 9.0, valid=False),
                   _stage(300, 40.0), _stage(600, 50.0, valid=False)],
        "validity": {"valid": False, "reasons": ["the generator fell behind"]},
        "server_timing_ms": {},
    }  # fmt: skip
    api = sustained(summary)
    assert api["knee_per_s"] == 300
    fig = {"sshd": "stock", "api": api, "ratios": {"api_overhead_at_same_rate_ms": 2.0}}
    met = {t["target"]: (t["met"], t["stage_valid"]) for t in verdicts(fig)}
    assert met["knee jobs/s"] == (True, True)
    assert met["50/s p90 ms"] == (True, True)
    assert met["90/s p99 ms"] == (False, False)
    assert met["API overhead at 10/s over raw paced ms"] == (True, True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_agent_parts_compare_the_modes_through_the_relay(tmp_path: Path) -> None:
    """`--exec-modes channel agent --rtt-ms 5 --parts floor wan`: sshd's CPU per command in both
    modes beside the posix_spawn floor, and the p50 through the relay per mode and per
    request, each at least the RTT; agent mode's targets judged. 40 commands: agent mode's
    ~1 ms of sshd CPU each must add up to several of /proc's 10-ms ticks (10 read 0 once)."""
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench", "--sshd", "stock", "--parts", "floor", "wan",
         "--exec-modes", "channel", "agent", "--rtt-ms", "5", "--floor-commands", "40",
         "--wan-commands", "5", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    (run,) = tmp_path.glob("*-bench")
    channel, agent = json.loads((run / "bench.json").read_text())["figures"]
    assert (channel["exec_mode"], agent["exec_mode"]) == ("channel", "agent")
    a = agent["agent_vs_channel"]
    assert a["floor"]["floor_cpu_ms_median"] > 0
    for mode in ("channel", "agent"):
        assert a["floor"][mode]["sshd_cpu_ms_median"] > 0
    for design in ("channel", "agent", "per-request"):
        assert a["wan"][design]["p50_ms"] >= 5
    assert {t["target"] for t in a["targets"]} == {
        "agent sshd + remote CPU per command ms",
        "5 ms RTT, agent p50 ms",
    }
    assert "Agent mode against channel mode (stock sshd" in output
