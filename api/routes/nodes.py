"""Admin: drain a login node of a host with several (`POST /v1/admin/hosts/{host}/nodes/{node}/
drain`) and take it back (`.../undrain`). A drained node takes no new work on any replica; its
running commands end as they would and its connections close as their last channel ends.
`.../probe` probes the node now on this replica (over the host's service account): a node down
is up again when it answers. One probe per node at a time: concurrent asks, and asks within a
second of its end, share its answer (sshpool's `Pool.reprobe`), so the endpoint never adds
logins to the node's sshd faster than that."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from api.auth import Principal
from api.config import HostConfig
from api.deps import Svc, require
from api.problems import Problem
from api.schemas import NodeInfo, NodeProbe
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


@router.post(
    "/{host}/nodes/{node}/probe", response_model=NodeProbe, summary="Probe a login node now"
)
async def probe(host: HostName, node: NodeName, who: Admin, svc: Svc) -> NodeProbe:
    target = _node(svc, host, node).target()
    answered = await svc.pool.reprobe(target, node)
    state = svc.pool.nodes(target)[node]["state"]
    return NodeProbe(host=host, node=node, answered=answered, state=state)
