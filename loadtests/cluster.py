"""Login-node faults under load: a cluster of real sshd (the rig's `LocalCluster` on
127.0.0.2-5, run as root, logging in N researcher accounts), an open-model stream of commands
(`sleep 1` by default) from random accounts, and, in one run, the issue's four faults:

    .venv/bin/python -m loadtests.cluster --accounts 40 --rate 50 --phase 10

1. steady: --phase seconds, after a warm-up of 3 s: p50/p99 of the commands sent then;
2. kill: one node's sshd and its sessions killed (`stop(kill_sessions=True)`): the commands
   that ended NodeFailed against those running there at that moment, failures among the
   others (the issue wants 0: they had not started, they move), p99 of the others sent in
   this phase against steady's;
3. back: that node started again: seconds until the first command starts on it, and the
   most handshakes in flight to its sshd at once (sampled every 5 ms) against max_handshakes;
4. drain: another node drained (`Pool.drain`): failed and lost among the commands sent while
   it drains, and the seconds between its last command's end and its last connection closed;
5. a fourth node: one command per account on the cluster with a fourth node: how many
   accounts run on another node than before (the issue wants <= a quarter), beside what
   chance gives: each account moves with chance 1/4, so N accounts move Binomial(N, 1/4)
   (its mean, spread and the chance of more than a quarter are printed), and the share of
   1,000 rig account names that `sshpool.cluster.rank` moves (no run: the hash alone).

Measured at the pool, without HTTP. Prints one JSON object per phase and a summary table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests import hdr
from loadtests.server import limits
from sshpool import NodeFailed, Pool, SSHPoolError, Target
from sshpool.cluster import rank
from sshpool.devhost import LocalCluster, Rig, RigSpec
from sshpool.devhost.accounts import account_names, ensure_accounts

WARMUP = 3.0
# Seconds into a fault's phase before the fault: the stream runs on every node by then.
LEAD = 2.0


@dataclass
class Sent:
    """One command of the stream: when sent, where it started, how it ended."""

    account: str
    send: float
    node: str | None = None
    started: float | None = None
    end: float | None = None
    status: str = "running"


@dataclass
class Stream:
    pool: Pool
    targets: list[Target]
    args: argparse.Namespace
    sent: list[Sent] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def one(self, target: Target, item: Sent) -> None:
        def on_node(node: str) -> None:
            item.node, item.started = node, time.perf_counter()

        try:
            result = await self.pool.run(
                target,
                ["sleep", str(self.args.command_seconds)],
                timeout=30,
                acquire_timeout=self.args.deadline,
                on_node=on_node,
            )
            item.status = "ok" if result.ok else f"exit {result.exit_status}"
        except NodeFailed:
            item.status = "NodeFailed"
        except SSHPoolError as exc:
            item.status = type(exc).__name__
        item.end = time.perf_counter()

    async def run(self, seconds: float) -> None:
        t0 = time.perf_counter()
        for i in range(int(self.args.rate * seconds)):
            send = t0 + i / self.args.rate
            await asyncio.sleep(max(0.0, send - time.perf_counter()))
            target = random.choice(self.targets)
            item = Sent(target.username, send)
            self.sent.append(item)
            task = asyncio.create_task(self.one(target, item))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def window(self, start: float, end: float) -> list[Sent]:
        return [s for s in self.sent if start <= s.send < end]


def latency(items: list[Sent]) -> dict[str, float | int | None]:
    """p50 and p99 from send to end of the commands that succeeded, in ms."""
    p = hdr.percentiles(
        hdr.histogram((s.end - s.send) * 1000.0 for s in items if s.status == "ok" and s.end)
    )
    return {"p50_ms": p["p50"], "p99_ms": p["p99"]}


def binomial(n: int, p: float) -> dict[str, float | str]:
    """Binomial(n, p): mean, standard deviation, the central range holding >= 95 % of it, and
    the chance of more than the mean (the chance a run of n accounts misses "<= n p")."""
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    cdf = [sum(pmf[: k + 1]) for k in range(n + 1)]
    low = max((k + 1 for k in range(n + 1) if cdf[k] <= 0.025), default=0)
    high = min(k for k in range(n + 1) if cdf[k] >= 0.975)
    mean = n * p
    return {
        "expected": mean,
        "sd": round(math.sqrt(n * p * (1 - p)), 2),
        "range_95": f"{low}-{high}",
        "p_more": round(1 - cdf[math.floor(mean)], 3),
    }


def moved_share(three: tuple[str, ...], four: tuple[str, ...], names: list[str]) -> float:
    """The share of `names` whose first node in `four` is not their first in `three`."""
    return sum(rank(list(three), a)[0] != rank(list(four), a)[0] for a in names) / len(names)


def statuses(items: list[Sent]) -> dict[str, int]:
    return dict(Counter(s.status for s in items))


async def measure(
    cluster: LocalCluster, targets: list[Target], args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    three = targets[0].nodes
    async with Pool() as pool:
        stream = Stream(pool, targets, args)
        phase = args.phase

        # 1. steady
        t0 = time.perf_counter()
        await stream.run(WARMUP + phase)
        steady = stream.window(t0 + WARMUP, time.perf_counter())
        await _settle(stream)
        homes = {s.account: s.node for s in stream.sent if s.node is not None}
        rows.append({"phase": "steady", "sent": len(steady), "statuses": statuses(steady)})
        rows[-1] |= latency(steady)

        # 2. kill the node with the most commands running, once the stream runs everywhere
        t_kill = time.perf_counter()
        kill_task = asyncio.create_task(stream.run(phase))
        await asyncio.sleep(LEAD)
        running = Counter(s.node for s in stream.sent if s.started and s.end is None)
        victim_name = running.most_common(1)[0][0] if running else three[0]
        victim = cluster.nodes[cluster.addresses.index(str(victim_name))]
        t_stop = time.perf_counter()
        victim.stop(kill_sessions=True)
        await kill_task
        killed = stream.window(t_kill, time.perf_counter())
        everything_then = [s for s in stream.sent if s.send < time.perf_counter()]
        await _settle(stream)
        lost = [s for s in everything_then if s.status == "NodeFailed"]
        # Running there when the kill began: started, and not ended before it. One whose exit
        # was already on its way may still end `ok` while the kill runs.
        in_flight = [
            s
            for s in stream.sent
            if s.node == victim_name
            and s.started is not None
            and s.started < t_stop
            and (s.end is None or s.end >= t_stop)
        ]
        others = [s for s in killed if s.status != "NodeFailed"]
        # Everything sent so far that neither succeeded nor ran on the node killed.
        failed_not_started = [s for s in stream.sent if s.status not in ("ok", "NodeFailed")]
        rows.append(
            {
                "phase": "kill",
                "node": victim_name,
                "in_flight_at_kill": len(in_flight),
                "in_flight_ended_ok": sum(s.status == "ok" for s in in_flight),
                "lost_node_failed": len(lost),
                "node_failed_not_in_flight": sum(s not in in_flight for s in lost),
                "failed_others": len(failed_not_started),
                "statuses": statuses(killed),
                "others_p99_ms": latency(others)["p99_ms"],
                "steady_p99_ms": rows[0]["p99_ms"],
            }
        )

        # 3. back: restart it; first work there, handshakes in flight to it
        sshd_key = f"{victim.address}:{victim.port}"
        most = 0

        async def sample() -> None:
            nonlocal most
            while True:
                stats = pool.sshd_stats().get(sshd_key)
                if stats is not None:
                    most = max(most, stats["handshakes_in_flight"])
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        back_task = asyncio.create_task(stream.run(phase))
        # The longest wait any account's breaker on that node still has before a trial connect.
        backoff = max(
            (
                p["breaker_retry_after"]
                for t, p in pool.stats().items()
                if t.host == victim.address and t.port == victim.port
            ),
            default=0.0,
        )
        victim.start()
        t_back = time.perf_counter()
        await back_task
        await _settle(stream)
        sampler.cancel()
        first = min(
            (
                s.started
                for s in stream.sent
                if s.node == victim_name and s.started and s.started > t_back
            ),
            default=None,
        )
        back = stream.window(t_back, time.perf_counter())
        rows.append(
            {
                "phase": "back",
                "node": victim_name,
                "first_work_after_s": None if first is None else round(first - t_back, 2),
                "handshakes_in_flight_max": most,
                "max_handshakes": targets[0].limits.max_handshakes,
                "breaker_retry_after_at_start_s": backoff,
                "statuses": statuses(back),
            }
            | latency(back)
        )

        # 4. drain another node under load
        drained = next(n for n in three if n != victim_name)
        t_drain = time.perf_counter()
        drain_task = asyncio.create_task(stream.run(phase))
        await asyncio.sleep(LEAD)
        t_drain_at = time.perf_counter()
        running_there = sum(
            1 for s in stream.sent if s.node == drained and s.started and s.end is None
        )
        pool.drain(targets[0], drained)
        closed_at: float | None = None
        while closed_at is None and time.perf_counter() - t_drain < phase + args.deadline:
            if pool.nodes(targets[0])[drained]["connections"] == 0:
                closed_at = time.perf_counter()
            await asyncio.sleep(0.01)
        await drain_task
        await _settle(stream)
        during = stream.window(t_drain, time.perf_counter())
        last_end = max(
            (s.end for s in stream.sent if s.node == drained and s.end is not None), default=0.0
        )
        rows.append(
            {
                "phase": "drain",
                "node": drained,
                "failed": sum(s.status not in ("ok", "NodeFailed") for s in during),
                "lost": sum(s.status == "NodeFailed" for s in during),
                "closed_after_last_end_s": round(closed_at - last_end, 3) if closed_at else None,
                "running_there_at_drain": running_there,
                "started_there_after_drain": sum(
                    1 for s in during if s.node == drained and (s.started or 0) > t_drain_at
                ),
                "statuses": statuses(during),
            }
            | latency(during)
        )
        pool.drain(targets[0], drained, drained=False)

    # 5. a fourth node: each account's node with three nodes up, and then with four
    four = [dataclasses.replace(t, nodes=cluster.addresses) for t in targets]
    async with Pool() as pool:
        moved: Counter[str] = Counter()
        for target in four:
            seen: list[str] = []
            await pool.run(target, ["true"], acquire_timeout=args.deadline, on_node=seen.append)
            if seen and homes.get(target.username) not in (None, seen[0]):
                moved[seen[0]] += 1
        known = sum(1 for t in four if homes.get(t.username))
    new = cluster.addresses[3]
    rows.append(
        {
            "phase": "fourth",
            "accounts": known,
            "moved": sum(moved.values()),
            "moved_to_the_new_node": moved[new],
        }
        | binomial(known, 0.25)
    )
    names = account_names(1000)
    rows.append(
        {
            "phase": "fourth_names",
            "accounts": len(names),
            "moved_share": round(moved_share(three, cluster.addresses, names), 3),
        }
        | binomial(len(names), 0.25)
    )
    return rows


async def _settle(stream: Stream) -> None:
    """Wait for the commands under way to end."""
    pending = list(stream.tasks)
    if pending:
        await asyncio.wait(pending, timeout=stream.args.deadline + 35)


def table(rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        figures = ", ".join(f"{k}={v}" for k, v in row.items() if k != "phase")
        out.append(f"{row['phase']:7} {figures}")
    return "\n".join(out)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.cluster", description=__doc__)
    parser.add_argument("--accounts", type=int, default=40)
    parser.add_argument("--rate", type=float, default=50.0, help="commands/s")
    parser.add_argument("--command-seconds", type=float, default=1.0, help="each is sleep N")
    parser.add_argument("--phase", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--deadline", type=float, default=30.0, help="acquire timeout, s")
    parser.add_argument("--data-dir", default=".data-cluster")
    return parser.parse_args(argv)


def faults(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The stream and its faults on a rig of four login nodes logging in `--accounts` researcher
    accounts (made when missing, as root): one row per phase."""
    data_dir = Path(args.data_dir).absolute()
    accounts = ensure_accounts(args.accounts, data_dir=data_dir)
    with Rig(RigSpec("bench", "stock", nodes=4, researchers=True), data_dir=data_dir) as rig:
        cluster = rig.cluster
        assert cluster is not None
        three = cluster.addresses[:3]
        node0 = cluster.nodes[0]
        pool_limits = limits("pooled")
        targets = [
            dataclasses.replace(a.target(node0), host=cluster.name, nodes=three, limits=pool_limits)
            for a in accounts
        ]
        return asyncio.run(measure(cluster, targets, args))


def main(argv: list[str] | None = None) -> int:
    rows = faults(parse(argv))
    for row in rows:
        print(json.dumps(row), flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
