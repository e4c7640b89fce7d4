"""The pool against real OpenSSH sshd (asyncssh backend): reuse, limits, kills, caps, failures."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from sshpool import (
    AuthenticationFailed,
    CommandTimeout,
    ConnectError,
    HostKeyMismatch,
    HostUnavailable,
    Pool,
    PoolFull,
    PoolTimeout,
)
from sshpool.devhost import LocalHost

MakeHost = Callable[..., LocalHost]


def marker() -> str:
    """A unique word to find a test's remote processes with pgrep."""
    return f"sshapi-test-{uuid.uuid4().hex[:12]}"


async def gone(host: LocalHost, pattern: str, within: float = 2.0) -> bool:
    """True once no process of the host account matches `pattern` (polled up to `within` s)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not host.processes(pattern):
            return True
        await asyncio.sleep(0.1)
    return not host.processes(pattern)


async def test_runs_argv_byte_exact(tuned_host: LocalHost) -> None:
    """argv with shell metacharacters arrives as separate, unchanged arguments."""
    args = ["a b", "$(id)", "`id`", "x;y", "it's", "new\nline", "ünï €", "-n", "*"]
    async with Pool() as pool:
        result = await pool.run(tuned_host.target(), ["printf", "%s\\0", *args])
    assert result.exit_status == 0
    assert result.stdout.split(b"\0")[:-1] == [a.encode() for a in args]


async def test_exit_status_stderr_and_stdin(tuned_host: LocalHost) -> None:
    """stdin reaches the command; stderr and a non-zero exit status come back."""
    async with Pool() as pool:
        result = await pool.run(
            tuned_host.target(), "cat; echo oops >&2; exit 3", stdin=b"hello\x00world"
        )
    assert (result.exit_status, result.stdout, result.stderr) == (3, b"hello\x00world", b"oops\n")
    assert not result.ok


async def test_thousand_commands_reuse_connections(tuned_host: LocalHost) -> None:
    """1,000 commands (50 at a time) open no more than max_connections connections."""
    target = tuned_host.target(max_connections=4)
    async with Pool() as pool:
        sem = asyncio.Semaphore(50)

        async def one(i: int) -> bytes:
            async with sem:
                return (await pool.run(target, ["echo", str(i)])).stdout

        outs = await asyncio.gather(*(one(i) for i in range(1000)))
        stats = pool.stats()[target]
    assert outs == [f"{i}\n".encode() for i in range(1000)]
    assert stats["counters"]["connects"] <= 4
    assert stats["counters"]["commands"] == 1000


@pytest.mark.parametrize("max_sessions", [8, 16], ids=["default", "above-MaxSessions"])
async def test_cold_burst_of_200_on_stock_sshd_has_no_failures(
    stock_host: LocalHost, max_sessions: int
) -> None:
    """200 commands released at once on a cold pool against stock sshd all succeed, even when
    max_sessions is set above the host's MaxSessions 10 (the pool shrinks capacity instead)."""
    target = stock_host.target(max_sessions=max_sessions)
    async with Pool() as pool:
        results = await asyncio.gather(
            *(pool.run(target, ["echo", str(i)]) for i in range(200)), return_exceptions=True
        )
        stats = pool.stats()[target]
    failures = [r for r in results if isinstance(r, BaseException)]
    assert failures == []
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(200)]  # type: ignore[union-attr]
    assert stats["counters"]["connects"] <= target.limits.max_connections
    assert stats["counters"].get("connects_failed", 0) == 0
    if max_sessions > 10:
        assert stats["counters"]["channel_refused"] >= 1
        assert stats["capacity"] <= 10 * stats["connections"]


async def test_timeout_kills_the_remote_process_tree(stock_host: LocalHost) -> None:
    """A command past its timeout raises CommandTimeout and leaves no process on the host."""
    word = marker()
    async with Pool() as pool:
        started = time.monotonic()
        with pytest.raises(CommandTimeout) as info:
            # A pipeline and a background child: the whole group must go, not just the shell.
            await pool.run(
                stock_host.target(), f"echo partial; sleep 60 & sleep 61 | cat # {word}", timeout=1
            )
        assert time.monotonic() - started < 4
        assert info.value.result.stdout == b"partial\n"
        assert await gone(stock_host, word)
        assert pool.stats()[stock_host.target()]["counters"]["killed"] == 1


