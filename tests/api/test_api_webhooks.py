"""Webhooks (issue 43): an identity's job state changes POSTed, signed after the Standard
Webhooks specification, to a real receiver on 127.0.0.1 (loadtests/webhook_receiver.py, which
verifies each signature with the `standardwebhooks` package): each final state once per
`webhook-id`, everything after a receiver that was down comes back (across an API restart), no
duplicates from two replicas; and the destinations refused (RELIABILITY.md)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import ssl
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from api_helpers import (
    LOCAL_ISS,
    SSHAPI,
    Api,
    Keys,
    config_toml,
    eventually,
    free_port,
    make_settings,
    pg_schema,
    running_api,
)
from standardwebhooks.webhooks import Webhook

from api.client import AsyncClient
from api.webhooks.config import WebhooksConfig
from api.webhooks.deliver import signed_headers
from api.webhooks.safety import Refused, check_url, resolve
from loadtests.webhook_receiver import Receiver
from sshpool.devhost import LocalHost

# Loopback allowed (the receiver's); short retries, so that a receiver coming back is served
# within the test.
HOOKS = """
[webhooks]
allowed_urls = ["http://*", "https://*"]
allowed_networks = ["127.0.0.0/8"]
retry_first = 0.2
retry_max = 1.0
# The default: a shorter one, under a loaded box's pauses, ends attempts the receiver has
# answered, and the retry repeats a webhook-id (allowed, but the tests count exactly).
timeout = 10
max_response_bytes = 4096
poll_interval = 0.3
max_per_identity = 3
max_in_flight = 6
max_in_flight_per_identity = 2
"""
FINAL_EVENTS = ["job.succeeded", "job.failed", "job.timed_out", "job.cancelled", "job.lost"]


@pytest.fixture
def hook_config(tuned_host: LocalHost, secret_file: Path, keys: Keys, tmp_path: Path) -> Path:
    path = tmp_path / "hooks.toml"
    path.write_text(config_toml(tuned_host, secret_file, keys, HOOKS))
    return path


@pytest.fixture
def subject() -> str:
    return f"hooks-{uuid.uuid4().hex[:8]}"


async def add_hook(api: Api, sub: str, url: str, events: list[str]) -> dict[str, Any]:
    r = await api.client.post(
        f"{api.url}/v1/webhooks", json={"url": url, "events": events}, headers=api.auth(sub)
    )
    assert r.status_code == 201, r.text
    return dict(r.json())


async def run_jobs(api: Api, sub: str, count: int) -> dict[str, str]:
    """`count` jobs, half `true` and half `false`: job id -> the event type its end is."""
    bodies = [{"host": "local", "argv": ["true" if n % 2 else "false"]} for n in range(count)]
    answers = await asyncio.gather(*(api.submit(b, sub=sub, wait=0) for b in bodies))
    assert all(r.status_code in (201, 202) for r in answers), [r.text for r in answers]
    return {
        r.json()["id"]: "job.succeeded" if b["argv"] == ["true"] else "job.failed"
        for r, b in zip(answers, bodies, strict=True)
    }


def check_once(receiver: Receiver, expected: dict[str, str]) -> None:
    """Each job's final state delivered exactly once per webhook-id, signed, of its type."""
    got = [r for r in receiver.received if r.message["type"] in FINAL_EVENTS]
    assert all(r.valid for r in got)
    by_id: dict[str, set[str]] = {}
    for r in got:
        by_id.setdefault(r.id, set()).add(r.message["data"]["id"])
    assert all(len(jobs) == 1 for jobs in by_id.values())  # one event per webhook-id
    events = {r.id: r for r in got}
    types = Counter((r.message["data"]["id"], r.message["type"]) for r in events.values())
    assert dict(types) == {(job, kind): 1 for job, kind in expected.items()}
    for r in events.values():
        assert r.message["data"]["state"] == r.message["type"].removeprefix("job.")


async def delivered(receiver: Receiver, expected: dict[str, str]) -> None:
    await eventually(
        lambda: (
            {(r.message["data"]["id"], r.message["type"]) for r in receiver.received}
            >= set(expected.items())
        ),
        timeout=120,
    )


