"""/v1/hosts: the hosts the caller may use, their health and pool statistics. An admin sees
every account's pool with its target (user@host:port); anyone else sees only the pool of the
account the policy maps them to, without the target (accounts are the operator's business)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.auth import Principal
from api.deps import Reader, Svc
from api.problems import Problem
from api.schemas import HostInfo
from api.services import Services

router = APIRouter(prefix="/v1/hosts", tags=["hosts"])


def _info(svc: Services, who: Principal, name: str) -> HostInfo:
    host = svc.config.hosts[name]
    # By Target, not by address: two hosts on one user@host:port (other keys, limits or
    # backend) have pools of their own, and each host shows only its own.
    stats = svc.pool.stats()
    pools: list[dict[str, Any]] = svc.policy.pools(name, stats)
    # Health is the host's (any account's pool): it names no account.
    if any(p.get("breaker") == "open" for p in pools):
        health = "down"
    elif any(p.get("connections", 0) > 0 for p in pools):
        health = "ok"
    else:
        health = "unknown"
    nodes: list[dict[str, Any]] = []
    if host.nodes:
        nodes = [{"name": n} | s for n, s in svc.pool.nodes(host.target()).items()]
        if any(n["state"] == "up" for n in nodes):
            health = "ok"
        elif any(n["state"] == "down" for n in nodes):
            health = "down"
    if not who.is_admin:
        own = svc.policy.grant(who, name).target
        mine = [own.node_target(n) for n in own.nodes] if own.nodes else [own]
        pools = [{k: v for k, v in stats[t].items() if k != "target"} for t in mine if t in stats]
        nodes = [{"name": n["name"], "state": n["state"]} for n in nodes]
    details = who.is_admin or not svc.config.api.host_details_require_admin
    if not details:  # a node's name is a host name too
        nodes = [{"state": n["state"]} for n in nodes]
    return HostInfo(
        name=name,
        hostname=host.name_shown if details else None,
        port=host.port if details else None,
        description=host.description,
        shell=svc.policy.shell_allowed(who, name),
        health=health,  # type: ignore[arg-type]
        pool=pools,
        nodes=nodes,
    )


@router.get(
    "",
    response_model=list[HostInfo],
    summary="Hosts you may use (admin: all, with every account's pool)",
)
async def list_hosts(who: Reader, svc: Svc) -> list[HostInfo]:
    return [_info(svc, who, n) for n in svc.policy.visible_hosts(who)]


@router.get("/{name}", response_model=HostInfo, summary="One host")
async def get_host(name: str, who: Reader, svc: Svc) -> HostInfo:
    if name not in svc.policy.visible_hosts(who):
        raise Problem(404, "host-not-found", "No such host", f"no host {name!r} for you")
    return _info(svc, who, name)
