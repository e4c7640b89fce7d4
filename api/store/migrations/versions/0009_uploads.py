"""Resumable uploads: their state kept in the store, so that any replica takes the next chunk
(issue 41, item 3).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sshapi_uploads",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("owner_iss", sa.String(512), nullable=False),
        sa.Column("owner_sub", sa.String(512), nullable=False),
        sa.Column("owner_account", sa.String(64), nullable=True),
        sa.Column("host", sa.String(64), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("resolved", sa.Text(), nullable=False),
        sa.Column("temp", sa.Text(), nullable=False),
        sa.Column("length", sa.BigInteger(), nullable=False),
        sa.Column("received", sa.BigInteger(), nullable=False),
        sa.Column("if_match", sa.Text(), nullable=True),
        sa.Column("create_only", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("busy_until", sa.Float(), nullable=True),
        sa.Column("busy_by", sa.String(36), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=True),
        sa.Column("etag", sa.String(64), nullable=True),
        sa.Column("replaced", sa.Boolean(), nullable=True),
    )
    op.create_index("sshapi_uploads_owner", "sshapi_uploads", ["owner_iss", "owner_sub"])
    op.create_index("sshapi_uploads_expiry", "sshapi_uploads", ["expires_at"])


def downgrade() -> None:
    op.drop_index("sshapi_uploads_expiry", "sshapi_uploads")
    op.drop_index("sshapi_uploads_owner", "sshapi_uploads")
    op.drop_table("sshapi_uploads")
