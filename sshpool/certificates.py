"""Short-lived OpenSSH user certificates, minted per connection (docs/pool.md, "Certificates").

A `UserCA` holds a CA private key (read once) and the rules of what it signs. A Target with
`ca=` set logs in with `UserCA.mint(account, identity)`: a fresh ed25519 key pair made in memory
and a certificate for it, which live only as long as the connect that uses them. No user key is
ever written anywhere; sshd trusts the CA (`TrustedUserCAKeys`), not any one key.

What a certificate says (sshd enforces all of it):
- principals: the account only (asyncssh's default, no principals, is a certificate sshd
  refuses);
- valid from 60 s before now (a login host whose clock runs behind still accepts it) to `ttl`
  seconds after now: sshd checks it only when a connection authenticates, so an expiry never
  closes an open connection; the pool's max_lifetime and idle_timeout do;
- key id `<identity>/<replica>/<serial>`: sshd logs it with every login, which ties the login
  to the person the caller named; the serial is random (64 bits, never 0), so that it names one
  certificate across processes, replicas and restarts (a KRL revokes by serial);
- no pty, no port, agent or X11 forwarding; `permit-user-rc` only when asked for (off: a user's
  `~/.ssh/rc` cannot run before our commands);
- `source-address` when given: sshd accepts the certificate only from those addresses.

The signing is asyncssh's (`SSHKey.generate_user_certificate`): no hand-written crypto.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncssh

# Clock skew allowed for: sshd rejects a certificate valid only from "now" when its clock is
# behind ours.
BACKDATE = 60.0
# The key type of the per-connection key pair: the cheapest to make and to sign, and one all
# three backends log in with (libssh2 >= 1.11 takes ed25519 certificates from memory).
KEY_TYPE = "ssh-ed25519"
# Printable ASCII without spaces or '/': what an identity or replica name may hold in a key id.
_KEY_ID_PART = re.compile(r"[!-.0-~]{1,200}")


@dataclass(frozen=True, slots=True)
class Credentials:
    """One connection's login: an OpenSSH private key and its certificate, both in memory."""

    private_key: bytes
    """The private key in OpenSSH format (no passphrase)."""
    certificate: bytes
    """The certificate as one `*-cert-v01@openssh.com AAAA...` line (a `-cert.pub` file's text)."""
    key_id: str

    def __repr__(self) -> str:
        # Never print the private key (tracebacks, logs).
        return f"Credentials(key_id={self.key_id!r})"


class UserCA:
    """An OpenSSH user CA: its private key, read once, and the rules of every certificate it
    signs (see the module docstring). Compared by identity: Targets sharing one UserCA share
    pooled connections, given the same account and identity.

    ```python
    ca = UserCA("/etc/sshapi/user_ca", ttl=300, replica="api-1")
    target = Target("login1", "alice", (), "/etc/sshapi/known_hosts", ca=ca, identity="alice@idp")
    ```
    """

    def __init__(
        self,
        key: str | Path | bytes,
        *,
        ttl: float = 300.0,
        source_address: Sequence[str] = (),
        permit_user_rc: bool = False,
        replica: str = "",
    ) -> None:
        """`key`: the CA private key, a file path or its OpenSSH/PEM text (no passphrase).
        `replica`: the middle part of key ids (default: host name and pid of the minting
        process).
        Raises ValueError for a key that cannot be read or parsed (the message names the file,
        never its content)."""
        if ttl <= 0:
            raise ValueError("ttl must be > 0")
        if replica and not _KEY_ID_PART.fullmatch(replica):
            raise ValueError(f"replica {replica!r}: printable ASCII without spaces or '/'")
        try:
            if isinstance(key, bytes):
                self._key = asyncssh.import_private_key(key)
            else:
                self._key = asyncssh.read_private_key(str(key))
        except (OSError, asyncssh.KeyImportError) as exc:
            where = "the CA key" if isinstance(key, bytes) else f"CA key {key}"
            raise ValueError(f"{where}: cannot read it: {exc.__class__.__name__}") from None
        self.ttl = ttl
        self.source_address = tuple(source_address)
        self.permit_user_rc = permit_user_rc
        self.replica = replica

    @property
    def public_key(self) -> str:
        """The CA's public key line: what sshd's TrustedUserCAKeys file holds."""
        return self._key.export_public_key().decode().strip()

    @property
    def key_type(self) -> str:
        """The CA key's algorithm, e.g. "ecdsa-sha2-nistp256" or "ssh-ed25519"."""
        return self._key.get_algorithm()

    @property
    def fingerprint(self) -> str:
        """The CA's SHA256 fingerprint, as sshd logs it ("CA ED25519 SHA256:...")."""
        return self._key.get_fingerprint()

    @staticmethod
    def check_identity(identity: str) -> None:
        """ValueError unless `identity` can stand in a key id (1-200 printable ASCII characters,
        no spaces or '/': sshd's log line stays one line and the key id's parts stay apart)."""
        if not _KEY_ID_PART.fullmatch(identity):
            raise ValueError("identity: 1-200 printable ASCII characters, no spaces or '/'")

    def mint(self, account: str, identity: str, *, now: float | None = None) -> Credentials:
        """A fresh key pair and its certificate for logging in as `account` on behalf of
        `identity` (free text without spaces or '/', e.g. a token's subject)."""
        self.check_identity(identity)
        now = time.time() if now is None else now
        serial = secrets.randbits(64) or 1
        # Unnamed: this process, named when it mints (a CA made before worker processes fork
        # names each worker, and their serials, apart).
        replica = self.replica or f"{socket.gethostname()}.{os.getpid()}"
        key_id = f"{identity}/{replica}/{serial}"
        user_key = asyncssh.generate_private_key(KEY_TYPE)
        cert = self._key.generate_user_certificate(
            user_key,
            key_id,
            serial=serial,
            principals=[account],
            valid_after=int(now - BACKDATE),
            valid_before=int(now + self.ttl) + 1,
            source_address=list(self.source_address) or None,
            permit_x11_forwarding=False,
            permit_agent_forwarding=False,
            permit_port_forwarding=False,
            permit_pty=False,
            permit_user_rc=self.permit_user_rc,
        )
        return Credentials(
            private_key=user_key.export_private_key("openssh"),
            certificate=cert.export_certificate(),
            key_id=key_id,
        )

    def __repr__(self) -> str:
        return f"UserCA({self.fingerprint}, ttl={self.ttl}, replica={self.replica!r})"
