"""OpenSSH 10.0's sshd beside the system's, for the tests that need a newer sshd's defaults
(``PerSourcePenalties``, on by default since 9.8; Debian 12's sshd is 9.2).

``python -m sshpool.devhost.openssh fetch --dir DIR`` (``make openssh10``) downloads Debian's
``openssh-server`` package of bookworm-backports with ``apt-get download`` and unpacks it with
``dpkg-deb -x`` into ``DIR/root``. Nothing is installed: apt-get runs with a sources list, package
lists and cache of its own under ``DIR`` (``-o Dir::Etc::sourcelist=...``), so the system's apt
state and its sshd stay as they are, and no root is needed (nor sudo). A second run finds the
unpacked sshd and does nothing.

The package's sshd runs from there: ``LocalHost(sshd=str(fetch(DIR)))``. Since 9.8 sshd runs
each connection in a separate program (``sshd-session``; since 10.0 also ``sshd-auth``), found
at a path compiled in (``/usr/lib/openssh/``), where the system's older sshd has none: the
LocalHost points ``SshdSessionPath`` and ``SshdAuthPath`` at the unpacked ones. Its libraries
are Debian 12's (the package is built for bookworm).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SOURCE = "deb http://deb.debian.org/debian bookworm-backports main"
PACKAGE = "openssh-server/bookworm-backports"
TIMEOUT = 300.0


class OpenSSHUnavailable(RuntimeError):
    """The newer sshd cannot be had here (no apt-get or dpkg-deb, no network): the message says
    why, in words a skipped test can show."""


def sshd_path(directory: Path) -> Path:
    """Where the unpacked sshd lives under ``directory``."""
    return directory / "root" / "usr" / "sbin" / "sshd"


def _apt_options(directory: Path) -> list[str]:
    options = {
        "Dir::Etc::sourcelist": directory / "sources.list",
        "Dir::Etc::sourceparts": "-",
        "Dir::State::Lists": directory / "lists",
        "Dir::Cache": directory / "cache",
        # Root's apt would drop to _apt for downloads, which cannot write into our directory.
        "APT::Sandbox::User": "root" if os.geteuid() == 0 else "",
    }
    argv: list[str] = []
    for name, value in options.items():
        if value != "":
            argv += ["-o", f"{name}={value}"]
    return argv


def _run(argv: list[str], cwd: Path) -> None:
    try:
        done = subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OpenSSHUnavailable(f"{argv[0]} {argv[-1]}: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise OpenSSHUnavailable(f"{' '.join(argv[:1] + argv[-2:])} failed: {' | '.join(tail)}")


def fetch(directory: Path, *, apt_get: str = "apt-get", dpkg_deb: str = "dpkg-deb") -> Path:
    """The unpacked sshd under ``directory``, downloaded and unpacked when missing. Raises
    OpenSSHUnavailable when that cannot be done."""
    sshd = sshd_path(directory)
    if sshd.exists():
        return sshd
    tools = {name: shutil.which(name) for name in (apt_get, dpkg_deb)}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        raise OpenSSHUnavailable(f"{' and '.join(missing)} not found (not a Debian system?)")
    # Readable by all: the LocalHost's sshd runs as its own account and must reach its programs.
    for sub in ("", "lists/partial", "cache/archives/partial", "debs"):
        (directory / sub).mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(directory, 0o755)
    (directory / "sources.list").write_text(SOURCE + "\n")
    options = _apt_options(directory)
    _run([apt_get, "-q", *options, "update"], directory)
    debs = directory / "debs"
    for stale in debs.glob("*.deb"):
        stale.unlink()
    _run([apt_get, "-q", *options, "download", PACKAGE], debs)
    found = sorted(debs.glob("openssh-server_*.deb"))
    if not found:
        raise OpenSSHUnavailable("apt-get download left no openssh-server package")
    staging = directory / "root.partial"
    shutil.rmtree(staging, ignore_errors=True)
    _run([dpkg_deb, "-x", str(found[-1]), str(staging)], directory)
    # Moved into place last: a run cut short leaves no sshd that looks ready.
    shutil.rmtree(directory / "root", ignore_errors=True)
    staging.rename(directory / "root")
    return sshd


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sshpool.devhost.openssh",
        description="Fetch OpenSSH 10.0's sshd (Debian bookworm-backports) into a directory.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="download and unpack it (nothing when already there)")
    get.add_argument("--dir", type=Path, required=True, help="where to keep it")
    get.add_argument("--apt", default="apt-get", help="the apt-get program")
    get.add_argument("--dpkg-deb", default="dpkg-deb", help="the dpkg-deb program")
    args = parser.parse_args(argv)
    try:
        sshd = fetch(args.dir.absolute(), apt_get=args.apt, dpkg_deb=args.dpkg_deb)
    except OpenSSHUnavailable as exc:
        # Not an error of the build: the tests that need it skip and say this.
        print(f"OpenSSH 10.0 not fetched: {exc}", file=sys.stderr)
        return 0
    print(sshd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
