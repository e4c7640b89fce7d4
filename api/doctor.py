"""`sshapi doctor`: for each configured host, what the API will do there and whether the host
can take it. Each finding is one line: host, check, ok / WARN / FAIL, and what to change.

Checks, in order (a failed connection step skips the rest for that host):
- reachable: a TCP connection to hostname:port answers with an SSH banner;
- host key / auth: the pool connects with the host's default account, key and known_hosts;
- login shell: `true` prints nothing. The pool's wrapper (sshpool/command.py) finds the process
  group id on a marker line; what the login prints before it (an rc file that echoes) is kept
  out of the output up to 64 KiB, costs every command its time, and past that breaks timeout
  and cancel kills;
- shell start: the fastest of a few `true` runs on the warm connection (channel open + login
  shell start + exit); past 20 ms every job pays it (a module system or pyenv in the rc: ~100 ms);
- sshd limits: MaxSessions / MaxStartups / PerSourceMaxStartups from `sshd -T` on the host when
  the account may run it (usually root only), else the configured `[hosts.X.sshd]` values; the
  pool limits x SSHAPI_REPLICAS x workers checked against them over the whole sshd, all the
  accounts the policy maps to the host together (HostConfig.ssh_budget);
- agent: whether the host's python3 (`agent_python`) can run agent mode's executor, and the
  fastest `true` through it; a host in agent or auto mode (the default) without one runs its
  commands as channels (WARN), a host in channel mode is told what agent mode would give it
  (ok);
- clock (certificate hosts): the host's `date +%s` against ours; certificates are back-dated
  60 s, so a host more than CLOCK_WARN_S behind or ahead is a WARN (run NTP on both);
- penalties: OpenSSH >= 9.8's PerSourcePenalties from `sshd -T` when readable, and whether this
  machine's address (the host's `$SSH_CLIENT`) is in PerSourcePenaltyExemptList: not exempt, a
  few failed logins of any account lock every caller out for a while (WARN); `sshd -T` not
  readable: the banner's OpenSSH version says whether penalties may be on (WARN: unknown);
- slurm (hosts with a scheduler): `sbatch --version` and `squeue` answer over SSH.

The login shell and shell start checks run as channels whatever the host's exec_mode: that is
where the login's noise and cost show (agent mode pays them once per connection).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import time
from dataclasses import dataclass, replace
from typing import Literal

from api.config import Config, HostConfig, SshdLimits
from api.policy import Policy
from api.settings import Settings
from api.sshd_budget import budgets
from sshpool import (
    AuthenticationFailed,
    CommandResult,
    ConnectTimeout,
    HostKeyMismatch,
    Pool,
    SSHPoolError,
)

Status = Literal["ok", "WARN", "FAIL"]
SHELL_START_WARN_MS = 20.0
SHELL_START_RUNS = 5
# sshd -T needs sshd's path, often outside a user's PATH; /bin/sh whatever the login shell.
SSHD_T = ["/bin/sh", "-c", "PATH=$PATH:/usr/sbin:/sbin exec sshd -T 2>&1"]
# The host's clock and this machine's address as the host sees it (the first of SSH_CLIENT).
WHERE_WHEN = ["/bin/sh", "-c", "date +%s; echo $SSH_CLIENT"]
# Half the 60 s certificates are back-dated: a host further apart refuses them soon.
CLOCK_WARN_S = 30.0
PENALTIES_SINCE = (9, 8)  # OpenSSH's PerSourcePenalties, on by default


@dataclass(frozen=True, slots=True)
class Finding:
    host: str
    check: str
    status: Status
    detail: str

    def line(self) -> str:
        return f"{self.host:16} {self.check:12} {self.status:4}  {self.detail}"


def processes(settings: Settings) -> tuple[int, int]:
    """(replicas, workers per replica): every process has its own pool."""
    workers = getattr(settings, "workers", 1)  # SSHAPI_WORKERS, where this version has it
    return settings.replicas, int(workers) if isinstance(workers, int) else 1


async def diagnose(config: Config, settings: Settings, timeout: float = 10.0) -> list[Finding]:
    """Every host's findings, hosts one after another (a doctor must not load the hosts)."""
    found: list[Finding] = []
    async with Pool(backend=settings.backend) as pool:
        for name, host in config.hosts.items():
            accounts = len(Policy(config).sshd_targets(name))
            found += await check_host(pool, name, host, settings, timeout, accounts)
    return found


