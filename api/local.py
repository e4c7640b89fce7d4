"""Local development wiring, in one place: the local issuer and tokens, the local host's limits
and configuration, and `<data_dir>/local.toml`, the plain configuration `sshapi dev` leaves.

Serving never needs the dev rig: `sshapi dev` (which starts `sshpool.devhost`) writes the local
host as an ordinary TOML configuration file, and a server started without SSHAPI_CONFIG reads
that file with the normal loader. Nothing here imports `sshpool.devhost`, FastAPI or SQLAlchemy,
so a load generator can mint tokens without the web stack:

    from api.local import local_token, resolve_config
    from api.settings import Settings, read_secret_file

    settings = Settings()
    token = local_token(settings, resolve_config(settings), "alice", ["jobs:read"], ttl=3600)
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import jwt
import tomli_w

from api.config import LOCAL_ISSUER as LOCAL_ISSUER  # re-exported: loadtests, tests use it
from api.config import (
    Config,
    HostConfig,
    IssuerConfig,
    PolicyRule,
    SchedulerConfig,
    SshdLimits,
    load_config,
)
from api.credentials import CertificateCredentials
from api.settings import Settings, read_secret_file
from api.webhooks.config import WebhooksConfig
from sshpool import ExecMode, Limits

LOCAL_AUDIENCE = "sshapi"
# The claim naming the caller's account in local tokens (as Keycloak's and most IdPs' tokens).
ACCOUNT_CLAIM = "preferred_username"
# A local token lives at most this long: it cannot be revoked (rotate the secret instead).
MAX_TOKEN_TTL = 30 * 86400.0
LOCAL_CONFIG_NAME = "local.toml"

# The pool's defaults (4 connections x 8 channels, inside a stock sshd) with one connection kept
# open, so that a burst on a cold pool does not wait for its handshakes. Wider limits, which
# sshd_config.tuned allows, measured no different from the defaults in `loadtests.raw_matrix`,
# so nothing backs them (docs/benchmarks.md, "Figures behind the code").
LOCAL_LIMITS = Limits(min_connections=1)

NO_CONFIG = (
    "no configuration: set SSHAPI_CONFIG to your TOML file (see api/sshapi.example.toml), "
    "or run `sshapi dev` once to set up the local host (it leaves {path})"
)


class NoLocalIssuer(ValueError):
    """The configuration has no HS256 issuer: tokens come from the identity provider."""


class LocalSshd(Protocol):
    """What the local host configuration needs of a started local sshd (a
    `sshpool.devhost.LocalHost`), so this module does not import the dev rig."""

    @property
    def address(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def username(self) -> str: ...
    @property
    def client_key(self) -> str: ...
    @property
    def known_hosts(self) -> str: ...


def rig_dir(data_dir: Path) -> Path:
    """Where `sshapi dev` keeps its local host and Slurm: beside the data dir, not in it. The
    host's account must traverse the rig's directories, while the data dir (the job database,
    the secret) stays 0700."""
    return data_dir.parent / f"{data_dir.name}-hosts"


def local_config_path(data_dir: Path) -> Path:
    """Where `sshapi dev` leaves the local configuration."""
    return data_dir / LOCAL_CONFIG_NAME


def default_config(local: HostConfig | None = None, hpc: HostConfig | None = None) -> Config:
    """The local configuration: the local HS256 issuer, the local host as `local` (when there is
    one) and as `hpc` (each caller as their own account: `sshapi dev --accounts`), and a policy
    letting any authenticated subject use it with argv and raw shell lines, and its files under
    the account's home (file roots are opt-in: written here). Webhooks may call this machine's
    loopback over plain http (a receiver beside `make run`), which a server refuses by default."""
    hosts = {"local": local} if local else {}
    if hpc is not None:
        hosts["hpc"] = hpc
    return Config(
        issuers=[
            IssuerConfig(
                issuer=LOCAL_ISSUER,
                audience=LOCAL_AUDIENCE,
                algorithms=["HS256"],
                # Whoever can read the data dir's secret runs this instance: it may grant admin.
                scopes=["jobs:read", "jobs:write", "files:read", "files:write", "admin"],
                account_claim=ACCOUNT_CLAIM if hpc is not None else None,
            )
        ],
        hosts=hosts,
        webhooks=WebhooksConfig(
            allowed_urls=["http://*", "https://*"],
            allowed_networks=["127.0.0.0/8", "::1/128"],
        ),
        policy=[
            PolicyRule(
                issuer=LOCAL_ISSUER,
                hosts=["*"],
                shell_hosts=["*"],
                templates=["*"],
                file_roots={"*": ["~"]},
            )
        ],
    )


def with_oidc_issuer(config: Config, issuer: str, audience: str, account_claim: str) -> Config:
    """`config` also trusting the rig's OpenID provider (`sshapi dev --oidc`): its RS256 tokens
    through its JWKS, with the same rights as the local issuer's but never admin."""
    entry = IssuerConfig(
        issuer=issuer,
        audience=audience,
        algorithms=["RS256"],
        jwks_url=f"{issuer}/jwks",
        account_claim=account_claim,
    )
    rule = config.policy[0].model_copy(update={"issuer": issuer})
    return config.model_copy(
        update={"issuers": [*config.issuers, entry], "policy": [*config.policy, rule]}
    )


