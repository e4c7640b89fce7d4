"""Process settings from `SSHAPI_*` environment variables: what differs per process or
deployment. Hosts, issuers and policy live in the TOML file that `config.py` loads."""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger("sshapi.settings")

# Values people paste from examples. A secret that is one of these (or short) is refused.
PLACEHOLDER_SECRETS = frozenset(
    {"changeme", "change-me", "changethis", "secret", "password", "example", "test", "xxx"}
)
MIN_SECRET_BYTES = 32
SECRET_FILE_NAME = "jwt_secret"
DATABASE_NAME = "jobs.sqlite3"


def default_data_dir() -> Path:
    """`<repo>/.data` when running from a checkout, else `~/.local/share/sshapi`."""
    repo = Path(__file__).resolve().parent.parent
    if (repo / "pyproject.toml").is_file():
        return repo / ".data"
    return Path.home() / ".local" / "share" / "sshapi"


class Settings(BaseSettings):
    """Everything a process needs besides the TOML configuration. Refuses placeholder secrets."""

    model_config = SettingsConfigDict(env_prefix="SSHAPI_", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir)
    # The TOML file with hosts, issuers, templates and policy. Unset: <data_dir>/local.toml,
    # which `sshapi dev` writes (see api/local.py).
    config: Path | None = None
    # SQLAlchemy async URL. Unset: SQLite (WAL) at <data_dir>/jobs.sqlite3.
    database_url: str | None = None
    # PostgreSQL only: the schema (search_path) holding the tables, created if missing.
    database_schema: str | None = None
    # `auto`: each start brings the database to this release's schema (Alembic, under a lock
    # so that replicas starting together migrate once). `off`: a start on a database at another
    # revision refuses and names `sshapi db upgrade`, for sites that upgrade as a deploy step.
    db_upgrade: Literal["auto", "off"] = "auto"
    # HS256 secret for the local issuer. Unset: <data_dir>/jwt_secret, generated on first use.
    jwt_secret: SecretStr | None = None
    # Stable name of this replica: on start it marks its own unfinished jobs `lost`, and only its
    # own, so replicas sharing a database must have distinct names.
    replica: str = Field(default_factory=socket.gethostname)
    # How many replicas share the hosts: the start checks each host's SSH budget for all of
    # them together (HostConfig.ssh_budget) and warns when they would exceed sshd's limits.
    replicas: int = Field(default=1, ge=1)
    # redis://host:6379/0: rate limits and concurrent-job caps shared by all replicas. Unset:
    # counted per process (N replicas allow N times the rate). See api/quota.py.
    redis_url: str | None = None
    # API processes on this machine, all on one port (`sshapi serve --workers N`): each has its
    # own pool, store writer and replica name (`<replica>-w<i>`), as separate replicas would.
    # The SSH budget check counts workers x replicas.
    workers: int = Field(default=1, ge=1, le=64)
    backend: Literal["asyncssh", "paramiko", "ssh2"] = "asyncssh"
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    # Seconds an idle HTTP keep-alive connection stays open. Longer than clients keep theirs
    # idle (httpx 5 s, the load suite 2 s) and than the shipped nginx's upstream keepalive_timeout
    # (60 s): the side that closes first must be the client, or a request sent as the server
    # closes is lost ("Remote end closed connection without response"). 75 s as nginx and Go
    # servers use. uvicorn's own default is 5 s.
    keepalive_timeout: int = Field(default=75, ge=1)
    # Seconds a graceful shutdown lets running jobs finish before cancelling them.
    shutdown_grace: float = 10.0
    # The server's edge (api/server.py): bytes of request header (request line + headers)
    # before 431; seconds from connecting (or a kept-alive request's first byte) until the
    # header is complete, then until the body is (plus one second per `body_min_rate` bytes
    # received), before 408 and close; client connections open at once (lowered to what the
    # descriptor limit allows), beyond which those holding the server for nothing are closed
    # (answered ones, then those furthest behind their due rate: api/server.py).
    max_header_bytes: int = Field(default=32 << 10, ge=1024)
    header_timeout: float = Field(default=10.0, gt=0)
    body_timeout: float = Field(default=30.0, gt=0)
    # Bytes a second a body must keep arriving at to earn more time than `body_timeout`.
    # 64 KiB/s (512 kbit/s) is below any link a researcher uploads data over (a slow hotel or
    # field link, a congested VPN), so an honest upload of any size is never cut off, while a
    # client holding a connection with a trickle of bytes still is: it buys 1 s per 64 KiB.
    body_min_rate: int = Field(default=64 << 10, gt=0)
    max_connections: int = Field(default=4096, ge=1)
    # Client connections open at once from one address (an IPv6 client: from its /64), beyond
    # which a new one is answered 429 and closed, so that one client cannot hold them all. Not
    # applied to `trusted_proxies`, whose connections carry many clients' requests (the shipped
    # nginx caps its own clients per address: `limit_conn`).
    max_connections_per_address: int = Field(default=64, ge=1)
    # Addresses (or networks, "10.0.0.0/8"; "*" for any) of the proxies in front: only their
    # X-Forwarded-For is believed (uvicorn's proxy headers, as `forwarded_allow_ips`), and their
    # connections are not capped per address. uvicorn's own default. Empty: no proxy.
    trusted_proxies: str = "127.0.0.1,::1"
    # Seconds a download's client may take nothing (less than 128 KiB) before its answer ends
    # and its SFTP channel and transfer slot are let go (api/sending.py): nginx's send_timeout,
    # between two writes, so a slow client that keeps reading is never cut off.
    send_timeout: float = Field(default=60.0, gt=0)

    @field_validator("trusted_proxies")
    @classmethod
    def _parse_proxies(cls, value: str) -> str:
        proxy_networks(value)  # raises on an entry that is no address or network
        return value

    @property
    def trusted_proxy_networks(self) -> tuple[IPNetwork, ...] | None:
        """`trusted_proxies` parsed; None for "*" (every address)."""
        return proxy_networks(self.trusted_proxies)

    @field_validator("jwt_secret")
    @classmethod
    def _refuse_placeholder(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            check_secret(value.get_secret_value())
        return value

    @field_validator("database_url")
    @classmethod
    def _refuse_sqlite_in_memory(cls, value: str | None) -> str | None:
        # The store reads on SQLAlchemy's connections and writes on its own (api/store/); an
        # in-memory SQLite database exists once per connection, so the jobs it wrote would
        # never be found. (The URL is not parsed with SQLAlchemy: Locust workers load these
        # settings and stay free of it.)
        if value is not None and value.split(":", 1)[0].split("+", 1)[0] == "sqlite":
            path = value.split("://", 1)[-1].removeprefix("/").split("?", 1)[0]
            if not path or path == ":memory:" or "mode=memory" in value:
                raise ValueError(
                    "SQLite needs a database file, as in sqlite+aiosqlite:////var/lib/sshapi/"
                    "jobs.sqlite3: an in-memory database is one per connection"
                )
        return value

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{self.data_dir / DATABASE_NAME}"

    def secure_data_dir(self) -> None:
        """The data dir 0700 and its private files 0600 (the job database with its -wal and
        -shm files, the secret): the local host's account, which every token holder runs
        commands as in dev mode, must not read other users' outputs from them. A looser mode
        left by an older version is tightened, with a log line."""
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _tighten(self.data_dir, 0o700)
        db = self.data_dir / DATABASE_NAME
        if self.database_url is None and not db.exists():
            # SQLite creates -wal and -shm with the database file's mode: make it 0600 first.
            os.close(os.open(db, os.O_WRONLY | os.O_CREAT, 0o600))
        for name in (DATABASE_NAME, f"{DATABASE_NAME}-wal", f"{DATABASE_NAME}-shm"):
            if (self.data_dir / name).exists():
                _tighten(self.data_dir / name, 0o600)
        if (self.data_dir / SECRET_FILE_NAME).exists():
            _tighten(self.data_dir / SECRET_FILE_NAME, 0o600)

    def hs256_secret(self, *, create: bool = True) -> str:
        """The local issuer's secret: SSHAPI_JWT_SECRET, else the data dir's file (made if
        missing, mode 0600, so `sshapi token` and the server agree with no options)."""
        if self.jwt_secret is not None:
            return self.jwt_secret.get_secret_value()
        path = self.data_dir / SECRET_FILE_NAME
        if not path.exists():
            if not create:
                raise FileNotFoundError(f"no secret at {path}: set SSHAPI_JWT_SECRET")
            self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass  # another process made it first: read theirs
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_urlsafe(48))
        _tighten(path, 0o600)  # ours (made 0600 above): an older, looser one is tightened
        return read_secret_file(path)


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def proxy_networks(text: str) -> tuple[IPNetwork, ...] | None:
    """A comma-separated list of addresses and networks as networks; None if it holds "*"."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if "*" in items:
        return None
    try:
        return tuple(ipaddress.ip_network(item, strict=False) for item in items)
    except ValueError as exc:
        raise ValueError(f"trusted_proxies: {exc}") from None


def _tighten(path: Path, mode: int) -> None:
    current = path.stat().st_mode & 0o777
    if current & ~mode:
        log.warning("tightening %s from mode %o to %o", path, current, mode)
        path.chmod(mode)


def read_secret_file(path: Path) -> str:
    """An HS secret from a file: refused when group or others may read it (anyone who can read
    it can mint tokens) or when it fails `check_secret`."""
    mode = path.stat().st_mode
    if mode & 0o077:
        raise ValueError(
            f"secret file {path} is readable by others (mode {mode & 0o777:o}): chmod 600 it"
        )
    value = path.read_text().strip()
    try:
        check_secret(value)
    except ValueError as exc:
        raise ValueError(f"secret file {path}: {exc}") from None
    return value


def check_secret(value: str) -> None:
    """Refuse secrets that are placeholders or too short to resist brute force."""
    if value.strip().lower() in PLACEHOLDER_SECRETS:
        raise ValueError("the JWT secret is a placeholder value: generate a real one")
    if len(value.encode()) < MIN_SECRET_BYTES:
        raise ValueError(f"the JWT secret must be at least {MIN_SECRET_BYTES} bytes")
