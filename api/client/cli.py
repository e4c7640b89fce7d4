"""The client commands of `sshapi`: talk HTTP to a server (`api.client`), never SSH.

    sshapi run HOST -- ARGV...        live stdout/stderr, exits with the remote exit status
    sshapi jobs list|show|cancel|logs|watch
    sshapi handles create|list|delete tokens that read one job (docs/portals.md)
    sshapi batch submit SCRIPT
    sshapi files ls|get|put|mkdir|rm  files on a host (docs/files.md; api/client/files_cli.py)
    sshapi webhooks add|list|rm       job state changes POSTed to a URL (docs/portals.md)
    sshapi login|logout|whoami        sign in through the identity provider (docs/login.md)

The server and token come from SSHAPI_URL / SSHAPI_TOKEN or a profile of the client
configuration file (`--profile`; see `api.client.load_profile`). `--json` prints the API's JSON
for scripts. An error the client raises exits 255 (as ssh does for its own failures); a file
error names its side and path (`HOST:PATH (remote)`, `PATH (local)`); `rm` and `mkdir` of
several paths go on past one that fails, report each and exit 1.

What the server hands back (file names, symlink targets, problem details, a job's command line
and error) is printed through `printable`: a name is anyone's choice, and raw it could drive
the terminal. A job's stdout and stderr (`run`, `jobs logs`) are the command's own bytes and
pass as they are, as ssh passes them: colours and progress bars work, and a pipe gets them exact.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from api.client.files_cli import files_app
from api.client.portals_cli import handles_app, jobs_watch
from api.client.terminal import ERROR_EXIT, AsJson, Profile, client, say
from api.client.webhooks_cli import webhooks_app

# The client (httpx, pydantic) and rich load when a command runs, not when `sshapi` starts:
# `sshapi --help` and the server's commands never need them (api/cli.py).
if TYPE_CHECKING:
    from api.client import Client, Job, Stream

jobs_app = typer.Typer(
    help="Your jobs on the server (SSHAPI_URL).", no_args_is_help=True, rich_markup_mode=None
)
batch_app = typer.Typer(
    help="Batch jobs for a host's scheduler.", no_args_is_help=True, rich_markup_mode=None
)


def show(job: Job, as_json: bool) -> None:
    if as_json:
        typer.echo(job.model_dump_json(indent=2))
        return
    status = f"exit {job.exit_status}" if job.exit_status is not None else ""
    if job.exit_signal:
        status = f"signal {job.exit_signal}"
    say(f"{job.id}  {job.state:9} {status:10} {job.host:10} {describe(job)}")


def describe(job: Job) -> str:
    if job.argv:
        return " ".join(job.argv)
    if job.batch is not None:
        return f"batch {job.batch.name or ''}".strip()
    return job.command or job.template or ""


def run(
    host: Annotated[str, typer.Argument(help="A configured host name.")],
    argv: Annotated[
        list[str] | None, typer.Argument(help="The command and its arguments (after --).")
    ] = None,
    shell: Annotated[
        str | None,
        typer.Option(
            "--shell",
            help="A raw line for the remote login shell instead of ARGV (pipes, globs, $VARS), "
            "where the host allows it.",
        ),
    ] = None,
    timeout: Annotated[float | None, typer.Option(help="Seconds the command may run.")] = None,
    no_stdin: Annotated[
        bool, typer.Option("--no-stdin", "-n", help="Do not send stdin (as ssh -n).")
    ] = False,
    profile: Profile = None,
    as_json: AsJson = False,
) -> None:
    """Run a command on HOST and print its output as it arrives.

    Prints its stdout and stderr as they arrive and exits with its exit status (a signal as
    128+n, a timeout as 124). Ctrl-C cancels the remote command. A piped or redirected stdin is
    sent to the command (UTF-8 text, up to the server's cap); a terminal's is not read."""
    from api.client import SshapiError, exit_code

    if (shell is None) == (not argv):
        raise typer.BadParameter("give either -- ARGV... or --shell LINE", param_hint="ARGV")
    with client(profile) as c:
        job = submit_with_stdin(c, host, argv or None, no_stdin, command=shell, timeout=timeout)
        try:
            for event in c.events(job.id):
                if event.event == "output" and not as_json:
                    out = sys.stdout if event.data["stream"] == "stdout" else sys.stderr
                    out.write(event.data["text"])
                    out.flush()
                elif event.event == "gap" and not as_json:
                    lost = event.data["next_offset"] - event.data["offset"]
                    typer.echo(f"\n[sshapi: {lost} bytes of {event.data['stream']} not kept]",
                               err=True)  # fmt: skip
        except KeyboardInterrupt:
            typer.echo(f"\nsshapi: cancelling job {job.id}", err=True)
            try:
                c.cancel(job.id)
            except SshapiError as exc:  # finished meanwhile (409): report and go on
                typer.echo(f"sshapi: {exc}", err=True)
            raise typer.Exit(130) from None
        job = c.get(job.id)
    if as_json:
        show(job, True)
    elif job.error and job.state != "succeeded":
        say(f"sshapi: job {job.id} {job.state}: {job.error}", err=True)
    raise typer.Exit(exit_code(job))


# The most stdin `run` reads before giving up: the server's cap (api.max_stdin_bytes, 64 KiB
# by default) is within its body cap (api.max_body_bytes, 1 MiB by default); this bound only
# keeps `yes | sshapi run ...` from filling memory.
STDIN_READ = 16 << 20


def piped_stdin(skip: bool) -> str | None:
    """Our stdin for the job, as ssh forwards it: a pipe's or a file's bytes, never a
    terminal's (nobody typed it for the job). The API takes stdin as UTF-8 text."""
    from api.client import SshapiError

    if skip or sys.stdin is None or sys.stdin.isatty():
        return None
    data = sys.stdin.buffer.read(STDIN_READ + 1)
    if len(data) > STDIN_READ:
        raise SshapiError(
            f"stdin: more than {STDIN_READ} bytes, more than any job takes: nothing ran; "
            "copy it to the host (sshapi files put) and redirect the command from it"
        )
    try:
        return data.decode() if data else None
    except UnicodeDecodeError:
        raise SshapiError(
            "stdin: not UTF-8 text, which is all the API sends to a command: nothing ran; "
            "copy it to the host (sshapi files put) and redirect the command from it"
        ) from None


def submit_with_stdin(
    c: Client, host: str, argv: list[str] | None, skip: bool, **options: Any
) -> Job:
    """Submit with our piped stdin; over the server's cap, one line saying so (never cut)."""
    from api.client import InvalidRequest, SshapiError

    stdin = piped_stdin(skip)
    try:
        return c.submit(host, argv, stdin=stdin, **options)
    except InvalidRequest as exc:
        if stdin is None or exc.status != 413:
            raise
        size = len(stdin.encode())
        raise SshapiError(
            f"stdin: {size} bytes, more than this server takes ({exc.title}: {exc.detail}): "
            "nothing ran; copy it to the host (sshapi files put) and redirect the command from it"
        ) from None


@jobs_app.command("list")
def jobs_list(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    host: Annotated[str | None, typer.Option(help="Only jobs on this host.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many.")] = 20,
    profile: Profile = None,
    as_json: AsJson = False,
) -> None:
    """Your jobs, newest first."""
    with client(profile) as c:
        jobs = c.list(state=state, host=host, limit=limit)
    if as_json:
        typer.echo(json.dumps([j.model_dump(mode="json") for j in jobs], indent=2))
        return
    for job in jobs:
        show(job, False)


@jobs_app.command("show")
def jobs_show(job_id: str, profile: Profile = None, as_json: AsJson = False) -> None:
    """One job."""
    with client(profile) as c:
        show(c.get(job_id), as_json)


@jobs_app.command("cancel")
def jobs_cancel(job_id: str, profile: Profile = None, as_json: AsJson = False) -> None:
    """Cancel a job: kill its remote process tree (a batch job: scancel)."""
    with client(profile) as c:
        show(c.cancel(job_id), as_json)


@jobs_app.command("wait")
def jobs_wait(job_id: str, profile: Profile = None, as_json: AsJson = False) -> None:
    """Wait until a job is final.

    Prints it and exits with its exit status, as sshapi run does."""
    from api.client import exit_code

    with client(profile) as c:
        try:
            job = c.wait(job_id)
        except KeyboardInterrupt:  # the job goes on: only the waiting stops
            typer.echo(f"\nsshapi: job {job_id} goes on; `sshapi jobs wait {job_id}`", err=True)
            raise typer.Exit(130) from None
    show(job, as_json)
    if job.error and job.state != "succeeded" and not as_json:
        say(f"sshapi: job {job.id} {job.state}: {job.error}", err=True)
    raise typer.Exit(exit_code(job))


def hosts_list(profile: Profile = None, as_json: AsJson = False) -> None:
    """The hosts you may use on the server.

    Each one's name, health, whether it takes raw shell lines, and description."""
    with client(profile) as c:
        hosts = c.hosts()
    if as_json:
        typer.echo(json.dumps(hosts, indent=2))
        return
    for host in hosts:
        shell = "shell" if host.get("shell") else "argv"
        name, health = str(host.get("name")), str(host.get("health"))
        say(f"{name:16} {health:8} {shell:6} {host.get('description', '')}")


@jobs_app.command("logs")
def jobs_logs(
    job_id: str,
    stream: Annotated[str, typer.Option(help="stdout or stderr.")] = "stdout",
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Go on printing until the job is final.")
    ] = False,
    profile: Profile = None,
) -> None:
    """Print a job's output (bytes as they are); with -f, as it arrives."""
    if stream not in ("stdout", "stderr"):
        raise typer.BadParameter("stdout or stderr", param_hint="--stream")
    which: Stream = "stdout" if stream == "stdout" else "stderr"
    out = sys.stdout.buffer
    with client(profile) as c:
        if follow:
            for chunk in c.follow(job_id, which):
                out.write(chunk)
                out.flush()
        else:
            out.write(c.output(job_id, which))
            out.flush()


