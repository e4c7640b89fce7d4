"""Job handles (issue 43, docs/portals.md): opaque bearer tokens that read one job.

A portal following a job for hours need not keep its user's token fresh: the user (or the portal
with the user's token) makes a handle once, `POST /v1/jobs/{id}/handles`, and hands it to whatever
follows the job. The handle:
- reads that job only: its status, output, live output and events; cancels it only when made
  with `cancel: true` (which takes `jobs:write` to make). Its bearer's principal has the
  handle's own identity (HANDLE_ISSUER, the handle's id) and no policy rule, so anything else
  (submitting, lists, files, hosts, the change feed, other jobs) is refused as for a stranger;
- lives `ttl` seconds (capped by the creator's policy rule, `handle_max_ttl`), whatever becomes
  of the creator's token;
- ends when deleted (`DELETE /v1/jobs/{id}/handles/{handle_id}`), when it expires, and when its
  creator is revoked (by identity or by account: every request checks the creator against the
  revocations, and an identity revocation deletes the creator's handles);
- is kept as its SHA-256 only: the token is shown once, in the 201.
Its reads are paid from its creator's buckets and caps (follower cap, reads bucket).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
from collections.abc import AsyncIterator, Callable
from datetime import timedelta

from api.auth import HANDLE_ISSUER, HandleGrant, Principal
from api.config import Config, PolicyRule
from api.policy import Policy
from api.problems import STORE_RETRY_AFTER, Problem, retry_after, store_is_down, unauthorized
from api.store import JobHandle, JobRow, Store, new_id, utcnow

# Every handle starts so: `authenticate` (api/deps.py) tells a handle from a JWT by it.
PREFIX = "sshh_"
TOKEN_BYTES = 32  # 256 random bits
MAX_HANDLE_CHARS = 128  # anything longer is no handle of ours: refused before hashing
# A live stream (output, events) read with a handle asks the store this often whether the
# handle still stands: deleted or expired, the stream ends (as a revoked caller's does).
CHECK_EVERY = 5.0


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def is_handle(token: str) -> bool:
    return token.startswith(PREFIX)


class Handles:
    def __init__(self, config: Config, policy: Policy, store: Store) -> None:
        self.config = config
        self.policy = policy
        self.store = store

    def max_ttl(self, who: Principal) -> float:
        rule = self.policy.rule_for(who)
        return (rule.handle_max_ttl if rule is not None else
                PolicyRule.model_fields["handle_max_ttl"].default)  # fmt: skip

    async def create(
        self, who: Principal, row: JobRow, ttl: float, cancel: bool
    ) -> tuple[str, JobHandle]:
        """A new handle of `row` (the caller's: checked by the route) for `ttl` seconds, at most
        the policy's; 429 beyond `max_handles_per_job` unexpired handles of the job."""
        if who.handle is not None:
            raise Problem(403, "handle-not-allowed", "Not with a handle",
                          "a job handle cannot make handles")  # fmt: skip
        now = utcnow()
        live = [h for h in await self.store.handles_of(row.id) if h.expires_at > now]
        cap = self.config.api.max_handles_per_job
        if len(live) >= cap:
            raise Problem(429, "too-many-handles", "Too many handles",
                          f"this job has {cap} unexpired handles: delete one first")  # fmt: skip
        token = PREFIX + secrets.token_urlsafe(TOKEN_BYTES)
        handle = JobHandle(
            id=new_id(),
            job_id=row.id,
            digest=digest(token),
            owner_iss=who.issuer,
            owner_sub=who.subject,
            owner_account=who.kept_account,
            cancel=cancel,
            created_at=now,
            expires_at=now + timedelta(seconds=min(ttl, self.max_ttl(who))),
        )
        await self.store.add_handle(handle)
        return token, handle

    async def of(self, row: JobRow) -> list[JobHandle]:
        return await self.store.handles_of(row.id)

    async def drop(self, row: JobRow, handle_id: str) -> bool:
        """Delete one handle of the job; False when it has none of that id."""
        return await self.store.drop_handle(row.id, handle_id)

    async def alive(self, grant: HandleGrant) -> bool:
        """Whether the handle still stands: not deleted, not expired."""
        handles = await self.store.handles_of(grant.job_id)
        return any(h.id == grant.id and h.expires_at > utcnow() for h in handles)

    @contextlib.asynccontextmanager
    async def watching(
        self, who: Principal, wake: Callable[[], None]
    ) -> AsyncIterator[Callable[[], bool]]:
        """For a live stream of `who`: a `stop()` that turns true once their handle is deleted
        or expired (asked every CHECK_EVERY seconds; `wake()` then, so that the stream asks).
        Never true for a token's stream."""
        grant = who.handle
        if grant is None:
            yield lambda: False
            return
        ended = False

        async def check() -> None:
            nonlocal ended
            while True:
                await asyncio.sleep(CHECK_EVERY)
                with contextlib.suppress(Exception):  # the store away: ask again later
                    if not await self.alive(grant):
                        ended = True
                        wake()
                        return

        task = asyncio.create_task(check(), name=f"handle-{grant.id}")
        try:
            yield lambda: ended
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def authenticate(self, token: str) -> Principal:
        """The principal of a handle's bearer; 401 for an unknown, deleted or expired one."""
        if len(token) > MAX_HANDLE_CHARS:
            raise unauthorized("unknown or revoked handle")
        try:
            handle = await self.store.handle_by_digest(digest(token))
        except Exception as exc:
            # Checked ahead of the app (api/gate.py), where the app's store-error handler does
            # not reach: the same 503 it would answer.
            if not store_is_down(exc):
                raise
            raise Problem(503, "store-unavailable", "Job store unavailable",
                          "the job store cannot be reached; retry later",
                          headers=retry_after(STORE_RETRY_AFTER)) from None  # fmt: skip
        if handle is None:
            raise unauthorized("unknown or revoked handle")
        if handle.expires_at <= utcnow():
            raise unauthorized("handle expired")
        creator = Principal(
            issuer=handle.owner_iss,
            subject=handle.owner_sub,
            scopes=frozenset(),
            account=handle.owner_account,
        )
        scopes = frozenset({"jobs:read"})
        grant = HandleGrant(handle.id, handle.job_id, handle.cancel, creator)
        return Principal(HANDLE_ISSUER, handle.id, scopes, None, grant)
