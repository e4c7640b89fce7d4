"""Revocations: identities and accounts refused at once on every replica (issue 28).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sshapi_revocations",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("issuer", sa.String(512), nullable=True),
        sa.Column("subject", sa.String(512), nullable=True),
        sa.Column("account", sa.String(64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by_iss", sa.String(512), nullable=False),
        sa.Column("created_by_sub", sa.String(512), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("sshapi_revocations")
