"""The outbox's deliverer: a supervised task of every API process (`webhooks`, api/services.py).

It wakes when this process commits a state change (the store's `on_event`) or every
`poll_interval` seconds (the state changes of other replicas), reads the due deliveries, claims
some under a lease (api/store/webhooks.py: one replica per delivery) and sends each in a task
of its own: a signed POST (Standard Webhooks: `webhook-id` = the event's id, the same on every
retry; `webhook-timestamp` = this attempt's Unix time; `webhook-signature` = `v1,<base64
HMAC-SHA256 of "id.timestamp.body">` by the `standardwebhooks` package) of `{"type",
"timestamp", "data"}` to the checked address (api/webhooks/safety.py), redirects not followed,
within `timeout`, reading at most `max_response_bytes` of the answer. A 2xx is delivered; any
other outcome is retried after `retry_first` seconds doubling to `retry_max`, until
`retry_for` seconds after the event, then the delivery is `failed` and counted on its webhook.

The deliveries of an identity a revocation refuses (of their identity, or of an account they
run as: one their rule maps, or the account claim their token had when the webhook was made) are
held (not sent: the job data is theirs) and retried like failures, so a lift within the retry
window lets them go out. A delivery whose URL the owner's policy rule no longer allows
(`webhook_urls` narrowed since the webhook was made) is not sent and is `failed` at once: no
retry could change the rule's answer before the operator does.

In flight at once: at most `max_in_flight` per process and `max_in_flight_per_identity` per
identity per process; a claimed delivery over its identity's cap is given back unsent.

A process that dies mid-delivery leaves its lease to run out (`timeout` + LEASE_MARGIN): then
another process sends it again with the same `webhook-id` (at least once; receivers drop a
repeated id, as the specification asks them to)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
from standardwebhooks.webhooks import Webhook as Signer

from api.schemas import JobSummary
from api.store import Delivery, Store, WebhookStore
from api.tasks import TaskSet
from api.webhooks.config import WebhooksConfig
from api.webhooks.safety import Refused, destination

log = logging.getLogger("sshapi.webhooks")

LEASE_MARGIN = 30.0  # seconds a lease outlasts an attempt's timeout


def backoff(attempts: int, config: WebhooksConfig) -> float:
    """Seconds before the next attempt after `attempts` failed ones: doubling, capped, with
    a tenth of jitter (receivers that come back are not met by every retry at once)."""
    delay = min(config.retry_first * 2 ** max(attempts - 1, 0), config.retry_max)
    return float(delay * random.uniform(0.9, 1.1))


def body_of(delivery: Delivery, data: dict[str, Any]) -> bytes:
    stamp = datetime.fromtimestamp(delivery.created_at, UTC).isoformat().replace("+00:00", "Z")
    message = {"type": delivery.type, "timestamp": stamp, "data": data}
    return json.dumps(message, separators=(",", ":"), ensure_ascii=True).encode()


def signed_headers(secret: str, msg_id: str, now: float, body: bytes) -> dict[str, str]:
    moment = datetime.fromtimestamp(int(now), UTC)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now)),
        "webhook-signature": Signer(secret).sign(msg_id, moment, body.decode()),
        "content-type": "application/json",
    }


class Deliverer:
    def __init__(
        self,
        store: Store,
        config: WebhooksConfig,
        replica: str,
        *,
        details: bool,
        revoked: Callable[[tuple[str, str], str | None], bool] = lambda owner, account: False,
        rule_allows: Callable[[tuple[str, str], str], bool] = lambda owner, url: True,
    ) -> None:
        self.store = store
        # Whether a revocation refuses the owner (api/admin/revocations.py), given their
        # recorded account claim: their deliveries wait, retried as a failure would be, until
        # it is lifted or their window ends.
        self.revoked = revoked
        self.rule_allows = rule_allows  # Policy.webhook_url_allowed, asked at every attempt
        self.config = config
        self.replica = replica
        self.details = details  # the job's `node` in `data` (api.host_details_require_admin)
        self.hooks = WebhookStore(store.transactions)
        self._wake = asyncio.Event()
        self._in_flight: Counter[tuple[str, str]] = Counter()
        self._sending: dict[str, Delivery] = {}  # claimed, outcome not recorded yet
        self._tasks = TaskSet("webhook delivery")
        # Its own client: never a proxy from the environment, never a redirect.
        self.http = httpx.AsyncClient(
            follow_redirects=False,
            trust_env=False,
            timeout=config.timeout,
            limits=httpx.Limits(max_connections=config.max_in_flight),
        )
        store.on_event.append(self._wake.set)

    async def loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._claim_due()
            except Exception:  # the store is down: try again at the next poll
                log.warning("could not read the webhook outbox", exc_info=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.poll_interval):
                    await self._wake.wait()

    async def close(self) -> None:
        """Stop sending; the deliveries cut short are given back at once (not left to their
        leases running out), so the next process sends them without delay."""
        self.store.on_event.remove(self._wake.set)
        await self._tasks.close(timeout=5)
        for delivery in list(self._sending.values()):
            with contextlib.suppress(Exception):
                await self.hooks.release(delivery, self.replica)
        await self.http.aclose()

    async def _claim_due(self) -> None:
        room = self.config.max_in_flight - sum(self._in_flight.values())
        if room <= 0:
            return
        now = time.time()
        cap = self.config.max_in_flight_per_identity
        taken: Counter[tuple[str, str]] = Counter()
        full = {owner for owner, n in self._in_flight.items() if n >= cap}
        ids: list[str] = []
        # Owners at their cap are left out of the next read, so that one identity's backlog
        # (thousands due for a receiver that came back) never hides the others' deliveries.
        while len(ids) < room:
            due = await self.hooks.due(now, room * 2, full)
            newly_full = False
            for delivery_id, iss, sub in due:
                owner = (iss, sub)
                if owner not in full and len(ids) < room and delivery_id not in ids:
                    taken[owner] += 1
                    ids.append(delivery_id)
                    if self._in_flight[owner] + taken[owner] >= cap:
                        full.add(owner)
                        newly_full = True
            if len(due) < room * 2 or not newly_full:
                break  # all due seen, or no owner left out anew: a read would find no more
        lease = self.config.timeout + LEASE_MARGIN
        for delivery in await self.hooks.claim(ids, now, lease, self.replica):
            if self._in_flight[delivery.owner] >= cap:
                await self.hooks.release(delivery, self.replica)
                continue
            self._in_flight[delivery.owner] += 1
            self._tasks.spawn(self._deliver(delivery), f"webhook-{delivery.id}")

    async def _deliver(self, delivery: Delivery) -> None:
        self._sending[delivery.id] = delivery
        cancelled = False
        try:
            await self._attempt(delivery)
        except asyncio.CancelledError:
            cancelled = True  # closing: left in _sending, which `close` gives back
            raise
        finally:
            if not cancelled:  # done, or failed (the store down): its lease runs out
                self._sending.pop(delivery.id, None)
            self._in_flight[delivery.owner] -= 1
            if self._in_flight[delivery.owner] <= 0:
                del self._in_flight[delivery.owner]
            self._wake.set()  # its identity may have more due

    async def _attempt(self, delivery: Delivery) -> None:
        row = await self.store.summary(delivery.job_id)
        # A job pruned meanwhile (`sshapi db prune`) is announced by its id alone.
        data = (
            JobSummary.of(row, self.details).model_dump(mode="json")
            if row is not None
            else {"id": delivery.job_id}
        )
        body = body_of(delivery, data)
        now = time.time()
        headers = signed_headers(delivery.secret, delivery.event_id, now, body)
        status: int | None
        error: str | None
        refused = False
        if self.revoked(delivery.owner, delivery.owner_account):
            status, error = None, "held: the identity is revoked"
        elif not self.rule_allows(delivery.owner, delivery.url):
            status, error, refused = (
                None,
                "refused: your policy rule no longer allows this URL",
                True,
            )
        else:
            status, error = await self._post(delivery.url, body, headers)
        done = time.time()
        if status is not None and 200 <= status < 300:
            outcome, next_at = "delivered", done
        elif refused:
            outcome, next_at = "failed", done
        else:
            deadline = delivery.created_at + self.config.retry_for
            next_at = min(done + backoff(delivery.attempts, self.config), deadline)
            outcome = "failed" if done >= deadline else "pending"
        await self.hooks.record(
            delivery,
            self.replica,
            status=outcome,
            now=done,
            next_at=next_at,
            http_status=status,
            error=error,
        )

    async def _post(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int | None, str | None]:
        """(the receiver's status, why it is not a success); status None when it did not
        answer."""
        try:
            target = await destination(url, self.config)
        except Refused as exc:
            return None, f"destination refused: {exc}"
        headers = {**headers, "host": target.host_header}
        extensions = {"sni_hostname": target.server_name} if target.url.scheme == "https" else {}
        try:
            async with asyncio.timeout(self.config.timeout):
                request = self.http.build_request(
                    "POST", target.url, content=body, headers=headers, extensions=extensions
                )
                response = await self.http.send(request, stream=True)
                try:
                    read = 0
                    async for chunk in response.aiter_raw():
                        read += len(chunk)
                        if read >= self.config.max_response_bytes:
                            break  # the rest is not read: closing drops the connection
                finally:
                    await response.aclose()
        except TimeoutError:
            return None, f"no answer within {self.config.timeout:g} s"
        except httpx.HTTPError as exc:
            return None, f"could not deliver: {type(exc).__name__}"
        status = response.status_code
        if 200 <= status < 300:
            return status, None
        if 300 <= status < 400:
            return status, "redirects are not followed: give the final URL"
        return status, f"the receiver answered {status}"