@pytest.fixture(params=["sqlite", "postgresql"])
async def hook_api(
    request: pytest.FixtureRequest, hook_config: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    async with AsyncExitStack() as stack:
        schema = None
        if request.param == "postgresql":
            schema = await stack.enter_async_context(pg_schema())
        settings = make_settings(tmp_path, hook_config, request.param, schema)
        yield await stack.enter_async_context(running_api(settings, keys, secret))


async def test_forty_jobs_each_final_state_is_delivered_once_signed_and_typed(
    hook_api: Api, subject: str
) -> None:
    """40 jobs (half `true`, half `false`): each one's final state reaches the receiver once,
    with a valid signature and the right type; `job.running` too, where subscribed."""
    async with Receiver() as receiver:
        hook = await add_hook(hook_api, subject, receiver.url, [*FINAL_EVENTS, "job.running"])
        assert hook["secret"].startswith("whsec_")
        assert hook["events"] == sorted([*FINAL_EVENTS, "job.running"])
        receiver.secret = hook["secret"]
        expected = await run_jobs(hook_api, subject, 40)
        await delivered(receiver, expected)
        await eventually(lambda: len(receiver.ids("job.running")) >= 40, timeout=120)
        await asyncio.sleep(1)  # a duplicate would come within the poll interval
        check_once(receiver, expected)
        assert all(r.valid for r in receiver.received)
        starts = set(receiver.ids("job.running"))
        running = Counter(r.message["data"]["id"] for r in receiver.received if r.id in starts)
        assert set(running) == set(expected) and set(running.values()) == {1}
        shown = await counted(lambda: hook_status(hook_api, subject, hook["id"]), 80)
        assert "secret" not in shown
        assert shown["delivered"] == 80 and shown["failed"] == 0 and shown["pending"] == 0
        assert shown["last_delivery"]["status"] == 204


async def test_a_receiver_down_gets_everything_after_it_returns_across_an_api_restart(
    hook_config: Path, secret: str, keys: Keys, tmp_path: Path, subject: str
) -> None:
    """The receiver is stopped; 20 jobs end; the API restarts; the receiver comes back on its
    port: every final state is delivered, once per webhook-id. Meanwhile GET shows the
    failures."""
    settings = make_settings(tmp_path, hook_config, "sqlite", None)
    receiver = Receiver()
    await receiver.start()
    try:
        async with running_api(settings, keys, secret) as api:
            hook = await add_hook(api, subject, receiver.url, FINAL_EVENTS)
            receiver.secret = hook["secret"]
            await receiver.stop()
            expected = await run_jobs(api, subject, 20)
            for job_id in expected:
                await api.until_final(job_id, sub=subject, timeout=60)

            async with asyncio.timeout(60):
                while True:
                    r = await api.client.get(
                        f"{api.url}/v1/webhooks/{hook['id']}", headers=api.auth(subject)
                    )
                    last = r.json()["last_delivery"]
                    if last is not None and last["status"] is None:
                        break
                    await asyncio.sleep(0.1)
            assert last["error"] == "could not deliver: ConnectError"
            assert r.json()["pending"] == 20 and r.json()["delivered"] == 0
        assert receiver.received == []
        async with running_api(settings, keys, secret) as api:
            await receiver.start()  # the same port
            await delivered(receiver, expected)
            await asyncio.sleep(1)
            check_once(receiver, expected)
            shown = await counted(lambda: hook_status(api, subject, hook["id"]), 20)
            assert shown["delivered"] == 20 and shown["pending"] == 0
    finally:
        await receiver.stop()


async def test_two_replicas_deliver_each_event_once(
    hook_config: Path, secret: str, keys: Keys, tmp_path: Path, subject: str
) -> None:
    """Jobs submitted to both replicas of one PostgreSQL store: no delivery twice."""
    async with pg_schema() as schema, AsyncExitStack() as stack, Receiver() as receiver:
        apis = []
        for name in ("a", "b"):
            base = make_settings(tmp_path / name, hook_config, "postgresql", schema)
            settings = base.model_copy(update={"replica": name})
            apis.append(await stack.enter_async_context(running_api(settings, keys, secret)))
        a, b = apis
        hook = await add_hook(a, subject, receiver.url, FINAL_EVENTS)
        receiver.secret = hook["secret"]
        expected = await run_jobs(a, subject, 20) | await run_jobs(b, subject, 20)
        await delivered(receiver, expected)
        await asyncio.sleep(1.5)
        check_once(receiver, expected)
        assert len(receiver.received) == 40


async def test_signature_matches_the_specifications_test_vector() -> None:
    """The specification's own example (standard-webhooks/spec, its reference libraries'
    tests): this secret, id, timestamp and body sign to this signature."""
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    msg_id = "msg_p5jXN8AQM9LWM0D4loKWxJek"
    timestamp = 1614265330
    body = b'{"test": 2432232314}'
    expected = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert signed_headers(secret, msg_id, timestamp, body)["webhook-signature"] == expected
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    assert "v1," + base64.b64encode(mac).decode() == expected
    moment = datetime.fromtimestamp(timestamp, UTC)
    assert Webhook(secret).sign(msg_id, moment, body.decode()) == expected


async def hook_status(api: Api, sub: str, hook_id: str) -> dict[str, Any]:
    r = await api.client.get(f"{api.url}/v1/webhooks/{hook_id}", headers=api.auth(sub))
    assert r.status_code == 200, r.text
    return dict(r.json())


async def counted(show: Callable[[], Awaitable[dict[str, Any]]], delivered: int) -> dict[str, Any]:
    """The webhook as shown once it counts `delivered` deliveries: the receiver has a delivery
    before the API has read its answer and counted it."""
    async with asyncio.timeout(60):
        while (shown := await show())["delivered"] < delivered:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return shown


async def last_attempt(api: Api, sub: str, hook_id: str) -> dict[str, Any]:
    async with asyncio.timeout(60):
        while (shown := await hook_status(api, sub, hook_id))["last_delivery"] is None:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    return dict(shown["last_delivery"])


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://[::1]:8080/hook", "resolves to ::1"),
        ("http://169.254.169.254/latest/meta-data/", "resolves to 169.254.169.254"),
        ("http://10.1.2.3/hook", "resolves to 10.1.2.3"),
        ("http://[::ffff:10.0.0.1]/hook", "private, loopback"),
        ("ftp://example.org/hook", "must be http"),
        ("http://user:pw@127.0.0.1/hook", "credentials"),
        ("http://127.0.0.1/" + "a" * 3000, "at most 2048 characters"),
        ("http://no-such-host.invalid/hook", "does not resolve"),
    ],
)
async def test_destinations_this_server_does_not_call_are_refused(
    api: Api, url: str, why: str
) -> None:
    r = await api.client.post(
        f"{api.url}/v1/webhooks",
        json={"url": url, "events": ["job.succeeded"]},
        headers=api.auth("hostile"),
    )
    assert r.status_code == 422, r.text
    assert why in r.text
    assert "Traceback" not in r.text


