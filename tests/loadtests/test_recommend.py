"""The experiment's recommendation per setting of sshd_config.tuned, from recorded figures (pure
logic: no sshd, no run)."""

from __future__ import annotations

from typing import Any

from loadtests.recommend import APPLY, STOCK, UNMEASURED, recommend, render
from loadtests.verdict import Interval
from sshpool.devhost.host import tuned_settings

EVEN = Interval(0.0, -1.0, 1.0)


def row(
    mode: str,
    p99: Interval = EVEN,
    throughput: Interval = EVEN,
    failure_rate: Interval = EVEN,
    load: str = "burst 100",
) -> dict[str, Any]:
    """A verdict row as loadtests.verdict.verdicts makes it (tuned - stock)."""
    return {
        "cells": f"asyncssh/{mode}/burst",
        "load": load,
        "p99_diff_ms": p99,
        "p99_verdict": p99.verdict(True, "tuned"),
        "throughput_diff": throughput,
        "throughput_verdict": throughput.verdict(False, "tuned"),
        "failure_rate_diff": failure_rate,
        "failure_rate_verdict": failure_rate.verdict(True, "tuned"),
    }


def cell(mode: str, sshd: str, **refusals: int) -> dict[str, Any]:
    """A comparison row (loadtests.experiment.compare) with sshd's refusal log lines."""
    return {"pool_mode": mode, "sshd": sshd, "sshd_refusals": refusals}


def advice(recs: list[Any]) -> dict[str, tuple[str, str]]:
    return {r.keyword: (r.advice, r.figure) for r in recs}


def test_a_setting_whose_cell_shows_tuned_worse_is_left_at_stock() -> None:
    """Issue 44's default run: tuned worse in the channels cell (throughput -62.5/s, 95% CI
    [-121.9, -3.1]), indistinguishable per request. MaxSessions (the channels cell's setting)
    is left at stock with that figure; MaxStartups (per request) applied, no cost measured, with
    sshd's MaxStartups log lines; the settings no load exercises are applied for their reason."""
    settings, _ = tuned_settings((9, 2))
    verdicts = [row("per-request"), row("channels", throughput=Interval(-62.5, -121.9, -3.1))]
    rows = [cell("per-request", "stock", MaxStartups=162), cell("per-request", "tuned",
            MaxStartups=423), cell("channels", "stock"), cell("channels", "tuned")]  # fmt: skip
    got = advice(recommend(settings, verdicts, rows))
    assert got["MaxSessions"] == (
        STOCK,
        "tuned worse: asyncssh/channels/burst burst 100: throughput -62.5/s [-121.9, -3.1]",
    )
    assert got["MaxStartups"] == (
        APPLY,
        "no cost measured: indistinguishable in asyncssh/per-request/burst burst 100 "
        "(sshd log: MaxStartups lines stock 162, tuned 423)",
    )
    assert got["PermitUserRC"][0] == APPLY
    assert "asyncssh/channels/burst burst 100" in got["PermitUserRC"][1]
    assert [k for k, _ in settings] == list(got)  # one per setting, in the file's order


def test_per_source_max_startups_failing_on_10_0_is_left_at_stock() -> None:
    """docs/benchmarks.md's 10.0 run with PerSourceMaxStartups 16: tuned failed 485 of 600
    requests per request (failure rate +80.8%) against stock's none: leave at stock, saying so;
    and a gain is an "apply" with its figure."""
    failing = row("per-request", failure_rate=Interval(0.808, 0.70, 0.90))
    got = advice(recommend([("PerSourceMaxStartups", "16")], [failing], []))
    assert got["PerSourceMaxStartups"] == (
        STOCK,
        "tuned worse: asyncssh/per-request/burst burst 100: failure rate +80.8% [+70.0%, +90.0%]",
    )
    helped = row("per-request", p99=Interval(-250.0, -400.0, -90.0))
    got = advice(recommend([("MaxStartups", "30:30:100")], [helped], []))
    assert got["MaxStartups"] == (
        APPLY,
        "tuned better: asyncssh/per-request/burst burst 100: p99 -250.0 ms [-400.0, -90.0]",
    )


def test_a_setting_without_its_cell_is_not_measured() -> None:
    """A run without a channels cell says MaxSessions is not measured, not "apply"; a keyword
    the sshd was too old for is listed as such."""
    recs = recommend(
        [("MaxSessions", "16"), ("MaxStartups", "30:30:100")],
        [row("per-request")],
        [],
        skipped=["PerSourcePenaltyExemptList"],
    )
    got = advice(recs)
    assert got["MaxSessions"] == (UNMEASURED, "no channels cell in this run")
    assert got["PerSourcePenaltyExemptList"] == (UNMEASURED, "this sshd is too old for it")
    text = render(recs, "OpenSSH 9.2")
    assert text.startswith("## Recommendation per setting of sshd_config.tuned (OpenSSH 9.2)")
    assert "| MaxSessions | 16 | **not measured** | no channels cell in this run |" in text


def test_every_shipped_setting_is_judged() -> None:
    """Each keyword of the shipped tuned files, on 9.2 and on 10.0, has a rule: a recommendation
    of "apply" or "leave at stock" when both cells were measured, never "not in the tables"."""
    for version in ((9, 2), (10, 0)):
        settings, _ = tuned_settings(version)
        recs = recommend(settings, [row("per-request"), row("channels")], [])
        assert {r.advice for r in recs} <= {APPLY, STOCK}, (version, recs)