async def test_another_pool_kills_a_process_group_by_its_id(stock_host: LocalHost) -> None:
    """pool.kill(target, pgid) from a second pool (another API replica) ends a command the
    first pool runs, with no signal request on its channel: the run ends killed by TERM."""
    word = marker()
    async with Pool() as owner, Pool() as other:
        pgid: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(
            owner.run(stock_host.target(), f"sleep 60 # {word}", on_started=pgid.set_result)
        )
        await other.kill(stock_host.target(), await asyncio.wait_for(pgid, 10))
        result = await asyncio.wait_for(task, 10)
        assert result.exit_signal == "TERM"
        assert await gone(stock_host, word)
        assert other.stats()[stock_host.target()]["counters"]["killed"] == 1


async def test_cancel_kills_the_remote_process_tree(stock_host: LocalHost) -> None:
    """Cancelling the task awaiting run() leaves no process of the command on the host."""
    word = marker()
    async with Pool() as pool:
        started: asyncio.Event = asyncio.Event()
        task = asyncio.create_task(
            pool.run(
                stock_host.target(), f"sleep 60 # {word}", on_started=lambda _pgid: started.set()
            )
        )
        await asyncio.wait_for(started.wait(), 10)
        assert stock_host.processes(word)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await gone(stock_host, word)


async def test_output_is_capped_and_counted_with_bounded_memory(tuned_host: LocalHost) -> None:
    """200 MB on stdout: the head is kept up to the cap, the total is exact, memory stays flat."""
    size = 200 * 1024 * 1024
    process = psutil.Process(os.getpid())
    async with Pool() as pool:
        before = process.memory_info().rss
        result = await pool.run(
            tuned_host.target(), f"head -c {size} /dev/zero; echo err >&2", max_output=65536
        )
        growth = process.memory_info().rss - before
    assert result.exit_status == 0
    assert (result.stdout_bytes, len(result.stdout), result.stdout_truncated) == (
        size,
        65536,
        True,
    )
    assert (result.stderr, result.stderr_truncated) == (b"err\n", False)
    assert growth < 64 * 1024 * 1024, f"client memory grew by {growth / 2**20:.0f} MiB"


async def test_wrong_host_key_runs_nothing(make_host: MakeHost) -> None:
    """A replaced host key gives HostKeyMismatch and the command never runs."""
    host = make_host("stock")
    host.replace_host_key()
    flag = f"/tmp/{marker()}"
    async with Pool() as pool:
        with pytest.raises(HostKeyMismatch):
            await pool.run(host.target(), ["touch", flag], acquire_timeout=10)
    assert not await asyncio.to_thread(Path(flag).exists)


async def test_wrong_client_key_fails_once_without_retry_loop(
    make_host: MakeHost, tmp_path: Path
) -> None:
    """A key the host does not accept gives AuthenticationFailed after a single attempt."""
    host = make_host("stock")
    other = tmp_path / "other_key"
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)]
    await asyncio.to_thread(subprocess.run, keygen, check=True)
    good = host.target()
    bad = type(good)(
        host=good.host,
        username=good.username,
        client_keys=(str(other),),
        known_hosts=good.known_hosts,
        port=good.port,
    )
    async with Pool() as pool:
        with pytest.raises(AuthenticationFailed):
            await pool.run(bad, ["true"], acquire_timeout=10)
        assert pool.stats()[bad]["counters"]["connects_failed"] == 1


async def test_host_down_fails_fast_then_breaker_opens(make_host: MakeHost) -> None:
    """With sshd down: ConnectError at once, and after the threshold HostUnavailable."""
    host = make_host("stock")
    target = host.target(breaker_threshold=3, breaker_backoff=5)
    host.stop()
    async with Pool() as pool:
        started = time.monotonic()
        for _ in range(3):
            with pytest.raises(ConnectError):
                await pool.run(target, ["true"], acquire_timeout=10)
        # At once: none waited its acquire_timeout (10 s) for the host to come back. A
        # refused connect takes milliseconds; the bound leaves the loaded box its pauses.
        assert time.monotonic() - started < 10
        with pytest.raises(HostUnavailable) as info:
            await pool.run(target, ["true"], acquire_timeout=10)
        assert 0 < info.value.retry_after <= 5
        assert pool.stats()[target]["breaker"] == "open"
        assert pool.stats()[target]["counters"]["connects_failed"] == 3


async def test_breaker_recovers_when_sshd_returns(make_host: MakeHost) -> None:
    """Once the back-off passes and sshd is back, one trial connect closes the breaker."""
    host = make_host("stock")
    target = host.target(breaker_threshold=1, breaker_backoff=0.5, breaker_backoff_max=0.5)
    host.stop()
    async with Pool() as pool:
        with pytest.raises(ConnectError):
            await pool.run(target, ["true"])
        with pytest.raises(HostUnavailable):
            await pool.run(target, ["true"])
        host.start()
        await asyncio.sleep(0.6)
        assert (await pool.run(target, ["echo", "back"])).stdout == b"back\n"
        assert pool.stats()[target]["breaker"] == "closed"