@pytest.fixture
async def api(hook_config: Path, secret: str, keys: Keys, tmp_path: Path) -> AsyncIterator[Api]:
    """The API on SQLite, with this module's [webhooks]."""
    settings = make_settings(tmp_path, hook_config, "sqlite", None)
    async with running_api(settings, keys, secret) as running:
        yield running


async def test_defaults_refuse_loopback_and_plain_http() -> None:
    """Without `allowed_networks` and with the default `https://*` only."""
    config = WebhooksConfig()
    for url in ("http://127.0.0.1:9/hook", "http://example.org/hook"):
        with pytest.raises(Refused, match="none of the allowed patterns"):
            check_url(url, config)
    for url in ("https://127.0.0.1/hook", "https://localhost/hook", "https://[::1]/x"):
        with pytest.raises(Refused, match="private, loopback"):
            await resolve(check_url(url, config), config)


async def test_a_webhook_per_identity_cap_and_an_unknown_event(api: Api, subject: str) -> None:
    for _ in range(3):
        await add_hook(api, subject, "http://127.0.0.1:9/hook", ["job.failed"])
    r = await api.client.post(
        f"{api.url}/v1/webhooks",
        json={"url": "http://127.0.0.1:9/hook", "events": ["job.failed"]},
        headers=api.auth(subject),
    )
    assert r.status_code == 409 and r.json()["type"].endswith(":too-many-webhooks")
    r = await api.client.post(
        f"{api.url}/v1/webhooks",
        json={"url": "http://127.0.0.1:9/hook", "events": ["job.exploded"]},
        headers=api.auth("other"),
    )
    assert r.status_code == 422
    listed = await api.client.get(f"{api.url}/v1/webhooks", headers=api.auth(subject))
    ids = [h["id"] for h in listed.json()["items"]]
    assert len(ids) == 3 and all("secret" not in h for h in listed.json()["items"])
    # Another identity neither sees nor deletes them.
    r = await api.client.delete(f"{api.url}/v1/webhooks/{ids[0]}", headers=api.auth("other"))
    assert r.status_code == 404
    r = await api.client.delete(f"{api.url}/v1/webhooks/{ids[0]}", headers=api.auth(subject))
    assert r.status_code == 204
    r = await api.client.get(f"{api.url}/v1/webhooks/{ids[0]}", headers=api.auth(subject))
    assert r.status_code == 404


