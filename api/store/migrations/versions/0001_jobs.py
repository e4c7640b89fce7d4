"""The jobs table as release 0.1.0 (63c127d) created it, and the adoption of a database that
release or an earlier one wrote.

Until then the store had no migrations: it ran `create_all` and added any missing column (all
nullable) on start. A database without Alembic's version table is adopted here: the table is
created if absent, else its missing columns and indexes are added as that code did, so every
database written so far reaches this revision with its jobs. The definition is written out, not
imported, so later revisions cannot change what this one means.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TABLE = "sshapi_jobs"
INDEXES = {
    "sshapi_jobs_owner": ["owner_iss", "owner_sub", "id"],
    "sshapi_jobs_replica_state": ["replica", "state"],
}


def _columns() -> list[sa.Column[object]]:
    return [
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("owner_iss", sa.String(512), nullable=False),
        sa.Column("owner_sub", sa.String(512), nullable=False),
        sa.Column("replica", sa.String(255), nullable=False),
        sa.Column("host", sa.String(64), nullable=False),
        sa.Column("target", sa.String(512), nullable=False),
        sa.Column("argv", sa.JSON, nullable=True),
        sa.Column("command", sa.Text, nullable=True),
        sa.Column("template", sa.String(64), nullable=True),
        sa.Column("params", sa.JSON, nullable=True),
        sa.Column("timeout", sa.Float, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("error_kind", sa.String(64), nullable=True),
        sa.Column("exit_status", sa.Integer, nullable=True),
        sa.Column("exit_signal", sa.String(32), nullable=True),
        sa.Column("stdout", sa.LargeBinary, nullable=False),
        sa.Column("stderr", sa.LargeBinary, nullable=False),
        sa.Column("stdout_bytes", sa.Integer, nullable=False),
        sa.Column("stderr_bytes", sa.Integer, nullable=False),
        sa.Column("stdout_truncated", sa.Boolean, nullable=False),
        sa.Column("stderr_truncated", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("timings", sa.JSON, nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("request_hash", sa.String(64), nullable=True),
        sa.Column("kind", sa.String(16), nullable=True),
        sa.Column("batch", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("scheduler_job_id", sa.String(32), nullable=True),
        sa.Column("scheduler_state", sa.String(64), nullable=True),
        sa.Column("scheduler_reason", sa.Text, nullable=True),
        sa.Column("pgid", sa.Integer, nullable=True),
        sa.Column("cancel_requested", sa.Text, nullable=True),
    ]


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    if not inspector.has_table(TABLE):
        op.create_table(
            TABLE,
            *_columns(),
            sa.UniqueConstraint(
                "owner_iss", "owner_sub", "idempotency_key", name="sshapi_jobs_idem"
            ),
        )
        for name, columns in INDEXES.items():
            op.create_index(name, TABLE, columns)
        return
    # Adopt a table an earlier release made. Columns are added nullable, as that release's start
    # added them: a NOT NULL column cannot be added to a table with rows and no default.
    present = {c["name"] for c in inspector.get_columns(TABLE)}
    for column in _columns():
        if column.name not in present:
            op.add_column(TABLE, sa.Column(column.name, column.type, nullable=True))
    indexed = {i["name"] for i in inspector.get_indexes(TABLE)}
    for name, columns in INDEXES.items():
        if name not in indexed:
            op.create_index(name, TABLE, columns)


def downgrade() -> None:
    op.drop_table(TABLE)