@batch_app.command("submit")
def batch_submit(
    host: Annotated[str, typer.Argument(help="A host with a scheduler.")],
    script: Annotated[Path, typer.Argument(help="The batch script.", exists=True, dir_okay=False)],
    name: Annotated[str | None, typer.Option(help="Job name.")] = None,
    partition: Annotated[str | None, typer.Option(help="Partition (queue).")] = None,
    time_limit: Annotated[int | None, typer.Option(help="Time limit in seconds.")] = None,
    wait: Annotated[bool, typer.Option(help="Wait until the job is final.")] = False,
    profile: Profile = None,
    as_json: AsJson = False,
) -> None:
    """Submit a batch script.

    With --wait, wait for it to end (a spinner on stderr), print its stdout and stderr, and
    exit with its exit status."""
    options: dict[str, Any] = {"script": script.read_text()}
    for key, value in (("name", name), ("partition", partition), ("time_limit", time_limit)):
        if value is not None:
            options[key] = value
    from rich.console import Console

    from api.client import FINAL, exit_code

    with client(profile) as c:
        job = c.submit(host, batch=options, wait=0)
        if wait:
            console = Console(stderr=True)
            with console.status(f"job {job.id}: waiting for the scheduler") as status:
                while job.state not in FINAL:
                    job = c.wait(job, timeout=5)
                    status.update(f"job {job.id}: {job.state}")
            if not as_json:
                print_output(c, job)
    if wait and not as_json:
        typer.echo(f"sshapi: batch job {job.id} {job.state}", err=True)
    else:
        show(job, as_json)
    if wait:
        raise typer.Exit(exit_code(job))


