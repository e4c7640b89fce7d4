"""Checksums computed on the host (sha256sum), not by downloading: the remote script and its
reading."""

from __future__ import annotations

import re

from api.config import ApiConfig
from api.files.errors import file_problem
from api.policy import Grant
from api.problems import Problem
from sshpool import CommandTimeout, Pool, SSHPoolError

# The checksum's remote script ($1: the resolved, confined path). The file is opened once, onto
# stdin, and hashed from there, so what is hashed is what was checked: a regular file, still
# named by the path (not a symlink, same device and inode), else exit NOT_A_FILE. Checked
# before the open too, because opening a FIFO blocks until a writer comes (sh has no
# O_NONBLOCK): only a swap within the microseconds between that check and the open still
# blocks, and then until the checksum's own timeout. sha256sum reading stdin prints `-` for a
# name: names with a newline or a backslash (which it escapes) need no parsing. One line and no
# `!`: a csh-family login shell takes it as it is (sshpool's command_line re-encodes others).
NOT_A_FILE = 65
CHECKSUM = "; ".join(
    [
        f'[ -h "$1" ] && exit {NOT_A_FILE}',
        f'[ -f "$1" ] || exit {NOT_A_FILE}',
        'exec <"$1"',
        f'[ -h "$1" ] && exit {NOT_A_FILE}',
        f'[ -f /dev/stdin ] && [ /dev/stdin -ef "$1" ] || exit {NOT_A_FILE}',
        "exec sha256sum",
    ]
)


def timeout_for(api: ApiConfig, grant: Grant, size: int) -> float:
    """The checksum's limit for a file of `size` bytes: the base, plus the time at the slowest
    rate allowed, within the caps."""
    scaled = api.checksum_timeout + size / api.checksum_min_rate
    return min(scaled, api.checksum_max_timeout, grant.rule.max_timeout)


async def compute(
    pool: Pool,
    grant: Grant,
    host: str,
    given: str,
    path: str,
    *,
    timeout: float,
    acquire_timeout: float,
    tenant: tuple[str, str],
) -> str:
    """The sha256 of the file at `path` (resolved and confined), as hex digits."""
    try:
        result = await pool.run(
            grant.target,
            ["sh", "-c", CHECKSUM, "sh", path],
            timeout=timeout,
            acquire_timeout=acquire_timeout,
            max_output=4096,
            tenant=tenant,
        )
    except CommandTimeout:
        raise Problem(
            504,
            "checksum-timeout",
            "The checksum took too long",
            f"stopped after {timeout:g} s (the limit for a file of this size)",
        ) from None
    except SSHPoolError as exc:
        raise file_problem(exc, host) from exc
    if result.exit_status == NOT_A_FILE:
        raise Problem(409, "not-a-file", "Not a regular file", f"{given!r} changed meanwhile")
    digest = result.stdout[:64].decode("ascii", "replace")
    if result.exit_status != 0 or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise Problem(502, "checksum-failed", "The host could not compute the checksum", None)
    return digest
