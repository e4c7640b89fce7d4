"""The transfer lane (sshpool.lane): bulk SFTP sessions on connections of their own, their I/O
on the lane's thread, counted in the sshd budget, and the chunk turns shared fairly between
tenants. The pure turn logic runs without sshd; the rest against the real one."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import sys
import threading
import uuid
from collections.abc import Hashable, Iterator

import pytest

from sshpool import ConnectionLost, Lane, Pool, PoolTimeout, Target
from sshpool.backends import BACKENDS
from sshpool.devhost import LatencyRelay, LocalHost, RelayedHost
from sshpool.devhost.fake import FakeBackend, FakeConnection, FakeSFTP
from sshpool.lane import (
    LANE_NICE,
    MIN_CHUNK,
    MIN_WINDOW,
    LaneBackend,
    LaneConnection,
    LaneFile,
    LaneSFTP,
    Turns,
    wan_sizes,
)

MIB = 1 << 20


@pytest.fixture
def lane() -> Iterator[Lane]:
    running = Lane(slots=4).start()
    yield running
    running.stop()


@pytest.fixture
def big_file(tuned_host: LocalHost) -> Iterator[str]:
    """A sparse 64 MiB file in the account's home."""
    path = f"{tuned_host.account.home}/lane-{uuid.uuid4().hex[:8]}.bin"
    tuned_host.run_local(["truncate", "-s", str(64 * MIB), path])
    yield path
    tuned_host.run_local(["rm", "-f", path])


# ---- the turns (no sshd)


async def _ops(
    turns: Turns, tenant: Hashable, transfer: Hashable, n: int, gate: asyncio.Event
) -> None:
    for _ in range(n):
        async with turns.turn(tenant, transfer, MIB):
            await gate.wait()
            await asyncio.sleep(0)


async def test_a_saturated_lane_shares_bytes_equally_between_tenants() -> None:
    """alice runs three transfers and bob one, all asking at once for one slot: while both
    wait, each gets half of the grants (by bytes), not a quarter for bob."""
    turns = Turns(slots=1)
    gate = asyncio.Event()
    tasks = [asyncio.ensure_future(_ops(turns, "alice", f"a{i}", 12, gate)) for i in range(3)]
    tasks.append(asyncio.ensure_future(_ops(turns, "bob", "b", 12, gate)))
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.gather(*tasks)
    order = list(turns.order)
    # Up to bob's last grant both had waiters all along: equal shares within one chunk.
    bobs = [i for i, t in enumerate(order) if t == "bob"]
    window = order[: bobs[-1] + 1]
    assert window.count("bob") == 12
    assert abs(window.count("alice") - window.count("bob")) <= 1
    assert turns.granted == {"alice": 36 * MIB, "bob": 12 * MIB}
    assert turns.busy == 0 and turns.queued == 0


async def test_a_tenants_transfers_share_its_turns() -> None:
    """Within one tenant, its transfers take its turns in turn (each an equal share)."""
    turns = Turns(slots=1)
    gate = asyncio.Event()
    seen: list[str] = []

    async def ops(name: str) -> None:
        for _ in range(6):
            async with turns.turn("alice", name, MIB):
                seen.append(name)
                await gate.wait()
                await asyncio.sleep(0)

    tasks = [asyncio.ensure_future(ops(name)) for name in ("x", "y")]
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.gather(*tasks)
    assert seen.count("x") == seen.count("y") == 6
    assert all(a != b for a, b in itertools.pairwise(seen[1:11]))  # alternating


async def test_a_cancelled_waiter_gives_its_place_up() -> None:
    turns = Turns(slots=1)
    release = asyncio.Event()

    async def hold() -> None:
        async with turns.turn("alice", "a", MIB):
            await release.wait()

    holder = asyncio.ensure_future(hold())
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(_ops(turns, "bob", "b", 1, asyncio.Event()))
    await asyncio.sleep(0)
    assert turns.queued == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert turns.queued == 0
    release.set()
    await holder
    done = asyncio.Event()
    done.set()
    await _ops(turns, "carol", "c", 1, done)  # the slot was not lost
    assert turns.busy == 0


# ---- against sshd


