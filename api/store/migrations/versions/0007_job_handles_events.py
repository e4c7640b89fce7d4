"""Job handles and the job event log (issue 43: portals without polling).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sshapi_job_events",
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("owner_iss", sa.String(512), nullable=False),
        sa.Column("owner_sub", sa.String(512), nullable=False),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "sshapi_job_events_owner", "sshapi_job_events", ["owner_iss", "owner_sub", "seq"]
    )
    op.create_index("sshapi_job_events_at", "sshapi_job_events", ["at"])
    op.create_table(
        "sshapi_job_handles",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False, unique=True),
        sa.Column("owner_iss", sa.String(512), nullable=False),
        sa.Column("owner_sub", sa.String(512), nullable=False),
        sa.Column("owner_account", sa.String(64), nullable=True),
        sa.Column("cancel", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("sshapi_job_handles_job", "sshapi_job_handles", ["job_id"])


def downgrade() -> None:
    op.drop_table("sshapi_job_handles")
    op.drop_table("sshapi_job_events")
