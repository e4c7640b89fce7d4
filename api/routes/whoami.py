"""/v1/whoami: who the server takes the caller for (`sshapi whoami`). Any valid token may ask:
it tells the caller only what their token says and the accounts that are theirs to know
(`AdminService.whoami`)."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import Caller, Svc
from api.schemas import WhoAmI

router = APIRouter(prefix="/v1/whoami", tags=["hosts"])


@router.get("", response_model=WhoAmI, summary="Who the server takes you for")
async def whoami(who: Caller, svc: Svc) -> WhoAmI:
    return svc.admin.whoami(who)