@pytest.mark.parametrize("backend", list(BACKENDS))
async def test_transfers_run_on_the_lanes_thread_beside_the_jobs(
    backend: str, tuned_host: LocalHost, lane: Lane, big_file: str
) -> None:
    """A download in flight on the lane: its connection is not the jobs' one, its SFTP work
    runs on the lane's thread, and jobs keep being served meanwhile on their own connection."""
    target = tuned_host.target()
    async with Pool(backend, lane=lane) as pool:
        async with pool.sftp(target, acquire_timeout=30, tenant="alice", bulk=True) as fs:
            f = await fs.open_read(big_file)
            assert isinstance(f, LaneFile)
            first = await f.read(4 * MIB)
            assert len(first) == 4 * MIB
            # Mid-transfer: jobs run and end while the file is open and half read.
            for _ in range(3):
                result = await pool.run(target, ["true"], timeout=30, tenant="bob")
                assert result.exit_status == 0
            stats = pool.stats()[target]
            assert stats["connections"] == 1  # the jobs' connection
            assert stats["lane"]["connections"] == 1  # the transfer's own
            assert stats["lane"]["channels_in_use"] == 1
            rest = 4 * MIB
            while data := await f.read(4 * MIB):
                rest += len(data)
            await f.close()
            assert rest == 64 * MIB
        # Each call of the lane ran on the lane's thread, never on this one.
        threads: list[str] = []

        async def where() -> None:
            threads.append(threading.current_thread().name)

        await lane.call(where)
        assert threads == ["sshpool-lane"] != [threading.current_thread().name]
        # While a lane runs, the jobs' thread waits at most 1 ms for the GIL.
        assert sys.getswitchinterval() <= 0.001
        assert lane.turns.granted["alice"] >= 64 * MIB


async def test_what_a_call_made_as_its_caller_was_cancelled_is_closed_on_the_lane(
    lane: Lane,
) -> None:
    """A connect or open that ended on the lane with its result just as its caller was
    cancelled (the cancel came too late there): what it made is closed on the lane, not left
    open with no one to close it (a connection the sshd budget would no longer count)."""
    closed: list[str] = []
    started = threading.Event()

    class Made:
        async def close(self) -> None:
            closed.append(threading.current_thread().name)

    async def ends_with_a_result() -> Made:
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)
        return Made()

    async def release(made: Made) -> None:
        await made.close()

    caller = asyncio.create_task(lane.call(ends_with_a_result, release=release))
    assert await asyncio.to_thread(started.wait, 30)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert closed == ["sshpool-lane"]


async def test_a_lane_connect_cancelled_during_its_probe_closes_its_connection(
    lane: Lane,
) -> None:
    """Cancelled after the handshake, while its first SFTP round trip is timed: the new
    connection is closed (its caller never got it to close)."""
    probing = threading.Event()

    class ProbeHangs(FakeBackend):
        async def connect(self, target: Target) -> FakeConnection:
            conn = await super().connect(target)

            async def hang() -> FakeSFTP:
                probing.set()
                await asyncio.sleep(30)
                raise AssertionError("the probe was not cancelled")

            conn.sftp = hang  # type: ignore[method-assign]
            return conn

    backend = ProbeHangs(connect_time=0.0)
    connecting = asyncio.create_task(
        LaneBackend(backend, lane).connect(Target("fake", "u", ("k",), "kh"))
    )
    assert await asyncio.to_thread(probing.wait, 30)
    connecting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await connecting
    [conn] = backend.conns
    assert not conn.alive


def test_the_lanes_thread_runs_at_a_lower_cpu_priority(lane: Lane) -> None:
    """On contended cores the kernel runs the threads serving jobs before the lane's (what
    `top -H` shows an operator: the lane's thread at nice +10); the process keeps its own."""
    assert lane.native_id is not None
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert os.getpriority(os.PRIO_PROCESS, lane.native_id) == min(19, mine + LANE_NICE)
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == mine


async def test_lane_connections_count_in_the_sshd_budget(
    tuned_host: LocalHost, lane: Lane, big_file: str
) -> None:
    """With a budget of one connection to the sshd, a transfer in flight holds it: a job
    cannot get a connection until the transfer ends (then the idle lane connection is closed
    for the job's)."""
    target = tuned_host.target(max_total_connections=1)
    async with Pool(lane=lane) as pool:
        async with pool.sftp(target, acquire_timeout=30, tenant="alice", bulk=True) as fs:
            f = await fs.open_read(big_file)
            await f.read(MIB)
            assert pool.sshd_stats()[next(iter(pool.sshd_stats()))]["connections_busy"] == 1
            with pytest.raises(PoolTimeout):
                await pool.run(target, ["true"], timeout=30, acquire_timeout=1.0, tenant="bob")
            await f.close()
        result = await pool.run(target, ["true"], timeout=30, acquire_timeout=30, tenant="bob")
        assert result.exit_status == 0
        sshd = next(iter(pool.sshd_stats().values()))
        assert sshd["counters"].get("evictions", 0) == 1  # the idle lane connection made room
        assert pool.stats()[target]["lane"]["connections"] == 0