def _auth_advice(name: str, host: HostConfig) -> str:
    """What to check when sshd refused the login, in the order it most often is."""
    certs = host.certificates
    if certs is None:
        return (
            f"install the public key of {', '.join(host.client_keys)} in "
            f"~{host.username}/.ssh/authorized_keys on the host, or fix [hosts.{name}] username"
        )
    return (
        f"sshd refused a fresh certificate for {host.username!r} (sshd's log says which of "
        f"these): the CA is not trusted (TrustedUserCAKeys must hold the public key of "
        f"{certs.ca_key}, fingerprint {certs.ca.fingerprint}); the principal is refused (the "
        f"account {host.username!r} must exist, and the AuthorizedPrincipalsCommand of "
        f"deploy/sshd_config.certificates must name it as the service account); the clocks "
        f"differ by more than 60 s (certificates are back-dated 60 s and valid "
        f"{certs.cert_ttl:g} s: run NTP on both); source-address "
        f"{certs.source_address or 'any'} does not include this machine; or the API's address "
        "is penalised after failed logins (OpenSSH >= 9.8 PerSourcePenalties: exempt it with "
        "PerSourcePenaltyExemptList, sshd_config.tuned-9.8)"
    )


async def check_host(
    pool: Pool,
    name: str,
    host: HostConfig,
    settings: Settings,
    timeout: float,
    accounts: int = 1,
) -> list[Finding]:
    """`accounts`: how many accounts the policy maps to the host (its sshd's budget counts
    them all)."""
    found: list[Finding] = []

    def add(check: str, status: Status, detail: str) -> None:
        found.append(Finding(name, check, status, detail))

    # Every login node of a cluster must answer; its commands below go to one of them.
    cluster = host.target()
    nodes = [cluster.node_target(n) for n in cluster.nodes] or [cluster]
    where = ", ".join(f"{t.host}:{t.port}" for t in nodes)
    banners = []
    for node in nodes:
        banner = await _banner(node.host, node.port, timeout)
        banners.append(banner)
        if not banner.startswith("SSH-"):
            add(
                "reachable",
                "FAIL",
                f"{node.host}:{node.port}: {banner}; check hostname/port and the firewall",
            )
            return found
        add("reachable", "ok", f"{node.host}:{node.port} ({banner})")

    target = replace(host.target(), exec_mode="channel")
    try:
        await pool.run(target, ["true"], timeout=timeout, acquire_timeout=timeout)
    except HostKeyMismatch as exc:
        add(
            "host key",
            "FAIL",
            f"{exc}: the key of {where} is not the one in known_hosts {host.known_hosts}; "
            "verify it with the host's admin, then add it (ssh-keyscan -p PORT HOST)",
        )
        return found
    except AuthenticationFailed as exc:
        add("host key", "ok", f"known ({host.known_hosts})")
        add("auth", "FAIL", f"{exc}: {_auth_advice(name, host)}")
        return found
    except (ConnectTimeout, SSHPoolError) as exc:
        add("connect", "FAIL", f"{type(exc).__name__}: {exc}")
        return found
    add("host key", "ok", f"known ({host.known_hosts})")
    certs = host.certificates
    how = f"a certificate of CA {certs.ca.fingerprint}" if certs else ", ".join(host.client_keys)
    add("auth", "ok", f"{host.username} with {how}")
    if certs is not None:
        found.append(ca_key_finding(name, certs.ca.key_type))

    runs: list[CommandResult] = []
    times: list[float] = []
    for _ in range(SHELL_START_RUNS):
        start = time.perf_counter()
        runs.append(await pool.run(target, ["true"], timeout=timeout, acquire_timeout=timeout))
        times.append((time.perf_counter() - start) * 1000.0)
    noise = runs[0].preamble or runs[0].stdout
    if noise:
        add(
            "login shell",
            "FAIL",
            f"prints {noise[:60]!r} before every command: every command pays for it, and past "
            "64 KiB the pool's process-group marker is lost (no kill on timeout or cancel); "
            f"make the account's shell rc files silent for non-interactive shells "
            f"(~{host.username})",
        )
    elif runs[0].stderr:
        add(
            "login shell",
            "WARN",
            f"prints {runs[0].stderr[:60]!r} on stderr before every command: it lands in every "
            "job's stderr; make the account's rc files silent for non-interactive shells",
        )
    else:
        add("login shell", "ok", "prints nothing before the command")
    fastest = min(times)
    if fastest > SHELL_START_WARN_MS:
        add(
            "shell start",
            "WARN",
            f"{fastest:.1f} ms for `true` (fastest of {SHELL_START_RUNS}) > "
            f"{SHELL_START_WARN_MS:g} ms: every job pays it; give the account a lean rc "
            "(no module system or pyenv init for non-interactive shells)",
        )
    else:
        add("shell start", "ok", f"{fastest:.1f} ms for `true` (fastest of {SHELL_START_RUNS})")
    found.append(await _agent(pool, name, host, timeout))

    sshd_t = await _run_text(pool, host, SSHD_T, timeout)
    where_when = await _run_text(pool, host, WHERE_WHEN, timeout, timed=True)
    remote, _, client = where_when.partition("\n")
    if certs is not None:
        found.append(clock_finding(name, remote.split(maxsplit=1)[:1]))
    found += _sshd_limits(name, host, settings, accounts, sshd_t)
    found.append(penalties_finding(name, sshd_t, banners[0], client.split(maxsplit=1)[:1]))
    if host.scheduler is not None:
        found += await _slurm(pool, name, host, timeout)
    return found


