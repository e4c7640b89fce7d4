"""Bursts on POST /v1/jobs (docs/load-suite.md): N simultaneous requests released by a barrier.

    locust -f loadtests/burst.py --headless                              # 10 50 100 200 400, x3
    locust -f loadtests/burst.py --headless --burst-sizes 10 100 --repeats 5 --cooldown 5

Each burst's requests are started, parked on a barrier, then released at one instant; latency
counts from the release (the intended send time), the makespan is release to the last answer.
Sizes are interleaved across repeats; a cool-down separates bursts. Errors are counted by kind
(HTTP status, timeout, reset). In distributed mode each worker fires its share of every burst;
workers pace their bursts themselves, so only the first release is aligned across them.
"""

from __future__ import annotations

import time
from typing import Any

import gevent
from gevent.event import Event
from locust import LoadTestShape, User, events, task
from locust.runners import MasterRunner

from loadtests.client import JobClient
from loadtests.harness import Harness, add_common_arguments, ui_option
from loadtests.schedule import Burst, burst_plan, split

HARNESS = Harness("burst")
GIVE_UP_AFTER = 30 * 60.0  # seconds: the run ends even if a generator never reports done


def _arguments(parser: Any) -> None:
    add_common_arguments(parser)
    group = parser.add_argument_group("burst")
    ui_option(
        group, "--burst-sizes", type=int, nargs="+", default=[10, 50, 100, 200, 400],
        help="Burst sizes (simultaneous requests), interleaved across repeats.",
    )  # fmt: skip
    ui_option(group, "--repeats", type=int, default=3, help="Times each size is fired.")
    ui_option(group, "--cooldown", type=float, default=2.0, help="Seconds between bursts.")


# Registered by a call, not as a decorator: locust's hooks are untyped.
events.init_command_line_parser.add_listener(_arguments)


def _describe() -> dict[str, Any]:
    o = HARNESS.options
    return {
        "title": "burst",
        "model": "burst",
        "latency_from": "barrier release",
        "burst_sizes": o.burst_sizes,
        "repeats": o.repeats,
        "cooldown_s": o.cooldown,
    }


HARNESS.describe = _describe


class BurstGenerator(User):
    """One per process: fires this process's share of every burst of the plan."""

    def wait_time(self) -> float:
        return 0.0

    @task
    def fire_plan(self) -> None:
        o = HARNESS.options
        index, count = HARNESS.slot()
        client = HARNESS.client()
        tokens = HARNESS.tokens()
        for burst in burst_plan(o.burst_sizes, o.repeats):
            _fire(client, tokens, burst, split(burst.size, index, count))
            gevent.sleep(o.cooldown)
        HARNESS.generator_done()
        while True:  # the shape stops the run once every generator is done
            gevent.sleep(1.0)


def _fire(client: JobClient, tokens: list[str], burst: Burst, n: int) -> None:
    barrier = Event()
    release: list[float] = []

    def one(k: int) -> None:
        barrier.wait()
        sent = time.perf_counter()
        outcome = client.post(tokens[k % len(tokens)])
        latency = (outcome.end - release[0]) * 1000.0  # to the last byte, before the parse
        HARNESS.record(
            "burst", release[1], latency, (sent - release[0]) * 1000.0, outcome, burst.index,
            False, burst_size=burst.size, name=f"/v1/jobs [burst {burst.size}]",
        )  # fmt: skip

    group = [gevent.spawn(one, k) for k in range(n)]
    gevent.sleep(0)  # let every greenlet reach the barrier before the release
    release += [time.perf_counter(), time.time()]
    barrier.set()
    gevent.joinall(group, timeout=HARNESS.options.request_timeout + 5)


class Plan(LoadTestShape):
    """One generator per process until every generator has fired its plan."""

    def tick(self) -> tuple[int, float, list[type[User]]] | None:
        runner = self.runner
        generators = runner.worker_count if isinstance(runner, MasterRunner) else 1
        elapsed: float = self.get_run_time()  # type: ignore[no-untyped-call]  # untyped in locust
        if HARNESS.done >= generators or elapsed > GIVE_UP_AFTER:
            return None
        return generators, float(generators), [BurstGenerator]