async def test_a_redirect_is_not_followed(api: Api, subject: str) -> None:
    async with Receiver() as target, Receiver(status=307) as redirector:
        redirector.location = target.url
        hook = await add_hook(api, subject, redirector.url, ["job.succeeded"])
        await api.submit({"host": "local", "argv": ["true"]}, sub=subject)
        last = await last_attempt(api, subject, hook["id"])
        assert last["status"] == 307
        assert last["error"] == "redirects are not followed: give the final URL"
        assert len(redirector.received) >= 1 and target.received == []


async def test_a_huge_answer_is_not_read_and_a_slow_receiver_times_out(
    api: Api, subject: str
) -> None:
    """A receiver answering 200 with 200 MB: delivered, its body read only to the cap (it
    could write little more than the sockets' buffers). One answering after 12 s (timeout
    10 s): an error on the webhook, retried."""
    async with Receiver(status=200, body_bytes=200 << 20) as huge, Receiver(delay=12) as slow:
        big = await add_hook(api, subject, huge.url, ["job.succeeded"])
        late = await add_hook(api, subject, slow.url, ["job.succeeded"])
        await api.submit({"host": "local", "argv": ["true"]}, sub=subject)
        assert (await last_attempt(api, subject, big["id"]))["status"] == 200
        assert (await hook_status(api, subject, big["id"]))["delivered"] == 1
        assert huge.sent < 64 << 20
        last = await last_attempt(api, subject, late["id"])
        assert last == {"at": last["at"], "status": None, "error": "no answer within 10 s"}
        assert (await hook_status(api, subject, late["id"]))["pending"] == 1


async def test_the_address_is_checked_again_at_delivery(
    tuned_host: LocalHost, secret_file: Path, keys: Keys, secret: str, tmp_path: Path, subject: str
) -> None:
    """A webhook to a DNS name resolving to loopback (`localhost`) made while loopback was
    allowed; the API restarted without that allowance: its deliveries are refused after a
    fresh lookup, not sent, and GET says why."""
    path = tmp_path / "hooks.toml"
    path.write_text(config_toml(tuned_host, secret_file, keys, HOOKS))
    settings = make_settings(tmp_path, path, "sqlite", None)
    async with Receiver() as receiver:
        async with running_api(settings, keys, secret) as api:
            url = receiver.url.replace("127.0.0.1", "localhost")
            hook = await add_hook(api, subject, url, ["job.succeeded"])
        path.write_text(
            config_toml(tuned_host, secret_file, keys, HOOKS.replace('"127.0.0.0/8"', ""))
        )
        async with running_api(settings, keys, secret) as api:
            await api.submit({"host": "local", "argv": ["true"]}, sub=subject)
            last = await last_attempt(api, subject, hook["id"])
        assert last["status"] is None
        assert last["error"].startswith("destination refused: the host 'localhost' resolves to")
        assert receiver.received == []


