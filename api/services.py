"""The long-lived objects of one API process, built in order and closed in the reverse order, and
every long-lived task, owned by one supervisor (api/tasks.py: one `asyncio.TaskGroup`).

Built, in this order (closed in the reverse): the data directory's permissions, the supervisor,
the store (its writer a task of the supervisor's; the jobs a previous run of this replica left
active marked `lost`), the HTTP client (JWKS), the pool, the policy, the quota (Redis or local),
the live relay, batch jobs, the claimed accounts' lookups, the job service, the file service,
the pool and tracker metrics, the revocations, the drains and the admin service, then the tasks
below. Objects handed in (a test's pool or store) stay the caller's to start and close.

The supervisor's tasks and what their death means (a death is an exception other than
cancellation; every one is logged with its traceback):

| task                | what                               | policy  | why                       |
|---------------------|------------------------------------|---------|---------------------------|
| `store-writer`      | commits the store's queued writes  | restart | the queue survives it:    |
|                     | (api/store/store.py)               |         | the callers' writes wait, |
|                     |                                    |         | then commit               |
| `live-relay-listen` | with Redis: other replicas' wish   | restart | lost, followers elsewhere |
|                     | to follow our commands             |         | see no live output        |
|                     | (api/live/relay.py)                |         |                           |
| `track-<host>`      | polls the host's scheduler for the | restart | the tracked jobs live in  |
|                     | batch jobs this process tracks     |         | the Tracker: a restart    |
|                     |                                    |         | resumes; lost, they never |
|                     |                                    |         | reach a final state here  |
| `renew-batch-holds` | renews batch jobs' active-job      | restart | lost, the entries lapse   |
|                     | entries (api/quota.py)             |         | and the cap undercounts   |
| `revocations`       | reads the revocations each second  | restart | lost, revocations made on |
|                     | or when nudged; enforces new ones  |         | other replicas do not     |
|                     | (api/admin/revocations.py)         |         | reach this one            |
| `revocations-nudge` | with Redis: the nudge of a new     | restart | lost, the poll remains    |
|                     | revocation or lift                 |         |                           |
| `node-drains`       | hosts with login nodes: reads the  | restart | lost, a drain or undrain  |
|                     | drained nodes each second, so a    |         | made on another replica   |
|                     | drain holds on every replica       |         | never reaches this one    |
|                     | (api/admin/nodes.py)               |         |                           |
| `change-prune`      | deletes job events older than the  | restart | lost, the event log grows |
|                     | change feed's window               |         | until `sshapi db prune`   |
|                     | (api/live/changes.py)              |         |                           |
| `change-publish`    | with Redis: tells the replicas     | restart | lost, their feeds see our |
|                     | whose jobs changed here            |         | changes at a keep-alive   |
| `change-listen`     | with Redis: wakes this process's   | restart | lost, as above, the other |
|                     | feeds on the other replicas' news  |         | way                       |
| `prewarm-<host>`    | opens the host's `min_connections` | once    | best effort: jobs connect |
|                     | at start                           |         | on demand anyway          |
| `sshd-budget`       | with Redis: takes, renews and      | restart | lost, the leases lapse    |
|                     | gives back this process's share of |         | (the pool keeps within    |
|                     | each sshd (api/sshd_budget.py);    |         | the last share), the      |
|                     | stopped last, after the pool       |         | others take them          |
| `sshd-budget-nudge` | with Redis: other processes' ask   | restart | lost, shares rebalance at |
|                     | to rebalance now                   |         | each renewal (1 s)        |
| `node-health`       | with Redis: publishes this         | restart | lost, each process judges |
|                     | process's login-node verdicts,     |         | its login nodes alone     |
|                     | renews and reads the down keys     |         |                           |
|                     | (api/node_health.py)               |         |                           |
| `node-health-nudge` | with Redis: the other processes'   | restart | lost, their verdicts come |
|                     | verdicts as they come              |         | each second (the keys)    |
| `webhooks`          | sends the webhook outbox's due     | restart | lost, this process sends  |
|                     | deliveries                         |         | none (other replicas do;  |
|                     | (api/webhooks/deliver.py)          |         | the outbox keeps them)    |
| `upload-expiry`     | removes expired resumable uploads' | restart | lost, this process sweeps |
|                     | temporary files and records        |         | none (other replicas do); |
|                     | (api/files/resumable.py)           |         | it catches its own errors |

`restart`: started again after a pause (doubling); the third death within a minute takes the
process down. Taking it down: the other tasks are cancelled, /readyz answers 503, and the
process's fatal handler runs (api/tasks.py `on_fatal`: `sshapi serve` stops serving gracefully and
exits with status 70, so that its supervisor, systemd or the orchestrator starts it again with a
clean state; an app run by a test stays up, not ready).

Short-lived tasks belong to the service that starts them, in a `TaskSet` (api/tasks.py) that it
cancels and awaits when it closes, each failure logged:

| task                       | owner                                                           |
|----------------------------|-----------------------------------------------------------------|
| `job-<id>`, `batch-<id>`   | api/jobs/runner.py `Runner`: closed after the grace             |
| a job's command and marker | awaited by the job's runner task                                |
| `cancel-<id>`              | api/jobs/cancel.py `Cancels`                                    |
| `account-lookup-<account>` | api/accounts.py `AccountLookups`: closed after the job service  |
| `resolve-<id>`             | api/jobs/batch.py `BatchJobs`                                   |
| `pub-<id>`, `live-<id>`    | api/live/hub.py `LiveHub`                                       |
| request-scoped tasks       | the request that starts them (api/routes/files.py, api/files/)  |
| `handle-<id>`              | a stream read with a job handle (api/handles.py `watching`)     |
| `store-transaction`        | its caller, through a shield (api/store/shielded.py): the store |
|                            | waits for those a cancelled caller left before it closes        |

Shutdown: not ready (503) first; the trackers, the renewer and the prewarms stopped (the last
started first); the job service closed (batch lookups, the relay's listener and the live feeds,
the running jobs' grace then their kill, the cancels); then the quota, the pool, the HTTP client
and the store (its accepted writes committed, then its writer stopped); the supervisor last.

May import: every part of `api` it builds, `sshpool` by its public names.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import httpx

from api.accounts import AccountLookups
from api.admin import AdminService, NodeDrains, RedisNudge, Revocations
from api.auth import Authenticator, Principal
from api.client import tls_context
from api.config import Config, HostConfig
from api.files import FileService, Resumable
from api.handles import Handles
from api.jobs import BatchJobs, JobService
from api.live import ChangeFeeds, make_relay
from api.metrics import Metrics
from api.node_health import RedisNodeHealth
from api.policy import Policy
from api.problems import Problem
from api.quota import Quota, make_quota
from api.settings import Settings
from api.sshd_budget import RedisBudget, budgets, make_coordinator
from api.store import JobRow, Store, UploadStore
from api.tasks import OnDeath, Supervisor
from api.webhooks.deliver import Deliverer
from api.webhooks.service import WebhookService
from sshpool import Lane, Pool, SSHPoolError

log = logging.getLogger("sshapi")


@dataclass(slots=True)
class Services:
    """The shared objects of one app (api/deps.py hands them to the routes)."""

    settings: Settings
    config: Config
    policy: Policy
    auth: Authenticator
    store: Store
    pool: Pool
    jobs: JobService
    metrics: Metrics
    http: httpx.AsyncClient
    files: FileService
    quota: Quota
    batch: BatchJobs
    revocations: Revocations
    supervisor: Supervisor
    admin: AdminService
    handles: Handles
    changes: ChangeFeeds
    webhooks: WebhookService
    accepting: bool = False

    @property
    def ready(self) -> bool:
        """Started, not stopping, and no background task took the process down."""
        return self.accepting and self.supervisor.healthy


# Who cancels the jobs of a revoked identity (their `error` says so).
REVOKER = Principal(issuer="sshapi", subject="revocation", scopes=frozenset({"admin"}))


async def _cancel_revoked(jobs: JobService, store: Store, row: JobRow) -> bool:
    """Cancel one active job of a revoked identity, here or on its replica: True when it ended
    cancelled (by this cancel, or by its own replica's, which learnt of the revocation too)."""
    try:
        await jobs.cancels.cancel(REVOKER, row)
    except Problem:  # finished meanwhile, or its replica could not be reached
        current = await store.get(row.id)
        return current is not None and current.state == "cancelled"
    return True


def _owner_revoked(revocations: Revocations, owner: tuple[str, str], account: str | None) -> bool:
    """Whether a revocation refuses a webhook's owner: of their identity, or of an account they
    run as (their rule's, or `account`: the claim their token had when they made the webhook)."""
    who = Principal(issuer=owner[0], subject=owner[1], scopes=frozenset(), account=account)
    return revocations.refused(who) is not None


async def _prewarm(pool: Pool, name: str, host: HostConfig) -> None:
    try:
        await pool.prewarm(host.target())
    except SSHPoolError as exc:
        # Not fatal: the host may come up later; jobs then connect on demand.
        log.warning("prewarm of host %s failed: %s", name, exc)


@contextlib.asynccontextmanager
async def running(
    settings: Settings,
    config: Config,
    metrics: Metrics,
    *,
    pool: Pool | None = None,
    store: Store | None = None,
) -> AsyncIterator[Services]:
    """Build and start every long-lived object and background task; close them on exit (see
    the module docstring for both orders)."""
    async with contextlib.AsyncExitStack() as stack:
        settings.secure_data_dir()
        # First in, last out: every long-lived task of the process runs in its group.
        supervisor = Supervisor()
        await supervisor.start()
        stack.push_async_callback(supervisor.close)
        the_store = store or Store(
            settings.resolved_database_url,
            schema=settings.database_schema,
            upgrade=settings.db_upgrade == "auto",
        )
        if store is None:
            await the_store.start(supervisor)
            stack.push_async_callback(the_store.close)
        lost = await the_store.mark_lost(settings.replica)
        if lost:
            log.warning("%d job(s) left active by a previous run are now `lost`", lost)
        http = httpx.AsyncClient(follow_redirects=False, verify=tls_context())
        stack.push_async_callback(http.aclose)
        processes = settings.replicas * settings.workers
        coordinator = make_coordinator(settings.redis_url, processes, settings.replica)
        if isinstance(coordinator, RedisBudget):
            # Its leases are given back once the pool is closed (the pool's connections count
            # until then), after its two tasks have ended: its Redis clients are closed there,
            # and a listener still subscribed on one of them then hung the shutdown (redis-py
            # waits on its connection's lock after the cancel; seen in a whole test run).
            budget_tasks = (
                supervisor.spawn("sshd-budget", coordinator.loop, OnDeath.RESTART),
                supervisor.spawn("sshd-budget-nudge", coordinator.listen, OnDeath.RESTART),
            )
            stack.push_async_callback(coordinator.close)
            stack.push_async_callback(supervisor.stop, *budget_tasks)
        health = (
            RedisNodeHealth(settings.redis_url, settings.replica) if settings.redis_url else None
        )
        if health is not None:
            # Login nodes' health shared with the other processes (api/node_health.py); its
            # tasks end before its Redis clients close (as the budget's, above).
            health_tasks = (
                supervisor.spawn("node-health", health.loop, OnDeath.RESTART),
                supervisor.spawn("node-health-nudge", health.listen, OnDeath.RESTART),
            )
            stack.push_async_callback(health.close)
            stack.push_async_callback(supervisor.stop, *health_tasks)
        lane = None
        if pool is None and config.api.transfer_lane:
            # Stopped after the pool is closed (its lane connections close on its thread).
            lane = Lane(config.api.transfer_lane_slots).start()
            stack.callback(lane.stop)
        the_pool = pool or Pool(
            backend=settings.backend, coordinator=coordinator, health=health, lane=lane
        )
        if pool is None:
            stack.push_async_callback(the_pool.close)
        policy = Policy(config)
        quota = make_quota(settings.redis_url)
        stack.push_async_callback(quota.close)
        batch = BatchJobs(config, policy, the_store, the_pool, metrics, quota)
        # The relay is closed by the job service's live feeds (api/live/hub.py `LiveHub.close`).
        relay = make_relay(settings.redis_url, settings.replica)
        lookups = AccountLookups(the_pool)
        stack.push_async_callback(lookups.close)
        jobs = JobService(
            config,
            policy,
            the_store,
            the_pool,
            metrics,
            settings.replica,
            batch,
            lookups,
            quota,
            relay,
        )
        stack.push_async_callback(jobs.close, settings.shutdown_grace)
        files = FileService(config, policy, the_pool, quota, metrics, lookups)
        resumable = files.resumable = Resumable(
            files, UploadStore(the_store.transactions), config.api
        )
        for name, host in config.hosts.items():
            # Every worker of every replica has its own pool: the host sees all of them, unless
            # they share each sshd's budget through Redis (api/sshd_budget.py). Counted over the
            # host's sshd: every account the policy maps to it, under any name.
            accounts = len(policy.sshd_targets(name))
            shared = budgets(settings.redis_url, processes, host.limits.max_handshakes)
            for problem in host.ssh_budget(shared, accounts):
                log.warning("SSH budget of host %s: %s", name, problem)

        def pools_by_host() -> dict[str, list[dict[str, Any]]]:
            stats = the_pool.stats()
            return {n: policy.pools(n, stats) for n in config.hosts}

        def sshds_by_host() -> dict[str, list[dict[str, Any]]]:
            sshds = the_pool.sshd_stats()
            return {
                name: [sshds[key] for key in sorted({p["sshd"] for p in pools}) if key in sshds]
                for name, pools in pools_by_host().items()
            }

        def nodes_by_host() -> dict[str, dict[str, dict[str, Any]]]:
            return {
                n: the_pool.nodes(host.target()) for n, host in config.hosts.items() if host.nodes
            }

        def durations_by_host() -> dict[str, list[dict[str, Any]]]:
            durations = the_pool.durations()
            return {n: policy.pools(n, durations) for n in config.hosts}

        metrics.watch_pool(pools_by_host, nodes_by_host, durations_by_host)
        metrics.watch_sshds(sshds_by_host)
        release = version("sshapi")
        metrics.watch_service(settings.replica, release, the_store.write_stats, jobs.live.stats)
        metrics.watch_trackers(lambda: batch.trackers)
        changes = ChangeFeeds(
            the_store,
            quota,
            cap=config.api.max_change_feeds,
            keepalive=config.api.change_keepalive,
            window=config.api.change_window,
            replica=settings.replica,
            shared=processes > 1 or settings.database_url is not None,
            redis_url=settings.redis_url,
        )
        stack.push_async_callback(changes.close)
        the_store.on_change = changes.changed

        def wake_followers() -> None:
            jobs.live.wake_all()
            changes.wake_all()

        nudge = RedisNudge(settings.redis_url) if settings.redis_url else None
        if nudge is not None:
            stack.push_async_callback(nudge.close)
        revocations = Revocations(
            the_store,
            the_pool,
            policy,
            functools.partial(_cancel_revoked, jobs, the_store),
            wake_followers,
            settings.replica,
            nudge,
        )
        await revocations.refresh()
        # Nothing admitted before a revocation starts after it (the pool asks before each start).
        the_pool.admit = revocations.admits
        await batch.start(settings.replica)
        jobs.start(supervisor)
        for host in config.hosts.values():
            if host.nodes:
                # A node's health is judged over the host's own account, never a researcher's.
                the_pool.probe_with(host.target())
        drains = NodeDrains(config, the_store, the_pool)
        await drains.refresh()  # a drain survives the restart before any job is taken
        tasks = [
            supervisor.spawn(task_name, loop, OnDeath.RESTART)
            for task_name, loop in {
                **batch.loops(),
                **changes.loops(),
                "revocations": revocations.loop,
            }.items()
        ]
        if nudge is not None:
            listen = functools.partial(nudge.listen, revocations.heard)
            tasks.append(supervisor.spawn("revocations-nudge", listen, OnDeath.RESTART))
        if any(host.nodes for host in config.hosts.values()):
            tasks.append(supervisor.spawn("node-drains", drains.loop, OnDeath.RESTART))
        for name, host in config.hosts.items():
            if host.limits.min_connections > 0:
                prewarm = functools.partial(_prewarm, the_pool, name, host)
                tasks.append(supervisor.spawn(f"prewarm-{name}", prewarm, OnDeath.ONCE))
        # Webhook deliveries: state changes of any replica, this one's woken at once.
        details = not config.api.host_details_require_admin
        deliverer = Deliverer(
            the_store,
            config.webhooks,
            settings.replica,
            details=details,
            revoked=functools.partial(_owner_revoked, revocations),
            rule_allows=policy.webhook_url_allowed,
        )
        stack.push_async_callback(deliverer.close)
        tasks.append(supervisor.spawn("webhooks", deliverer.loop, OnDeath.RESTART))
        tasks.append(supervisor.spawn("upload-expiry", resumable.loop, OnDeath.RESTART))
        # Stopped before the job service closes (the trackers write to the store it uses).
        stack.push_async_callback(supervisor.stop, *tasks)
        services = Services(
            settings=settings,
            config=config,
            policy=policy,
            auth=Authenticator(config.issuers, settings.hs256_secret, http),
            store=the_store,
            pool=the_pool,
            jobs=jobs,
            metrics=metrics,
            http=http,
            files=files,
            quota=quota,
            batch=batch,
            revocations=revocations,
            supervisor=supervisor,
            admin=AdminService(config, policy, the_store, the_pool, revocations, drains),
            handles=Handles(config, policy, the_store),
            changes=changes,
            webhooks=WebhookService(deliverer.hooks, config.webhooks, policy.webhook_url_allowed),
            accepting=True,
        )
        try:
            yield services
        finally:
            services.accepting = False
