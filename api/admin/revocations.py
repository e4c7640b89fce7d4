"""Revocation: an identity (issuer and subject) or an account refused at once, on every replica
(docs/operations.md, "Revoking an identity").

`POST /v1/admin/revocations` (api/routes/admin.py) writes a row to the store, then here
`Revocations.apply` kills that identity's running commands, wherever they run (the store knows
them all), and closes this replica's pooled connections of it. Every other replica reads the
revocations once per POLL_INTERVAL (`loop`), or at once when Redis (SSHAPI_REDIS_URL) carries
the nudge the POST sends (`RedisNudge`: pub/sub, best effort; the poll remains), then kills its
own commands of the identity and closes its connections, in that order: closing a connection
whose command runs would leave that command running on the host. Until a revocation is lifted,
`refused` answers yes for every request of that identity, or of anyone who would run as that
account on some host (their token names it, or a policy rule maps them to it); their live
output streams end then too (`stops`: the replica wakes its followers).
sshd cannot revoke an open connection: its certificate was checked at login. Closing the
connections is what makes a revocation reach the host.

What was admitted before a revocation starts nothing after it: the pool asks `admits` (its
gate, `Pool.admit`) before every command and SFTP session starts, on every replica as soon as it
knows the revocation; the request itself is checked again once its body is read
(api/deps.py), and a transfer under way at each piece it moves (api/routes/files.py). With
`end_running` false, the identity's running jobs are left to finish (and their connections
open: nothing new starts on them, they close when idle).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from api.auth import Principal
from api.policy import Policy, key_id_identity
from api.pubsub import listen, subscriber
from api.quota import PREFIX, REDIS_TIMEOUT
from api.store import JobRow, Revocation, Store
from sshpool import Pool, Target

# At most this many of a revocation's jobs are being ended at once (each a kill over SSH, up to
# the cancel wait): an account revocation may cover many identities' jobs.
CANCELS_AT_ONCE = 16

log = logging.getLogger("sshapi.revocations")

# How often every replica reads the revocations: the most another replica takes to refuse a
# revoked identity and close its connections without Redis (the replica that took the POST
# does it at once; with Redis, every replica does).
POLL_INTERVAL = 1.0
CHANNEL = f"{PREFIX}revocations"


@dataclass(frozen=True, slots=True)
class Effect:
    """What a revocation did: the commands it killed, the connections it closed here."""

    jobs_cancelled: int
    connections_closed: int


def refusing(
    revocations: Iterable[Revocation], who: Principal, policy: Policy
) -> Revocation | None:
    """The first of `revocations` that refuses `who`: one of their identity, or of an account
    they would run as on some host (their token's or one a policy rule maps them to)."""
    accounts: set[str] | None = None  # computed once, and only when an account is revoked
    for revocation in revocations:
        if revocation.account is None:
            if who.key == (revocation.issuer, revocation.subject):
                return revocation
            continue
        if accounts is None:
            accounts = policy.accounts_of(who)
        if revocation.account in accounts:
            return revocation
    return None


class RedisNudge:
    """Tells every replica at once that the revocations changed (Redis pub/sub), so that they
    read them now rather than at their next poll. Best effort: a nudge lost (Redis down, a
    replica resubscribing) leaves the poll, and a resubscribed replica reads them again."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self._redis: Any = aioredis.from_url(
            url, socket_timeout=1.0, socket_connect_timeout=REDIS_TIMEOUT
        )
        self._sub = subscriber(url)
        self._failing = False

    def _failed(self, what: str, exc: Exception) -> None:
        if not self._failing:
            self._failing = True
            log.warning("revocations: Redis %s failed (%s): replicas poll", what, exc)

    async def send(self) -> None:
        try:
            await self._redis.publish(CHANNEL, b"1")
        except Exception as exc:
            self._failed("publish", exc)

    async def listen(self, heard: Callable[[], None]) -> None:
        """Call `heard()` on every nudge (and on each (re)subscription), until cancelled; a
        failure of Redis's is retried (api/pubsub.py)."""

        def subscribed() -> None:
            self._failing = False
            heard()

        await listen(
            self._sub,
            CHANNEL,
            lambda _: heard(),
            lambda exc: self._failed("subscribe", exc),
            subscribed,
        )

    async def close(self) -> None:
        await self._redis.aclose()
        await self._sub.aclose()


class Revocations:
    """The revocations as this replica knows them, and what revoking does here."""

    def __init__(
        self,
        store: Store,
        pool: Pool,
        policy: Policy,
        cancel: Callable[[JobRow], Awaitable[bool]],
        wake: Callable[[], None],
        replica: str,
        nudge: RedisNudge | None = None,
    ) -> None:
        """`cancel(row)`: cancel one active job (here or on its replica); True when it ended
        cancelled. `wake()`: make every live follower of this process ask its `stops` again."""
        self.store = store
        self.pool = pool
        self.policy = policy
        self.cancel = cancel
        self.wake = wake
        self.replica = replica
        self.nudge = nudge
        self._heard = asyncio.Event()
        self.known: dict[str, Revocation] = {}
        self.generation = 0  # counts the revocations that came: `stops` asks again after one
        # What the pool's gate asks, from `known` (`_index`): revoked accounts, identities
        # (issuer, subject) and certificate key ids.
        self._accounts: frozenset[str] = frozenset()
        self._identities: frozenset[tuple[str, str]] = frozenset()
        self._key_ids: frozenset[str] = frozenset()

    def _index(self) -> None:
        """`known` changed: what the gate asks, again."""
        revocations = self.known.values()
        self._accounts = frozenset(r.account for r in revocations if r.account is not None)
        self._identities = frozenset(
            (r.issuer, r.subject)
            for r in revocations
            if r.issuer is not None and r.subject is not None
        )
        self._key_ids = frozenset(key_id_identity(*identity) for identity in self._identities)

    def admits(self, target: Target, tenant: object) -> bool:
        """The pool's gate (`Pool.admit`): may work for `tenant` (the API passes the caller's
        identity, `Principal.key`) start on `target` now? No when the account it would run as
        is revoked, or the identity it runs for (the tenant, or a certificate's key id)."""
        if target.username in self._accounts or tenant in self._identities:
            return False
        return target.ca is None or target.identity not in self._key_ids

    def refused(self, who: Principal) -> Revocation | None:
        """The revocation that refuses `who` (a job handle's bearer: its creator), if any."""
        return refusing(self.known.values(), who.accountable, self.policy)

    def stops(self, who: Principal) -> Callable[[], bool]:
        """For a live follower of `who`: true once a revocation refuses them. It asks again only
        after a revocation came, so that a follower's every step costs no scan."""
        seen, answer = -1, False

        def revoked() -> bool:
            nonlocal seen, answer
            if seen != self.generation:
                seen, answer = self.generation, self.refused(who) is not None
            return answer

        return revoked

    def _came(self) -> None:
        """A revocation came: followers ask again (and the refused ones end at once)."""
        self.generation += 1
        self.wake()

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

    async def _cancel_jobs(self, revocation: Revocation, everywhere: bool) -> int:
        """Cancel the active jobs the revocation covers: all replicas', or this one's;
        CANCELS_AT_ONCE at a time."""
        owner = None
        if revocation.issuer is not None and revocation.subject is not None:
            owner = (revocation.issuer, revocation.subject)
        rows = await self.store.active_of(owner, revocation.account)
        if not everywhere:
            rows = [row for row in rows if row.replica == self.replica]
        turns = asyncio.Semaphore(CANCELS_AT_ONCE)

        async def cancel(row: JobRow) -> bool:
            async with turns:
                return await self.cancel(row)

        return sum(await asyncio.gather(*(cancel(row) for row in rows)))

    async def _end(self, revocation: Revocation, everywhere: bool) -> Effect:
        """Kill the jobs, then close the connections; neither when its running jobs are to
        finish (the gate already keeps anything new from starting)."""
        if not revocation.end_running:
            return Effect(0, 0)
        cancelled = await self._cancel_jobs(revocation, everywhere)
        return Effect(cancelled, await self.close_connections(revocation))

    async def apply(self, revocation: Revocation) -> Effect:
        """Refuse at once here and nudge the other replicas, kill the identity's active jobs
        (all replicas': one may be down or not nudged), then close this replica's connections
        of it."""
        self.known[revocation.id] = revocation
        self._index()
        self._came()
        if revocation.issuer is not None and revocation.subject is not None:
            # Their job handles end with them, even if the revocation is lifted later.
            await self.store.drop_handles(owner=(revocation.issuer, revocation.subject))
        if self.nudge is not None:
            await self.nudge.send()
        return await self._end(revocation, everywhere=True)

    async def lifted(self, revocation_id: str) -> None:
        self.known.pop(revocation_id, None)
        self._index()
        if self.nudge is not None:
            await self.nudge.send()

    async def refresh(self) -> None:
        """Read the revocations; for any new one, kill this replica's commands of it, then
        close its connections of it."""
        before = set(self.known)
        current = {r.id: r for r in await self.store.revocations()}
        new = [r for r in current.values() if r.id not in self.known]
        # One `apply` made during the read stays (the read may predate its row).
        self.known = {**{k: r for k, r in self.known.items() if k not in before}, **current}
        self._index()
        if new:
            self._came()
        for revocation in new:
            effect = await self._end(revocation, everywhere=False)
            if effect.jobs_cancelled or effect.connections_closed:
                log.info(
                    "revocation %s: cancelled %d job(s), closed %d connection(s)",
                    revocation.id,
                    effect.jobs_cancelled,
                    effect.connections_closed,
                )

    def heard(self) -> None:
        """A nudge came (RedisNudge.listen): read the revocations now."""
        self._heard.set()

    async def loop(self) -> None:
        """Every POLL_INTERVAL, or at once when nudged, for the supervisor: a failed read keeps
        what was known."""
        while True:
            self._heard.clear()
            try:
                await self.refresh()
            except Exception as exc:
                log.warning("reading the revocations failed: %s", type(exc).__name__)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_INTERVAL):
                    await self._heard.wait()
