"""What a minted certificate says, as OpenSSH's own ssh-keygen reads it (no sshd needed; the
logins themselves are in the backend conformance suite)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import replace
from pathlib import Path

import asyncssh
import pytest

from sshpool import Target, UserCA


@pytest.fixture
def ca_key(tmp_path: Path) -> Path:
    path = tmp_path / "user_ca"
    path.write_bytes(asyncssh.generate_private_key("ssh-ed25519").export_private_key())
    path.chmod(0o600)
    return path


def describe(certificate: bytes) -> str:
    """`ssh-keygen -L` of a certificate: OpenSSH's reading of it."""
    done = subprocess.run(
        ["ssh-keygen", "-L", "-f", "/dev/stdin"],
        input=certificate,
        capture_output=True,
        check=True,
    )
    return done.stdout.decode()


def test_certificate_names_the_account_only_and_grants_nothing_else(ca_key: Path) -> None:
    """Principals: the account alone; back-dated 60 s, ttl ahead; key id identity/replica/serial;
    no pty, no forwarding, no user rc."""
    ca = UserCA(ca_key, ttl=120, replica="api-1")
    now = time.time()
    first, second = ca.mint("alice", "alice@idp", now=now), ca.mint("alice", "alice@idp")
    text = describe(first.certificate)
    assert "Principals: \n                alice\n" in text
    serial = first.key_id.rsplit("/", 1)[1]
    assert f'Key ID: "alice@idp/api-1/{serial}"' in text and f"Serial: {serial}\n" in text
    assert second.key_id.startswith("alice@idp/api-1/") and second.key_id != first.key_id
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(int(now - 60)))
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(int(now + 120) + 1))
    assert f"Valid: from {start} to {end}" in text
    extensions = text.split("Extensions:")[1]
    assert extensions.split() == ["(none)"]  # no permit-pty, -*-forwarding, -user-rc
    assert "Critical Options: (none)" in text
    assert first.private_key != second.private_key  # a fresh key pair each time


def test_serials_are_unique_across_processes_and_replicas(ca_key: Path) -> None:
    """Two CAs on the same key, as two worker processes or replicas hold (before: each counted
    from 1, so sshd logged `serial 1` for certificates of both and a KRL revoking one serial
    revoked the other's too): 500 certificates each, 1000 serials, all distinct and nonzero,
    each the certificate's own (ssh-keygen -L) and its key id's last part."""
    serials = []
    for replica in ("api-1", "api-2"):
        ca = UserCA(ca_key, replica=replica)
        for _ in range(500):
            creds = ca.mint("alice", "alice@idp")
            serials.append(int(creds.key_id.rsplit("/", 1)[1]))
    assert len(set(serials)) == 1000 and all(0 < s < 1 << 64 for s in serials)
    assert f"Serial: {serials[-1]}\n" in describe(creds.certificate)


def test_user_rc_and_source_address_only_when_asked(ca_key: Path) -> None:
    ca = UserCA(ca_key, permit_user_rc=True, source_address=["192.0.2.0/24"])
    text = describe(ca.mint("alice", "alice").certificate)
    assert text.split("Extensions:")[1].split() == ["permit-user-rc"]
    assert "source-address 192.0.2.0/24" in text


def test_credentials_never_show_the_private_key(ca_key: Path) -> None:
    creds = UserCA(ca_key).mint("alice", "alice")
    assert b"PRIVATE KEY" in creds.private_key
    assert "PRIVATE" not in repr(creds) and "PRIVATE" not in str(creds)


@pytest.mark.parametrize("identity", ["", "a b", "a/b", "a\nb", "\0", "é", "x" * 201])
def test_identity_that_would_break_the_key_id_is_refused(ca_key: Path, identity: str) -> None:
    """The key id is one token in sshd's log: no spaces, '/', control or non-ASCII characters."""
    ca = UserCA(ca_key)
    target = Target("h", "alice", (), "/dev/null", ca=ca)
    with pytest.raises(ValueError, match="identity"):
        replace(target, identity=identity or " ")
    with pytest.raises(ValueError, match="identity"):
        ca.mint("alice", identity)


def test_unreadable_ca_key_names_the_file_not_its_content(tmp_path: Path) -> None:
    bad = tmp_path / "user_ca"
    bad.write_text("not a key SECRET")
    with pytest.raises(ValueError, match="user_ca") as caught:
        UserCA(bad)
    assert "SECRET" not in str(caught.value)
    with pytest.raises(ValueError, match="cannot read"):
        UserCA(tmp_path / "missing")


def test_target_takes_keys_or_a_ca_not_both(ca_key: Path) -> None:
    with pytest.raises(ValueError, match="client key, or a CA"):
        Target("h", "alice", (), "/dev/null")
    with pytest.raises(ValueError, match="not both"):
        Target("h", "alice", ("/k",), "/dev/null", ca=UserCA(ca_key))
