"""The TOML configuration: API knobs, token issuers, hosts, command templates and policy.

One file, validated at start (a typo fails the start, not a request). The README shows a file
with every key. Secrets are not kept here: the HS256 secret comes from SSHAPI_JWT_SECRET, a
`secret_file`, or the data dir.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from api.credentials import CertificateCredentials, Credentials, KeyCredentials, Strict
from api.protected_paths import PROTECTED_PATHS
from api.settings import read_secret_file
from api.webhooks.config import WebhooksConfig
from sshpool import Limits, Target

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
# The scopes a token can carry (api/auth.py keeps only these).
SCOPES = ("jobs:read", "jobs:write", "files:read", "files:write", "admin")
ASYMMETRIC = {"RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "PS256", "EdDSA"}
SYMMETRIC = {"HS256", "HS384", "HS512"}
# The issuer of `sshapi token` / `sshapi dev` (api/local.py): the only HS issuer that may go
# without its own `secret_file` (it uses SSHAPI_JWT_SECRET or the data dir's secret).
LOCAL_ISSUER = "sshapi-local"


class ApiConfig(Strict):
    # Prefer: wait=N: the default (long, so a short command finishes in one request) and the cap.
    wait_default: float = Field(default=30.0, ge=0)
    wait_max: float = Field(default=300.0, ge=0)
    # How long an admitted job may wait for a channel slot (incl. connecting) before `error`.
    queue_timeout: float = Field(default=30.0, gt=0)
    # Command timeout when the request names none; always capped by the policy's max_timeout.
    default_timeout: float = Field(default=300.0, gt=0)
    max_body_bytes: int = Field(default=1 << 20, gt=0)
    max_stdin_bytes: int = Field(default=64 << 10, ge=0)
    max_argv_bytes: int = Field(default=128 << 10, gt=0)
    # /metrics needs a token with the admin scope when true (the default: its labels name the
    # hosts, and its counters describe the site's load). False: open to anyone who reaches it,
    # e.g. on a scrape-only listen address.
    metrics_require_admin: bool = True
    # A host's `hostname` and `port` in /v1/hosts for admins only when true (the default): other
    # callers use the host by its name and need not know where it is.
    host_details_require_admin: bool = True
    max_page: int = Field(default=200, ge=1)
    # Live followers (GET /v1/jobs/{id}/output?follow=true, /events) at once per identity.
    max_followers: int = Field(default=8, ge=1)
    # Job handles (POST /v1/jobs/{id}/handles): unexpired handles one job may have at once (the
    # TTL's cap is the policy rule's `handle_max_ttl`).
    max_handles_per_job: int = Field(default=16, ge=1)
    # The change feed (GET /v1/jobs/events): feeds open at once per identity (over all replicas
    # with Redis), the seconds between keep-alives of an idle feed, and how long events are kept
    # for a Last-Event-ID to resume from (older: a `reset` event says some were missed).
    max_change_feeds: int = Field(default=4, ge=1)
    change_keepalive: float = Field(default=15.0, gt=0, le=300)
    change_window: float = Field(default=86400.0, ge=60)
    # Directory listings (api/files/listings.py `Listings`): the most entries one listing reads from
    # the host (413 beyond: it stops reading at one more), how long a listing may take to read,
    # and its snapshot for the next pages: kept this many seconds after its last page, within
    # this many bytes for all identities together (the least recently used go first).
    max_list_entries: int = Field(default=100_000, ge=1)
    list_timeout: float = Field(default=60.0, gt=0)
    list_snapshot_ttl: float = Field(default=60.0, gt=0)
    list_snapshot_bytes: int = Field(default=256 << 20, ge=0)
    # A checksum (GET .../files/checksum) runs at most checksum_timeout seconds plus one for
    # every checksum_min_rate bytes of the file, never more than checksum_max_timeout (nor the
    # caller's max_timeout): sha256sum reads several hundred MB/s from the page cache.
    checksum_timeout: float = Field(default=10.0, gt=0)
    checksum_min_rate: int = Field(default=32 << 20, gt=0)
    checksum_max_timeout: float = Field(default=600.0, gt=0)
    # Resumable uploads (POST .../files/uploads, docs/files.md): an upload no chunk has reached
    # for upload_ttl seconds expires (its temporary file removed by the sweep, every
    # upload_sweep seconds); at most max_open_uploads open per identity; a chunk (one PATCH)
    # carries at most max_upload_chunk bytes.
    upload_ttl: float = Field(default=24 * 3600.0, gt=0)
    upload_sweep: float = Field(default=60.0, gt=0)
    max_open_uploads: int = Field(default=16, ge=1)
    max_upload_chunk: int = Field(default=256 << 20, ge=1)
    # Transfers on connections of their own whose SSH work runs on a thread (sshpool.lane), at
    # most transfer_lane_slots chunks at once, fairly shared by identity (docs/files.md, "The
    # transfer lane"). False: on the jobs' connections and event loop.
    transfer_lane: bool = True
    transfer_lane_slots: int = Field(default=8, ge=1, le=256)


class IssuerConfig(Strict):
    """One identity provider whose tokens are accepted. The token's `iss` picks the entry."""

    issuer: str
    audience: str
    # Fixed list: the token's `alg` header must be in it; keys are chosen by algorithm family.
    algorithms: list[str] = Field(default_factory=lambda: ["HS256"], min_length=1)
    # HS*: secret file (mode 0600). Unset: SSHAPI_JWT_SECRET or <data_dir>/jwt_secret.
    secret_file: Path | None = None
    # Asymmetric algorithms: PEM public keys, and/or a JWKS URL.
    public_keys: list[Path] = Field(default_factory=list)
    jwks_url: str | None = None
    jwks_cache_seconds: float = Field(default=300.0, gt=0)
    # A token with an unknown `kid` triggers a refetch at most this often.
    jwks_min_refresh_seconds: float = Field(default=30.0, ge=0)
    jwks_timeout: float = Field(default=5.0, gt=0)
    leeway: float = Field(default=30.0, ge=0, le=300)
    # The scopes this issuer may grant: a token's scopes are intersected with this list. Only an
    # issuer listing `admin` can make anyone an admin (by default none does).
    scopes: list[str] = Field(
        default_factory=lambda: ["jobs:read", "jobs:write", "files:read", "files:write"]
    )
    # The claim naming the caller's own Unix account (e.g. "preferred_username"): on a host
    # whose credentials are certificates, the caller runs as that account unless their policy
    # rule maps a fixed one. Unset: no account from tokens of this issuer.
    account_claim: str | None = Field(default=None, min_length=1, max_length=64)
    # The OAuth clients whose tokens are accepted (the token's `azp`, or RFC 9068's `client_id`
    # when it has no `azp`): set, a token of another client, or one naming none, is a 401.
    # Unset: any client of this issuer whose tokens carry the audience.
    clients: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)

    @field_validator("scopes")
    @classmethod
    def _known_scopes(cls, value: list[str]) -> list[str]:
        unknown = set(value) - set(SCOPES)
        if unknown:
            raise ValueError(f"unknown scopes {sorted(unknown)}: use {list(SCOPES)}")
        return value

    @field_validator("algorithms")
    @classmethod
    def _known_algorithms(cls, value: list[str]) -> list[str]:
        unknown = set(value) - ASYMMETRIC - SYMMETRIC
        if unknown:
            raise ValueError(f"unsupported algorithms {sorted(unknown)} ('none' is never allowed)")
        return value

    @model_validator(mode="after")
    def _has_keys(self) -> IssuerConfig:
        algorithms = set(self.algorithms)
        if algorithms & ASYMMETRIC and not (self.public_keys or self.jwks_url):
            raise ValueError(f"issuer {self.issuer!r}: asymmetric algorithms need keys or JWKS")
        if algorithms & ASYMMETRIC and algorithms & SYMMETRIC:
            # Whoever holds the shared secret could sign as the identity provider.
            raise ValueError(
                f"issuer {self.issuer!r} mixes HS and asymmetric algorithms: use one family"
            )
        if algorithms & SYMMETRIC:
            if self.secret_file is not None:
                read_secret_file(self.secret_file)  # strength and mode, at start
            elif self.issuer != LOCAL_ISSUER:
                raise ValueError(
                    f"HS issuer {self.issuer!r} needs its own secret_file: only the local "
                    f"issuer {LOCAL_ISSUER!r} uses SSHAPI_JWT_SECRET or the data dir's secret"
                )
        return self

    @property
    def symmetric(self) -> bool:
        return bool(set(self.algorithms) & SYMMETRIC)


