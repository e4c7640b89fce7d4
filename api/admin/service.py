"""`AdminService`: what the admin routes (revocations, login-node drains and probes) and the
host listing call. It holds the store, the pool and the policy for them, so that no route
touches them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from api.admin.nodes import NodeDrains
from api.admin.revocations import Effect, Revocations, refusing
from api.auth import Principal
from api.config import Config, HostConfig
from api.policy import Policy, host_details
from api.problems import Problem
from api.schemas import HostAccount, HostInfo, NodeInfo, NodeProbe, WhoAmI
from api.store import Revocation, Store, new_id, utcnow
from sshpool import Pool

# Revocations are for people cut off now, lifted later: a few. Every replica reads them all
# each second, and every request is checked against them.
MAX_REVOCATIONS = 1000


@dataclass(frozen=True, slots=True)
class Revoked:
    """A revocation made: its row, what it did here, and whether the API knew whom it revoked
    (`AdminService.known`)."""

    revocation: Revocation
    effect: Effect
    known: bool


class AdminService:
    """Revocations, login-node drains and node state, host details: each method checks what it
    is asked (404 and 409 as `Problem`) and does it on this replica, the store telling the
    others."""

    def __init__(
        self,
        config: Config,
        policy: Policy,
        store: Store,
        pool: Pool,
        revocations: Revocations,
        drains: NodeDrains,
    ) -> None:
        self.config = config
        self.policy = policy
        self.store = store
        self.pool = pool
        self.revocations = revocations
        self.drains = drains

    # ---- revocations (api/admin/revocations.py)

    async def revoke(
        self,
        who: Principal,
        issuer: str | None,
        subject: str | None,
        account: str | None,
        end_running: bool,
    ) -> Revoked:
        """Revoke an identity (`issuer` and `subject`) or an account at once, on every replica,
        ending its running jobs too (`end_running`): 409 past MAX_REVOCATIONS, or when it would
        refuse `who` too."""
        if len(self.revocations.known) >= MAX_REVOCATIONS:
            raise Problem(
                409, "too-many-revocations", "Too many revocations", f"at most {MAX_REVOCATIONS}"
            )
        revocation = Revocation(
            id=new_id(),
            issuer=issuer,
            subject=subject,
            account=account,
            created_at=utcnow(),
            created_by_iss=who.issuer,
            created_by_sub=who.subject,
            end_running=end_running,
        )
        if refusing([revocation], who, self.policy) is not None:
            # Else the last admin who may lift it could lock themselves out.
            raise Problem(
                409,
                "revokes-yourself",
                "That would revoke you",
                "this revocation would refuse you too; another admin may make it",
            )
        await self.store.revoke(revocation)
        effect = await self.revocations.apply(revocation)
        return Revoked(revocation, effect, await self.known(revocation))

    async def known(self, revocation: Revocation) -> bool:
        """Whether the API knows whom it revoked (a name misspelt, or not yet used: recorded all
        the same, an admin may revoke ahead): an account the configuration names (a host's or a
        policy rule's) or one a job ran as; an identity that submitted a job. Within the job
        store's retention: an identity whose jobs were all pruned is unknown again."""
        if revocation.account is not None:
            names = {t.username for h in self.config.hosts for t in self.policy.targets(h)}
            if revocation.account in names:
                return True
        owner = None
        if revocation.issuer is not None and revocation.subject is not None:
            owner = (revocation.issuer, revocation.subject)
        return await self.store.seen(owner, revocation.account)

    async def revocations_in_force(self) -> list[Revocation]:
        return await self.store.revocations()

    async def lift(self, revocation_id: str) -> None:
        """Lift a revocation: 404 for an id that is not one in force."""
        try:
            uuid.UUID(revocation_id)
        except ValueError:
            raise Problem(404, "not-found", "No such revocation", "no such revocation id") from None
        if not await self.store.lift(revocation_id):
            raise Problem(404, "not-found", "No such revocation", "no such revocation id")
        await self.revocations.lifted(revocation_id)

    # ---- login nodes (api/admin/nodes.py)

    def _node(self, host: str, node: str) -> HostConfig:
        config = self.config.hosts.get(host)
        if config is None:
            raise Problem(404, "host-not-found", "No such host", f"no host {host!r}")
        if node not in config.nodes:
            raise Problem(
                404, "node-not-found", "No such login node", f"host {host!r} has no node {node!r}"
            )
        return config

    async def drain(self, who: Principal, host: str, node: str, drained: bool) -> NodeInfo:
        """Drain a login node (`drained`) or take it back, on every replica: 404 for a host or
        node not configured."""
        config = self._node(host, node)
        if drained:
            await self.store.drain(host, node, who.key)
        else:
            await self.store.undrain(host, node)
        await self.drains.refresh()  # here at once; the other replicas within a second
        state = self.pool.nodes(config.target())[node]
        return NodeInfo(host=host, node=node, drained=drained, state=state["state"])

    async def probe(self, host: str, node: str) -> NodeProbe:
        """Probe a login node now on this replica (over the host's service account: one probe
        per node at a time, shared by the callers asking meanwhile, `Pool.reprobe`): 404 for a
        host or node not configured."""
        target = self._node(host, node).target()
        answered = await self.pool.reprobe(target, node)
        state = self.pool.nodes(target)[node]["state"]
        return NodeProbe(host=host, node=node, answered=answered, state=state)

    # ---- hosts

    def hosts(self, who: Principal) -> list[HostInfo]:
        """The hosts `who` may use, each as `host` describes it."""
        return [self._info(who, name) for name in self.policy.visible_hosts(who)]

    def host(self, who: Principal, name: str) -> HostInfo:
        """One host `who` may use: its health and pool statistics; 404 for any other name. An
        admin sees every account's pool with its target (user@host:port); anyone else only the
        pool of the account the policy maps them to, without the target (accounts are the
        operator's business)."""
        if name not in self.policy.visible_hosts(who):
            raise Problem(404, "host-not-found", "No such host", f"no host {name!r} for you")
        return self._info(who, name)

    def whoami(self, who: Principal) -> WhoAmI:
        """Who `who` is to this server: identity, scopes, and per host they may use the account
        they run as where it is theirs to know (their token's claim; everything for admins),
        as /v1/hosts does: a shared or mapped account is the operator's business."""
        hosts: list[HostAccount] = []
        for name in self.policy.visible_hosts(who):
            try:
                grant = self.policy.grant(who, name)
            except Problem as exc:  # their own refusal, phrased for them (no account named)
                hosts.append(HostAccount(name=name, refused=exc.detail))
                continue
            known = who.is_admin or grant.claimed
            hosts.append(HostAccount(name=name, account=grant.target.username if known else None))
        return WhoAmI(
            subject=who.subject,
            issuer=who.issuer,
            scopes=sorted(who.scopes),
            admin=who.is_admin,
            account=who.account or None,
            hosts=hosts,
        )

    def _info(self, who: Principal, name: str) -> HostInfo:
        host = self.config.hosts[name]
        # By Target, not by address: two hosts on one user@host:port (other keys, limits or
        # backend) have pools of their own, and each host shows only its own.
        stats = self.pool.stats()
        pools: list[dict[str, Any]] = self.policy.pools(name, stats)
        # Health is the host's (any account's pool): it names no account.
        if any(p.get("breaker") == "open" for p in pools):
            health = "down"
        elif any(p.get("connections", 0) > 0 for p in pools):
            health = "ok"
        else:
            health = "unknown"
        nodes: list[dict[str, Any]] = []
        if host.nodes:
            nodes = [{"name": n} | s for n, s in self.pool.nodes(host.target()).items()]
            if any(n["state"] == "up" for n in nodes):
                health = "ok"
            elif any(n["state"] == "down" for n in nodes):
                health = "down"
        if not who.is_admin:
            own = self.policy.grant(who, name).target
            mine = [own.node_target(n) for n in own.nodes] if own.nodes else [own]
            pools = [
                {k: v for k, v in stats[t].items() if k != "target"} for t in mine if t in stats
            ]
            nodes = [{"name": n["name"], "state": n["state"]} for n in nodes]
        details = host_details(who, self.config.api)
        if not details:  # a node's name is a host name too, a pool's sshd its address
            nodes = [{"state": n["state"]} for n in nodes]
            pools = [{k: v for k, v in p.items() if k != "sshd"} for p in pools]
        modes = {"agent": 0, "channel": 0}
        for p in pools:
            for mode, n in p.get("connections_by_mode", {}).items():
                modes[mode] = modes.get(mode, 0) + n
        return HostInfo(
            name=name,
            exec_mode=host.exec_mode,
            connections_by_mode=modes,
            hostname=host.name_shown if details else None,
            port=host.port if details else None,
            description=host.description,
            shell=self.policy.shell_allowed(who, name),
            health=health,  # type: ignore[arg-type]
            pool=pools,
            nodes=nodes,
        )
