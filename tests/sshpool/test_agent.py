"""Agent mode through the pool against real sshd (sshpool/agent): argv with no shell, the login
shell once per connection, no python3, the executor killed, the connection cut, output floods,
commands past MaxSessions. The executor alone: test_agent_executor.py; the backend conformance
suite runs in agent mode too (test_backend_conformance.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from sshpool import ConnectionLost, Pool, Target
from sshpool.devhost import LocalHost

MakeHost = Callable[..., LocalHost]
EXECUTOR = "sys.stdin.buffer.read"  # in the executor's command line (a pgrep pattern)


def agent(target: Target, **changes: object) -> Target:
    return replace(target, exec_mode="agent", **changes)  # type: ignore[arg-type]


def word() -> str:
    return f"sshapi-agent-{uuid.uuid4().hex[:12]}"


def own(host: LocalHost, pids: list[int]) -> list[int]:
    """Those of `pids` under this host's sshd: the account is shared by every rig on the
    machine (other test runs, other checkouts), whose executors are not this test's to kill."""
    mine = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if host.pid in (p.pid for p in psutil.Process(pid).parents()):
                mine.append(pid)
    return mine


def living(pgid: int) -> list[psutil.Process]:
    """The processes of group `pgid` that still run (zombies left aside: this machine's init
    does not reap the orphans a killed executor leaves)."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


async def group_ends(pgid: int, within: float = 30.0) -> bool:
    """Does group `pgid` end within `within` seconds? A SIGKILLed process is gone only once the
    kernel has run it to its exit, which a loaded box may delay past the kill's answer."""
    deadline = time.monotonic() + within
    while living(pgid):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def appears(host: LocalHost, pattern: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if host.processes(pattern):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{pattern} never ran")


async def gone(host: LocalHost, pattern: str, within: float = 3.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not host.processes(pattern):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_argv_runs_without_a_shell_byte_exact(stock_host: LocalHost) -> None:
    """argv reaches the program byte-exact (newline, `!`, quotes, `$`), stdin goes in, exit
    codes come back, and on_started gets the command's own process group."""
    args = ["a b", "it's", "$HOME", "line\nbreak", "bang!", "*", ""]
    groups: list[int] = []
    async with Pool() as pool:
        target = agent(stock_host.target())
        result = await pool.run(target, ["printf", "%s\\0", *args], on_started=groups.append)
        assert result.stdout.split(b"\0")[:-1] == [a.encode() for a in args]
        result = await pool.run(target, ["sh", "-c", "cat; exit 7"], stdin=b"in")
        assert (result.exit_status, result.stdout) == (7, b"in")
        result = await pool.run(target, ["no-such-program-sshapi"])
        assert result.exit_status == 127 and b"no-such-program-sshapi" in result.stderr
        assert pool.stats()[target]["exec_mode"] == "agent"
    assert len(groups) == 1 and groups[0] > 1


async def test_host_without_python3_falls_back_to_channels(
    stock_host: LocalHost, caplog: pytest.LogCaptureFixture
) -> None:
    """No usable interpreter: commands run as channels, and the log says so once."""
    target = agent(stock_host.target(max_connections=2), agent_python="/nonexistent/python3")
    with caplog.at_level(logging.WARNING, logger="sshpool"):
        async with Pool() as pool:
            results = await asyncio.gather(*(pool.run(target, ["echo", "ok"]) for _ in range(20)))
            assert {r.stdout for r in results} == {b"ok\n"}
            assert pool.stats()[target]["exec_mode"] == "channel"
    lines = [r.message for r in caplog.records if "run as channels" in r.message]
    assert len(lines) == 1 and "/nonexistent/python3" in lines[0]


async def test_executor_killed_mid_job(stock_host: LocalHost) -> None:
    """The executor SIGKILLed under a running job (no chance to clean up): the pool kills the
    job's process group over its connection (a TERM-ignoring command and its child too), then
    the job ends ConnectionLost(started=True, remote_killed), and the next job gets a fresh
    executor."""
    w = word()
    async with Pool() as pool:
        target = agent(stock_host.target(max_connections=1))
        job = asyncio.create_task(
            pool.run(target, ["sh", "-c", f"trap '' TERM; sleep 30 & sleep 30; : {w}"])
        )
        await appears(stock_host, w)
        for pid in own(stock_host, stock_host.processes(EXECUTOR)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with pytest.raises(ConnectionLost) as info:
            await asyncio.wait_for(job, 10)
        assert info.value.started and info.value.remote_pgid is not None
        assert info.value.remote_killed
        assert await group_ends(info.value.remote_pgid)
        result = await pool.run(target, ["echo", "next"])
        assert result.stdout == b"next\n"
        assert pool.stats()[target]["counters"]["agents_started"] == 2
    assert not stock_host.processes(w)


async def test_connection_cut_kills_the_commands(make_host: MakeHost) -> None:
    """sshd going down with its sessions: the job ends ConnectionLost(started=True), and the
    executor, its channel closed, kills what it started."""
    host = make_host()
    w = word()
    async with Pool() as pool:
        target = agent(host.target(max_connections=1))
        job = asyncio.create_task(pool.run(target, ["sh", "-c", f"sleep 30; : {w}"]))
        await appears(host, w)
        host.stop(kill_sessions=True)
        with pytest.raises(ConnectionLost) as info:
            await asyncio.wait_for(job, 10)
        assert info.value.started
    assert await gone(host, w)


async def test_login_shell_runs_once_per_connection(make_host: MakeHost) -> None:
    """An account whose ~/.bashrc sleeps 0.3 s and exports a variable: in agent mode the rc
    file runs once per connection (its environment reaches every command); in channel mode
    every command pays it."""
    host = make_host(shell="/bin/bash")
    rc = Path(host.account.home) / ".bashrc"
    saved = rc.read_bytes() if rc.exists() else None
    rc.write_text("sleep 0.3\nexport SSHAPI_FROM_RC=yes\n")
    try:
        async with Pool() as pool:
            target = agent(host.target(max_connections=1))
            await pool.run(target, ["true"])  # the connection, its login and its executor
            started = time.perf_counter()
            for _ in range(10):
                result = await pool.run(target, ["printenv", "SSHAPI_FROM_RC"])
                assert result.stdout == b"yes\n"
            agent_each = (time.perf_counter() - started) / 10
            channel = host.target(max_connections=1)
            await pool.run(channel, ["true"])
            started = time.perf_counter()
            await pool.run(channel, ["true"])
            channel_each = time.perf_counter() - started
    finally:
        if saved is None:
            rc.unlink()
        else:
            rc.write_bytes(saved)
    assert agent_each < 0.05 and channel_each > 0.3, (agent_each, channel_each)


async def test_commands_past_maxsessions_on_one_connection(stock_host: LocalHost) -> None:
    """Stock MaxSessions is 10: one connection in agent mode runs 30 commands at once. Each
    waits until all 30 have started (a barrier of files): 10 at a time, none would pass.
    (Before: 30 x 0.5 s within 1.5 s, a bound the box's load could break.)"""
    barrier = f"barrier-{uuid.uuid4().hex[:8]}"
    # Each gives up after 120 s (2,400 naps): a run cut short leaves no process looping on.
    wait_all = (
        f"n=0; until [ $(ls {barrier} 2>/dev/null | wc -l) -ge 30 ]; "
        "do [ $n -ge 2400 ] && exit 1; n=$((n+1)); sleep 0.05; done"
    )
    async with Pool() as pool:
        target = agent(stock_host.target(max_connections=1, agent_max_commands=30))
        await pool.run(target, ["true"])
        join = f"mkdir -p {barrier}; touch {barrier}/$$"
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(pool.run(target, f"{join}; {wait_all}") for _ in range(30))),
                120,  # not a speed bound: commands that never meet wait here forever
            )
        finally:
            shutil.rmtree(Path(stock_host.account.home, barrier), ignore_errors=True)
        assert all(r.exit_status == 0 for r in results)
        assert pool.stats()[target]["connections"] == 1


async def test_output_flood_keeps_memory_bounded(stock_host: LocalHost) -> None:
    """200 MB with no live observer: the executor counts past the cap and sends the head only.
    100 MB watched live: every byte flows through the acknowledged window, memory flat."""
    me = psutil.Process()
    async with Pool() as pool:
        target = agent(stock_host.target())
        result = await pool.run(target, ["head", "-c", "200000000", "/dev/zero"])
        assert (result.stdout_bytes, len(result.stdout), result.stdout_truncated) == (
            200_000_000,
            1 << 20,
            True,
        )
        seen = 0

        def count(stream: str, data: bytes) -> None:
            nonlocal seen
            seen += len(data)

        before = me.memory_info().rss
        result = await pool.run(target, ["head", "-c", "100000000", "/dev/zero"], on_output=count)
        grown = me.memory_info().rss - before
    assert seen == result.stdout_bytes == 100_000_000
    assert grown < 50 << 20, f"client memory grew {grown >> 20} MiB"


async def test_sftp_beside_the_executor_stays_within_maxsessions(stock_host: LocalHost) -> None:
    """Stock MaxSessions is 10, max_sessions 9: on one agent connection 20 SFTP sessions and
    20 commands at once all succeed; the sessions take at most 8 channels beside the
    executor's, and a channel sshd refuses (it frees a session only once its sftp-server
    exited) costs the SFTP sessions room, not the executor's 32 commands."""
    target = agent(stock_host.target(max_connections=1, max_sessions=9))

    async def session() -> str:
        async with pool.sftp(target, acquire_timeout=30) as fs:
            home = await fs.realpath(".")
            await asyncio.sleep(0.3)
            return home

    async with Pool() as pool:
        await pool.run(target, ["true"])
        results = await asyncio.gather(
            *(session() for _ in range(20)),
            *(pool.run(target, ["sleep", "0.3"]) for _ in range(20)),
        )
        assert len({r for r in results[:20]}) == 1
        stats = pool.stats()[target]
    assert (stats["connections"], stats["capacity"]) == (1, 32), stats


async def test_waiters_open_connections_by_the_executors_cap(stock_host: LocalHost) -> None:
    """Agent mode, max_sessions 2, 32 commands per executor: 20 commands waiting for a
    connection open one (one login, one executor), not one per 2 waiters (four, the cap)."""
    target = agent(stock_host.target(max_connections=4, max_sessions=2))
    async with Pool() as pool:
        await pool.run(target, ["true"])  # the account is known good: connects may run at once
        for pid in own(stock_host, stock_host.processes(EXECUTOR)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for _ in range(100):  # until the pool saw the executor end (5 s at most)
            if not pool.stats()[target]["connections"]:
                break
            await asyncio.sleep(0.05)
        results = await asyncio.gather(*(pool.run(target, ["sleep", "0.3"]) for _ in range(20)))
        assert all(r.exit_status == 0 for r in results)
        stats = pool.stats()[target]
    assert (stats["connections"], stats["counters"]["agents_started"]) == (1, 2), stats
