"""Is the account a token claims a researcher's? Looked up on the host before its first SSH work.

On a certificate host a caller runs as the account their token's claim names (api/policy.py has
already refused a malformed name, the deny list, the host's own account and the ones the policy
maps). What is left is asked of the host itself: `getent passwd NAME`, run over the pool as the
host's own account (`username`), the first time a name is used. Refused, 403
`account-refused` before any certificate is minted for it: a missing account, a uid below the
host's `min_uid` (system accounts: avahi, mysql... whatever the site installed), a `nologin` or
`false` shell. The answer is the same for each reason (a token's claim is no way to learn which
accounts exist), and the host's own output is never in it; the reason goes to the log.

Answers are kept per (host, account): `lookup_ttl` seconds, a missing account's
`lookup_negative_ttl` (it may be created soon), at most MAX_KNOWN of them (least recently used
out). Concurrent requests for one name share one lookup (a task of this process's, shielded:
a caller that goes away does not fail the others). A host runs at most `max_lookups` lookups
at once here; beyond that a request for a name not known is 503 `account-lookups-busy` with
Retry-After, so a flood of made-up names costs the host that many `getent` at a time and the
caller their rate tokens (the lookup comes after them), never a queue of SSH work. An SSH
failure of the lookup is the usual SSH problem (503/502/504) and is not kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from api.policy import Grant, account_refused
from api.problems import Problem, ssh_problem
from api.tasks import TaskSet
from sshpool import Pool, SSHPoolError

log = logging.getLogger("sshapi.accounts")

# How long one `getent passwd` may take (acquiring a channel included): a local file or an
# sssd/LDAP cache answers in milliseconds; a directory that is down must not hold requests.
LOOKUP_TIMEOUT = 10.0
MAX_KNOWN = 10_000
REFUSED_SHELLS = frozenset({"nologin", "false"})
BUSY_RETRY_AFTER = "1"


def refusal(entry: bytes, name: str, min_uid: int) -> str | None:
    """Why the passwd line `entry` (getent's output for `name`) is no researcher's account, or
    None when it is one."""
    fields = entry.decode(errors="replace").partition("\n")[0].split(":")
    if len(fields) != 7 or fields[0] != name or not fields[2].isdigit():
        return "no usable passwd entry"
    if int(fields[2]) < min_uid:
        return f"uid {fields[2]} below min_uid {min_uid}"
    if fields[6].rpartition("/")[2] in REFUSED_SHELLS:
        return f"login shell {fields[6]}"
    return None


class AccountLookups:
    """The claimed accounts this process has looked up (module docstring)."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        # (host, account) -> (why refused or None, monotonic time until which it holds).
        self._known: OrderedDict[tuple[str, str], tuple[str | None, float]] = OrderedDict()
        self._running: dict[tuple[str, str], asyncio.Task[str | None]] = {}
        self._tasks = TaskSet("account-lookup", expected=(Problem,))

    async def check(self, grant: Grant) -> None:
        """Nothing when the grant's account may be logged in as; else 403 `account-refused`
        (or 503 when the host's lookups are all taken, an SSH problem when the lookup fails)."""
        certs = grant.host.certificates
        if not grant.claimed or certs is None:
            return  # an account the configuration names: the operator's choice
        key = (grant.host_name, grant.target.username)
        known = self._known.get(key)
        if known is not None and time.monotonic() < known[1]:
            self._known.move_to_end(key)
            why = known[0]
        else:
            task = self._running.get(key)
            if task is None:
                busy = sum(1 for host, _ in self._running if host == grant.host_name)
                if busy >= certs.max_lookups:
                    raise Problem(
                        503,
                        "account-lookups-busy",
                        "Too many accounts being looked up",
                        f"host {grant.host_name!r}: try again shortly",
                        headers={"Retry-After": BUSY_RETRY_AFTER},
                    )
                task = self._tasks.spawn(self._lookup(grant), f"account-lookup-{key[1]}")
                self._running[key] = task
                task.add_done_callback(lambda _: self._running.pop(key, None))
            # Shielded: a caller that goes away does not stop the lookup the others wait for.
            why = await asyncio.shield(task)
        if why is not None:
            raise account_refused(
                f"the account your token names is no researcher account on host "
                f"{grant.host_name!r} (missing, a system account, or without a login shell)"
            )

    async def _lookup(self, grant: Grant) -> str | None:
        certs = grant.host.certificates
        assert certs is not None
        name = grant.target.username
        try:
            # As the host's own account: never a certificate for the name before it passed.
            result = await self._pool.run(
                grant.host.target(),
                ["getent", "passwd", "--", name],
                timeout=LOOKUP_TIMEOUT,
                acquire_timeout=LOOKUP_TIMEOUT,
                max_output=4096,
            )
        except SSHPoolError as exc:
            raise ssh_problem(exc, host=grant.host_name) from None
        if result.exit_status == 0:
            why, ttl = refusal(result.stdout, name, certs.min_uid), certs.lookup_ttl
        elif result.exit_status == 2:  # getent: "key not found"
            why, ttl = "no such account", certs.lookup_negative_ttl
        else:
            log.warning(
                "host %s: getent passwd %s exited %s", grant.host_name, name, result.exit_status
            )
            raise ssh_problem(None, "ssh-error", detail=f"host {grant.host_name!r}: lookup failed")
        if why is not None:
            log.info("host %s: account %s refused: %s", grant.host_name, name, why)
        key = (grant.host_name, name)
        self._known[key] = (why, time.monotonic() + ttl)
        self._known.move_to_end(key)
        while len(self._known) > MAX_KNOWN:
            self._known.popitem(last=False)
        return why

    async def close(self) -> None:
        await self._tasks.close()
