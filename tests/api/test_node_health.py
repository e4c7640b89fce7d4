"""Login nodes' health shared by several API processes through Redis (api/node_health.py): two
pools in one test process, each with its own `RedisNodeHealth` as two workers would have, on
a real 3-node cluster (stock sshd) and the real Redis, a key prefix of their own per test. A
node killed and seen down by one process is out of the other's routing before the other
fails there; an "up" from elsewhere is probed, never believed; the node back, both take it
back on their own probes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from api.node_health import RedisNodeHealth
from sshpool import Pool
from sshpool.devhost import LocalCluster
from tests.api.api_helpers import REDIS_URL, eventually

HOSTNAME = ["sh", "-c", "echo $SSH_CONNECTION"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster("nh", 3, "stock", data_dir=tmp_path / "rig") as c:
        yield c


@contextlib.asynccontextmanager
async def shared_pools(n: int, prefix: str) -> AsyncIterator[list[Pool]]:
    """`n` pools, each with its own RedisNodeHealth (its loop and listener running), as `n`
    API processes."""
    boards = [RedisNodeHealth(REDIS_URL, f"p{i}", prefix=prefix) for i in range(n)]
    pools = [Pool(health=b) for b in boards]
    tasks = [asyncio.create_task(f()) for b in boards for f in (b.loop, b.listen)]
    try:
        yield pools
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pool, board in zip(pools, boards, strict=True):
            await pool.close()
            await board.close()


def node_of(stdout: bytes) -> str:
    return stdout.decode().split()[2]


async def test_a_node_down_for_one_process_is_out_of_every_process_routing(
    cluster: LocalCluster,
) -> None:
    # No periodic probe within the test: what B knows of the node, it heard.
    target = cluster.target(probe_interval=600)
    prefix = f"test-{secrets.token_hex(6)}:"
    client = aioredis.from_url(REDIS_URL)
    async with shared_pools(2, prefix) as (a, b):
        home = node_of((await a.run(target, HOSTNAME, acquire_timeout=30)).stdout)
        assert node_of((await b.run(target, HOSTNAME, acquire_timeout=30)).stdout) == home
        victim = cluster.nodes[cluster.addresses.index(home)]
        victim.stop(kill_sessions=True)
        # A's next command finds the node dead and moves on; A's probe takes the node down.
        assert node_of((await a.run(target, HOSTNAME, acquire_timeout=30)).stdout) != home
        await eventually(lambda: a.nodes(target)[home]["state"] == "down", 30)
        await eventually(lambda: b.nodes(target)[home]["state"] == "down", 10)
        seen = b.nodes(target)[home]
        assert seen["why_down"].startswith("another process"), seen
        # B's new work goes elsewhere at once, without failing on the dead node itself.
        for _ in range(3):
            assert node_of((await b.run(target, HOSTNAME, acquire_timeout=30)).stdout) != home
        counters = b.nodes(target)[home]["counters"]
        assert counters.get("failovers", 0) == 0, counters
        assert counters["downs_heard"] == 1, counters

        # Another's word that the node is up: B probes it, finds it dead, keeps it down.
        failed = counters.get("probes_failed", 0)
        node = f"{home}:{target.port}"
        forged = {"node": node, "down": False, "why": "", "token": "x", "from": "forger"}
        await client.publish(f"{prefix}node-health", json.dumps(forged))
        await eventually(
            lambda: b.nodes(target)[home]["counters"].get("probes_failed", 0) >= failed + 2, 30
        )
        assert b.nodes(target)[home]["state"] == "down"

        # Back: the first probe that answers brings it back, on both.
        victim.start()
        await eventually(
            lambda: {a.nodes(target)[home]["state"], b.nodes(target)[home]["state"]} == {"up"},
            30,
        )
        assert node_of((await b.run(target, HOSTNAME, acquire_timeout=30)).stdout) == home
    await client.aclose()