async def test_sshd_restart_with_idle_connections(make_host: MakeHost) -> None:
    """After sshd restarts and its sessions die, the next commands run on fresh connections."""
    host = make_host("stock")
    target = host.target(max_connections=2)
    async with Pool() as pool:
        await asyncio.gather(*(pool.run(target, ["true"]) for _ in range(16)))
        host.stop(kill_sessions=True)
        host.start()
        results = await asyncio.gather(*(pool.run(target, ["echo", "ok"]) for _ in range(16)))
    assert all(r.stdout == b"ok\n" for r in results)


async def test_queue_deadline_and_waiter_bound(tuned_host: LocalHost) -> None:
    """With every slot busy, a caller past its deadline gets PoolTimeout; past max_waiters,
    PoolFull at once."""
    target = tuned_host.target(max_connections=1, min_connections=1, max_sessions=2, max_waiters=1)
    word = marker()
    async with Pool() as pool:
        await pool.prewarm(target)
        busy = [asyncio.create_task(pool.run(target, f"sleep 3 # {word}")) for _ in range(2)]
        await asyncio.sleep(0.5)
        waiter = asyncio.create_task(pool.run(target, ["true"], acquire_timeout=0.5))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(PoolFull):
            await pool.run(target, ["true"])
        # Refused without queueing: the slots stay busy for 3 s (sleep 3), a queued caller
        # would wait that long; the refusal itself is synchronous, whatever the load.
        assert time.monotonic() - started < 2.5
        with pytest.raises(PoolTimeout):
            await waiter
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        assert await gone(tuned_host, word)


async def test_stats_and_repr_describe_the_pool(tuned_host: LocalHost) -> None:
    """stats() and repr() report connections, channels in use and counters."""
    target = tuned_host.target()
    async with Pool() as pool:
        task = asyncio.create_task(pool.run(target, "sleep 1"))
        await asyncio.sleep(0.3)
        stats = pool.stats()[target]
        assert (stats["connections"], stats["channels_in_use"], stats["waiters"]) == (1, 1, 0)
        assert "channels_in_use=1" in repr(pool)
        await task
        assert pool.stats()[target]["counters"]["commands"] == 1


async def test_prewarm_opens_min_connections(tuned_host: LocalHost) -> None:
    """prewarm() opens min_connections before any command, and idle ones beyond it close."""
    target = tuned_host.target(min_connections=2, idle_timeout=0.5)
    async with Pool() as pool:
        await pool.prewarm(target)
        assert pool.stats()[target]["connections"] == 2
        await asyncio.gather(*(pool.run(target, "sleep 0.3") for _ in range(30)))
        assert pool.stats()[target]["connections"] > 2
        await asyncio.sleep(2.5)
        assert pool.stats()[target]["connections"] == 2


@pytest.mark.parametrize("backend", ["paramiko", "ssh2"])
async def test_target_can_choose_its_own_backend(tuned_host: LocalHost, backend: str) -> None:
    """A target naming a backend runs on that library, beside the pool's default."""
    default, chosen = tuned_host.target(), dataclasses.replace(tuned_host.target(), backend=backend)
    async with Pool() as pool:
        results = await asyncio.gather(
            pool.run(default, ["echo", "a"]), pool.run(chosen, ["echo", "b"])
        )
        stats = pool.stats()
    assert [r.stdout for r in results] == [b"a\n", b"b\n"]
    assert (stats[default]["backend"], stats[chosen]["backend"]) == ("asyncssh", backend)


async def test_a_backlog_on_real_sshd_delays_another_tenant_by_one_turn(
    tuned_host: LocalHost,
) -> None:
    """100 queued `sleep 0.2` of one tenant: another tenant's commands wait one turn at most."""
    target = tuned_host.target(max_connections=1, max_sessions=4)
    async with Pool() as pool:
        await pool.run(target, ["true"])  # connected: what follows measures the queue only
        backlog = [
            asyncio.create_task(pool.run(target, ["sleep", "0.2"], tenant="batchy"))
            for _ in range(100)
        ]
        await asyncio.sleep(0.3)
        queued = []
        for _ in range(5):
            result = await pool.run(target, ["true"], tenant="interactive")
            queued.append(result.timings["queue"])
        for task in backlog:
            task.cancel()
        await asyncio.gather(*backlog, return_exceptions=True)
    # One turn is the next of four `sleep 0.2` slots to free up (<= 0.2 s, plus the channel
    # close and open around it on a shared box); FIFO would put it behind ~95 of them (~5 s).
    assert max(queued) <= 0.2 + 0.15, queued