async def sshapi(*args: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        SSHAPI,
        *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(60):
        out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_the_client_and_the_cli_add_list_and_remove_webhooks(api: Api, subject: str) -> None:
    """`AsyncClient.add_webhook` and `sshapi webhooks add|list|rm`; the client's deliveries are
    verified with the secret it was given."""
    async with Receiver() as receiver, AsyncClient(api.url, api.token(subject)) as c:
        hook = await c.add_webhook(receiver.url, ["job.succeeded"])
        receiver.secret = hook["secret"]
        await c.run("local", ["true"])
        await eventually(lambda: len(receiver.received) == 1)
        assert receiver.received[0].valid
        assert (await counted(lambda: c.webhook(hook["id"]), 1))["delivered"] == 1
        env = {"SSHAPI_URL": api.url, "SSHAPI_TOKEN": api.token(subject)}
        code, out = await sshapi("webhooks", "add", receiver.url, "-e", "job.failed", env=env)
        assert code == 0, out
        second = out.split()[0]
        assert "secret: whsec_" in out
        code, out = await sshapi("webhooks", "list", env=env)
        assert code == 0, out
        assert f"{hook['id']} {receiver.url}  1 delivered, 0 failed, 0 pending; last: 204" in out
        assert f"{second} {receiver.url}  0 delivered" in out
        code, out = await sshapi("webhooks", "rm", second, env=env)
        assert code == 0, out
        await c.remove_webhook(hook["id"])
        assert await c.webhooks() == []


def docs_receiver() -> str:
    """The receiver example of docs/portals.md, as the page shows it."""
    page = (Path(__file__).parents[2] / "docs" / "portals.md").read_text()
    section = page.split("### A receiver that checks signatures", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


async def test_the_receiver_example_of_the_portals_page_verifies_real_deliveries(
    api: Api, subject: str, tmp_path: Path
) -> None:
    """docs/portals.md's receiver, run as it is: it prints the end of a real job, and answers
    401 to a delivery whose body was changed after signing."""
    script = tmp_path / "receiver.py"
    script.write_text(docs_receiver())
    port = free_port()
    url = f"http://127.0.0.1:{port}/hook"
    hook = await add_hook(api, subject, url, ["job.succeeded"])
    env = {**os.environ, "SSHAPI_WEBHOOK_SECRET": hook["secret"], "PORT": str(port)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), env=env, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            assert json.loads(await proc.stdout.readline()) == {"listening": port}
            job = (await api.submit({"host": "local", "argv": ["true"]}, sub=subject)).json()
            line = (await proc.stdout.readline()).decode().split()
        assert line == ["job.succeeded", job["id"], "succeeded", "0"]
        data = b'{"id":"x","state":"succeeded","exit_status":0}'
        body = b'{"type":"job.succeeded","timestamp":"x","data":' + data + b"}"
        headers = signed_headers(hook["secret"], "msg_1", time.time(), body)
        forged = body.replace(b'"exit_status":0', b'"exit_status":1')
        r = await api.client.post(url, content=forged, headers=headers)
        assert r.status_code == 401
        r = await api.client.post(url, content=body, headers=headers)
        assert r.status_code == 204
    finally:
        proc.kill()
        await proc.wait()


async def test_one_identitys_backlog_does_not_hold_up_anothers_deliveries(api: Api) -> None:
    """Identity a has 30 deliveries queued for a receiver that answers after 3 s, 2 in flight
    at a time (its cap; the process has room for 6): identity b's delivery goes out at once, not
    after a's backlog (which the outbox lists first: older)."""
    async with Receiver(delay=3.0) as slow, Receiver() as fast:
        await add_hook(api, "backlog-a", slow.url, ["job.succeeded"])
        await add_hook(api, "backlog-b", fast.url, ["job.succeeded"])
        await run_jobs_of(api, "backlog-a", 30)
        await run_jobs_of(api, "backlog-b", 1)
        await eventually(lambda: len(fast.received) == 1, timeout=60)
        # Without the per-owner skip, b's delivery waited until fewer than 8 of a's were due.
        assert len(slow.received) <= 10


async def run_jobs_of(api: Api, sub: str, count: int) -> None:
    body = {"host": "local", "argv": ["true"]}
    answers = await asyncio.gather(*(api.submit(body, sub=sub, wait=10) for _ in range(count)))
    assert all(r.json()["state"] == "succeeded" for r in answers), [r.text for r in answers]


async def test_a_revoked_identitys_deliveries_are_held_until_the_lift(
    api: Api, subject: str
) -> None:
    """Revoked while its job runs: the job ends `cancelled`, and that event is not sent to the
    identity's receiver while the revocation holds; lifted, it goes out."""
    admin = {"Authorization": f"Bearer {api.token('root-admin', 'jobs:read jobs:write admin')}"}
    async with Receiver() as receiver:
        hook = await add_hook(api, subject, receiver.url, ["job.cancelled"])
        receiver.secret = hook["secret"]
        job = (await api.submit({"host": "local", "command": "sleep 60"}, sub=subject)).json()
        await api.wait_state(job["id"], ("running",), sub=subject)
        r = await api.client.post(
            f"{api.url}/v1/admin/revocations",
            json={"issuer": LOCAL_ISS, "subject": subject},
            headers=admin,
        )
        assert r.status_code == 201, r.text
        revocation = r.json()["id"]
        await api.wait_state(job["id"], ("cancelled",), scope="jobs:read admin")
        await asyncio.sleep(1.5)  # the deliverer looked several times (poll 0.3 s)
        assert receiver.received == []
        r = await api.client.delete(f"{api.url}/v1/admin/revocations/{revocation}", headers=admin)
        assert r.status_code == 204
        await eventually(lambda: len(receiver.received) == 1, timeout=60)
        [got] = receiver.received
        assert got.valid and got.message["type"] == "job.cancelled"
        assert got.message["data"]["id"] == job["id"]


async def test_a_delivery_is_given_up_after_its_retry_window_and_shown_failed(
    tuned_host: LocalHost, secret_file: Path, keys: Keys, secret: str, tmp_path: Path, subject: str
) -> None:
    """`retry_for` 1.5 s (25 h by default) and a receiver that never answers: the delivery is
    retried, then `failed`, counted on the webhook, and not sent when the receiver comes up."""
    path = tmp_path / "short.toml"
    path.write_text(config_toml(tuned_host, secret_file, keys, HOOKS + "retry_for = 1.5\n"))
    settings = make_settings(tmp_path, path, "sqlite", None)
    receiver = Receiver()
    await receiver.start()
    await receiver.stop()  # its port, closed
    async with running_api(settings, keys, secret) as api:
        hook = await add_hook(api, subject, receiver.url, ["job.succeeded"])
        await api.submit({"host": "local", "argv": ["true"]}, sub=subject)
        async with asyncio.timeout(60):
            while (shown := await hook_status(api, subject, hook["id"]))["failed"] == 0:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert (shown["failed"], shown["pending"], shown["delivered"]) == (1, 0, 0)
        assert shown["last_delivery"]["error"] == "could not deliver: ConnectError"
        await receiver.start()
        await asyncio.sleep(1)  # polls at 0.3 s: a pending delivery would go out now
        assert receiver.received == []
    await receiver.stop()


async def test_https_goes_to_the_checked_address_with_the_urls_name_for_tls(
    api: Api, subject: str, tmp_path: Path
) -> None:
    """`https://localhost:PORT/`: the delivery connects to the address the check resolved
    (127.0.0.1) and names `localhost` in TLS (SNI), so the receiver's certificate is checked
    against the URL's name. Here a self-signed one, which the API refuses to trust."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    openssl = [
        "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(*openssl, stderr=asyncio.subprocess.DEVNULL)
    assert await proc.wait() == 0
    names: list[str | None] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: names.append(name)  # type: ignore[assignment, misc, return-value]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    try:
        hook = await add_hook(api, subject, f"https://localhost:{port}/hook", ["job.succeeded"])
        await api.submit({"host": "local", "argv": ["true"]}, sub=subject)
        last = await last_attempt(api, subject, hook["id"])
        assert last == {
            "at": last["at"],
            "status": None,
            "error": "could not deliver: ConnectError",
        }
        assert "localhost" in names
    finally:
        server.close()
