"""The sync client is generated from the async one (issue 27): api/client/_sync.py must be what
scripts/gen_sync_client.py makes of api/client/_async.py today, so that nobody edits the
generated half by hand and no change to the source is left out of it."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("source", ["_async.py", "_async_files.py"])
def test_the_committed_sync_client_is_generated_from_the_async_one(source: str) -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_sync_client", ROOT / "scripts" / "gen_sync_client.py"
    )
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    path = ROOT / "api" / "client" / source
    generated = generator.generate(path)
    target = generator.MODULES[path]
    committed = target.read_text()
    diff = "".join(
        difflib.unified_diff(
            committed.splitlines(keepends=True),
            generated.splitlines(keepends=True),
            "committed",
            "generated",
        )
    )
    assert diff == "", f"{target.name} differs from what `make unasync` makes:\n{diff}"
