"""Webhooks and their delivery outbox (issue 43).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sshapi_webhooks",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("owner_iss", sa.String(512), nullable=False),
        sa.Column("owner_sub", sa.String(512), nullable=False),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("events", sa.String(512), nullable=False),
        sa.Column("secret", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_attempt_at", sa.Float(), nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.String(512), nullable=True),
        sa.Column("delivered", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
    )
    op.create_index("sshapi_webhooks_owner", "sshapi_webhooks", ["owner_iss", "owner_sub"])
    op.create_table(
        "sshapi_webhook_deliveries",
        sa.Column("id", sa.String(80), primary_key=True),
        sa.Column("event_id", sa.String(36), nullable=False),
        sa.Column("webhook_id", sa.String(36), nullable=False),
        sa.Column("owner_iss", sa.String(512), nullable=False),
        sa.Column("owner_sub", sa.String(512), nullable=False),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("next_at", sa.Float(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("lease_until", sa.Float(), nullable=True),
        sa.Column("lease_by", sa.String(255), nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.String(512), nullable=True),
    )
    op.create_index(
        "sshapi_webhook_deliveries_due", "sshapi_webhook_deliveries", ["status", "next_at"]
    )
    op.create_index(
        "sshapi_webhook_deliveries_webhook", "sshapi_webhook_deliveries", ["webhook_id"]
    )


def downgrade() -> None:
    op.drop_table("sshapi_webhook_deliveries")
    op.drop_table("sshapi_webhooks")
