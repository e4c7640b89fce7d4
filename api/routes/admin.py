"""Revocations (admin scope): refuse an identity or an account at once, on every replica, kill
its commands and close its connections (api/admin/revocations.py); list them; lift one. The
routes call the admin service (`AdminService`) only."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.auth import MAX_SUBJECT, Principal
from api.deps import Svc, require
from api.store import Revocation

router = APIRouter(prefix="/v1/admin", tags=["admin"])
Admin = Annotated[Principal, Depends(require("admin"))]
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
    revoked = await svc.admin.revoke(who, body.issuer, body.subject, body.account, body.end_running)
    return RevocationDone(
        **_out(revoked.revocation).model_dump(),
        jobs_cancelled=revoked.effect.jobs_cancelled,
        connections_closed=revoked.effect.connections_closed,
        known=revoked.known,
    )


@router.get("/revocations", summary="The revocations in force")
async def revocations(svc: Svc, who: Admin) -> list[RevocationOut]:
    return [_out(r) for r in await svc.admin.revocations_in_force()]


@router.delete("/revocations/{revocation_id}", status_code=204, summary="Lift a revocation")
async def lift(revocation_id: str, svc: Svc, who: Admin) -> Response:
    await svc.admin.lift(revocation_id)
    return Response(status_code=204)