class Account(Strict):
    """The remote account a policy maps an identity to on one host. On a host whose
    credentials are keys, with its key files; on a certificate host, the name alone."""

    username: str
    client_keys: list[str] = Field(default_factory=list)


class SchedulerConfig(Strict):
    """The batch scheduler on a host's login node: its commands run over the host's pool."""

    kind: Literal["slurm"] = "slurm"
    # Tracking: one squeue per host per interval; doubles while nothing changes, up to the max.
    poll_interval: float = Field(default=2.0, gt=0)
    max_poll_interval: float = Field(default=30.0, gt=0)
    # How long a submission whose outcome is unknown may still show up in the scheduler.
    settle: float = Field(default=5.0, gt=0)


class SshdLimits(Strict):
    """What the host's sshd (and site) allow, to check the pools of all replicas against."""

    # MaxStartups' first number: unauthenticated connections at once before sshd drops some.
    max_startups: int = Field(default=10, ge=1)
    # PerSourceMaxStartups (OpenSSH >= 8.5), when replicas share one source address (one
    # machine, or behind NAT); unset: not configured on the host.
    per_source_max_startups: int | None = Field(default=None, ge=1)
    # MaxSessions: channels per connection.
    max_sessions: int = Field(default=10, ge=1)
    # Sessions the sshd may hold at once, all accounts together (a site limit: memory, its
    # processes; per account: pam_limits maxlogins, nproc, policy).
    max_total_sessions: int | None = Field(default=None, ge=1)


