"""deploy/sshapi-principals as sshd runs it (`%u %i SERVICE MIN_UID %U`, and the older line
without the uid): which certificates' principals it prints. sshd's own use of it (a root sshd
refusing root and the service account, letting a researcher in) is in
tests/api/test_api_certificates.py."""

from __future__ import annotations

import pwd
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "sshapi-principals"
SERVICE = "svc-sshapi"


def principals(*args: str) -> list[str]:
    done = subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.split()


def researcher() -> pwd.struct_passwd:
    for entry in pwd.getpwall():
        if 1000 <= entry.pw_uid <= 59999:
            return entry
    pytest.skip("no account with a uid from 1000 to 59999 on this machine")


def test_a_researchers_account_is_its_own_principal_with_or_without_the_uid() -> None:
    who = researcher()
    name = who.pw_name
    assert principals(name, "alice@issuer/1", SERVICE, "1000", str(who.pw_uid)) == [name]
    assert principals(name, "alice@issuer/1", SERVICE, "1000") == [name]  # `id` looks it up
    assert principals(name, "alice@issuer/1", SERVICE) == [name]
    # A site that raises MIN_UID above this account's uid refuses it.
    higher = str(who.pw_uid + 1)
    assert principals(name, "alice@issuer/1", SERVICE, higher, str(who.pw_uid)) == []


def test_root_system_accounts_and_nobody_are_never_principals() -> None:
    nobody = pwd.getpwnam("nobody")
    daemon = pwd.getpwnam("daemon")
    for entry in (pwd.getpwnam("root"), daemon, nobody):
        uid = str(entry.pw_uid)
        assert principals(entry.pw_name, "x@y/1", SERVICE, "1000", uid) == []
        assert principals(entry.pw_name, "x@y/1", SERVICE, "1000") == []
    # A uid that is not a number (never from sshd) is not trusted: `id` decides.
    assert principals("root", "x@y/1", SERVICE, "1000", "1500x") == []
    assert principals("sshapi-no-such-account", "x@y/1", SERVICE, "1000") == []


def test_the_service_account_only_with_the_apis_own_key_id() -> None:
    assert principals(SERVICE, "sshapi/replica-a/7", SERVICE, "1000", "990") == [SERVICE]
    assert principals(SERVICE, "mallory@issuer/1", SERVICE, "1000", "990") == []
    assert principals(SERVICE, "mallory@issuer/1", SERVICE, "1000", "5000") == []
