"""Admin: drain a login node of a host with several (`POST /v1/admin/hosts/{host}/nodes/{node}/
drain`) and take it back (`.../undrain`). A drained node takes no new work on any replica; its
running commands end as they would and its connections close as their last channel ends.
`.../probe` probes the node now on this replica (over the host's service account): a node down
is up again when it answers. One probe per node at a time: concurrent asks, and asks within a
second of its end, share its answer (sshpool's `Pool.reprobe`), so the endpoint never adds
logins to the node's sshd faster than that. The routes call `AdminService` only
(api/admin/nodes.py holds the drains)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from api.auth import Principal
from api.deps import Svc, require
from api.schemas import NodeInfo, NodeProbe

router = APIRouter(prefix="/v1/admin/hosts", tags=["admin"])
Admin = Annotated[Principal, Depends(require("admin"))]
HostName = Annotated[str, Path(max_length=64)]
NodeName = Annotated[str, Path(max_length=255)]


@router.post("/{host}/nodes/{node}/drain", response_model=NodeInfo, summary="Drain a login node")
async def drain(host: HostName, node: NodeName, who: Admin, svc: Svc) -> NodeInfo:
    return await svc.admin.drain(who, host, node, True)


@router.post(
    "/{host}/nodes/{node}/undrain", response_model=NodeInfo, summary="Undrain a login node"
)
async def undrain(host: HostName, node: NodeName, who: Admin, svc: Svc) -> NodeInfo:
    return await svc.admin.drain(who, host, node, False)


@router.post(
    "/{host}/nodes/{node}/probe", response_model=NodeProbe, summary="Probe a login node now"
)
async def probe(host: HostName, node: NodeName, who: Admin, svc: Svc) -> NodeProbe:
    return await svc.admin.probe(host, node)
