"""The webhooks table and its delivery outbox (api/store/schema.py) as the webhook service and
the deliverer use them (api/webhooks/). Rare writes (a webhook's creation, a delivery's outcome)
go through the engine, outside the job writer, one short transaction each.

Exactly one delivery per event across replicas: a replica claims due rows by setting a lease
(`lease_until`, `lease_by`) in one UPDATE whose WHERE requires the row still pending and its
lease free; on PostgreSQL the rows are picked `FOR UPDATE SKIP LOCKED`, so two replicas claiming
at once take different rows instead of waiting on each other; SQLite has one writer at a time.
An outcome is recorded only under the claimer's own lease (a replica whose lease ran out, paused
past it, cannot overwrite the outcome of the replica that took the row over).

Every transaction runs whole whatever happens to its caller (api/store/shielded.py); a claim
whose caller was cancelled (the deliverer stopping) gives its leases back at once."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, func, insert, not_, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from api.store.schema import WEBHOOK_DELIVERIES, WEBHOOKS, aware
from api.store.shielded import Transactions, take_turn

D = WEBHOOK_DELIVERIES.c
W = WEBHOOKS.c


@dataclass(frozen=True, slots=True, kw_only=True)
class Webhook:
    id: str
    owner_iss: str
    owner_sub: str
    url: str
    events: list[str]
    secret: str
    created_at: datetime
    owner_account: str | None = None  # the creator's account claim (a revocation's target)
    last_attempt_at: float | None = None
    last_status: int | None = None
    last_error: str | None = None
    delivered: int = 0
    failed: int = 0
    pending: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """A claimed delivery, with what sending it needs."""

    id: str
    event_id: str
    webhook_id: str
    owner: tuple[str, str]
    owner_account: str | None
    job_id: str
    type: str
    created_at: float
    attempts: int
    lease_until: float
    url: str
    secret: str


def events_column(events: list[str]) -> str:
    return "," + ",".join(events) + ","


def _webhook(row: Any, pending: int = 0) -> Webhook:
    values = dict(row._mapping)
    values["events"] = [e for e in values["events"].split(",") if e]
    values["created_at"] = aware(values["created_at"])
    values.pop("pending", None)
    return Webhook(**values, pending=pending)


# pg_advisory_xact_lock's first key for an owner's new webhooks (`take_turn`): the crc32 of
# "sshapi-webhooks", its sign bit cleared.
PG_WEBHOOKS_LOCK = 0x6D3B_84F1


class WebhookStore:
    def __init__(self, transactions: Transactions) -> None:
        """`transactions`: the store's (`Store.transactions`), so that its `close` waits for
        ours."""
        self.transactions = transactions
        self.engine = transactions.engine
        self.postgres = self.engine.dialect.name == "postgresql"

    async def create(self, hook: Webhook, limit: int) -> bool:
        """Insert `hook` unless its owner has `limit` webhooks already (False)."""
        mine = (W.owner_iss == hook.owner_iss, W.owner_sub == hook.owner_sub)
        count = select(func.count()).select_from(WEBHOOKS).where(*mine)
        values = {
            "id": hook.id,
            "owner_iss": hook.owner_iss,
            "owner_sub": hook.owner_sub,
            "url": hook.url,
            "events": events_column(hook.events),
            "secret": hook.secret,
            "created_at": hook.created_at,
            "owner_account": hook.owner_account,
            "delivered": 0,
            "failed": 0,
        }

        async def add(conn: AsyncConnection) -> bool:
            await take_turn(conn, PG_WEBHOOKS_LOCK, f"{hook.owner_iss} {hook.owner_sub}")
            if (await conn.execute(count)).scalar_one() >= limit:
                return False
            await conn.execute(insert(WEBHOOKS).values(**values))
            return True

        return await self.transactions.run(add)

    async def of(self, owner: tuple[str, str], webhook_id: str | None = None) -> list[Webhook]:
        """The owner's webhooks (or the one of that id), oldest first, each with its count of
        pending deliveries."""
        pending = (
            select(func.count())
            .where(D.webhook_id == W.id, D.status == "pending")
            .scalar_subquery()
            .label("pending")
        )
        query = (
            select(WEBHOOKS, pending)
            .where(W.owner_iss == owner[0], W.owner_sub == owner[1])
            .order_by(W.created_at, W.id)
        )
        if webhook_id is not None:
            query = query.where(W.id == webhook_id)
        async with self.engine.connect() as conn:
            return [_webhook(r, r.pending) for r in await conn.execute(query)]

    async def delete(self, owner: tuple[str, str], webhook_id: str) -> bool:
        """Delete a webhook and its deliveries not made yet; False when it is not the owner's."""

        async def drop(conn: AsyncConnection) -> bool:
            gone = await conn.execute(
                delete(WEBHOOKS).where(
                    W.id == webhook_id, W.owner_iss == owner[0], W.owner_sub == owner[1]
                )
            )
            if not gone.rowcount:
                return False
            await conn.execute(delete(WEBHOOK_DELIVERIES).where(D.webhook_id == webhook_id))
            return True

        return await self.transactions.run(drop)

    async def due(
        self, now: float, limit: int, skip: Collection[tuple[str, str]] = ()
    ) -> list[tuple[str, str, str]]:
        """Up to `limit` deliveries due and not leased, of owners not in `skip` (at their cap
        of deliveries in flight): (id, owner issuer, owner subject). A read: an idle replica
        polls with it and writes nothing."""
        query = (
            select(D.id, D.owner_iss, D.owner_sub)
            .where(D.status == "pending", D.next_at <= now, _free(now))
            .order_by(D.next_at)
            .limit(limit)
        )
        if skip:
            query = query.where(
                not_(or_(*(and_(D.owner_iss == iss, D.owner_sub == sub) for iss, sub in skip)))
            )

        async def read(conn: AsyncConnection) -> list[tuple[str, str, str]]:
            return [(r.id, r.owner_iss, r.owner_sub) for r in await conn.execute(query)]

        # Shielded too: the deliverer polls with it and is cancelled at shutdown.
        return await self.transactions.run(read, read=True)

    async def claim(self, ids: list[str], now: float, lease: float, replica: str) -> list[Delivery]:
        """Lease those of `ids` still pending and free to this replica; the ones it got."""
        if not ids:
            return []
        pick = select(D.id).where(D.id.in_(ids), D.status == "pending", _free(now))
        if self.postgres:
            pick = pick.with_for_update(skip_locked=True)
        until = now + lease
        claim = (
            update(WEBHOOK_DELIVERIES)
            .where(D.id.in_(pick.scalar_subquery()), D.status == "pending", _free(now))
            .values(lease_until=until, lease_by=replica, attempts=D.attempts + 1)
            .returning(D.id)
        )

        async def take(conn: AsyncConnection) -> list[Any]:
            claimed = [r.id for r in await conn.execute(claim)]
            if not claimed:
                return []
            query = (
                select(WEBHOOK_DELIVERIES, W.url, W.secret, W.owner_account)
                .join(WEBHOOKS, W.id == D.webhook_id)
                .where(D.id.in_(claimed))
            )
            return list((await conn.execute(query)).all())

        async def give_back(rows: list[Any]) -> None:  # the caller is gone: nobody sends them
            if rows:
                gone = [_delivery(r, until) for r in rows]
                await self.transactions.rowcount(*(_given_back(d, replica) for d in gone))

        rows = await self.transactions.run(take, abandoned=give_back)
        return [_delivery(r, until) for r in rows]

    async def release(self, delivery: Delivery, replica: str) -> None:
        """Give a claimed delivery back unsent (the owner's deliveries in flight are at their
        cap here): due again at once, its attempt not counted."""
        await self.transactions.rowcount(_given_back(delivery, replica))

    async def record(
        self,
        delivery: Delivery,
        replica: str,
        *,
        status: str,
        now: float,
        next_at: float,
        http_status: int | None,
        error: str | None,
    ) -> bool:
        """The outcome of one attempt, under this replica's lease: `status` pending (retry at
        `next_at`), delivered or failed; the webhook's last outcome and counts follow. False
        when the lease was lost meanwhile (nothing recorded)."""
        error = error[:500] if error else None
        query = _mine(delivery, replica).values(
            status=status,
            next_at=next_at,
            lease_until=None,
            lease_by=None,
            last_status=http_status,
            last_error=error,
        )
        counts: dict[str, Any] = {}
        if status == "delivered":
            counts["delivered"] = W.delivered + 1
        elif status == "failed":
            counts["failed"] = W.failed + 1
        hook = (
            update(WEBHOOKS)
            .where(W.id == delivery.webhook_id)
            .values(last_attempt_at=now, last_status=http_status, last_error=error, **counts)
        )

        async def outcome(conn: AsyncConnection) -> bool:
            if not (await conn.execute(query)).rowcount:
                return False
            await conn.execute(hook)
            return True

        return await self.transactions.run(outcome)


def _delivery(r: Any, lease_until: float) -> Delivery:
    return Delivery(
        id=r.id,
        event_id=r.event_id,
        webhook_id=r.webhook_id,
        owner=(r.owner_iss, r.owner_sub),
        owner_account=r.owner_account,
        job_id=r.job_id,
        type=r.type,
        created_at=r.created_at,
        attempts=r.attempts,
        lease_until=lease_until,
        url=r.url,
        secret=r.secret,
    )


def _given_back(delivery: Delivery, replica: str) -> Any:
    """Its lease dropped and its attempt not counted: due again at once."""
    return _mine(delivery, replica).values(lease_until=None, lease_by=None, attempts=D.attempts - 1)


def _free(now: float) -> Any:
    return or_(D.lease_until.is_(None), D.lease_until < now)


def _mine(delivery: Delivery, replica: str) -> Any:
    return update(WEBHOOK_DELIVERIES).where(
        and_(
            D.id == delivery.id,
            D.lease_by == replica,
            D.lease_until == delivery.lease_until,
        )
    )
