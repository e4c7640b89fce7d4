"""`sshapi jobs watch` (the change feed) and `sshapi handles create|list|delete` (job handles):
docs/portals.md. Registered by api/client/cli.py."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from api.client.terminal import AsJson, Profile, client, say

handles_app = typer.Typer(
    help="Job handles: tokens that read one job (docs/portals.md).",
    no_args_is_help=True,
    rich_markup_mode=None,
)


def jobs_watch(
    last_event_id: Annotated[
        str | None, typer.Option(help="Resume after this event id (the first column).")
    ] = None,
    profile: Profile = None,
    as_json: AsJson = False,
) -> None:
    """Print your jobs' state changes as they happen, until interrupted.

    One line per change: event id, event (job.running, job.succeeded...), job id, host. With
    --json, each event as one JSON line. Resumes by itself after a dropped connection."""
    with client(profile) as c:
        try:
            for event in c.watch(last_event_id):
                if as_json:
                    typer.echo(json.dumps({"id": event.id, "event": event.event, **event.data}))
                    continue
                job = event.data.get("data")
                if isinstance(job, dict):
                    say(f"{event.id}\t{event.event}\t{job.get('id')}\t{job.get('host')}")
                elif event.event in ("reset", "revoked"):
                    say(f"sshapi: {event.event}: {event.data.get('detail')}", err=True)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None


@handles_app.command("create")
def handles_create(
    job_id: str,
    ttl: Annotated[float, typer.Option(help="Seconds the handle lives (the policy caps it).")],
    cancel: Annotated[bool, typer.Option(help="The handle may cancel the job too.")] = False,
    profile: Profile = None,
    as_json: AsJson = False,
) -> None:
    """Make a handle of a job and print its token (shown once)."""
    with client(profile) as c:
        made = c.create_handle(job_id, ttl, cancel=cancel)
    if as_json:
        typer.echo(json.dumps(made, indent=2))
        return
    typer.echo(made["handle"])
    say(f"handle {made['id']} of job {job_id}, expires {made['expires_at']}", err=True)


@handles_app.command("list")
def handles_list(job_id: str, profile: Profile = None, as_json: AsJson = False) -> None:
    """A job's handles (never their tokens)."""
    with client(profile) as c:
        handles = c.handles(job_id)
    if as_json:
        typer.echo(json.dumps(list(handles), indent=2))
        return
    for h in handles:
        say(f"{h['id']}\texpires {h['expires_at']}\t{'cancel' if h['cancel'] else 'read'}")


@handles_app.command("delete")
def handles_delete(job_id: str, handle_id: str, profile: Profile = None) -> None:
    """Revoke a handle: its next request is refused (401)."""
    with client(profile) as c:
        c.delete_handle(job_id, handle_id)
    say(f"handle {handle_id} deleted", err=True)
