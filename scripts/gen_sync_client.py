"""Generate the sync client (api/client/_sync.py) from the async one (api/client/_async.py), as
httpcore does: unasync's token rules, then ruff's import order and format with the project's
settings. `make unasync` writes it; `--check` only says whether the committed file is current
(tests/test_unasync.py runs the same comparison).

    python scripts/gen_sync_client.py [--check]
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import unasync

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "api" / "client" / "_async.py"
TARGET = ROOT / "api" / "client" / "_sync.py"
# On top of unasync's own (async/await removed, __aenter__ -> __enter__, AsyncIterator ->
# Iterator, any AsyncX -> SyncX such as localfile's AsyncFile -> SyncFile).
REPLACEMENTS = {
    "AsyncClient": "Client",  # ours, and httpx's
    "AsyncBaseTransport": "BaseTransport",
    "aclose": "close",
    "aread": "read",
    "aiter_bytes": "iter_bytes",
    "aiter_lines": "iter_lines",
    "anext": "next",
    "asyncio": "time",  # `from asyncio import sleep`, the source's only use of asyncio
}
HEADER = (
    '"""GENERATED from _async.py by scripts/gen_sync_client.py (`make unasync`): edit _async.py,\n'
    'never this file. `Client`, the synchronous client."""'
)


def ruff(*args: str, text: str) -> str:
    """`text` through a ruff command reading stdin, as if it were the target file (the
    project's settings apply)."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(TARGET), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return done.stdout


def generate() -> str:
    """The sync module's text, generated in a temporary directory."""
    with tempfile.TemporaryDirectory() as tmp:
        source_dir, sync_dir = Path(tmp, "async"), Path(tmp, "sync")
        source_dir.mkdir()
        shutil.copyfile(SOURCE, source_dir / SOURCE.name)
        rule = unasync.Rule(str(source_dir), str(sync_dir), additional_replacements=REPLACEMENTS)
        unasync.unasync_files([str(source_dir / SOURCE.name)], [rule])
        text = (sync_dir / SOURCE.name).read_text()
    # The source's docstring explains the generation; the generated file says what it is.
    assert text.startswith('"""'), "the source starts with its docstring"
    text = HEADER + text[text.index('"""', 3) + 3 :]
    text = ruff("check", "--fix", "--quiet", "--select", "I,F401", text=text)
    return ruff("format", "--quiet", text=text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args()
    text = generate()
    if not args.check:
        TARGET.write_text(text)
        return 0
    current = TARGET.read_text()
    if current == text:
        return 0
    diff = difflib.unified_diff(
        current.splitlines(keepends=True),
        text.splitlines(keepends=True),
        "api/client/_sync.py (committed)",
        "api/client/_sync.py (generated)",
    )
    sys.stdout.writelines(diff)
    print("api/client/_sync.py is not what _async.py generates: run `make unasync`")
    return 1


if __name__ == "__main__":
    sys.exit(main())
