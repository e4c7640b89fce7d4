"""The resumable uploads' table (api/store/schema.py `UPLOADS`) as the file service uses it
(api/files/resumable.py). Rare, small writes (an upload's creation, a chunk's lease and its
outcome) go outside the job writer, one short transaction each, whole whatever happens to
their caller (api/store/shielded.py: a chunk's lease taken for a caller who is gone is given
back).

One chunk at a time per upload, across replicas: a chunk takes the row's lease in one UPDATE
whose WHERE requires the upload open, unexpired and its lease free (or lapsed: a process that
died mid-chunk holds it for one lease at most), and records its outcome only under its own
lease. The expiry sweep takes the same lease before it removes a temporary file, so a sweep
and a chunk never act on one upload at once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import ColumnElement, and_, delete, func, insert, or_, select, update
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from api.store.schema import UPLOADS
from api.store.shielded import Transactions, take_turn

U = UPLOADS.c


@dataclass(frozen=True, slots=True, kw_only=True)
class UploadRow:
    id: str
    owner_iss: str
    owner_sub: str
    owner_account: str | None
    host: str
    path: str
    resolved: str
    temp: str
    length: int
    received: int
    if_match: str | None
    create_only: bool
    state: str
    created_at: float
    expires_at: float
    busy_until: float | None = None
    busy_by: str | None = None
    sha256: str | None = None
    etag: str | None = None
    replaced: bool | None = None

    @property
    def owner(self) -> tuple[str, str]:
        return (self.owner_iss, self.owner_sub)


def _row(row: Row[tuple[object, ...]]) -> UploadRow:
    return UploadRow(**dict(row._mapping))


def _free(now: float) -> ColumnElement[bool]:
    return or_(U.busy_until.is_(None), U.busy_until < now)


# pg_advisory_xact_lock's first key for an owner's creations (`take_turn`): the crc32 of
# "sshapi-uploads", its sign bit cleared.
PG_UPLOADS_LOCK = 0x1008_C99B


class UploadStore:
    def __init__(self, transactions: Transactions) -> None:
        """`transactions`: the store's (`Store.transactions`, api/store/shielded.py): each one
        runs whole whatever happens to its caller, and the store's close waits for them."""
        self.transactions = transactions
        self.engine = transactions.engine

    async def create(self, values: Mapping[str, object], cap: int, now: float) -> bool:
        """Insert the upload of `values` (UploadRow's fields) unless its owner has `cap` open,
        unexpired uploads already."""
        count = (
            select(func.count())
            .select_from(UPLOADS)
            .where(
                U.owner_iss == values["owner_iss"],
                U.owner_sub == values["owner_sub"],
                U.state == "open",
                U.expires_at > now,
            )
        )

        async def add(conn: AsyncConnection) -> bool:
            await take_turn(conn, PG_UPLOADS_LOCK, f"{values['owner_iss']} {values['owner_sub']}")
            if (await conn.execute(count)).scalar_one() >= cap:
                return False
            await conn.execute(insert(UPLOADS).values(**values))
            return True

        return await self.transactions.run(add)

    async def get(self, upload_id: str, owner: tuple[str, str], now: float) -> UploadRow | None:
        """The owner's upload of that id, unless it has expired (another owner's: None)."""
        query = select(UPLOADS).where(
            U.id == upload_id,
            U.owner_iss == owner[0],
            U.owner_sub == owner[1],
            U.expires_at > now,
        )
        async with self.engine.connect() as conn:
            found = (await conn.execute(query)).first()
        return None if found is None else _row(found)

    async def claim(self, upload_id: str, token: str, until: float, now: float) -> bool:
        """Take the open upload's lease for one chunk (False: another chunk holds it)."""
        claim = (
            update(UPLOADS)
            .where(U.id == upload_id, U.state == "open", U.expires_at > now, _free(now))
            .values(busy_until=until, busy_by=token)
        )

        async def take(conn: AsyncConnection) -> bool:
            return bool((await conn.execute(claim)).rowcount)

        async def give_back(taken: bool) -> None:  # the chunk's caller is gone
            if taken:
                await self.release(upload_id, token)

        return await self.transactions.run(take, abandoned=give_back)

    async def renew(self, upload_id: str, token: str, until: float) -> bool:
        """Hold the lease longer (a long chunk); False when it was lost meanwhile."""
        renew = update(UPLOADS).where(U.id == upload_id, U.busy_by == token)
        return bool(await self.transactions.rowcount(renew.values(busy_until=until)))

    async def record(self, upload_id: str, token: str, received: int) -> None:
        """The bytes confirmed so far, the lease kept (a chunk that goes on: its commit)."""
        done = update(UPLOADS).where(U.id == upload_id, U.busy_by == token)
        await self.transactions.rowcount(done.values(received=received))

    async def release(
        self,
        upload_id: str,
        token: str,
        *,
        received: int | None = None,
        expires_at: float | None = None,
    ) -> None:
        """The lease let go, with the chunk's outcome when given: the bytes now confirmed and
        the expiry moved on."""
        values: dict[str, object] = {"busy_until": None, "busy_by": None}
        if received is not None:
            values["received"] = received
        if expires_at is not None:
            values["expires_at"] = expires_at
        done = update(UPLOADS).where(U.id == upload_id, U.busy_by == token).values(**values)
        await self.transactions.rowcount(done)

    async def complete(
        self,
        upload_id: str,
        token: str,
        *,
        sha256: str,
        etag: str,
        replaced: bool,
        expires_at: float,
    ) -> None:
        """The upload committed: its answer kept (until `expires_at`), its lease let go."""
        done = (
            update(UPLOADS)
            .where(U.id == upload_id, U.busy_by == token)
            .values(
                state="complete",
                received=U.length,
                sha256=sha256,
                etag=etag,
                replaced=replaced,
                expires_at=expires_at,
                busy_until=None,
                busy_by=None,
            )
        )
        await self.transactions.rowcount(done)

    async def delete(self, upload_id: str, token: str | None = None) -> None:
        """Forget the upload (under `token`'s lease when given)."""
        gone = delete(UPLOADS).where(U.id == upload_id)
        if token is not None:
            gone = gone.where(U.busy_by == token)
        await self.transactions.rowcount(gone)

    async def expired(self, now: float, token: str, until: float, limit: int) -> list[UploadRow]:
        """Up to `limit` expired uploads no chunk holds, each now leased to `token` (the sweep:
        a replica that takes one is the only one acting on it)."""
        due = (
            select(U.id).where(U.expires_at <= now, _free(now)).order_by(U.expires_at).limit(limit)
        )

        async def sweep(conn: AsyncConnection) -> list[UploadRow]:
            taken: list[UploadRow] = []
            ids = [r.id for r in await conn.execute(due)]
            for upload_id in ids:
                claim = (
                    update(UPLOADS)
                    .where(and_(U.id == upload_id, U.expires_at <= now, _free(now)))
                    .values(busy_until=until, busy_by=token)
                )
                if (await conn.execute(claim)).rowcount:
                    row = (await conn.execute(select(UPLOADS).where(U.id == upload_id))).first()
                    if row is not None:
                        taken.append(_row(row))
            return taken

        # A sweep cut short leaves its leases to run out (`until`): no upload is lost by it.
        return await self.transactions.run(sweep)
