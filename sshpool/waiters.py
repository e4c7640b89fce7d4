"""The callers waiting for a channel slot of one host pool, in turns by tenant (`Waiters`)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sshpool.lease import PooledConn


class Waiters:
    """Callers waiting for a slot: a FIFO queue per tenant, and the tenants with waiters in a
    ring. The next waiter is the head of the first tenant's queue; once served, that tenant
    goes to the back of the ring if it still has waiters (round robin: with every command
    costing one channel, deficit round robin reduces to this). A tenant that arrives joins the
    back of the ring, so it waits for at most one turn of each tenant ahead of it, however long
    their queues are."""

    __slots__ = ("_len", "_queues", "_ring")

    def __init__(self) -> None:
        self._queues: dict[Hashable, deque[asyncio.Future[PooledConn]]] = {}
        self._ring: deque[Hashable] = deque()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[asyncio.Future[PooledConn]]:
        for queue in self._queues.values():
            yield from queue

    def append(self, tenant: Hashable, fut: asyncio.Future[PooledConn]) -> None:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
            self._ring.append(tenant)
        queue.append(fut)
        self._len += 1

    def peek(self) -> asyncio.Future[PooledConn]:
        """The waiter to serve next (IndexError when none)."""
        return self._queues[self._ring[0]][0]

    def popleft(self) -> asyncio.Future[PooledConn]:
        """Take the next waiter and end its tenant's turn."""
        tenant = self._ring.popleft()
        queue = self._queues[tenant]
        fut = queue.popleft()
        self._len -= 1
        if queue:
            self._ring.append(tenant)
        else:
            del self._queues[tenant]
        return fut

    def remove(self, tenant: Hashable, fut: asyncio.Future[PooledConn]) -> None:
        """Drop a waiter that gave up; ValueError if it is not waiting."""
        queue = self._queues.get(tenant)
        if queue is None:
            raise ValueError("not waiting")
        queue.remove(fut)
        self._len -= 1
        if not queue:
            del self._queues[tenant]
            self._ring.remove(tenant)
