"""The job store: SQLAlchemy 2 async over SQLite (WAL, the default) or PostgreSQL (by URL).

Exports `Store` (the one face the service uses), the row record `JobRow`, the table `JOBS`
(for the few Core expressions callers pass to `Store.update`) and the value helpers `new_id`,
`utcnow` and `aware`, `migrate` (what `sshapi db upgrade` runs) and `prune` (`sshapi db
prune`). May import `api.states` and `api.tasks` (the supervisor its writer runs under) and
nothing else of `api`.

Modules: `schema` (the table and the record), `store` (reads, the write queue), `sqlite` and
`postgres` (each dialect's writer), `migrate` (the schema's Alembic migrations), `outbox` (the
webhook deliveries a state change queues in its own transaction), `webhooks` (the webhooks and
their outbox, for api/webhooks/), `uploads` (resumable uploads' state, for api/files/),
`shielded` (the writes outside the job writer, whole whatever happens to their caller),
`retention` (`prune`).
"""

from api.store import migrate
from api.store.portals import JobEvent
from api.store.retention import prune
from api.store.schema import JOBS, JobHandle, JobRow, Revocation, aware, new_id, utcnow
from api.store.store import Store
from api.store.uploads import UploadRow, UploadStore
from api.store.webhooks import Delivery, Webhook, WebhookStore

__all__ = [
    "JOBS",
    "Delivery",
    "JobEvent",
    "JobHandle",
    "JobRow",
    "Revocation",
    "Store",
    "UploadRow",
    "UploadStore",
    "Webhook",
    "WebhookStore",
    "aware",
    "migrate",
    "new_id",
    "prune",
    "utcnow",
]
