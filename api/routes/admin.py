"""Revocations (admin scope): refuse an identity or an account at once, on every replica, kill
its commands and close its connections (api/revocations.py); list them; lift one."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.auth import MAX_SUBJECT, Principal
from api.deps import Svc, require
from api.problems import Problem
from api.revocations import refusing
from api.services import Services
from api.store import Revocation, new_id, utcnow

router = APIRouter(prefix="/v1/admin", tags=["admin"])
Admin = Annotated[Principal, Depends(require("admin"))]
# Revocations are for people cut off now, lifted later: a few. Every replica reads them all
# each second, and every request is checked against them.
MAX_REVOCATIONS = 1000
PRINTABLE = re.compile(r"\A[^\x00-\x1f\x7f]+\Z")


class RevocationRequest(BaseModel):
    """`issuer` and `subject` (one identity), or `account` (whoever's token names it)."""

    model_config = ConfigDict(extra="forbid")

    issuer: str | None = Field(default=None, min_length=1, max_length=512, pattern=PRINTABLE)
    subject: str | None = Field(
        default=None, min_length=1, max_length=MAX_SUBJECT, pattern=PRINTABLE
    )
    account: str | None = Field(default=None, min_length=1, max_length=64, pattern=PRINTABLE)
    end_running: bool = Field(
        default=True,
        strict=True,  # true or false, not "yes" or 1
        description="also end its running jobs on every replica (their process groups killed) "
        "and close its connections; false: they finish, nothing new starts",
    )

    @model_validator(mode="after")
    def _one_form(self) -> RevocationRequest:
        identity = self.issuer is not None and self.subject is not None
        partial = (self.issuer is None) != (self.subject is None)
        if partial or identity == (self.account is not None):
            raise ValueError('send {"issuer": ..., "subject": ...} or {"account": ...}')
        return self


class RevocationOut(BaseModel):
    id: str
    issuer: str | None
    subject: str | None
    account: str | None
    end_running: bool
    created_at: datetime
    created_by: str


class RevocationDone(RevocationOut):
    jobs_cancelled: int = Field(description="active jobs of the identity cancelled (all replicas)")
    connections_closed: int = Field(description="pooled connections closed by this replica")
    known: bool = Field(
        description="the API knows it: the job store holds a job of the identity (or run as the "
        "account), or the configuration names the account; false: recorded all the same"
    )


def _out(r: Revocation) -> RevocationOut:
    by = f"{r.created_by_sub}@{r.created_by_iss}"
    return RevocationOut(
        id=r.id,
        issuer=r.issuer,
        subject=r.subject,
        account=r.account,
        end_running=r.end_running,
        created_at=r.created_at,
        created_by=by,
    )


@router.post("/revocations", status_code=201, summary="Revoke an identity or an account")
async def revoke(body: RevocationRequest, svc: Svc, who: Admin) -> RevocationDone:
    if len(svc.revocations.known) >= MAX_REVOCATIONS:
        raise Problem(
            409, "too-many-revocations", "Too many revocations", f"at most {MAX_REVOCATIONS}"
        )
    revocation = Revocation(
        id=new_id(),
        issuer=body.issuer,
        subject=body.subject,
        account=body.account,
        created_at=utcnow(),
        created_by_iss=who.issuer,
        created_by_sub=who.subject,
        end_running=body.end_running,
    )
    if refusing([revocation], who, svc.policy) is not None:
        # Else the last admin who may lift it could lock themselves out.
        raise Problem(
            409,
            "revokes-yourself",
            "That would revoke you",
            "this revocation would refuse you too; another admin may make it",
        )
    await svc.store.revoke(revocation)
    effect = await svc.revocations.apply(revocation)
    return RevocationDone(
        **_out(revocation).model_dump(),
        jobs_cancelled=effect.jobs_cancelled,
        connections_closed=effect.connections_closed,
        known=await _known(svc, revocation),
    )


async def _known(svc: Services, revocation: Revocation) -> bool:
    """Whether the API knows whom it revoked (a name misspelt, or not yet used: recorded all
    the same, an admin may revoke ahead): an account the configuration names (a host's or a
    policy rule's) or one a job ran as; an identity that submitted a job. Within the job
    store's retention: an identity whose jobs were all pruned is unknown again."""
    if revocation.account is not None:
        names = {t.username for h in svc.config.hosts for t in svc.policy.targets(h)}
        if revocation.account in names:
            return True
    owner = None
    if revocation.issuer is not None and revocation.subject is not None:
        owner = (revocation.issuer, revocation.subject)
    return await svc.store.seen(owner, revocation.account)


@router.get("/revocations", summary="The revocations in force")
async def revocations(svc: Svc, who: Admin) -> list[RevocationOut]:
    return [_out(r) for r in await svc.store.revocations()]


@router.delete("/revocations/{revocation_id}", status_code=204, summary="Lift a revocation")
async def lift(revocation_id: str, svc: Svc, who: Admin) -> Response:
    try:
        uuid.UUID(revocation_id)
    except ValueError:
        raise Problem(404, "not-found", "No such revocation", "no such revocation id") from None
    if not await svc.store.lift(revocation_id):
        raise Problem(404, "not-found", "No such revocation", "no such revocation id")
    await svc.revocations.lifted(revocation_id)
    return Response(status_code=204)
