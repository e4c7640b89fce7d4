"""How a host's accounts log in, in the configuration (`[hosts.X.credentials]`): key files
(`kind = "keys"`, the default) or a short-lived certificate per connection (`kind =
"certificate"`: docs/operations.md, "Researchers as themselves"). Split from api/config.py,
which imports it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from sshpool import UserCA


class Strict(BaseModel):
    """Every model of the configuration (api/config.py's too): an unknown key fails the start
    (a typo), and nothing changes it once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# A POSIX-portable user name (useradd's default rule, 32 characters at most).
ACCOUNT_PATTERN = r"^[a-z_][a-z0-9_-]{0,31}$"
# Accounts a token never names, whatever the pattern: Debian's and RHEL's system accounts.
DENY_ACCOUNTS = (
    "root", "daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news", "uucp",
    "proxy", "www-data", "backup", "list", "irc", "gnats", "nobody", "systemd-network",
    "systemd-resolve", "systemd-timesync", "messagebus", "sshd", "_apt", "adm", "halt",
    "shutdown", "operator", "ftp", "postgres", "redis", "slurm", "munge", "nginx", "polkitd",
)  # fmt: skip


class KeyCredentials(Strict):
    """The host's accounts log in with key files (`client_keys`): the default."""

    kind: Literal["keys"] = "keys"


class CertificateCredentials(Strict):
    """The host's accounts log in with a fresh short-lived certificate per connection, signed
    by `ca_key` (docs/operations.md, "Researchers as themselves"): no user key anywhere."""

    kind: Literal["certificate"]
    # The CA's private key: mode 0600 (anyone who reads it can log in as any account).
    ca_key: Path
    cert_ttl: float = Field(default=300.0, gt=0, le=86400)
    # The API's egress addresses: sshd accepts the certificates only from there. Empty: any.
    source_address: list[str] = Field(default_factory=list)
    permit_user_rc: bool = False
    # Which account names a token may name (full match), and which never.
    account_pattern: str = ACCOUNT_PATTERN
    deny_accounts: list[str] = Field(default_factory=lambda: list(DENY_ACCOUNTS))
    # A researcher's connection closes when idle this long (each account has its own).
    idle_timeout: float = Field(default=30.0, gt=0)
    # A claimed account is looked up on the host (`getent passwd`, as `username`) before its
    # first certificate: refused below this uid, with a nologin/false shell, or missing
    # (api/accounts.py). Answers are kept lookup_ttl seconds, a missing account's
    # lookup_negative_ttl; at most max_lookups run at once (503 + Retry-After beyond).
    min_uid: int = Field(default=1000, ge=0)
    lookup_ttl: float = Field(default=300.0, gt=0)
    lookup_negative_ttl: float = Field(default=30.0, gt=0)
    max_lookups: int = Field(default=4, ge=1, le=64)
    _ca: UserCA | None = PrivateAttr(default=None)

    @field_validator("account_pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        re.compile(value)
        return value

    def model_post_init(self, context: Any, /) -> None:
        mode = self.ca_key.stat().st_mode if self.ca_key.exists() else 0
        if mode & 0o077:
            raise ValueError(
                f"CA key {self.ca_key} is readable by others (mode {mode & 0o777:o}): chmod 600 "
                "it (whoever reads it can log in as any account)"
            )
        # Loaded now, so that a key that is not a CA key fails the start, not the first login.
        self._ca = self._load_ca()

    def _load_ca(self) -> UserCA:
        # The replica part of key ids is left to the minting process (host name and pid): the
        # configuration is loaded before worker processes start.
        return UserCA(
            self.ca_key,
            ttl=self.cert_ttl,
            source_address=self.source_address,
            permit_user_rc=self.permit_user_rc,
        )

    def __getstate__(self) -> dict[Any, Any]:
        """The configuration crosses into each worker process pickled (api/workers.py): the
        loaded CA key cannot be pickled, and each process loads its own from `ca_key`."""
        state = super().__getstate__()
        return {**state, "__pydantic_private__": {**state["__pydantic_private__"], "_ca": None}}

    @property
    def ca(self) -> UserCA:
        if self._ca is None:  # unpickled in a worker process
            self._ca = self._load_ca()
        return self._ca

    def account_problem(self, name: str) -> str | None:
        """Why `name` may not be logged in as here, or None when it may."""
        if not re.fullmatch(self.account_pattern, name):
            return f"not an account name here (must match {self.account_pattern})"
        if name == "root" or name in self.deny_accounts:
            return "a system account"
        return None


Credentials = Annotated[KeyCredentials | CertificateCredentials, Field(discriminator="kind")]