class HostConfig(Strict):
    # One login node: its name or address. Several: `nodes` instead (not both).
    hostname: str = ""
    # A cluster's login nodes (`name` or `name:port`): each account's work goes to one node
    # that is up, moving when it fails or is drained (docs/operations.md, "Login nodes").
    nodes: list[str] = Field(default_factory=list, max_length=64)
    # False when the nodes do not share the home file systems: an account's file requests
    # then always go to the same node (its first by rendezvous, up or not).
    shared_files: bool = True
    port: int = Field(default=22, ge=1, le=65535)
    # The account used when the policy names none for this host (on a certificate host: the
    # API's own, for health probes and the scheduler's tracker; callers run as theirs).
    username: str
    client_keys: list[str] = Field(default_factory=list)
    credentials: Credentials = Field(default_factory=KeyCredentials)
    known_hosts: str
    # Mapping anyone to root is refused unless the operator says so here.
    allow_root: bool = False
    description: str = ""
    # The SSH library for this host; unset: SSHAPI_BACKEND.
    backend: Literal["asyncssh", "paramiko", "ssh2"] | None = None
    # How commands reach the host: a session channel each ("channel"), one resident executor
    # per connection ("agent": the login shell runs once per connection), or the executor on
    # each connection where the host's python3 answers and channels on the others ("auto",
    # the default; channels with max_sessions 1). docs/pool.md#agent-mode.
    exec_mode: Literal["channel", "agent", "auto"] = "auto"
    # Agent mode's interpreter on the host (3.6 or newer), found in the login shell's PATH.
    agent_python: str = Field(default="python3", min_length=1, max_length=256)
    # sshpool's own Limits, validated by pydantic: unknown keys and bad values are refused.
    limits: Limits = Field(default_factory=Limits)
    # Set: the host accepts batch jobs (`batch` in POST /v1/jobs).
    scheduler: SchedulerConfig | None = None
    # The host's side (OpenSSH defaults): see ssh_budget.
    sshd: SshdLimits = Field(default_factory=SshdLimits)
    # Paths under the account's home the files API never creates, replaces, moves or deletes,
    # whatever the file roots (403 protected-path; docs/files.md). Setting it replaces the
    # default list: copy PROTECTED_PATHS and add to it.
    protected_paths: list[str] = Field(default_factory=lambda: list(PROTECTED_PATHS))

    @model_validator(mode="after")
    def _keys_for_key_logins(self) -> HostConfig:
        certificate = isinstance(self.credentials, CertificateCredentials)
        if not certificate and not self.client_keys:
            raise ValueError("client_keys: at least one key file (or credentials.kind = ...)")
        if certificate and self.client_keys:
            raise ValueError("a certificate host logs in with certificates: drop client_keys")
        return self

    @model_validator(mode="after")
    def _hostname_or_nodes(self) -> HostConfig:
        if bool(self.hostname) == bool(self.nodes):
            raise ValueError("a host has either `hostname` (one node) or `nodes` (several)")
        if self.nodes:
            self.target()  # a malformed or repeated node fails the start
        return self

    @property
    def name_shown(self) -> str:
        """The host name for people: `hostname`, or the nodes joined."""
        return self.hostname or ",".join(self.nodes)

    @property
    def certificates(self) -> CertificateCredentials | None:
        """The certificate settings when this host's accounts log in with certificates."""
        creds = self.credentials
        return creds if isinstance(creds, CertificateCredentials) else None

    @field_validator("protected_paths")
    @classmethod
    def _relative_paths(cls, value: list[str]) -> list[str]:
        cleaned = []
        for path in value:
            parts = [p for p in path.split("/") if p]
            if path.startswith(("/", "~")) or not parts or any(p in (".", "..") for p in parts):
                raise ValueError(
                    f"protected path {path!r}: a path relative to the home, without . or .."
                )
            cleaned.append("/".join(parts))
        return cleaned

    def handshakes(self, accounts: int = 1) -> tuple[int, str]:
        """The most handshakes one pool has in flight to this host's sshd, and how that comes:
        the gate (max_handshakes), or fewer accounts' connections than it holds."""
        lim = self.limits
        if accounts * lim.max_connections < lim.max_handshakes:
            n = accounts * lim.max_connections
            return n, f"{accounts} account(s) x max_connections {lim.max_connections}"
        return lim.max_handshakes, f"max_handshakes {lim.max_handshakes}"

    def ssh_budget(self, replicas: int, accounts: int = 1) -> list[str]:
        """Where `replicas` API processes, each with this pool, would exceed the host's sshd's
        limits, counted over the whole sshd: its `accounts` (the pool's handshake gate and
        connection budget are per sshd, shared by every account reaching it). Each replica has
        its own pool, so the host sees the sum: handshakes in flight up to replicas x
        max_handshakes (or fewer, `handshakes`), which must stay below MaxStartups' first
        number (beyond it sshd drops connections at random); connections up to replicas x
        min(accounts x max_connections, max_total_connections), each with up to max_sessions
        sessions. Per connection,
        max_sessions stays below MaxSessions: the kill of a cancelled command needs a spare
        channel, and sshd frees a slot only after the command exits. In agent mode a
        connection's channels are its executor's and up to max_sessions - 1 SFTP sessions'
        (commands open none): the same count, and the same spare, as sshd frees an SFTP
        session's slot only after its sftp-server exited; max_sessions 1 would leave no channel
        for SFTP ("auto" then runs channels: no finding)."""
        lim, sshd = self.limits, self.sshd
        found = []
        handshakes, gate = self.handshakes(accounts)
        if replicas * handshakes >= sshd.max_startups:
            found.append(
                f"{replicas} replica(s) x {gate} >= MaxStartups {sshd.max_startups}: "
                "sshd will drop handshakes"
            )
        per_source = sshd.per_source_max_startups
        if per_source is not None and replicas * handshakes > per_source:
            found.append(
                f"{replicas} replica(s) x {gate} > PerSourceMaxStartups {per_source}: sshd will "
                "drop handshakes from one address"
            )
        if lim.max_sessions >= sshd.max_sessions:
            found.append(
                f"max_sessions {lim.max_sessions} >= MaxSessions {sshd.max_sessions}: "
                + (
                    "the executor's channel and max_sessions - 1 SFTP sessions leave "
                    if self.exec_mode == "agent"
                    else ""
                )
                + "no spare channel per connection"
            )
        if self.exec_mode == "agent" and lim.max_sessions < 2:
            found.append(
                "exec_mode agent with max_sessions 1: no channel for SFTP beside the executor"
            )
        held = min(accounts * lim.max_connections, lim.max_total_connections)
        sessions = replicas * held * lim.max_sessions
        if sshd.max_total_sessions is not None and sessions > sshd.max_total_sessions:
            if accounts * lim.max_connections <= lim.max_total_connections:
                connections = f"{accounts} account(s) x max_connections {lim.max_connections}"
            else:
                connections = f"max_total_connections {lim.max_total_connections}"
            found.append(
                f"{replicas} replica(s) x {connections} x max_sessions "
                f"{lim.max_sessions} = {sessions} > max_total_sessions {sshd.max_total_sessions}"
            )
        return found

    def target(self, account: Account | None = None, identity: str = "") -> Target:
        """The Target of `account` (None: the host's own `username`). On a certificate host it
        logs in with a certificate naming `identity` (sshapi's own: "sshapi"), with the short
        per-account idle timeout and no connections kept open. A host with `nodes` is a
        cluster of login nodes (sshpool routes each command to one)."""
        username = account.username if account else self.username
        common: dict[str, Any] = {
            "host": self.hostname or "cluster",
            "port": self.port,
            "username": username,
            "known_hosts": self.known_hosts,
            "backend": self.backend,
            "exec_mode": self.exec_mode,
            "agent_python": self.agent_python,
            "nodes": tuple(self.nodes),
            "shared_files": self.shared_files,
        }
        certs = self.certificates
        if certs is None:
            keys = account.client_keys if account else self.client_keys
            return Target(client_keys=tuple(keys), limits=self.limits, **common)
        limits = replace(self.limits, idle_timeout=certs.idle_timeout, min_connections=0)
        return Target(
            client_keys=(), limits=limits, ca=certs.ca, identity=identity or "sshapi", **common
        )


