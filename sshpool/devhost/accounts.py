"""Researcher accounts on the local host: N real Unix accounts, each with its own key, for the
many-accounts tests and benchmarks (one sshd, many accounts: docs/pool.md).

```python
accounts = ensure_accounts(200, data_dir=Path(".data"))      # sshapi-r0001 .. sshapi-r0200
with LocalHost("hpc1", "stock", data_dir=Path(".data"), researchers=True) as host:
    targets = [account.target(host) for account in accounts]
...
remove_accounts(data_dir=Path(".data"))                       # userdel -r each of them
```

Only the dev rig creates accounts, and only as root. Each account is made with ``useradd``
(its own group and home, shell /bin/sh, password ``*``: no password matches, yet the account is
not locked), its public key in ``~/.ssh/authorized_keys`` as on a real login host. The key pairs
live in the rig's own directory, ``<data_dir>/accounts/keys/<name>`` (+ ``.pub``), readable by
the API's user only. A host logs these accounts in when it runs with ``researchers=True`` (its
sshd then runs as root, as a site's does).

Idempotent: an existing account and key are kept, a missing key is made and installed again.
useradd runs one account at a time (each locks and rewrites /etc/passwd; concurrent ones would
wait a second on the lock), the keys are made in parallel meanwhile.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sshpool.devhost.host import adopt_home
from sshpool.target import Limits, Target

if TYPE_CHECKING:
    from sshpool.devhost.host import LocalHost

PREFIX = "sshapi-r"
NAME = re.compile(r"sshapi-r\d{4}")
# A few keygens at once: each is a short process, and the box has other work.
KEYGEN_WORKERS = 8
_SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"


class AccountError(RuntimeError):
    """An account could not be created or removed."""


@dataclass(frozen=True, slots=True)
class Account:
    """One researcher account and the key pair the API logs it in with."""

    name: str
    uid: int
    gid: int
    home: Path
    key: Path

    def target(self, host: LocalHost, **limits: object) -> Target:
        """An sshpool Target logging this account in on ``host`` (a host started with
        ``researchers=True``); keyword arguments go to ``Limits``."""
        return Target(
            host=host.address,
            username=self.name,
            client_keys=(str(self.key),),
            known_hosts=host.known_hosts,
            port=host.port,
            limits=Limits(**limits),  # type: ignore[arg-type]
        )


def account_names(n: int, first: int = 1) -> list[str]:
    """The names of ``n`` researcher accounts from number ``first``: sshapi-r0001, ..."""
    if n < 0 or first < 1 or first + n - 1 > 9999:
        raise ValueError(f"account numbers go from 1 to 9999, not {first} to {first + n - 1}")
    return [f"{PREFIX}{i:04d}" for i in range(first, first + n)]


def keys_dir(data_dir: Path | str) -> Path:
    return Path(data_dir).absolute() / "accounts" / "keys"


def ensure_accounts(n: int, *, data_dir: Path | str, first: int = 1) -> list[Account]:
    """``n`` researcher accounts from number ``first``, created when missing, each with the key
    of ``data_dir`` authorized (beside those of other rigs sharing the machine's accounts)."""
    names = account_names(n, first)
    if names and os.geteuid() != 0:
        raise AccountError("creating Unix accounts needs root")
    keys = keys_dir(data_dir)
    keys.mkdir(parents=True, exist_ok=True)
    os.chmod(keys, 0o700)
    with ThreadPoolExecutor(KEYGEN_WORKERS) as pool:
        made = pool.map(lambda name: _ensure_key(keys / name), names)
        for name in names:
            _ensure_user(name)
        list(made)
    accounts: list[Account] = []
    for name in names:
        entry = pwd.getpwnam(name)
        account = Account(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir), keys / name)
        _authorize(account)
        accounts.append(account)
    return accounts


def existing_accounts() -> list[str]:
    """The names of the researcher accounts this machine has, sorted."""
    return sorted(entry.pw_name for entry in pwd.getpwall() if NAME.fullmatch(entry.pw_name))


def remove_accounts(names: Iterable[str] | None = None, *, data_dir: Path | str) -> int:
    """Remove researcher accounts (``userdel -r``: home and group too) and their keys: those
    named, or every one this machine has. Returns how many accounts were removed."""
    chosen = existing_accounts() if names is None else list(names)
    foreign = [name for name in chosen if not NAME.fullmatch(name)]
    if foreign:
        raise ValueError(f"not researcher accounts of the rig: {foreign[:5]}")
    userdel = shutil.which("userdel", path=_SBIN) or "userdel"
    removed = 0
    for name in chosen:
        try:
            pwd.getpwnam(name)
        except KeyError:
            pass
        else:
            done = subprocess.run([userdel, "-r", name], capture_output=True, text=True)
            # 12: the home could not be removed (already gone): the account is.
            if done.returncode not in (0, 12):
                raise AccountError(f"userdel {name} failed: {done.stderr.strip()}")
            removed += 1
        for path in (keys_dir(data_dir) / name, keys_dir(data_dir) / f"{name}.pub"):
            path.unlink(missing_ok=True)
    return removed


def _ensure_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
        return
    except KeyError:
        pass
    useradd = shutil.which("useradd", path=_SBIN) or "useradd"
    argv = [useradd, "--create-home", "--user-group", "--shell", "/bin/sh"]
    # '*': no password can match, yet the account is not locked (sshd without PAM refuses
    # locked accounts).
    argv += ["--password", "*", "--comment", "sshapi researcher (dev rig)", name]
    done = subprocess.run(argv, capture_output=True, text=True)
    # 9: the name exists (another process created it meanwhile).
    if done.returncode not in (0, 9):
        raise AccountError(f"useradd {name} failed: {done.stderr.strip()}")
    if done.returncode == 0:
        adopt_home(name)


def _ensure_key(path: Path) -> None:
    pub = path.with_name(path.name + ".pub")
    if path.exists() and pub.exists():
        return
    for stale in (path, pub):
        stale.unlink(missing_ok=True)
    done = subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise AccountError(f"ssh-keygen for {path} failed: {done.stderr.strip()}")


def _authorize(account: Account) -> None:
    """Add the account's public key to its ~/.ssh/authorized_keys, owned by it. Each line's
    comment is its private key's path: the keys of other rigs (another data dir, another test
    run) stay while their key file exists, so that runs sharing the accounts do not lock each
    other out, and go with it."""
    key_type, key_data = account.key.with_name(account.name + ".pub").read_text().split()[:2]
    line = f"{key_type} {key_data} {account.key}"
    ssh_dir = account.home / ".ssh"
    authorized = ssh_dir / "authorized_keys"
    try:
        lines = authorized.read_text().splitlines()
    except OSError:
        lines = []
    kept = [old for old in lines if old != line and Path(old.split(" ", 2)[-1]).is_file()]
    if [*kept, line] == lines:
        return
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    authorized.write_text("\n".join([*kept, line]) + "\n")
    for path in (ssh_dir, authorized):
        os.chown(path, account.uid, account.gid)
    os.chmod(authorized, 0o600)
