"""/v1/hosts: the hosts the caller may use, their health and pool statistics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.deps import Reader, Services, Svc
from api.problems import Problem
from api.schemas import HostInfo

router = APIRouter(prefix="/v1/hosts", tags=["hosts"])


def _info(svc: Services, name: str, shell: bool) -> HostInfo:
    host = svc.config.hosts[name]
    # By Target, not by address: two hosts on one user@host:port (other keys, limits or
    # backend) have pools of their own, and each host shows only its own.
    stats = svc.pool.stats()
    pools: list[dict[str, Any]] = [stats[t] for t in svc.policy.targets(name) if t in stats]
    if any(p.get("breaker") == "open" for p in pools):
        health = "down"
    elif any(p.get("connections", 0) > 0 for p in pools):
        health = "ok"
    else:
        health = "unknown"
    return HostInfo(
        name=name,
        hostname=host.hostname,
        port=host.port,
        description=host.description,
        shell=shell,
        health=health,  # type: ignore[arg-type]
        pool=pools,
    )


@router.get("", response_model=list[HostInfo], summary="Hosts you may use (admin: all)")
async def list_hosts(who: Reader, svc: Svc) -> list[HostInfo]:
    return [_info(svc, n, svc.policy.shell_allowed(who, n)) for n in svc.policy.visible_hosts(who)]


@router.get("/{name}", response_model=HostInfo, summary="One host")
async def get_host(name: str, who: Reader, svc: Svc) -> HostInfo:
    if name not in svc.policy.visible_hosts(who):
        raise Problem(404, "host-not-found", "No such host", f"no host {name!r} for you")
    return _info(svc, name, svc.policy.shell_allowed(who, name))