class ParamSpec(Strict):
    type: Literal["str", "int", "float", "bool"] = "str"
    required: bool = True
    default: str | int | float | bool | None = None
    description: str = ""
    # str: a full-match regex, a length cap, a closed set of values.
    pattern: str | None = None
    max_length: int = Field(default=256, ge=1)
    choices: list[str] | None = None
    # A str value starting with '-' is refused unless it lands after a literal "--" element or
    # this is true: a value must never turn into an option of the templated program.
    allow_leading_dash: bool = False
    # int/float bounds.
    min: float | None = None
    max: float | None = None

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            re.compile(value)
        return value


class TemplateConfig(Strict):
    """An operator-defined command: argv with `{param}` placeholders and typed parameters."""

    argv: list[str] = Field(min_length=1)
    description: str = ""
    params: dict[str, ParamSpec] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _placeholders_declared(self) -> TemplateConfig:
        used = {m for arg in self.argv for m in PLACEHOLDER.findall(arg)}
        if PLACEHOLDER.search(self.argv[0]):
            raise ValueError("the program (argv[0]) of a template cannot be a parameter")
        missing = used - set(self.params)
        if missing:
            raise ValueError(f"placeholders without a params entry: {sorted(missing)}")
        return self


Pattern = Annotated[str, Field(min_length=1)]


