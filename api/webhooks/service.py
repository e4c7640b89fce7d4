"""Creating, listing and deleting an identity's webhooks (the routes' face): the URL checked
against the configuration (api/webhooks/safety.py, its DNS answer too) and the caller's policy
rule (`webhook_urls`), at most `max_per_identity` per identity, the secret made here and shown
once."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable

from api.auth import Principal
from api.problems import Problem
from api.store import Webhook, WebhookStore, new_id, utcnow
from api.webhooks.config import WebhooksConfig
from api.webhooks.models import LastDelivery, WebhookCreated, WebhookInfo, WebhookRequest
from api.webhooks.safety import Refused, check_url, resolve

SECRET_BYTES = 24  # 192 bits; the specification asks for 24 to 64
RULE_REFUSED = "your policy rule does not allow webhooks to this URL (ask your operator which)"


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def not_found(webhook_id: str) -> Problem:
    return Problem(404, "webhook-not-found", "No such webhook", f"no webhook {webhook_id} of yours")


def info(hook: Webhook) -> WebhookInfo:
    last = None
    if hook.last_attempt_at is not None:
        last = LastDelivery(at=hook.last_attempt_at, status=hook.last_status, error=hook.last_error)
    return WebhookInfo(
        id=hook.id,
        url=hook.url,
        events=hook.events,
        created_at=hook.created_at.isoformat(),
        delivered=hook.delivered,
        failed=hook.failed,
        pending=hook.pending,
        last_delivery=last,
    )


class WebhookService:
    def __init__(
        self,
        hooks: WebhookStore,
        config: WebhooksConfig,
        rule_allows: Callable[[tuple[str, str], str], bool] = lambda owner, url: True,
    ) -> None:
        self.hooks = hooks
        self.config = config
        self.rule_allows = rule_allows  # Policy.webhook_url_allowed

    async def create(self, who: Principal, body: WebhookRequest) -> WebhookCreated:
        try:
            parsed = check_url(body.url, self.config)
            # The rule before any DNS work: a portal's identity asking for another receiver
            # learns only that its rule says no, not where the name resolves.
            if not self.rule_allows(who.key, body.url):
                raise Refused(RULE_REFUSED)
            await resolve(parsed, self.config)
        except Refused as exc:
            raise Problem(422, "webhook-url-refused", "Webhook URL refused", str(exc)) from None
        account = who.kept_account
        events = sorted(set(body.events))
        hook = Webhook(
            id=new_id(),
            owner_iss=who.issuer,
            owner_sub=who.subject,
            url=body.url,
            events=list(events),
            secret=new_secret(),
            created_at=utcnow(),
            owner_account=account,
        )
        if not await self.hooks.create(hook, self.config.max_per_identity):
            raise Problem(
                409,
                "too-many-webhooks",
                "Too many webhooks",
                f"you have {self.config.max_per_identity} webhooks, the most allowed: delete one",
            )
        return WebhookCreated(id=hook.id, url=hook.url, events=hook.events, secret=hook.secret)

    async def list(self, who: Principal) -> list[WebhookInfo]:
        return [info(h) for h in await self.hooks.of((who.issuer, who.subject))]

    async def get(self, who: Principal, webhook_id: str) -> WebhookInfo:
        found = await self.hooks.of((who.issuer, who.subject), webhook_id)
        if not found:
            raise not_found(webhook_id)
        return info(found[0])

    async def delete(self, who: Principal, webhook_id: str) -> None:
        if not await self.hooks.delete((who.issuer, who.subject), webhook_id):
            raise not_found(webhook_id)
