"""Alembic's environment: migrations always run on the connection api/store/migrate.py opened
(inside its transaction and lock), never on a URL of Alembic's own."""

from __future__ import annotations

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, transactional_ddl=True)
with context.begin_transaction():
    context.run_migrations()