def local_certificate_host_config(
    host: LocalSshd, ca_key: str, nodes: Sequence[str] = ()
) -> HostConfig:
    """The local host again, for researchers as themselves: each caller logs in as the account
    their token names, with a certificate of the rig's user CA (`sshapi dev --accounts`); with
    `nodes`, on those login nodes (`host` is the first: they share its CA and home)."""
    return HostConfig(
        hostname="" if nodes else host.address,
        nodes=list(nodes),
        port=host.port,
        username=host.username,
        known_hosts=host.known_hosts,
        credentials=CertificateCredentials(kind="certificate", ca_key=Path(ca_key)),
        description="The local HPC host, each researcher as their own account (certificates)",
        limits=LOCAL_LIMITS,
        sshd=SshdLimits(max_startups=30, max_sessions=16),
    )


def local_host_config(
    host: LocalSshd,
    *,
    slurm: bool = False,
    exec_mode: ExecMode = "auto",
    nodes: Sequence[str] = (),
) -> HostConfig:
    """The started local host as configuration (with a scheduler when Slurm runs beside it);
    with `nodes`, a cluster of login nodes on those addresses (`host` is its first)."""
    return HostConfig(
        exec_mode=exec_mode,
        hostname="" if nodes else host.address,
        nodes=list(nodes),
        port=host.port,
        username=host.username,
        client_keys=[host.client_key],
        known_hosts=host.known_hosts,
        description="The embedded local HPC host (OpenSSH sshd on loopback, tuned profile)",
        limits=LOCAL_LIMITS,
        sshd=SshdLimits(max_startups=30, max_sessions=16),
        scheduler=SchedulerConfig() if slurm else None,
    )


def resolve_config(settings: Settings) -> Config:
    """SSHAPI_CONFIG when set; else what `sshapi dev` left in the data dir; else the local
    issuer alone (no hosts: enough to mint and check tokens). Reads files only: it never starts
    or creates anything."""
    if settings.config is not None:
        return load_config(settings.config)
    path = local_config_path(settings.data_dir)
    if path.is_file():
        return load_config(path)
    return default_config()


def require_config(settings: Settings) -> Config:
    """`resolve_config` for serving: a server without hosts is a mistake, so without
    SSHAPI_CONFIG and without a local configuration this raises FileNotFoundError saying
    what to do."""
    path = local_config_path(settings.data_dir)
    if settings.config is None and not path.is_file():
        raise FileNotFoundError(NO_CONFIG.format(path=path))
    return resolve_config(settings)


def write_local_config(data_dir: Path, config: Config) -> Path:
    """Write `config` as `<data_dir>/local.toml`, a plain configuration file."""
    path = local_config_path(data_dir)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = config.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        "# Written by `sshapi dev`: the local host as a plain configuration file.\n"
        + tomli_w.dumps(data)
    )
    tmp.replace(path)  # atomic: a server starting meanwhile reads the old file or the new one
    return path


def mint(
    secret: str,
    *,
    issuer: str,
    audience: str,
    subject: str,
    scopes: Iterable[str],
    ttl: float = 3600.0,
    claims: dict[str, str] | None = None,
) -> str:
    """An HS256 token for the local issuer (what `sshapi token` and `sshapi dev` print), with
    `claims` added (the account claim of `sshapi dev --accounts`).
    ValueError for an empty subject or a lifetime that is not in (0, MAX_TOKEN_TTL]."""
    if not subject.strip():
        raise ValueError("--sub: the subject cannot be empty")
    if not (math.isfinite(ttl) and 0 < ttl <= MAX_TOKEN_TTL):
        raise ValueError(f"--ttl: seconds, more than 0 and at most {MAX_TOKEN_TTL:g} (30 days)")
    now = int(time.time())
    payload = {
        **(claims or {}),
        "iss": issuer,
        "aud": audience,
        "sub": subject,
        "scope": " ".join(scopes),
        "iat": now,
        "exp": now + int(ttl),
    }
    return jwt.encode(payload, secret, algorithm="HS256")


def default_scopes(config: Config) -> list[str]:
    """The scopes of the token `sshapi dev` and `sshapi token` print unless told otherwise:
    every scope the local (first HS256) issuer grants but `admin`, so one token runs jobs and
    moves files; admin is asked for by name (`--scope`)."""
    issuer = next((i for i in config.issuers if "HS256" in i.algorithms), None)
    return [s for s in issuer.scopes if s != "admin"] if issuer is not None else []


def local_token(
    settings: Settings,
    config: Config,
    sub: str,
    scopes: list[str],
    ttl: float = 3600.0,
    account: str | None = None,
) -> str:
    """A token the server with `config` accepts, signed with the first HS256 issuer's secret
    (its `secret_file`, else SSHAPI_JWT_SECRET or the data dir's secret), naming `account` in
    that issuer's account claim when given. NoLocalIssuer when the configuration has none."""
    issuer = next((i for i in config.issuers if "HS256" in i.algorithms), None)
    if issuer is None:
        raise NoLocalIssuer("no HS256 issuer in the configuration: tokens come from your IdP")
    if account is not None and issuer.account_claim is None:
        raise ValueError(f"--account: issuer {issuer.issuer!r} has no account_claim")
    claims = {issuer.account_claim: account} if account and issuer.account_claim else None
    secret = read_secret_file(issuer.secret_file) if issuer.secret_file else settings.hs256_secret()
    return mint(
        secret,
        issuer=issuer.issuer,
        audience=issuer.audience,
        subject=sub,
        scopes=scopes,
        ttl=ttl,
        claims=claims,
    )
