"""Generate the sync client (api/client/_sync.py, _sync_files.py) from the async one
(api/client/_async.py, _async_files.py), as httpcore does: unasync's token rules, then ruff's
import order and format with the project's settings. `make unasync` writes them; `--check` only
says whether the committed files are current (tests/test_unasync.py runs the same comparison).

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
CLIENT = ROOT / "api" / "client"
# Each async module and the sync one generated from it.
MODULES = {
    CLIENT / "_async.py": CLIENT / "_sync.py",
    CLIENT / "_async_files.py": CLIENT / "_sync_files.py",
}
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
    "_async_files": "_sync_files",  # _async.py imports AsyncFiles from it
}
HEADER = (
    '"""GENERATED from {source} by scripts/gen_sync_client.py (`make unasync`):\n'
    'edit {source}, never this file. {what}"""'
)
WHAT = {"_async.py": "`Client`, the synchronous client.", "_async_files.py": "Its files methods."}


def ruff(target: Path, *args: str, text: str) -> str:
    """`text` through a ruff command reading stdin, as if it were `target` (the project's
    settings apply)."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(target), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return done.stdout


def generate(source: Path = CLIENT / "_async.py") -> str:
    """The text of the sync module generated from `source`, made in a temporary directory."""
    target = MODULES[source]
    with tempfile.TemporaryDirectory() as tmp:
        source_dir, sync_dir = Path(tmp, "async"), Path(tmp, "sync")
        source_dir.mkdir()
        shutil.copyfile(source, source_dir / source.name)
        rule = unasync.Rule(str(source_dir), str(sync_dir), additional_replacements=REPLACEMENTS)
        unasync.unasync_files([str(source_dir / source.name)], [rule])
        text = (sync_dir / source.name).read_text()
    # The source's docstring explains the generation; the generated file says what it is.
    assert text.startswith('"""'), "the source starts with its docstring"
    header = HEADER.format(source=source.name, what=WHAT[source.name])
    text = header + text[text.index('"""', 3) + 3 :]
    text = ruff(target, "check", "--fix", "--quiet", "--select", "I,F401", text=text)
    return ruff(target, "format", "--quiet", text=text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args()
    stale = 0
    for source, target in MODULES.items():
        text = generate(source)
        if not args.check:
            target.write_text(text)
            continue
        current = target.read_text()
        if current == text:
            continue
        name = target.relative_to(ROOT).as_posix()
        diff = difflib.unified_diff(
            current.splitlines(keepends=True),
            text.splitlines(keepends=True),
            f"{name} (committed)",
            f"{name} (generated)",
        )
        sys.stdout.writelines(diff)
        print(f"{name} is not what {source.name} generates: run `make unasync`")
        stale += 1
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