class PolicyRule(Strict):
    """Who (issuer and subject glob patterns) may do what. The first matching rule applies.

    `issuer` is required: identity is (iss, sub), and a rule written for `alice` must not also
    match another identity provider's `alice`. `"*"` is allowed, but must be written."""

    issuer: Pattern
    subject: Pattern = "*"
    hosts: list[str] = Field(default_factory=lambda: ["*"])
    # Hosts where raw shell lines (`command`) and batch scripts (shell scripts too) are allowed.
    shell_hosts: list[str] = Field(default_factory=list)
    # Programs (glob patterns matched against the whole argv[0]) an `argv` job may run. ["*"]:
    # any; []: no argv at all, so templates (and shell_hosts) are the only way in. A program
    # that runs others (sh, env, xargs, find, python...) in this list opens everything again.
    programs: list[str] = Field(default_factory=lambda: ["*"])
    templates: list[str] = Field(default_factory=lambda: ["*"])
    # Remote account per host name; hosts not listed use the host's default account.
    accounts: dict[str, Account] = Field(default_factory=dict)
    max_timeout: float = Field(default=3600.0, gt=0)
    max_output: int = Field(default=1 << 20, ge=0)
    # Token bucket: sustained submissions per second and the burst allowed above it.
    rate: float = Field(default=5.0, gt=0)
    burst: int = Field(default=20, ge=1)
    max_concurrent: int = Field(default=8, ge=1)
    # Files (/v1/hosts/{host}/files): the directories each host's paths must resolve into, per
    # host name pattern (first match). `~` is the account's home, `{account}` its name, `{sub}`
    # the caller's subject; a relative root is under the home. No matching entry (the default):
    # no file access on that host. Nobody gets the home without it written here.
    file_roots: dict[str, list[str]] = Field(default_factory=dict)
    # A rule that may write files on an account which a restricted rule (no shell there, no
    # `"*"` in programs: templates only, say) also uses makes the start fail: the writer could
    # plant what those users' programs read and run (Config._writes_beside_restricted). True
    # leaves this rule out of that check, as writer and as restricted: the operator has checked
    # that the roots hold nothing those programs read, or accepts it.
    allow_writes_on_templates_account: bool = False
    # Largest file an upload may create, bytes one request may move (either way), transfers
    # (uploads + downloads) one identity may run at once.
    max_file_size: int = Field(default=4 << 30, ge=0)
    max_transfer_bytes: int = Field(default=4 << 30, ge=1)
    max_transfers: int = Field(default=4, ge=1)
    # Directory listings one identity may read from hosts at once (429 `too-many-listings`);
    # the next pages of a listing come from its snapshot and take no place.
    max_listings: int = Field(default=2, ge=1)
    # Job handles: the longest `ttl` a handle gets (a longer one asked for is cut to this).
    handle_max_ttl: float = Field(default=7 * 86400.0, gt=0)
    # Webhook URLs (fnmatch, scheme included) this rule's callers may use, within [webhooks]
    # allowed_urls and allowed_networks: it narrows them, never widens. []: no webhooks.
    webhook_urls: list[str] = Field(default_factory=lambda: ["*"])

    @model_validator(mode="before")
    @classmethod
    def _issuer_required(cls, data: Any) -> Any:
        if isinstance(data, dict) and "issuer" not in data:
            subject = data.get("subject", "*")
            raise ValueError(
                f"policy rule for subject {subject!r} has no `issuer`: write the issuer it is "
                'for (identity is issuer + subject), or issuer = "*" to mean any issuer'
            )
        return data


