"""`sshapi webhooks add|list|rm`: your jobs' state changes POSTed to a URL (docs/portals.md).
The shared pieces (`client`, `say`, `printable`) are api/client/terminal.py's."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated

import typer

from api.client.terminal import AsJson, Profile, client, printable, say

webhooks_app = typer.Typer(
    help="Webhooks: your jobs' state changes POSTed, signed, to a URL.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

FINAL_EVENTS = ["job.succeeded", "job.failed", "job.timed_out", "job.cancelled", "job.lost"]


@webhooks_app.command("add")
def webhooks_add(
    url: Annotated[str, typer.Argument(help="Where to POST (https://..., as the server allows).")],
    event: Annotated[
        list[str] | None,
        typer.Option(
            "--event",
            "-e",
            help="A state change to send (repeatable): job.running, job.succeeded, job.failed, "
            "job.timed_out, job.cancelled, job.lost, job.error. Default: the final ones but "
            "error.",
        ),
    ] = None,
    profile: Profile = None,
    as_json: AsJson = False,
) -> None:
    """Add a webhook.

    Prints its id and its secret (shown this once: keep it)."""
    with client(profile) as c:
        hook = c.add_webhook(url, event or FINAL_EVENTS)
    if as_json:
        typer.echo(json.dumps(hook, indent=2))
        return
    say(f"{hook['id']} {printable(str(hook['url']))}")
    say(f"secret: {hook['secret']}")
    say("sshapi: the secret is shown this once; verify deliveries with it", err=True)


@webhooks_app.command("list")
def webhooks_list(profile: Profile = None, as_json: AsJson = False) -> None:
    """Your webhooks.

    Each one's id, URL, deliveries made, failed and pending, and its last outcome."""
    with client(profile) as c:
        hooks = c.webhooks()
    if as_json:
        typer.echo(json.dumps(hooks, indent=2))
        return
    for hook in hooks:
        last = hook.get("last_delivery") or {}
        outcome = "-"
        if last:
            at = datetime.fromtimestamp(float(last["at"]), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            outcome = f"{last.get('status') or 'no answer'} at {at}"
            if last.get("error"):
                outcome += f" ({last['error']})"
        counts = (
            f"{hook['delivered']} delivered, {hook['failed']} failed, {hook['pending']} pending"
        )
        say(printable(f"{hook['id']} {hook['url']}  {counts}; last: {outcome}"))


@webhooks_app.command("rm")
def webhooks_rm(
    webhook_id: Annotated[str, typer.Argument(help="The webhook's id.")],
    profile: Profile = None,
) -> None:
    """Delete a webhook.

    Its deliveries not made yet are dropped."""
    with client(profile) as c:
        c.remove_webhook(webhook_id)
    say(f"webhook {webhook_id} removed", err=True)