def print_output(c: Client, job: Job) -> None:
    """A final job's stdout and stderr, to ours, as the command's own bytes (`sshapi run`)."""
    from api.client import NotFound

    for stream, out in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        which: Stream = "stdout" if stream == "stdout" else "stderr"
        try:
            for chunk in c.follow(job.id, which):
                out.buffer.write(chunk)
        except NotFound:  # the script wrote nothing there (no output file)
            continue
        out.flush()


def whoami(profile: Profile = None, as_json: AsJson = False) -> None:
    """Who the server takes you for.

    Your subject, issuer and scopes, your account on each host, and where the token came from
    (SSHAPI_TOKEN, a profile, a login)."""
    with client(profile) as c:
        me = c.whoami()
    if as_json:
        typer.echo(json.dumps(me, indent=2))
        return
    say(f"subject  {me.get('subject')}")
    say(f"issuer   {me.get('issuer')}")
    say(f"scopes   {' '.join(me.get('scopes') or [])}")
    if me.get("account"):
        say(f"account  {me['account']} (your token's claim)")
    say(f"token    from {c.token_from}")
    for host in me.get("hosts") or []:
        if host.get("refused"):
            said = f"refused: {host['refused']}"
        else:
            said = f"as {host['account']}" if host.get("account") else "as the operator's account"
        say(f"host     {host.get('name')}: {said}")