async def test_two_tenants_share_a_saturated_lane(tuned_host: LocalHost, big_file: str) -> None:
    """One slot, alice downloading twice and bob once at the same time, through sshd: bob's
    chunks are granted in turn with alice's (not behind both of hers), and every byte of each
    arrives."""
    lane = Lane(slots=1).start()
    try:
        target = tuned_host.target()
        async with Pool(lane=lane) as pool:

            async def download(tenant: str) -> int:
                got = 0
                async with pool.sftp(target, acquire_timeout=30, tenant=tenant, bulk=True) as fs:
                    f = await fs.open_read(big_file)
                    while data := await f.read(MIB):
                        got += len(data)
                    await f.close()
                return got

            sizes = await asyncio.gather(download("alice"), download("alice"), download("bob"))
        assert sizes == [64 * MIB] * 3
        order = list(lane.turns.order)
        # From bob's first grant to his last, both had chunks waiting (each asks for the next
        # as soon as the last is granted back, in the same step of the loop): alice, with two
        # transfers, got no more than bob (FIFO per transfer would have given her twice his).
        bobs = [i for i, t in enumerate(order) if t == "bob"]
        window = order[bobs[0] : bobs[-1] + 1]
        print(f"FIGURE lane fair share: bob {window.count('bob')}, alice {window.count('alice')}")
        assert window.count("bob") == 65  # 64 chunks and the read at the end of the file
        assert window.count("alice") <= 65 + 2
    finally:
        lane.stop()


# ---- long paths


def test_wan_sizes_follow_the_bandwidth_delay_product() -> None:
    assert wan_sizes(None, 125e6) == (4 * MIB, 2 * MIB)  # not measured yet: the LAN sizes
    assert wan_sizes(0.0003, 125e6) == (4 * MIB, 2 * MIB)  # loopback
    chunk, window = wan_sizes(0.020, 125e6)  # 2.5 MB in flight at a gigabit over 20 ms
    assert chunk == 8 * MIB and window == 5_000_000  # 4 products (10 MiB), capped at 8
    assert wan_sizes(0.008, 125e6) == (4 * MIB, 2 * MIB)  # 1 MB in flight: the LAN sizes
    assert wan_sizes(1.0, 125e6) == (8 * MIB, 16 * MIB)  # the caps on memory per transfer


@pytest.mark.parametrize("backend", list(BACKENDS))
async def test_a_lane_connection_sizes_its_transfers_from_its_round_trip(
    backend: str, tuned_host: LocalHost, lane: Lane, big_file: str
) -> None:
    """Through the rig's relay at 20 ms: the lane connection measures the round trip; with
    asyncssh and paramiko its files read in bigger calls on a channel opened with a bigger
    receive window (the window the channel got, as the library reports it); ssh2's libssh2
    grows its channel's window itself as it reads ahead. An upload through it writes 4 MiB
    calls (each one's last requests answered behind the next) and every byte arrives."""
    data = os.urandom(3 * MIB + 4321) * 4
    with LatencyRelay((tuned_host.address, tuned_host.port), 20) as relay:
        target = RelayedHost(tuned_host, relay).target()
        async with Pool(backend, lane=lane) as pool:
            async with pool.sftp(target, acquire_timeout=30, tenant="alice", bulk=True) as fs:
                assert isinstance(fs, LaneSFTP)
                f = await fs.open_read(big_file)
                assert isinstance(f, LaneFile)
                got = 0
                while data_read := await f.read(f.chunk):
                    got += len(data_read)
                await f.close()
                window = await fs.receive_window()
                w = await fs.open_write(f"{big_file}.up", exclusive=False)
                for i in range(0, len(data), w.chunk):
                    await w.write(data[i : i + w.chunk])
                await w.flush()
                await w.close()
            conn = pool._lane_hosts[target].conns[0].conn
            assert isinstance(conn, LaneConnection)
            assert conn.rtt is not None and conn.rtt >= 0.020
            assert window is not None and window > MIN_WINDOW
            if backend == "ssh2":
                assert f.chunk == MIN_CHUNK  # libssh2 reads ahead four calls' worth itself
            else:
                assert f.chunk > MIN_CHUNK  # 4 x bdp: more than loopback's 4 MiB
                sized = conn._conn.sftp_window  # type: ignore[attr-defined]
                assert window == sized  # what the lane asked for (from the rtt at the open)
            assert w.chunk == MIN_CHUNK
    assert got == 64 * MIB
    summed = tuned_host.run_local(["sha256sum", f"{big_file}.up"]).stdout.split()[0]
    tuned_host.run_local(["rm", "-f", f"{big_file}.up"])
    assert summed == hashlib.sha256(data).hexdigest()


async def test_discard_closes_the_lane_connections_too(
    tuned_host: LocalHost, lane: Lane, big_file: str
) -> None:
    """`Pool.discard` (how the API revokes an identity) closes the target's transfer
    connections as well as its command ones: a download in flight on the lane stops."""
    target = tuned_host.target()
    async with Pool(lane=lane) as pool:
        await pool.run(target, ["true"], timeout=30)
        with pytest.raises(ConnectionLost):
            async with pool.sftp(target, acquire_timeout=30, tenant="alice", bulk=True) as fs:
                f = await fs.open_read(big_file)
                await f.read(MIB)
                assert await pool.discard(target) == 2  # the command's and the transfer's
                while await f.read(4 * MIB):
                    pass
        assert pool.stats()[target]["lane"]["connections"] == 0
