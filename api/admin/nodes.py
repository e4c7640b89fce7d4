"""Drained login nodes on every replica: the store holds them (`POST /v1/admin/hosts/{host}/
nodes/{node}/drain`, api/routes/nodes.py), and each replica applies them to its own pool at
start and within `POLL` seconds of a change, so a drain survives a restart and holds on every
replica. Only hosts with `nodes` have any."""

from __future__ import annotations

import asyncio
import logging

from api.config import Config
from api.store import Store
from sshpool import Pool

log = logging.getLogger("sshapi.nodes")

# How often each replica reads the drained nodes (one small query).
POLL = 1.0


class NodeDrains:
    def __init__(self, config: Config, store: Store, pool: Pool) -> None:
        self.config = config
        self.store = store
        self.pool = pool
        self.applied: set[tuple[str, str]] = set()

    def apply(self, drained: set[tuple[str, str]]) -> None:
        """Make this replica's pool drain exactly `drained` (host, node) of configured nodes."""
        for name, host in self.config.hosts.items():
            for node in host.nodes:
                key = (name, node)
                if (key in drained) != (key in self.applied):
                    self.pool.drain(host.target(), node, key in drained)
                    log.warning(
                        "login node %s of host %s %s",
                        node,
                        name,
                        "drained" if key in drained else "back in service",
                    )
        self.applied = {
            (name, node)
            for name, node in drained
            if name in self.config.hosts and node in self.config.hosts[name].nodes
        }

    async def refresh(self) -> None:
        self.apply(await self.store.drained())

    async def loop(self) -> None:
        """The replica's poll (a supervisor task)."""
        while True:
            await self.refresh()
            await asyncio.sleep(POLL)