def login(
    profile: Profile = None,
    issuer: Annotated[
        str | None,
        typer.Option(
            help="The identity provider's issuer URL. Default: the profile's issuer.",
            envvar="SSHAPI_ISSUER",
        ),
    ] = None,
    client_id: Annotated[
        str | None, typer.Option(help="The OAuth client id. Default: the profile's, else sshapi.")
    ] = None,
    client_credentials: Annotated[
        bool,
        typer.Option(
            "--client-credentials",
            help="Sign in as a client (workflows, CI) with its secret, not in a browser.",
        ),
    ] = False,
    client_secret_file: Annotated[
        str | None,
        typer.Option(help="The client secret's file. Default: SSHAPI_CLIENT_SECRET."),
    ] = None,
) -> None:
    """Sign in through the identity provider (docs/login.md).

    The tokens are kept in the client configuration's logins/ directory and renewed as they
    expire."""
    import httpx

    from api.client import SshapiError, load_profile
    from api.client import login as oauth

    try:
        found = load_profile(profile)
        if not found.url:
            raise SshapiError(
                "no server URL: a login is kept for one server and its tokens go to no other; "
                "name it first: export SSHAPI_URL=https://... (or the profile's url)"
            )
        issuer = issuer or found.issuer
        if not issuer:
            raise SshapiError("no issuer: give --issuer, SSHAPI_ISSUER or the profile's issuer")
        client_id = client_id or found.client_id or "sshapi"
        with httpx.Client() as http:
            endpoints = oauth.discover(issuer, http)
            if client_credentials:
                made = oauth.client_credentials_login(
                    endpoints, client_id, client_secret_file, http
                )
            else:
                made = oauth.device_login(endpoints, client_id, http, lambda s: say(s, err=True))
                made["client_id"] = client_id
        assert found.file is not None
        path = oauth.login_path(found.file, found.name)
        oauth.save(
            path,
            {
                **made,
                "url": found.url,
                "issuer": endpoints.issuer,
                "token_endpoint": endpoints.token,
                "revocation_endpoint": endpoints.revocation,
            },
        )
    except SshapiError as exc:
        say(f"sshapi: {exc}", err=True)
        raise typer.Exit(ERROR_EXIT) from None
    say(f"signed in with {endpoints.issuer}; the login is kept in {path}", err=True)
    if os.environ.get("SSHAPI_TOKEN"):
        from api.client.base import overriding

        say(f"sshapi: warning: {overriding(path)}", err=True)


def logout(profile: Profile = None) -> None:
    """Forget the login and revoke it at the provider."""
    from api.client import SshapiError, load_profile
    from api.client import login as oauth

    try:
        found = load_profile(profile)
    except SshapiError as exc:
        say(f"sshapi: {exc}", err=True)
        raise typer.Exit(ERROR_EXIT) from None
    assert found.file is not None
    path = oauth.login_path(found.file, found.name)
    with suppress(SshapiError):  # unreadable or exposed: removed all the same
        oauth.revoke(oauth.load(path))
    path.unlink(missing_ok=True)
    say(f"signed out: {path} removed", err=True)


def register(app: typer.Typer, hosts_app: typer.Typer) -> None:
    """Add the client commands to the `sshapi` app, and `list` to its `hosts` group."""
    hosts_app.command("list")(hosts_list)
    app.command("run")(run)
    app.command("login")(login)
    app.command("logout")(logout)
    app.command("whoami")(whoami)
    jobs_app.command("watch")(jobs_watch)
    app.add_typer(jobs_app, name="jobs")
    app.add_typer(handles_app, name="handles")
    app.add_typer(batch_app, name="batch")
    app.add_typer(files_app, name="files")
    app.add_typer(webhooks_app, name="webhooks")
