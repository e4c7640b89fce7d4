"""Login-node clusters (issue 30): the node a command ran on, and the nodes operators drained.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sshapi_jobs", sa.Column("node", sa.String(255), nullable=True))
    op.create_table(
        "sshapi_node_drains",
        sa.Column("host", sa.String(64), primary_key=True),
        sa.Column("node", sa.String(255), primary_key=True),
        sa.Column("drained_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("drained_by_iss", sa.String(512), nullable=False),
        sa.Column("drained_by_sub", sa.String(512), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("sshapi_node_drains")
    with op.batch_alter_table("sshapi_jobs") as batch:
        batch.drop_column("node")
