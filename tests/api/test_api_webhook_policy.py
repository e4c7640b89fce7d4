"""Webhook destinations per policy rule (issue 43, "the issuer's or policy's allowed URL
patterns"): a rule's `webhook_urls` lets its identities (a portal's) call only their receiver,
within the server's [webhooks] limits, checked at creation and again at every delivery; and an
account's revocation holds the deliveries of a webhook whose creator's token named that account.
Against the real API and a real receiver on 127.0.0.1 (loadtests/webhook_receiver.py)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from api_helpers import (
    LOCAL_ISS,
    Api,
    Keys,
    config_toml,
    eventually,
    make_settings,
    pg_schema,
    running_api,
)
from test_api_webhooks import HOOKS, add_hook, hook_status, last_attempt

from loadtests.webhook_receiver import Receiver
from sshpool.devhost import LocalHost

CLAIM = "preferred_username"


def portal_config(
    host: LocalHost, secret_file: Path, keys: Keys, subject: str, patterns: list[str]
) -> str:
    """The webhook tests' configuration, with a rule for `subject` (a portal's identity) first,
    so that it wins over the catch-all rule, and the local issuer naming accounts by CLAIM."""
    text = config_toml(host, secret_file, keys, HOOKS)
    listed = ", ".join(f'"{p}"' for p in patterns)
    rule = (
        f'[[policy]]\nissuer = "*"\nsubject = "{subject}"\nhosts = ["local"]\n'
        f"webhook_urls = [{listed}]\nrate = 1000\nburst = 1000\n\n"
    )
    first = text.index("[[policy]]")
    text = text[:first] + rule + text[first:]
    issuer = f'[[issuers]]\nissuer = "{LOCAL_ISS}"\n'
    return text.replace(issuer, issuer + f'account_claim = "{CLAIM}"\n', 1)


def portal_subject() -> str:
    return f"portal-{uuid.uuid4().hex[:8]}"


async def refused(api: Api, sub: str, url: str) -> str:
    """The detail of a creation refused with 422 webhook-url-refused."""
    r = await api.client.post(
        f"{api.url}/v1/webhooks",
        json={"url": url, "events": ["job.succeeded"]},
        headers=api.auth(sub),
    )
    assert r.status_code == 422, r.text
    assert r.json()["type"].endswith("webhook-url-refused")
    return str(r.json()["detail"])


async def test_a_rules_webhook_urls_allow_its_receiver_and_refuse_another_port(
    tuned_host: LocalHost, secret_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """The portal's identity reaches its receiver (signed deliveries arrive); another loopback
    port, which the server's allowed_urls and allowed_networks admit, is refused by its rule
    alone, saying so without naming the rule's patterns; an identity of the catch-all rule may
    still use that port; and a rule pattern wider than the server's networks widens nothing."""
    sub = portal_subject()
    async with Receiver() as receiver, Receiver() as other:
        patterns = [f"http://127.0.0.1:{receiver.port}/*", "http://10.*"]
        path = tmp_path / "portal.toml"
        path.write_text(portal_config(tuned_host, secret_file, keys, sub, patterns))
        settings = make_settings(tmp_path, path, "sqlite", None)
        async with running_api(settings, keys, secret) as api:
            detail = await refused(api, sub, other.url)
            assert "your policy rule does not allow" in detail
            assert str(receiver.port) not in detail and "Traceback" not in detail
            # The server's address checks stay: the rule allows 10.*, the server does not.
            assert "resolves to 10.1.2.3" in await refused(api, sub, "http://10.1.2.3/hook")
            # Another identity (the catch-all rule, webhook_urls ["*"] by default) may.
            await add_hook(api, f"hooks-{uuid.uuid4().hex[:8]}", other.url, ["job.succeeded"])
            hook = await add_hook(api, sub, receiver.url, ["job.succeeded"])
            receiver.secret = hook["secret"]
            job = (await api.submit({"host": "local", "argv": ["true"]}, sub=sub, wait=10)).json()
            assert job["state"] == "succeeded"
            await eventually(lambda: len(receiver.received) == 1, timeout=60)
            [got] = receiver.received
            assert got.valid and got.message["data"]["id"] == job["id"]
            assert other.received == []