class Config(Strict):
    api: ApiConfig = Field(default_factory=ApiConfig)
    webhooks: WebhooksConfig = Field(default_factory=WebhooksConfig)
    issuers: list[IssuerConfig] = Field(min_length=1)
    hosts: dict[Annotated[str, Field(pattern=NAME)], HostConfig] = Field(default_factory=dict)
    templates: dict[Annotated[str, Field(pattern=NAME)], TemplateConfig] = Field(
        default_factory=dict
    )
    policy: list[PolicyRule] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        issuers = [i.issuer for i in self.issuers]
        if len(set(issuers)) != len(issuers):
            raise ValueError("issuer names must be unique")
        files = [i.secret_file.resolve() for i in self.issuers if i.secret_file and i.symmetric]
        if len(set(files)) != len(files):
            raise ValueError("each HS issuer needs a secret_file of its own (one secret each)")
        for name, host in self.hosts.items():
            if host.username == "root" and not host.allow_root:
                raise ValueError(f"host {name!r} logs in as root: set allow_root = true to mean it")
        for n, rule in enumerate(self.policy):
            for host_name, account in rule.accounts.items():
                mapped = self.hosts.get(host_name)
                if mapped is None:
                    raise ValueError(
                        f"policy rule {n} maps an account on unknown host {host_name!r}"
                    )
                if account.username == "root" and not mapped.allow_root:
                    raise ValueError(f"policy rule {n} maps to root on {host_name!r}: allow_root")
                if mapped.certificates is None and not account.client_keys:
                    raise ValueError(
                        f"policy rule {n} maps account {account.username!r} on {host_name!r} "
                        "without client_keys (a certificate host needs none; this one has keys)"
                    )
        self._writes_beside_restricted()
        return self

    def _writes_beside_restricted(self) -> None:
        """Refuse a rule that may write files on an account that a restricted rule also uses.

        Restricted: no raw shell on that host and no `"*"` in `programs` (`programs = []`,
        `shell_hosts = []` is "templates only"). Everyone mapped to one account is one Unix
        user: a writer could put into that home what the restricted users' programs read and
        run (a Python `.pth` file, a tool's configuration...), so the restriction would hold
        only as long as nobody uploads. The start fails rather than warns: this combination
        was the default before `file_roots` became opt-in, and a warning in a log nobody reads
        would leave the hole open on upgrade. A rule that sets
        `allow_writes_on_templates_account = true` is left out (as writer and as restricted)."""

        def writes(rule: PolicyRule) -> bool:
            # Issuers whose tokens this rule can match, and whether any may grant files:write.
            return any(
                fnmatchcase(i.issuer, rule.issuer) and ({"files:write", "admin"} & set(i.scopes))
                for i in self.issuers
            )

        for host_name, host in self.hosts.items():
            writers: dict[tuple[str, int, str], list[int]] = {}
            restricted: dict[tuple[str, int, str], list[int]] = {}
            for n, rule in enumerate(self.policy):
                if not any(fnmatchcase(host_name, p) for p in rule.hosts):
                    continue
                account = rule.accounts.get(host_name)
                key = (host.name_shown, host.port, account.username if account else host.username)
                roots = next(
                    (r for p, r in rule.file_roots.items() if fnmatchcase(host_name, p)), None
                )
                if rule.allow_writes_on_templates_account:
                    continue
                if roots and writes(rule):
                    writers.setdefault(key, []).append(n)
                shell = any(fnmatchcase(host_name, p) for p in rule.shell_hosts)
                if not shell and "*" not in rule.programs:
                    restricted.setdefault(key, []).append(n)
            for key, found in writers.items():
                if key in restricted:
                    raise ValueError(
                        f"host {host_name!r}, account {key[2]!r}: policy rule(s) "
                        f"{_rules(self.policy, found)} may write files where rule(s) "
                        f"{_rules(self.policy, restricted[key])} are restricted to templates or "
                        "listed programs; a writer could plant what their programs run. Map "
                        "them to different accounts, drop file_roots, or set "
                        "allow_writes_on_templates_account = true on the rules that mean it"
                    )


def _rules(policy: list[PolicyRule], numbers: list[int]) -> str:
    return ", ".join(f"{n} (subject {policy[n].subject!r})" for n in numbers)


def load_config(path: Path) -> Config:
    with path.open("rb") as f:
        return Config.model_validate(tomllib.load(f))
