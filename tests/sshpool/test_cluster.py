"""Login-node clusters (sshpool/cluster.py) on three real sshd (127.0.0.2-4, one port, one
account): accounts stick to a node, a node killed moves waiting work and fails running work
with NodeFailed, a probe brings it back, a drain closes its connections as its commands end.
Routing's arithmetic (rendezvous) is checked without SSH."""

from __future__ import annotations

import asyncio
import string
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from sshpool import HostUnavailable, NodeFailed, Pool, Target
from sshpool.cluster import Cluster, rank
from sshpool.devhost import LocalCluster, Rig, RigSpec

HOSTNAME = ["sh", "-c", "echo $SSH_CONNECTION"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with Rig(RigSpec("c", "stock", nodes=3), data_dir=tmp_path) as rig:
        assert rig.cluster is not None
        yield rig.cluster


def node_of(result_stdout: bytes) -> str:
    """The node address a command ran on ($SSH_CONNECTION's third field)."""
    return result_stdout.decode().split()[2]


def test_adding_a_fourth_node_moves_about_a_quarter_of_the_accounts() -> None:
    accounts = [f"r{i:04d}" for i in range(1000)]
    three, four = ["n1", "n2", "n3"], ["n1", "n2", "n3", "n4"]
    moved = sum(rank(three, a)[0] != rank(four, a)[0] for a in accounts)
    assert 200 <= moved <= 300  # a quarter, within chance
    # Losing a node moves only its own accounts.
    assert all(
        rank(three, a)[0] == rank(["n1", "n2"], a)[0] for a in accounts if rank(three, a)[0] != "n3"
    )


def test_a_long_queue_at_home_spills_to_the_next_node_with_a_shorter_one() -> None:
    cluster = Cluster(("n1", "n2", "n3"))
    order = rank(["n1", "n2", "n3"], "alice")
    queues = {order[0]: 16, order[1]: 3, order[2]: 0}
    assert cluster.pick("alice", set(), queues.__getitem__, spill=16) == order[2]
    queues[order[0]] = 15  # below the threshold: home, however short the others' queues
    assert cluster.pick("alice", set(), queues.__getitem__, spill=16) == order[0]
    cluster.nodes[order[0]].drained = True
    assert cluster.pick("alice", set(), queues.__getitem__, spill=16) == order[1]
    assert cluster.pick("alice", {order[1], order[2]}, queues.__getitem__, spill=16) is None
    # What an operator reads per node (/metrics): work sent there, of it spilled there.
    counts = {n: dict(node.counters) for n, node in cluster.nodes.items()}
    assert counts == {
        order[0]: {"routed": 1},
        order[1]: {"routed": 1},
        order[2]: {"routed": 1, "spilled": 1},
    }


def test_a_node_with_a_malformed_port_is_refused(cluster: LocalCluster) -> None:
    with pytest.raises(ValueError, match="optionally :port"):
        replace(cluster.target(), nodes=("127.0.0.2:x",))


async def test_an_account_sticks_to_one_node_and_accounts_spread(cluster: LocalCluster) -> None:
    target = cluster.target()
    async with Pool() as pool:
        seen = {node_of((await pool.run(target, HOSTNAME)).stdout) for _ in range(6)}
        assert len(seen) == 1
        # Other accounts (user names are what routing hashes) land on other nodes; the test's
        # one Unix account is reached under its own name, so only the routing is asked here.
        homes = {rank(list(target.nodes), name)[0] for name in string.ascii_lowercase}
        assert homes == set(target.nodes)
        nodes = pool.nodes(target)
    assert [n["state"] for n in nodes.values()] == ["up"] * 3
    assert sum(n["connections"] for n in nodes.values()) == 1


async def test_a_dead_node_moves_waiting_work_and_fails_running_work(
    cluster: LocalCluster,
) -> None:
    """Its node killed (sshd and sessions) under a running command and queued ones: the running
    one ends NodeFailed, the queued ones run on another node; the node comes back after a probe."""
    target = cluster.target(max_connections=1, max_sessions=1, breaker_backoff=0.5)
    async with Pool() as pool:
        home = node_of((await pool.run(target, HOSTNAME)).stdout)
        victim = cluster.nodes[cluster.addresses.index(home)]
        running = asyncio.create_task(pool.run(target, ["sleep", "30"], acquire_timeout=20))
        await asyncio.sleep(0.5)
        queued = [
            asyncio.create_task(pool.run(target, HOSTNAME, acquire_timeout=20)) for _ in range(4)
        ]
        await asyncio.sleep(0.2)
        victim.stop(kill_sessions=True)
        with pytest.raises(NodeFailed) as lost:
            await running
        assert lost.value.node == home and lost.value.started
        ran_on = {node_of((await q).stdout) for q in queued}
        assert home not in ran_on
        assert pool.nodes(target)[home]["state"] == "down"
        # New work goes elsewhere at once while it is down.
        assert node_of((await pool.run(target, HOSTNAME, acquire_timeout=5)).stdout) != home
        victim.start()
        for _ in range(100):
            if pool.nodes(target)[home]["state"] == "up":
                break
            await asyncio.sleep(0.1)
        assert pool.nodes(target)[home]["state"] == "up"
        assert node_of((await pool.run(target, HOSTNAME, acquire_timeout=5)).stdout) == home


async def test_drain_lets_running_commands_finish_then_closes_connections(
    cluster: LocalCluster,
) -> None:
    target = cluster.target()
    async with Pool() as pool:
        home = node_of((await pool.run(target, HOSTNAME)).stdout)
        running = asyncio.create_task(pool.run(target, ["sh", "-c", "sleep 1; echo done"]))
        await asyncio.sleep(0.3)
        pool.drain(target, home)
        assert pool.nodes(target)[home]["state"] == "draining"
        moved = node_of((await pool.run(target, HOSTNAME)).stdout)
        assert moved != home
        assert (await running).stdout == b"done\n"
        await asyncio.sleep(0.2)
        assert pool.nodes(target)[home]["state"] == "drained"
        assert pool.nodes(target)[home]["connections"] == 0
        pool.drain(target, home, drained=False)
        assert node_of((await pool.run(target, HOSTNAME)).stdout) == home
        with pytest.raises(KeyError):
            pool.drain(target, "127.0.0.9")


async def test_no_node_up_is_host_unavailable(cluster: LocalCluster) -> None:
    target: Target = cluster.target(breaker_backoff=5)
    cluster.stop(kill_sessions=True)
    async with Pool() as pool:
        with pytest.raises(HostUnavailable):
            await pool.run(target, ["true"], acquire_timeout=5)


async def test_files_follow_the_account_and_can_be_pinned(cluster: LocalCluster) -> None:
    """SFTP on a cluster: the session opens on the account's node; with shared_files=False it
    stays on the account's first node of all, and is refused while that node is drained."""
    target = cluster.target()
    first = rank(list(target.nodes), target.username)[0]
    async with Pool() as pool:
        async with pool.sftp(target, acquire_timeout=10) as fs:
            assert await fs.realpath(".")
        assert pool.nodes(target)[first]["connections"] == 1
        pinned = replace(target, shared_files=False)
        pool.drain(pinned, first)
        # Commands move; pinned files do not.
        assert node_of((await pool.run(pinned, HOSTNAME)).stdout) != first
        with pytest.raises(HostUnavailable):
            async with pool.sftp(pinned, acquire_timeout=5):
                pass
        pool.drain(pinned, first, drained=False)
        async with pool.sftp(pinned, acquire_timeout=10) as fs:
            assert await fs.realpath(".")
