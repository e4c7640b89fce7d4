"""/v1/hosts: the hosts the caller may use, their health and pool statistics. An admin sees
every account's pool with its target (user@host:port); anyone else sees only the pool of the
account the policy maps them to, without the target (accounts are the operator's business).
The routes call the admin service (`AdminService.hosts`, `AdminService.host`) only."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import Reader, Svc
from api.schemas import HostInfo

router = APIRouter(prefix="/v1/hosts", tags=["hosts"])


@router.get(
    "",
    response_model=list[HostInfo],
    summary="Hosts you may use (admin: all, with every account's pool)",
)
async def list_hosts(who: Reader, svc: Svc) -> list[HostInfo]:
    return svc.admin.hosts(who)


@router.get("/{name}", response_model=HostInfo, summary="One host")
async def get_host(name: str, who: Reader, svc: Svc) -> HostInfo:
    return svc.admin.host(who, name)
