"""Jobs: the traceparent of the job's span when it was traced (issue 42).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sshapi_jobs", sa.Column("traceparent", sa.String(55), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sshapi_jobs") as batch:
        batch.drop_column("traceparent")
