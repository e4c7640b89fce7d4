"""The webhook outbox in the job store, on SQLite and PostgreSQL: a state change queues its
deliveries in its own transaction (only for the owner's webhooks subscribed to it, and only when
the state really changed); `mark_lost` queues `job.lost`; a claim is one replica's; `db prune`
drops the deliveries made but keeps the pending ones."""

from __future__ import annotations

import time
from datetime import timedelta

from test_api_store import job

from api.store import Store, Webhook, WebhookStore, new_id, prune, utcnow


def hook(sub: str, events: list[str]) -> Webhook:
    return Webhook(
        id=new_id(),
        owner_iss="iss",
        owner_sub=sub,
        url="https://example.org/hook",
        events=events,
        secret="whsec_AAAA",
        created_at=utcnow(),
    )


async def test_a_state_change_queues_the_owners_subscribed_deliveries_once(store: Store) -> None:
    hooks = WebhookStore(store.transactions)
    finals = hook("alice", ["job.succeeded", "job.failed"])
    running = hook("alice", ["job.running"])
    bobs = hook("bob", ["job.succeeded"])
    for h in (finals, running, bobs):
        assert await hooks.create(h, limit=10)
    assert not await hooks.create(hook("alice", ["job.lost"]), limit=2)  # the cap
    row = await store.insert(job())
    assert await store.update(row.id, only_active=True, state="running")
    # A batch job's scheduler state changing within `running` writes the state again: no event.
    assert await store.update(row.id, only_active=True, state="running", scheduler_reason="x")
    assert await store.update(row.id, only_active=True, state="succeeded")
    # A late writer that changes nothing queues nothing.
    assert not await store.update(row.id, only_active=True, state="failed")
    now = time.time() + 1
    due = await hooks.due(now, 100)
    assert len(due) == 2 and {owner for _, _, owner in due} == {"alice"}
    first = await hooks.claim([d for d, _, _ in due], now, 30, "a")
    assert sorted(d.type for d in first) == ["job.running", "job.succeeded"]
    assert {d.webhook_id for d in first} == {running.id, finals.id}
    # Another replica claiming the same rows meanwhile gets none of them.
    assert await hooks.claim([d for d, _, _ in due], now, 30, "b") == []
    for d in first:
        recorded = await hooks.record(
            d, "a", status="delivered", now=now, next_at=now, http_status=204, error=None
        )
        assert recorded
    [shown] = await hooks.of(("iss", "alice"), finals.id)
    assert (shown.delivered, shown.pending, shown.last_status) == (1, 0, 204)
    # A restart's `lost` is an event too; pending deliveries survive `db prune`, made ones not.
    lost = await store.insert(job(replica="r9", state="running"))
    assert await store.mark_lost("r9") == 1
    assert await hooks.create(hook("alice", ["job.lost"]), limit=10) is True
    assert len(await hooks.due(time.time() + 1, 100)) == 0  # subscribed after the change
    later = await store.insert(job(replica="r9", state="running"))
    assert await store.mark_lost("r9") == 1
    [pending] = await hooks.due(time.time() + 1, 100)
    assert await store.get(lost.id) is not None
    await prune(store.url, store.schema, utcnow() + timedelta(days=1))
    assert await hooks.due(time.time() + 1, 100) == [pending]
    [claimed] = await hooks.claim([pending[0]], time.time() + 1, 30, "a")
    assert (claimed.job_id, claimed.type) == (later.id, "job.lost")
