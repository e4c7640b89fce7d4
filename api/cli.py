"""The `sshapi` command line: serve, dev (local host + API), token, hosts check, doctor, db
upgrade; the client commands (run, jobs, batch, files, whoami) are api/client/cli.py (files:
api/client/files_cli.py).

Every call starts here, a researcher's `sshapi jobs list` as much as `sshapi serve`, so this
module imports typer and the client commands only: each server command imports what it needs
when it runs (its settings, the configuration, the pool, the dev rig). That keeps `sshapi --help`
and the client commands fast, and working where only the client is installed (`pip install
sshapi`, without the `server` extra): a server command then says what to install.

Help is click's plain formatter (`rich_markup_mode=None`): it rewraps each docstring paragraph
to the terminal's width, so no line breaks where the source's did, and it loads no rich.
"""

from __future__ import annotations

import socket
import sys
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn

import typer

from api.client.cli import register as register_client_commands

if TYPE_CHECKING:
    from pydantic import ValidationError

    from api.config import Config
    from api.settings import Settings
    from api.store import migrate

app = typer.Typer(help="SSH-backed HPC REST API.", no_args_is_help=True, rich_markup_mode=None)
hosts_app = typer.Typer(help="Configured hosts.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(hosts_app, name="hosts")
db_app = typer.Typer(help="The job database.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(db_app, name="db")
# sshpool.ExecMode, written out: typer reads it when the app is built, and importing sshpool
# (asyncssh, cryptography) would cost every call (tests/api/test_api_cli.py checks the two agree).
ExecMode = Literal["channel", "agent", "auto"]
SERVER_EXTRA = "pip install 'sshapi[server]'"
# The researcher's commands (run, jobs, batch): HTTP to a server, in their own module.
register_client_commands(app, hosts_app)
# Modules that httpx and httpcore import whenever they are installed, which no command of
# `sshapi` uses: httpx's own command line (it brings click, rich and pygments) and httpcore's
# trio support (trio comes with selenium, for one). Together about half of a `sshapi jobs list`
# in an environment that has them (docs/benchmarks.md: CLI start-up).
UNUSED_OPTIONAL_MODULES = ("httpx._main", "trio")


def main() -> None:
    """The `sshapi` console script: `app`, in a process that is this command and nothing
    else, so the optional modules it never uses are marked absent (`import` of one raises
    ImportError, which is how httpx and httpcore learn a package is not installed). Only here:
    a program that imports `api.cli` or `api.client` keeps its trio."""
    for name in UNUSED_OPTIONAL_MODULES:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
    app()


Workers = Annotated[
    int | None,
    typer.Option(
        min=1,
        max=64,
        help="API processes sharing the port, each with its own SSH pool (default: "
        "SSHAPI_WORKERS, else 1). About one per core; see docs/operations.md.",
    ),
]


def fail(command: str, problem: str) -> NoReturn:
    """End the command with one line on stderr and exit 2: an operator's mistake in a setting
    or the configuration file gets what to fix, not a traceback."""
    typer.echo(f"sshapi {command}: {problem}", err=True)
    raise typer.Exit(2)


def problems(exc: ValidationError, *, env: bool = False) -> str:
    """pydantic's errors on one line, each as `where: what`: `where` is the SSHAPI_* variable
    when `env`, else the dotted key in the file."""
    found = []
    for error in exc.errors():
        loc = error["loc"]
        where = f"SSHAPI_{loc[0]}".upper() if env and loc else ".".join(map(str, loc)) or "file"
        found.append(f"{where}: {' '.join(error['msg'].split())}")
    return "; ".join(found)


def load_settings(command: str, workers: int | None = None, **values: Any) -> Settings:
    """Settings from SSHAPI_* (`values` and --workers win); invalid ones end the command, and
    so does a client-only install (every server command starts here)."""
    try:
        from pydantic import ValidationError

        from api.settings import Settings
    except ModuleNotFoundError as exc:
        fail(command, f"needs the server's packages ({exc.name} is missing): {SERVER_EXTRA}")
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        fail(command, f"invalid setting: {problems(exc, env=True)}")
    return settings if workers is None else settings.model_copy(update={"workers": workers})


def load_config(command: str, settings: Settings, *, require: bool = False) -> Config:
    """The configuration `resolve_config` (or, to serve, `require_config`) finds; a missing,
    unreadable, malformed or invalid file ends the command with one line naming the file and
    the problem."""
    import tomllib

    from pydantic import ValidationError

    from api.local import local_config_path, require_config, resolve_config

    path = settings.config or local_config_path(settings.data_dir)
    try:
        return require_config(settings) if require else resolve_config(settings)
    except tomllib.TOMLDecodeError as exc:
        fail(command, f"{path}: not valid TOML: {exc}")
    except ValidationError as exc:
        fail(command, f"{path}: invalid configuration: {problems(exc)}")
    except OSError as exc:  # missing (require_config says what to do), a directory, unreadable
        fail(command, f"{path}: {exc.strerror}" if exc.strerror else str(exc))
    except ValueError as exc:  # not UTF-8
        fail(command, f"{path}: {exc}")


@app.command()
def serve(workers: Workers = None) -> None:
    """Run the API.

    SSHAPI_* settings; hosts and policy from SSHAPI_CONFIG, else from the local configuration
    `sshapi dev` left in the data dir."""
    settings = load_settings("serve", workers)
    from api.workers import serve as run_server  # loaded by the commands that serve only

    config = load_config("serve", settings, require=True)
    if settings.db_upgrade == "off":
        # Checked once here, so a database that needs `sshapi db upgrade` ends the command with
        # one line instead of every worker's start failing.
        _store_schema("serve", settings, upgrade=False)
    run_server(settings, config)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Bring the job database to this release's schema.

    The database of SSHAPI_DATABASE_URL, else the data dir's SQLite file. Safe while replicas
    run and when another start upgrades at once."""
    settings = load_settings("db upgrade")
    done = _store_schema("db upgrade", settings, upgrade=True)
    if done is None or done.before == done.after:
        typer.echo(f"job database at revision {done.after if done else '?'}: nothing to do")
    else:
        before = done.before or "an unversioned database"  # new, or from before migrations
        typer.echo(f"job database upgraded from {before} to {done.after}")


@db_app.command("prune")
def db_prune(
    older_than: Annotated[
        float,
        typer.Option(
            min=0, help="Delete the jobs that ended more than this many days ago (0: all ended)."
        ),
    ],
) -> None:
    """Delete the finished jobs that ended before a cutoff.

    Jobs in every final state go; active jobs stay. Run it from a timer: each row keeps up to
    the policy's max_output of stdout and stderr."""
    import asyncio
    from datetime import UTC, datetime, timedelta

    from sqlalchemy.exc import SQLAlchemyError

    from api.store import prune

    settings = load_settings("db prune")
    settings.secure_data_dir()
    cutoff = datetime.now(UTC) - timedelta(days=older_than)
    url, schema = settings.resolved_database_url, settings.database_schema
    try:
        _store_schema("db prune", settings, upgrade=False)
        deleted = asyncio.run(prune(url, schema, cutoff))
    except (OSError, SQLAlchemyError) as exc:
        fail("db prune", f"the job database cannot be reached: {type(exc).__name__}: {exc}")
    typer.echo(f"deleted {deleted} job(s) that ended before {cutoff.isoformat(timespec='seconds')}")


def _store_schema(command: str, settings: Settings, *, upgrade: bool) -> migrate.Upgrade | None:
    """Upgrade (or only check) the job database's schema; a failure ends `command` with one
    line. Returns what the upgrade did (None for a check)."""
    import asyncio

    from sqlalchemy.exc import SQLAlchemyError

    from api.store import migrate

    settings.secure_data_dir()
    url, schema = settings.resolved_database_url, settings.database_schema
    try:
        if upgrade:
            return asyncio.run(migrate.upgrade(url, schema))
        asyncio.run(migrate.check(url, schema))
    except migrate.SchemaError as exc:
        fail(command, str(exc))
    except (OSError, SQLAlchemyError) as exc:
        fail(command, f"the job database cannot be reached: {type(exc).__name__}: {exc}")
    return None


@app.command()
def token(
    sub: Annotated[str, typer.Option(help="The subject (user name) of the token.")],
    scope: Annotated[
        str | None,
        typer.Option(
            help="Space-separated scopes. Default: every scope the local issuer grants but "
            "admin (jobs and files)."
        ),
    ] = None,
    ttl: Annotated[float, typer.Option(help="Lifetime in seconds, at most 30 days.")] = 3600.0,
    account: Annotated[
        str | None,
        typer.Option(help="The Unix account the token names (the issuer's account_claim)."),
    ] = None,
) -> None:
    """Mint a token the local server accepts.

    HS256, with the same data dir secret and configuration as the server."""
    settings = load_settings("token")
    from api.local import default_scopes, local_token

    config = load_config("token", settings)
    try:
        scopes = scope.split() if scope is not None else default_scopes(config)
        typer.echo(local_token(settings, config, sub, scopes, ttl, account))
    except OSError as exc:  # the data dir's secret cannot be made or read
        fail("token", f"{exc.filename}: {exc.strerror}" if exc.strerror else str(exc))
    except ValueError as exc:  # NoLocalIssuer, an empty --sub, a --ttl out of range
        raise typer.BadParameter(str(exc)) from None


@hosts_app.command("check")
def hosts_check(
    timeout: Annotated[float, typer.Option(help="Seconds per host.")] = 15.0,
) -> None:
    """Run `true` on every configured host and report.

    Each host is reached with its default account."""
    settings = load_settings("hosts check")
    import asyncio
    import time

    from sshpool import Pool, SSHPoolError

    config = load_config("hosts check", settings)
    if not config.hosts:
        typer.echo("no hosts configured (set SSHAPI_CONFIG, or run `sshapi dev` once)")
        raise typer.Exit(1)

    async def check() -> bool:
        ok = True
        async with Pool(backend=settings.backend) as pool:
            for name, host in config.hosts.items():
                start = time.perf_counter()
                try:
                    result = await pool.run(
                        host.target(), ["true"], timeout=timeout, acquire_timeout=timeout
                    )
                except SSHPoolError as exc:
                    ok = False
                    typer.echo(f"{name:20} FAIL  {type(exc).__name__}: {exc}")
                    continue
                ms = (time.perf_counter() - start) * 1000
                status = "ok" if result.exit_status == 0 else f"exit {result.exit_status}"
                ok = ok and result.exit_status == 0
                typer.echo(f"{name:20} {status:5} {ms:7.1f} ms  {host.target()}")
        return ok

    if not asyncio.run(check()):
        raise typer.Exit(1)


@app.command()
def doctor(
    timeout: Annotated[float, typer.Option(help="Seconds per SSH step.")] = 10.0,
) -> None:
    """Check that each host can take what the API will do.

    For each configured host: reachable, host key known, auth, silent and fast login shell,
    sshd limits against this API's pools (x SSHAPI_REPLICAS x workers), Slurm client. One line
    per check saying what to change; exit 1 on any FAIL."""
    settings = load_settings("doctor")
    import asyncio

    from api.doctor import diagnose

    config = load_config("doctor", settings)
    if not config.hosts:
        typer.echo("no hosts configured (set SSHAPI_CONFIG, or run `sshapi dev` once)")
        raise typer.Exit(1)
    findings = asyncio.run(diagnose(config, settings, timeout))
    for finding in findings:
        typer.echo(finding.line())
    failed = sum(f.status == "FAIL" for f in findings)
    warned = sum(f.status == "WARN" for f in findings)
    typer.echo(f"{len(config.hosts)} host(s): {failed} failure(s), {warned} warning(s)")
    if failed:
        raise typer.Exit(1)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _can_bind(port: int) -> bool:
    """True when 127.0.0.1:`port` can be bound now, as uvicorn binds it (SO_REUSEADDR)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _require_free_port(port: int) -> None:
    """End `sshapi dev` before it starts or prints anything when its port is taken: otherwise
    the token and curl it prints name a port another program answers on, and uvicorn dies later
    with a bare `address already in use`."""
    if _can_bind(port):
        return
    spare = next((p for p in range(port + 1, min(port + 100, 65536)) if _can_bind(p)), None)
    hint = f" (port {spare} is free)" if spare else ""
    fail(
        "dev",
        f"port {port} on 127.0.0.1 is in use (another `sshapi dev`?); pick another{hint}: "
        f"`make run PORT=N`, `SSHAPI_PORT=N make run` or `sshapi dev --port N`",
    )


@app.command()
def dev(
    port: Annotated[
        int | None,
        typer.Option(
            min=1, max=65535, help="API port on 127.0.0.1 (default: SSHAPI_PORT, else 8000)."
        ),
    ] = None,
    sub: Annotated[str, typer.Option(help="Subject of the printed token.")] = "dev",
    slurm: Annotated[
        bool,
        typer.Option(
            help="Also run a single-node Slurm for the local host (installed from the OS "
            "packages when missing): `local` then takes batch jobs."
        ),
    ] = False,
    workers: Workers = None,
    accounts: Annotated[
        int,
        typer.Option(
            help="Also create this many researcher accounts (root only: sshapi-r0001...) and "
            "the host `hpc`, where each caller runs as the account their token names, logged "
            "in with a certificate; the printed token names the first.",
            min=0,
            max=9999,
        ),
    ] = 0,
    exec_mode: Annotated[
        ExecMode,
        typer.Option(
            help="How the API runs commands on the local host: a channel each, through one "
            "executor per connection (agent), or the executor where the host's python3 "
            "answers and channels otherwise (auto, the default)."
        ),
    ] = "auto",
    nodes: Annotated[
        int,
        typer.Option(
            min=1,
            max=16,
            help="Login nodes of the local host: more than 1 starts that many sshd on "
            "127.0.0.2, .3, ... sharing one port, home and Slurm (a cluster, `nodes` in its "
            "configuration); with --accounts, `hpc` too, each researcher on every node.",
        ),
    ] = 1,
    rtt_ms: Annotated[
        float,
        typer.Option(
            min=0,
            help="Round trip (ms) added between the API and the local host by a latency relay "
            "(a WAN for the rig: docs/load-suite.md).",
        ),
    ] = 0.0,
    oidc: Annotated[
        bool,
        typer.Option(
            help="Also run a real OpenID provider (oidc-provider, with node; installed with npm "
            "on first use) that the API trusts: sign in with `sshapi login`."
        ),
    ] = False,
) -> None:
    """Start a local HPC host and the API, and print a token.

    The host is a real sshd on loopback (tuned profile), the API listens on 127.0.0.1; prints a
    token, the exports the client commands need (SSHAPI_URL, SSHAPI_TOKEN) and a curl command.
    Ctrl-C stops both."""
    # First: a client-only install stops here naming the server extra, a taken port before
    # anything is printed or started.
    given = {} if port is None else {"port": port}
    settings = load_settings("dev", workers, host="127.0.0.1", **given)
    _require_free_port(settings.port)
    import contextlib
    import shlex
    import signal

    from api.local import (
        default_config,
        default_scopes,
        local_certificate_host_config,
        local_host_config,
        local_token,
        rig_dir,
        with_oidc_issuer,
        write_local_config,
    )

    # The dev rig is imported here only: `serve`, `token` and `hosts check` never load it.
    from api.workers import serve as run_server
    from sshpool.devhost import Rig, RigSpec, install_packages
    from sshpool.devhost.accounts import ensure_accounts

    # uvicorn re-raises SIGTERM after its graceful shutdown; with the default handler the process
    # would die there, before the local host and Slurm below are stopped. Exit through Python.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    with contextlib.ExitStack() as stack:
        # Beside the data dir: the host's account must reach its files; the data dir is 0700.
        rig = rig_dir(settings.data_dir)
        if nodes > 1 and rtt_ms:
            raise typer.BadParameter("--nodes and --rtt-ms do not go together yet")
        if slurm:
            install_packages()
        names = [a.name for a in ensure_accounts(accounts, data_dir=rig)] if accounts else []
        # Several login nodes: the first stands for them below. They share its client
        # directory, so its user CA: a researcher logs in on every node.
        spec = RigSpec(
            "local", "tuned", nodes=nodes, researchers=bool(names), slurm=slurm, rtt_ms=rtt_ms
        )
        built = stack.enter_context(Rig(spec, data_dir=rig))
        host = built.host
        addresses = built.addresses
        # Left as a plain configuration file: `sshapi serve`, `sshapi token` and `sshapi hosts
        # check` read it later without the dev rig.
        hpc = local_certificate_host_config(host, host.user_ca_key, addresses) if names else None
        reached = built.reached
        local = local_host_config(reached, slurm=slurm, exec_mode=exec_mode, nodes=addresses)
        config = default_config(local, hpc)
        base = f"http://127.0.0.1:{settings.port}"
        provider = None
        if oidc:
            import secrets

            from sshpool.devhost import oidc as rig_oidc

            who = names[0] if names else host.username
            provider = rig_oidc.start(
                rig / "oidc", f"{base}/", ci_secret=secrets.token_urlsafe(24), ci_account=who
            )
            stack.callback(provider.stop)
            claim = "preferred_username"
            config = with_oidc_issuer(config, provider.issuer, rig_oidc.AUDIENCE, claim)
        write_local_config(settings.data_dir, config)
        account = names[0] if names else None
        scopes = default_scopes(config)
        tok = local_token(settings, config, sub, scopes, 24 * 3600.0, account)
        body = '{"host": "local", "argv": ["echo", "hello from the local HPC host"]}'
        if names:
            body = '{"host": "hpc", "argv": ["id", "-un"]}'
        if slurm:
            script = "#!/bin/sh\\nhostname; date\\n"
            body = f'{{"host": "local", "batch": {{"script": "{script}", "name": "hello"}}}}'
        if provider is not None:
            typer.echo(
                f"\nOpenID provider: {provider.issuer} (any login and password sign in)\n"
                f"  sshapi login --issuer {provider.issuer}\n"
                f"  SSHAPI_CLIENT_SECRET={provider.ci_secret} sshapi login --client-credentials "
                f"--client-id {rig_oidc.CI_CLIENT} --issuer {provider.issuer}"
            )
        typer.echo(
            f"\nLocal HPC host: {host.username}@{','.join(addresses) or host.address}:{host.port}"
            + " (sshd, tuned profile"
            + (", single-node Slurm" if slurm else "")
            + {"agent": ", agent mode", "channel": ", channel mode", "auto": ""}[exec_mode]
            + (f", {rtt_ms:g} ms RTT through a relay on port {reached.port})" if rtt_ms else ")")
            + f"\nAPI:            {base}  (docs: {base}/docs)\n\n"
            + (f"Accounts:       {names[0]} ... {names[-1]} on host `hpc`\n\n" if names else "")
            + f"Token for {sub!r}"
            + (f" as {account}" if account else "")
            + f" ({' '.join(scopes)}; 24 h; another: .venv/bin/sshapi token --sub NAME"
            + (" --account ACCOUNT" if account else "")
            + "):\n\n"
            f"export TOKEN={tok}\n"
            # The client commands send a token only to a server named to them (docs/client.md).
            f"export SSHAPI_URL={base} SSHAPI_TOKEN=$TOKEN  # for .venv/bin/sshapi\n\n"
            "Try:\n\n"
            f'curl -s -H "Authorization: Bearer $TOKEN" -H "Content-Type: application/json" \\\n'
            f"     -d {shlex.quote(body)} {base}/v1/jobs\n"
        )
        run_server(settings, config)
