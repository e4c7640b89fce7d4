"""Admin: drain a login node of a host with several (`POST /v1/admin/hosts/{host}/nodes/{node}/
drain`) and take it back (`.../undrain`). A drained node takes no new work on any replica; its
running commands end as they would and its connections close as their last channel ends."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from api.auth import Principal
from api.config import HostConfig
from api.deps import Svc, require
from api.problems import Problem
from api.schemas import NodeInfo
from api.services import Services

router = APIRouter(prefix="/v1/admin/hosts", tags=["admin"])
Admin = Annotated[Principal, Depends(require("admin"))]
HostName = Annotated[str, Path(max_length=64)]
NodeName = Annotated[str, Path(max_length=255)]


def _node(svc: Services, host: str, node: str) -> HostConfig:
    config = svc.config.hosts.get(host)
    if config is None:
        raise Problem(404, "host-not-found", "No such host", f"no host {host!r}")
    if node not in config.nodes:
        raise Problem(
            404, "node-not-found", "No such login node", f"host {host!r} has no node {node!r}"
        )
    return config


async def _set(svc: Services, who: Principal, host: str, node: str, drained: bool) -> NodeInfo:
    config = _node(svc, host, node)
    if drained:
        await svc.store.drain(host, node, who.key)
    else:
        await svc.store.undrain(host, node)
    await svc.drains.refresh()  # here at once; the other replicas within a second
    state = svc.pool.nodes(config.target())[node]
    return NodeInfo(host=host, node=node, drained=drained, state=state["state"])


@router.post("/{host}/nodes/{node}/drain", response_model=NodeInfo, summary="Drain a login node")
async def drain(host: HostName, node: NodeName, who: Admin, svc: Svc) -> NodeInfo:
    return await _set(svc, who, host, node, True)


@router.post(
    "/{host}/nodes/{node}/undrain", response_model=NodeInfo, summary="Undrain a login node"
)
async def undrain(host: HostName, node: NodeName, who: Admin, svc: Svc) -> NodeInfo:
    return await _set(svc, who, host, node, False)
