"""`pip install ARGS` with a progress line: what the Makefile's install stamps run, so that a first
`make run` (about 20 s of installing) does not sit silent. pip's own `-q` prints nothing until the
end and its plain output is some 150 lines; this prints one line that counts the packages as pip
fetches them (rewritten in place on a terminal, one line per tenth package in a log), then pip's
last words. pip's exit status is this program's; on failure its whole output is printed.

    python scripts/pip_progress.py LABEL -- -e '.[server]'
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator

COLLECTING = re.compile(r"^\s*(?:Collecting|Obtaining|Processing) (\S+)")
INSTALLING = re.compile(r"^\s*Installing collected packages: (.*)")


def progress(lines: Iterable[str], label: str, tty: bool, every: int = 10) -> Iterator[str]:
    """The progress lines for pip's output `lines`. On a terminal (`tty`), the counting line at
    every package, to be rewritten in place (it starts with a carriage return); in a log, at every
    `every`-th. Then the line that says how many it installs, which stays."""
    fetched = 0
    rewrite = "\r\033[K" if tty else ""  # back to the line's start, and clear it
    for line in lines:
        if m := COLLECTING.match(line):
            fetched += 1
            # "fastapi>=0.110", "uvicorn[standard]", or a wheel's path (pip's find-links)
            name = re.split(r"[<>=!~\[ ;]", m.group(1).rsplit("/", 1)[-1], maxsplit=1)[0]
            name = name.split("-", 1)[0] if name.endswith(".whl") else name
            text = f"{label}: {fetched} packages fetched ({name})"
            if tty:
                yield f"{rewrite}{text}"
            elif fetched % every == 0:
                yield f"{text}\n"
        elif m := INSTALLING.match(line):
            count = len(m.group(1).split(","))
            yield f"{rewrite}{label}: {fetched} fetched, installing {count}\n"


def main(argv: list[str]) -> int:
    label, sep, *pip_args = argv
    if sep != "--":
        raise SystemExit("usage: pip_progress.py LABEL -- PIP_INSTALL_ARGS...")
    started = time.monotonic()
    tty = sys.stdout.isatty()
    command = [sys.executable, "-m", "pip", "install", "--progress-bar", "off", *pip_args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen: list[str] = []

    def lines() -> Iterator[str]:
        for line in proc.stdout:  # type: ignore[union-attr]  # checked above
            seen.append(line)
            yield line

    last = "\n"
    for last in progress(lines(), label, tty):
        sys.stdout.write(last)
        sys.stdout.flush()
    status = proc.wait()
    if not last.endswith("\n"):
        print()
    if status:
        sys.stdout.write("".join(seen))
        print(f"{label}: pip failed (exit {status})", flush=True)
        return status
    print(f"{label}: done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