def ca_key_finding(name: str, key_type: str) -> Finding:
    """An Ed25519 CA costs the host's sshd more per login: OpenSSH checks a certificate's
    Ed25519 signature with its own portable code, at each of a login's two authentication
    requests; an ECDSA or RSA one through OpenSSL (docs/benchmarks.md has the figures)."""
    if key_type != "ssh-ed25519":
        return Finding(name, "ca key", "ok", key_type)
    return Finding(
        name,
        "ca key",
        "WARN",
        "ssh-ed25519: sshd checks an Ed25519 CA's signature with OpenSSH's own slower code, "
        "twice per login (about 1.4 x the sshd CPU of a login with an ECDSA P-256 CA, "
        "docs/benchmarks.md); with many accounts, make an ECDSA CA (ssh-keygen -t ecdsa -b 256), "
        'trust both on the hosts, then switch ca_key (docs/operations.md, "The CA key")',
    )


async def _banner(hostname: str, port: int, timeout: float) -> str:
    """The host's SSH banner, or why there is none."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(hostname, port)
            try:
                line = await reader.readline()
            finally:
                writer.close()
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return f"cannot connect ({exc.strerror or exc})"
    text = line.decode("ascii", "replace").strip()
    return text if text.startswith("SSH-") else f"not an SSH server (said {text[:40]!r})"


def parse_sshd_t(text: str, configured: SshdLimits) -> SshdLimits | None:
    """The limits `sshd -T` printed, or None when it printed no configuration."""
    values = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
    if "maxsessions" not in values or "maxstartups" not in values:
        return None
    per_source = values.get("persourcemaxstartups", "none")
    return configured.model_copy(
        update={
            "max_sessions": int(values["maxsessions"]),
            "max_startups": int(values["maxstartups"].split(":")[0]),
            "per_source_max_startups": None if per_source == "none" else int(per_source),
        }
    )


async def _run_text(
    pool: Pool, host: HostConfig, argv: list[str], timeout: float, timed: bool = False
) -> str:
    """What `argv` prints on the host (its error's name when it cannot run). `timed`: the
    first line becomes the host's time minus ours (seconds, ours taken mid-call)."""
    start = time.time()
    try:
        result = await pool.run(host.target(), argv, timeout=timeout, acquire_timeout=timeout)
    except SSHPoolError as exc:
        return type(exc).__name__
    text = result.stdout.decode(errors="replace")
    if not timed:
        return text
    first, _, rest = text.partition("\n")
    ours = (start + time.time()) / 2
    skew = f"{int(first) - ours:.1f}" if first.strip().isdigit() else "?"
    return f"{skew}\n{rest}"


def clock_finding(name: str, skew: list[str]) -> Finding:
    """The host's clock minus ours (`skew`: ["<seconds>"], or [] / ["?"] when unread)."""
    try:
        seconds = float(skew[0])
    except (IndexError, ValueError):
        return Finding(name, "clock", "WARN", "could not read the host's `date +%s`")
    way = "ahead of" if seconds > 0 else "behind"
    detail = f"the host's clock is {abs(seconds):.0f} s {way} this machine's"
    if abs(seconds) > CLOCK_WARN_S:
        return Finding(
            name,
            "clock",
            "WARN",
            f"{detail}: certificates are back-dated 60 s, so past that the host refuses them "
            "as not yet valid (or expired); run NTP on both",
        )
    return Finding(name, "clock", "ok", f"{detail} (certificates are back-dated 60 s)")


def _listed(address: str, exempt: str) -> bool:
    """Whether `address` is in an sshd address list ("10.0.0.0/8,192.0.2.7")."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    for item in exempt.split(","):
        try:
            if ip in ipaddress.ip_network(item.strip(), strict=False):
                return True
        except ValueError:
            continue
    return False


def penalties_finding(name: str, sshd_t: str, banner: str, client: list[str]) -> Finding:
    """PerSourcePenalties as `sshd -T` printed them, or as the banner's version suggests, and
    whether this machine (`client`: its address as the host saw it) is exempt."""
    ours = client[0] if client else "this machine"
    fix = (
        f"add the API's addresses ({ours}) to PerSourcePenaltyExemptList in the host's "
        "sshd_config (docs/operations.md, certificates)"
    )
    values = dict(line.split(" ", 1) for line in sshd_t.splitlines() if " " in line)
    if "maxsessions" in values:  # sshd -T printed the configuration
        penalties = values.get("persourcepenalties")
        if penalties is None:
            return Finding(name, "penalties", "ok", "none: this sshd predates PerSourcePenalties")
        if penalties.strip() == "no":
            return Finding(name, "penalties", "ok", "PerSourcePenalties no")
        exempt = values.get("persourcepenaltyexemptlist", "none").strip()
        if _listed(ours, exempt):
            return Finding(
                name, "penalties", "ok", f"on, and {ours} is in PerSourcePenaltyExemptList"
            )
        return Finding(
            name,
            "penalties",
            "WARN",
            f"PerSourcePenalties on ({penalties.split(' ', 1)[0]} ...) and {ours} is not "
            f"exempt (PerSourcePenaltyExemptList {exempt}): a few failed logins, of any "
            f"account, shut every caller out for a while; {fix}",
        )
    version = re.search(r"OpenSSH_(\d+)\.(\d+)", banner)
    if version and (int(version[1]), int(version[2])) < PENALTIES_SINCE:
        return Finding(
            name, "penalties", "ok", f"none: {version[0]} predates PerSourcePenalties (9.8)"
        )
    return Finding(
        name,
        "penalties",
        "WARN",
        f"unknown: sshd -T is not allowed here and the banner says {banner[:40]!r}; since "
        f"OpenSSH 9.8 PerSourcePenalties is on by default: {fix}",
    )


def _sshd_limits(
    name: str, host: HostConfig, settings: Settings, accounts: int, text: str
) -> list[Finding]:
    found: list[Finding] = []
    read = parse_sshd_t(text, host.sshd)
    if read is None:
        reason = (text.strip().splitlines() or ["no output"])[-1][:80]
        sshd = host.sshd
        source = f"configured [hosts.{name}.sshd] (sshd -T not allowed: {reason})"
    else:
        sshd = read
        source = "sshd -T on the host"
    per_source = sshd.per_source_max_startups
    found.append(
        Finding(
            name,
            "sshd limits",
            "ok",
            f"MaxSessions {sshd.max_sessions}, MaxStartups {sshd.max_startups}, "
            f"PerSourceMaxStartups {per_source or 'none'} from {source}",
        )
    )
    if read is not None and read != host.sshd:
        found.append(
            Finding(
                name,
                "sshd limits",
                "WARN",
                f"[hosts.{name}.sshd] says MaxSessions {host.sshd.max_sessions}, MaxStartups "
                f"{host.sshd.max_startups}: set it to what the host runs (the API's start-up "
                "check reads the configuration)",
            )
        )
    replicas, workers = processes(settings)
    lim = host.limits
    handshakes, gate = host.handshakes(accounts)
    pools = budgets(settings.redis_url, replicas * workers, lim.max_handshakes)
    budget = host.model_copy(update={"sshd": sshd}).ssh_budget(pools, accounts)
    how = "leased through SSHAPI_REDIS_URL" if settings.redis_url else "static shares"
    procs = (
        f"{replicas} replica(s) x {workers} worker(s) = {replicas * workers} process(es) "
        f"sharing {pools} budget(s) ({how}), {accounts} account(s) on one sshd"
    )
    for problem in budget:
        found.append(
            Finding(
                name,
                "budget",
                "FAIL",
                f"{procs}; {problem}; lower [hosts.{name}.limits] max_handshakes / max_sessions "
                "/ max_connections, SSHAPI_REPLICAS or workers, or raise the host's limits",
            )
        )
    if not budget:
        per_connection = f"max_sessions {lim.max_sessions}"
        if host.exec_mode == "agent" or (host.exec_mode == "auto" and lim.max_sessions > 1):
            fallback = ""
            if host.exec_mode == "auto":
                fallback = f"; max_sessions {lim.max_sessions} where it does not start"
            per_connection = (
                f"1 executor + {lim.max_sessions - 1} SFTP channels (up to "
                f"{lim.agent_max_commands} commands through the executor{fallback})"
            )
        found.append(
            Finding(
                name,
                "budget",
                "ok",
                f"{procs}; {pools} budget(s) x {gate} = "
                f"{pools * handshakes} handshakes < MaxStartups "
                f"{sshd.max_startups}; {per_connection} < MaxSessions {sshd.max_sessions}",
            )
        )
    return found


async def _agent(pool: Pool, name: str, host: HostConfig, timeout: float) -> Finding:
    """Whether agent mode's executor starts on the host, and what a command costs through it."""
    target = replace(host.target(), exec_mode="agent")
    times: list[float] = []
    try:
        for _ in range(SHELL_START_RUNS):
            start = time.perf_counter()
            await pool.run(target, ["true"], timeout=timeout, acquire_timeout=timeout)
            times.append((time.perf_counter() - start) * 1000.0)
    except SSHPoolError as exc:
        return Finding(name, "agent", "FAIL", f"{type(exc).__name__}: {exc}")
    stats = pool.stats()[target]
    tries = host.exec_mode == "agent" or (host.exec_mode == "auto" and host.limits.max_sessions > 1)
    if stats["exec_mode"] != "agent":
        # A host that would run agent mode and cannot is told (auto: channels work, but each
        # account's connection tries again every few minutes, a hanging python3 costing it its
        # connect_timeout); a channel host only learns what agent mode would do.
        if host.exec_mode == "agent":
            advice = "agent mode falls back to channels here; install python3 >= 3.6 or set "
            advice += f"[hosts.{name}] agent_python"
        elif tries:
            advice = "exec_mode auto runs channels here; install python3 >= 3.6, set "
            advice += f'[hosts.{name}] agent_python, or exec_mode = "channel" to stop trying'
        else:
            advice = "agent mode would run as channels here"
        return Finding(
            name, "agent", "WARN" if tries else "ok", f"{stats['agent_error']}: {advice}"
        )
    how = {
        "agent": "exec_mode agent",
        "auto": "exec_mode auto: agent mode here",
        "channel": "available (exec_mode channel)",
    }[host.exec_mode]
    if host.exec_mode == "auto" and not tries:
        how = "available (exec_mode auto runs channels: max_sessions 1)"
    return Finding(
        name,
        "agent",
        "ok",
        f"{host.agent_python} runs the executor: {how}, {min(times):.1f} ms for `true` "
        f"(fastest of {SHELL_START_RUNS})",
    )


async def _slurm(pool: Pool, name: str, host: HostConfig, timeout: float) -> list[Finding]:
    found: list[Finding] = []
    target = host.target()
    for argv, what in (
        (["sbatch", "--version"], "sbatch"),
        (["squeue", "--noheader", "--user", host.username], "squeue"),
    ):
        try:
            result = await pool.run(target, argv, timeout=timeout, acquire_timeout=timeout)
        except SSHPoolError as exc:
            found.append(Finding(name, "slurm", "FAIL", f"{what}: {type(exc).__name__}: {exc}"))
            continue
        if result.exit_status == 0:
            first = (result.stdout.decode(errors="replace").strip().splitlines() or [""])[0]
            found.append(Finding(name, "slurm", "ok", f"{what} answers {first[:60]!r}".rstrip()))
        else:
            err = result.stderr.decode(errors="replace").strip()[:100]
            found.append(
                Finding(
                    name,
                    "slurm",
                    "FAIL",
                    f"{what} exit {result.exit_status} ({err}): install the Slurm client on the "
                    "login host and make slurm.conf reachable for the account (SLURM_CONF), or "
                    f"remove [hosts.{name}.scheduler]",
                )
            )
    return found
