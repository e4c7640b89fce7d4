"""A webhook keeps its creator's account claim, so that an account's revocation holds its
deliveries (issue 43).

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sshapi_webhooks", sa.Column("owner_account", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sshapi_webhooks") as batch:
        batch.drop_column("owner_account")
