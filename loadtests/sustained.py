"""Sustained load on POST /v1/jobs (docs/load-suite.md).

    locust -f loadtests/sustained.py --headless                       # smoke, open model
    locust -f loadtests/sustained.py --headless --load-profile paper  # 50 then 90 requests/s
    locust -f loadtests/sustained.py --headless --load-profile paper --model closed  # the paper's

Open model (the default, for headline numbers): requests leave at intended times 1/rate apart,
whatever the answers do, and latency counts from the intended time, so a stalled server shows in
every request it delayed (no coordinated omission). At most --in-flight-cap requests are in
flight; arrivals beyond it are dropped and counted, and sends that leave late are counted: either
makes the run invalid. Closed model (the paper's Locust set-up, kept for comparison and
labelled): --closed-users users each send, wait for the answer, then pace to their share of the
rate; latency counts from the actual send, as in Locust. Warm-up stages are left out of results.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import gevent
import gevent.pool
from locust import LoadTestShape, User, events, task
from locust.runners import MasterRunner

from loadtests.client import JobClient
from loadtests.harness import Harness, add_common_arguments, ui_option
from loadtests.schedule import PROFILES, Stage, arrivals, scaled, share, stage_at, total_duration
from loadtests.timer import DeadlineTimer, Timers

HARNESS = Harness("sustained")
REQUESTS = itertools.count()  # closed model: round-robin over the token subjects
DRAIN_GRACE = 10.0  # seconds past the schedule and the request timeout before stopping anyway
# After a quiet gap of LEAD_GAP or more, a send's greenlet starts LEAD before its intended time
# and waits for it on a timer of its own, so that it sends as the timer fires: started at the
# intended time itself, it began 0.3 ms later at 10/s, on a loop that had just woken cold. Below
# that gap the loop is warm and a second timer per send only costs CPU (at 500/s the extra wait
# made the generator fall behind; docs/benchmarks.md). It holds its in-flight slot from its start.
LEAD = 0.002
LEAD_GAP = 0.008


def _arguments(parser: Any) -> None:
    add_common_arguments(parser)
    group = parser.add_argument_group("sustained")
    ui_option(
        group, "--load-profile", choices=sorted(PROFILES), default="smoke",
        help="The stages (docs/load-suite.md).",
    )  # fmt: skip
    ui_option(
        group, "--model", choices=["open", "closed"], default="open",
        help="open: intended send times; closed: the paper's set-up.",
    )  # fmt: skip
    ui_option(
        group, "--duration-factor", type=float, default=1.0, help="Scale every stage's duration."
    )
    ui_option(group, "--rate-factor", type=float, default=1.0, help="Scale every stage's rate.")
    ui_option(group, "--closed-users", type=int, default=20, help="Users of the closed model.")


# Registered by a call, not as a decorator: locust's hooks are untyped.
events.init_command_line_parser.add_listener(_arguments)


def _stages() -> list[Stage]:
    o = HARNESS.options
    return scaled(PROFILES[o.load_profile], o.duration_factor, o.rate_factor)


def _describe() -> dict[str, Any]:
    o = HARNESS.options
    closed = o.model == "closed"
    return {
        "title": f"sustained {o.load_profile} ({o.model} model)",
        "model": "closed (paper replication)" if closed else "open",
        "latency_from": "actual send" if closed else "intended send time",
        "profile": o.load_profile,
        "stages": [
            {"duration_s": s.duration, "rate": s.rate, "warmup": s.warmup} for s in _stages()
        ],
        **({"closed_users": o.closed_users} if closed else {}),
    }


HARNESS.describe = _describe


class OpenGenerator(User):
    """One per process: sends this process's share of the schedule at its intended times."""

    def wait_time(self) -> float:
        return 0.0

    @task
    def send_schedule(self) -> None:
        stages = _stages()
        index, count = HARNESS.slot()
        client = HARNESS.client()
        tokens = HARNESS.tokens()
        cap = HARNESS.options.in_flight_cap
        in_flight = gevent.pool.Pool(cap)
        wall, start = time.time(), time.perf_counter()
        # gevent.sleep wakes up to 1 ms late; the timer within tens of µs (loadtests/timer.py).
        with DeadlineTimer() as timer, Timers() as timers:
            previous = -LEAD_GAP
            for a in share(arrivals(stages), index, count):
                due = start + a.t
                timer.sleep_until(due - LEAD if a.t - previous >= LEAD_GAP else due)
                previous = a.t
                stage = stages[a.stage]
                if in_flight.full():
                    timer.sleep_until(due)
                    late = (time.perf_counter() - due) * 1000.0
                    HARNESS.record(
                        "open", wall + a.t, 0.0, late, None, a.stage, stage.warmup, stage.rate
                    )
                    continue
                token = tokens[a.index % len(tokens)]
                in_flight.spawn(_send, client, timers, token, due, wall + a.t, a.stage, stage)
            in_flight.join(timeout=HARNESS.options.request_timeout + 1)
        HARNESS.generator_done()
        while True:  # the shape stops the run once every generator is done
            gevent.sleep(1.0)


def _send(
    client: JobClient, timers: Timers, token: str, due: float, t: float, n: int, stage: Stage
) -> None:
    timers.sleep_until(due)
    lateness = (time.perf_counter() - due) * 1000.0
    outcome = client.post(token)
    latency = (outcome.end - due) * 1000.0  # to the last byte: the client's parse is not the API's
    HARNESS.record(
        "open", t, latency, lateness, outcome, n, stage.warmup, stage.rate, name=_name(stage)
    )


def _name(stage: Stage) -> str:
    return f"/v1/jobs [{stage.label}]"


class ClosedUser(User):
    """A Locust user of the closed model: send, wait for the answer, pace to rate/users."""

    def on_start(self) -> None:
        self.client = HARNESS.client()
        self.started = time.perf_counter()

    def wait_time(self) -> float:
        stages = _stages()
        n = stage_at(stages, time.time() - HARNESS.t0)
        if n is None:
            return 1.0
        interval = float(HARNESS.options.closed_users) / stages[n].rate
        return max(0.0, interval - (time.perf_counter() - self.started))

    @task
    def one(self) -> None:
        stages = _stages()
        t = time.time()
        n = stage_at(stages, t - HARNESS.t0)
        if n is None:
            return
        tokens = HARNESS.tokens()
        self.started = time.perf_counter()
        outcome = self.client.post(tokens[next(REQUESTS) % len(tokens)])
        stage = stages[n]
        HARNESS.record(
            "closed", t, outcome.service_ms, 0.0, outcome, n, stage.warmup, stage.rate,
            name=_name(stage),
        )  # fmt: skip


class Profile(LoadTestShape):
    """Ends the run by itself: the open model once every generator drained its schedule, the
    closed model when the profile's time is up."""

    def tick(self) -> tuple[int, float, list[type[User]]] | None:
        o = HARNESS.options
        stages = _stages()
        t: float = self.get_run_time()  # type: ignore[no-untyped-call]  # untyped in locust
        if o.model == "closed":
            if stage_at(stages, t) is None:
                return None
            return o.closed_users, float(o.closed_users), [ClosedUser]
        runner = self.runner
        generators = runner.worker_count if isinstance(runner, MasterRunner) else 1
        if HARNESS.done >= generators:
            return None
        if t > total_duration(stages) + o.request_timeout + DRAIN_GRACE:
            return None
        return generators, float(generators), [OpenGenerator]
