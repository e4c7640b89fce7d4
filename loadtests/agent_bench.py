"""Agent mode's parts of `loadtests.bench` (issue 34): channel and agent mode measured in the same
run, interleaved, on the raw pool (no HTTP), against the same host.

- floor: sshd's CPU per command (the listener's process tree: its per-connection processes,
  the shells or the executor, and the commands; loadtests/cpu.py) against the spawn floor
  measured in the same rounds: this Python process starting the same command with
  `os.posix_spawn` and waiting for it (its own CPU and the command's);
- bashrc: an account whose `~/.bashrc` sleeps 0.3 s (a module system's cost at login), p50
  of sequential commands per mode (needs root: the rig's bash account);
- wan: through the latency relay (`--rtt-ms`), the p50 of sequential commands per mode and for
  a connection per request (back to back: at 20 ms of RTT a new connection per request takes
  longer than a 10/s schedule allows, so a paced p50 would measure its backlog).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from loadtests.cpu import own_seconds, reaped_children_seconds, tree_seconds
from loadtests.server import limits
from sshpool import ExecMode, Pool, Target

COMMAND = ("hostname",)  # what the API's benchmark runs (loadtests/sustained.py)
BASHRC = "sleep 0.3\n"


def target_for(host: Any, mode: str, backend: str) -> Target:
    """The API's pooled limits on `host` (a LocalHost or RelayedHost) in `mode`: channel,
    agent, auto (the API's default), or per-request (a new connection per command)."""
    lim = limits("per-request" if mode == "per-request" else "pooled")
    target: Target = host.target(**dataclasses.asdict(lim))
    exec_mode: ExecMode = "agent" if mode == "agent" else "auto" if mode == "auto" else "channel"
    return dataclasses.replace(target, backend=backend, exec_mode=exec_mode)


def spawn_floor(n: int) -> float:
    """CPU ms per command of posix_spawn + waitpid of COMMAND from this process (its own time
    and the command's), its output to /dev/null."""
    path = shutil.which(COMMAND[0])
    assert path is not None
    quiet = [(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)]
    # getrusage, not os.times: times() counts in clock ticks (10 ms), more than a few dozen
    # commands cost together (a short run measured a floor of 0).
    before = own_seconds() + reaped_children_seconds()
    for _ in range(n):
        os.waitpid(os.posix_spawn(path, list(COMMAND), os.environ, file_actions=quiet), 0)
    return (own_seconds() + reaped_children_seconds() - before) * 1000.0 / n


async def sequential(pool: Pool, target: Target, n: int, sshd_pid: int | None) -> dict[str, Any]:
    """n commands one after another on a warm pool: p50 ms and sshd's CPU ms per command."""
    for _ in range(10):
        await pool.run(target, list(COMMAND), timeout=30)
    times = []
    cpu = tree_seconds(sshd_pid)
    for _ in range(n):
        start = time.perf_counter()
        await pool.run(target, list(COMMAND), timeout=30)
        times.append((time.perf_counter() - start) * 1000.0)
    cpu = tree_seconds(sshd_pid) - cpu
    return {"p50_ms": statistics.median(times), "sshd_cpu_ms": cpu * 1000.0 / n}


async def floor_part(
    host: Any, modes: list[str], backend: str, n: int, rounds: int
) -> dict[str, Any]:
    """Rounds of: the spawn floor, then each mode's sequential run; medians over rounds."""
    seen: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    floors = []
    async with Pool(backend=backend) as pool:
        for _ in range(rounds):
            floors.append(spawn_floor(n))
            for mode in modes:
                seen[mode].append(
                    await sequential(pool, target_for(host, mode, backend), n, host.pid)
                )
    out: dict[str, Any] = {"commands": n, "rounds": rounds, "floor_cpu_ms": floors}
    out["floor_cpu_ms_median"] = statistics.median(floors)
    for mode, rows in seen.items():
        out[mode] = {
            "sshd_cpu_ms": [r["sshd_cpu_ms"] for r in rows],
            "sshd_cpu_ms_median": statistics.median(r["sshd_cpu_ms"] for r in rows),
            "p50_ms": [r["p50_ms"] for r in rows],
        }
    return out


async def bashrc_part(data_dir: Path, modes: list[str], backend: str) -> dict[str, Any]:
    """p50 of sequential commands for an account whose ~/.bashrc sleeps 0.3 s."""
    from sshpool.devhost import Rig, RigSpec

    rig = Rig(RigSpec("bench-bashrc", "tuned", shell="/bin/bash"), data_dir=data_dir).start()
    host = rig.host
    rc = Path(host.account.home) / ".bashrc"
    saved = rc.read_bytes() if rc.exists() else None
    rc.write_text(BASHRC)
    out: dict[str, Any] = {}
    try:
        async with Pool(backend=backend) as pool:
            for mode in modes:
                n = 10 if mode == "channel" else 100
                out[mode] = await sequential(pool, target_for(host, mode, backend), n, host.pid)
    finally:
        if saved is None:
            rc.unlink()
        else:
            rc.write_bytes(saved)
        rig.stop()
    return out


async def wan_part(host: Any, modes: list[str], backend: str, n: int) -> dict[str, Any]:
    """Through the relay: each mode and a connection per request, n sequential commands each,
    interleaved twice; the p50 of each round (a failed command fails the part)."""
    designs = [*modes, "per-request"]
    runs: dict[str, list[float]] = {d: [] for d in designs}
    async with Pool(backend=backend) as pool:
        for _ in range(2):
            for d in designs:
                row = await sequential(pool, target_for(host, d, backend), n, host.pid)
                runs[d].append(row["p50_ms"])
    return {d: {"p50_ms": statistics.median(p), "rounds_p50_ms": p} for d, p in runs.items()}


def verdicts(fig: dict[str, Any], rtt_ms: float) -> list[dict[str, Any]]:
    """Issue 34's targets, from the parts that ran (agent against channel of the same run)."""
    out = []

    def check(name: str, value: float | None, op: str, goal: float | None) -> None:
        met = (
            value is not None
            and goal is not None
            and (value <= goal if op == "<=" else value >= goal)
        )
        out.append({"target": name, "goal": "-" if goal is None else f"{op} {goal:.2f}",
                    "value": value, "met": met})  # fmt: skip

    floor = fig.get("floor")
    if floor and "agent" in floor:
        goal = floor["floor_cpu_ms_median"] + 0.4
        check("agent sshd + remote CPU per command ms", floor["agent"]["sshd_cpu_ms_median"],
              "<=", goal)  # fmt: skip
    knees = fig.get("knees", {})
    if "agent" in knees and "channel" in knees:
        check("agent knee jobs/s", knees["agent"], ">=", 1.5 * knees["channel"])
    rc = fig.get("bashrc")
    if rc and "agent" in rc:
        check("0.3 s bashrc, agent p50 ms", rc["agent"]["p50_ms"], "<=", 15.0)
    wan = fig.get("wan")
    if wan and "agent" in wan:
        check(f"{rtt_ms:g} ms RTT, agent p50 ms", wan["agent"]["p50_ms"], "<=", 1.5 * rtt_ms + 10)
    burst = fig.get("agent_burst")
    if burst:
        check(f"burst {burst['size']}, agent failed", float(burst["failed"]), "<=", 0.0)
    return out
