"""Several API processes without Redis: per-identity limits are counted by each process, and
the start says so (F18 of issue 33)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from api_helpers import make_settings

from api import workers as app_module
from api.config import load_config


def _serve(settings: object, config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` up to the point where it would start processes (stubbed: nothing listens)."""
    monkeypatch.setattr(app_module, "_supervise", lambda settings, config: None)
    monkeypatch.setattr(app_module.uvicorn, "run", lambda *a, **kw: None)
    monkeypatch.setattr(app_module, "create_app", lambda settings, config: None)
    monkeypatch.setattr(app_module, "_freeze_startup_heap", lambda: None)
    app_module.serve(settings, load_config(config_file))  # type: ignore[arg-type]


def test_two_workers_without_redis_warn_that_limits_are_doubled(
    config_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`sshapi serve --workers 2` with no SSHAPI_REDIS_URL: the start warns that an identity
    may get twice each limit and says how to share them; with Redis, or one process, it is
    quiet."""
    base = make_settings(tmp_path, config_file, "sqlite", None)
    with caplog.at_level(logging.WARNING, logger="sshapi"):
        _serve(base.model_copy(update={"workers": 2}), config_file, monkeypatch)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("up to 2 times" in m and "SSHAPI_REDIS_URL" in m for m in said), said
    assert any("max_concurrent" in m and "max_transfers" in m for m in said), said

    caplog.clear()
    shared = base.model_copy(update={"workers": 2, "redis_url": "redis://127.0.0.1:1/0"})
    with caplog.at_level(logging.WARNING, logger="sshapi"):
        _serve(shared, config_file, monkeypatch)
        _serve(base, config_file, monkeypatch)
    assert not [r for r in caplog.records if "per-identity" in r.getMessage()]


def test_replicas_times_workers_is_the_factor(tmp_path: Path, config_file: Path) -> None:
    """Two declared replicas of three workers each: six processes count on their own."""
    settings = make_settings(tmp_path, config_file, "sqlite", None).model_copy(
        update={"workers": 3, "replicas": 2}
    )
    warning = app_module.per_process_limits(settings)
    assert warning is not None and "up to 6 times" in warning
