"""Per-owner caps of the store on SQLite and PostgreSQL: an owner's `max_open_uploads`
(api/store/uploads.py) and `max_webhooks` (api/store/webhooks.py) hold however many creations
race for the last places (`take_turn`, api/store/shielded.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

from test_api_webhook_store import hook

from api.store import Store, UploadStore, WebhookStore

CAP = 3
RACERS = 12


def upload(owner: str, now: float) -> dict[str, object]:
    """An open upload's row (UploadRow's fields), as api/files/resumable.py creates it."""
    upload_id = uuid.uuid4().hex
    return {
        "id": upload_id,
        "owner_iss": "iss",
        "owner_sub": owner,
        "owner_account": None,
        "host": "local",
        "path": f"f-{upload_id}",
        "resolved": f"/home/x/f-{upload_id}",
        "temp": f"/home/x/.f-{upload_id}.part",
        "length": 10,
        "received": 0,
        "if_match": None,
        "create_only": False,
        "state": "open",
        "created_at": now,
        "expires_at": now + 3600,
        "busy_until": None,
        "busy_by": None,
    }


async def test_racing_creations_never_pass_an_owners_cap(store: Store) -> None:
    """Twelve creations of one owner at once, three places: exactly three are created, the
    others refused (a 429 for the caller), none fails; another owner's are not counted."""
    table = UploadStore(store.transactions)
    now = time.time()
    for _ in range(5):  # rounds: a race that passes once in a few must show
        owner = uuid.uuid4().hex
        created = await asyncio.gather(
            *(table.create(upload(owner, now), CAP, now) for _ in range(RACERS))
        )
        assert created.count(True) == CAP, created
    assert await table.create(upload("someone-else", now), CAP, now)


async def test_racing_webhook_creations_never_pass_an_owners_cap(store: Store) -> None:
    """The same race for webhooks: twelve subscriptions of one owner at once, three places."""
    hooks = WebhookStore(store.transactions)
    for _ in range(5):
        owner = uuid.uuid4().hex
        created = await asyncio.gather(
            *(hooks.create(hook(owner, ["job.succeeded"]), CAP) for _ in range(RACERS))
        )
        assert created.count(True) == CAP, created
