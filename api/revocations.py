"""Revocation: an identity (issuer and subject) or an account refused at once, on every replica
(docs/operations.md, "Revoking an identity").

`POST /v1/admin/revocations` (api/routes/admin.py) writes a row to the store, then here
`Revocations.apply` kills that identity's running commands, wherever they run (the store knows
them all), and closes this replica's pooled connections of it; every other replica reads the
revocations once per POLL_INTERVAL (`loop`) and closes its own. Until a revocation is lifted,
`refused` answers yes for every request of that identity, or of a token naming that account.
sshd cannot revoke an open connection: its certificate was checked at login. Closing the
connections is what makes a revocation reach the host.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from api.auth import Principal
from api.policy import Policy, key_id_identity
from api.store import JobRow, Revocation, Store
from sshpool import Pool, Target

log = logging.getLogger("sshapi.revocations")

# How often every replica reads the revocations: the most another replica takes to refuse a
# revoked identity and close its connections (the replica that took the POST does it at once).
POLL_INTERVAL = 1.0


@dataclass(frozen=True, slots=True)
class Effect:
    """What a revocation did: the commands it killed, the connections it closed here."""

    jobs_cancelled: int
    connections_closed: int


def matches(revocation: Revocation, who: Principal) -> bool:
    if revocation.account is not None:
        return who.account == revocation.account
    return (who.issuer, who.subject) == (revocation.issuer, revocation.subject)


class Revocations:
    """The revocations as this replica knows them, and what revoking does here."""

    def __init__(
        self,
        store: Store,
        pool: Pool,
        policy: Policy,
        cancel: Callable[[JobRow], Awaitable[bool]],
    ) -> None:
        """`cancel(row)`: cancel one active job (here or on its replica); True when it was."""
        self.store = store
        self.pool = pool
        self.policy = policy
        self.cancel = cancel
        self.known: dict[str, Revocation] = {}

    def refused(self, who: Principal) -> Revocation | None:
        """The revocation that refuses `who`, if any."""
        return next((r for r in self.known.values() if matches(r, who)), None)

    def _targets(self, revocation: Revocation) -> list[Target]:
        """This replica's pooled targets the revocation covers: an account's on any host, or
        the identity's (its certificates name it in their key id)."""
        pooled = list(self.pool.stats())
        if revocation.account is not None:
            return [t for t in pooled if t.username == revocation.account]
        assert revocation.issuer is not None and revocation.subject is not None
        identity = key_id_identity(revocation.issuer, revocation.subject)
        return [t for t in pooled if t.ca is not None and t.identity == identity]

    async def close_connections(self, revocation: Revocation) -> int:
        closed = 0
        for target in self._targets(revocation):
            closed += await self.pool.discard(target)
        return closed

    async def apply(self, revocation: Revocation) -> Effect:
        """Refuse at once here, kill the identity's active jobs (all replicas'), then close
        this replica's connections of it."""
        self.known[revocation.id] = revocation
        owner = None
        if revocation.issuer is not None and revocation.subject is not None:
            owner = (revocation.issuer, revocation.subject)
        rows = await self.store.active_of(owner, revocation.account)
        outcomes = await asyncio.gather(*(self.cancel(row) for row in rows))
        closed = await self.close_connections(revocation)
        return Effect(sum(outcomes), closed)

    async def refresh(self) -> None:
        """Read the revocations; close this replica's connections of any new one."""
        current = {r.id: r for r in await self.store.revocations()}
        new = [r for r in current.values() if r.id not in self.known]
        self.known = current
        for revocation in new:
            closed = await self.close_connections(revocation)
            if closed:
                log.info("revocation %s: closed %d connection(s)", revocation.id, closed)

    async def loop(self) -> None:
        """Every POLL_INTERVAL, for the supervisor: a failed read keeps what was known."""
        while True:
            try:
                await self.refresh()
            except Exception as exc:
                log.warning("reading the revocations failed: %s", type(exc).__name__)
            await asyncio.sleep(POLL_INTERVAL)