async def test_a_rule_narrowed_after_the_webhook_was_made_stops_its_deliveries(
    tuned_host: LocalHost, secret_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """A webhook made while its rule allowed the receiver; the rule then names another receiver
    and the API restarts: the job's delivery is not sent, it is `failed` at once (not retried
    for 24 h), and GET on the webhook says why."""
    sub = portal_subject()
    path = tmp_path / "portal.toml"
    settings = make_settings(tmp_path, path, "sqlite", None)
    async with Receiver() as receiver:
        path.write_text(portal_config(tuned_host, secret_file, keys, sub, [receiver.url]))
        async with running_api(settings, keys, secret) as api:
            hook = await add_hook(api, sub, receiver.url, ["job.succeeded"])
        moved = ["https://portal.example.org/hook"]
        path.write_text(portal_config(tuned_host, secret_file, keys, sub, moved))
        async with running_api(settings, keys, secret) as api:
            await api.submit({"host": "local", "argv": ["true"]}, sub=sub, wait=10)
            last = await last_attempt(api, sub, hook["id"])
            assert last["status"] is None
            assert last["error"] == "refused: your policy rule no longer allows this URL"
            shown = await hook_status(api, sub, hook["id"])
            assert (shown["failed"], shown["pending"], shown["delivered"]) == (1, 0, 0)
            await asyncio.sleep(1)  # polls at 0.3 s: a pending delivery would go out now
        assert receiver.received == []


async def test_an_account_revocation_holds_the_deliveries_of_its_webhooks(
    tuned_host: LocalHost, secret_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """The webhook was made with a token naming account `acct-…`; that account is revoked (not
    the identity): the identity's job, submitted with a token naming no account, ends, and its
    event waits, shown held; the revocation lifted, it goes out."""
    sub = portal_subject()
    account = f"acct-{uuid.uuid4().hex[:8]}"
    async with Receiver() as receiver:
        path = tmp_path / "portal.toml"
        path.write_text(portal_config(tuned_host, secret_file, keys, sub, [receiver.url]))
        settings = make_settings(tmp_path, path, "sqlite", None)
        async with running_api(settings, keys, secret) as api:
            admin = {"Authorization": f"Bearer {api.token('root', 'jobs:read admin')}"}
            claimed = api.token(sub, "jobs:read jobs:write", **{CLAIM: account})
            r = await api.client.post(
                f"{api.url}/v1/webhooks",
                json={"url": receiver.url, "events": ["job.succeeded"]},
                headers={"Authorization": f"Bearer {claimed}"},
            )
            assert r.status_code == 201, r.text
            hook = r.json()
            receiver.secret = hook["secret"]
            r = await api.client.post(
                f"{api.url}/v1/admin/revocations", json={"account": account}, headers=admin
            )
            assert r.status_code == 201, r.text
            revocation = r.json()["id"]
            job = (await api.submit({"host": "local", "argv": ["true"]}, sub=sub, wait=10)).json()
            assert job["state"] == "succeeded"
            last = await last_attempt(api, sub, hook["id"])
            assert last["error"] == "held: the identity is revoked"
            assert (await hook_status(api, sub, hook["id"]))["pending"] == 1
            assert receiver.received == []
            r = await api.client.delete(
                f"{api.url}/v1/admin/revocations/{revocation}", headers=admin
            )
            assert r.status_code == 204
            await eventually(lambda: len(receiver.received) == 1, timeout=60)
            [got] = receiver.received
            assert got.valid and got.message["data"]["id"] == job["id"]


async def test_a_claim_longer_than_any_account_still_makes_webhooks_and_handles(
    tuned_host: LocalHost, secret_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """A token whose account claim is 100 characters (no host account or revocation can name
    one) makes a webhook and a job handle on PostgreSQL, whose owner_account columns hold 64:
    kept without the account, not a 500."""
    sub = portal_subject()
    long_claim = "a" * 100
    async with Receiver() as receiver, pg_schema() as schema:
        path = tmp_path / "portal.toml"
        path.write_text(portal_config(tuned_host, secret_file, keys, sub, ["*"]))
        settings = make_settings(tmp_path, path, "postgresql", schema)
        async with running_api(settings, keys, secret) as api:
            headers = {"Authorization": f"Bearer {api.token(sub, **{CLAIM: long_claim})}"}
            r = await api.client.post(
                f"{api.url}/v1/webhooks",
                json={"url": receiver.url, "events": ["job.succeeded"]},
                headers=headers,
            )
            assert r.status_code == 201, r.text
            r = await api.client.post(
                f"{api.url}/v1/jobs?wait=10",
                json={"host": "local", "argv": ["true"]},
                headers=headers,
            )
            assert r.status_code in (200, 201, 202), r.text
            job = r.json()["id"]
            r = await api.client.post(
                f"{api.url}/v1/jobs/{job}/handles", json={"ttl": 60}, headers=headers
            )
            assert r.status_code == 201, r.text
