"""/v1/webhooks: an identity's receivers of its job state changes (docs/portals.md)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Response

from api.deps import Reader, Svc, Writer
from api.problems import MEDIA_TYPE
from api.webhooks.models import WebhookCreated, WebhookInfo, WebhookList, WebhookRequest

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])

WebhookId = Annotated[str, Path(max_length=36)]


def _problem(description: str) -> dict[str, Any]:
    return {"description": description, "content": {MEDIA_TYPE: {}}}


ERRORS: dict[int | str, dict[str, Any]] = {
    401: _problem("Missing or invalid token."),
    403: _problem("Scope missing."),
    404: _problem("No such webhook (or not yours)."),
}


@router.post(
    "",
    status_code=201,
    response_model=WebhookCreated,
    responses={
        **ERRORS,
        409: _problem("You have `max_per_identity` webhooks already."),
        422: _problem("Invalid body, or a URL this server does not call (the detail says why)."),
    },
    summary="Have your jobs' state changes POSTed to a URL (signed; the secret shown once)",
)
async def create_webhook(
    body: Annotated[WebhookRequest, Body()], who: Writer, svc: Svc
) -> WebhookCreated:
    return await svc.webhooks.create(who, body)


@router.get("", response_model=WebhookList, responses=ERRORS, summary="Your webhooks")
async def list_webhooks(who: Reader, svc: Svc) -> WebhookList:
    return WebhookList(items=await svc.webhooks.list(who))


@router.get(
    "/{webhook_id}",
    response_model=WebhookInfo,
    responses=ERRORS,
    summary="One webhook, with its deliveries' counts and last outcome",
)
async def get_webhook(webhook_id: WebhookId, who: Reader, svc: Svc) -> WebhookInfo:
    return await svc.webhooks.get(who, webhook_id)


@router.delete(
    "/{webhook_id}",
    status_code=204,
    response_class=Response,
    responses=ERRORS,
    summary="Delete a webhook and its deliveries not made yet",
)
async def delete_webhook(webhook_id: WebhookId, who: Writer, svc: Svc) -> Response:
    await svc.webhooks.delete(who, webhook_id)
    return Response(status_code=204)
