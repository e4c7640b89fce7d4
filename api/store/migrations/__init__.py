"""Alembic's environment and the job store's revisions (`versions/`), run by migrate.py."""
