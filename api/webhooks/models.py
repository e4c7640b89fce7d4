"""The webhook routes' bodies (docs/http-api.md, Webhooks)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from api.webhooks.safety import MAX_URL

Event = Literal[
    "job.running",
    "job.succeeded",
    "job.failed",
    "job.timed_out",
    "job.cancelled",
    "job.lost",
    "job.error",
]


class WebhookRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=MAX_URL, examples=["https://portal.example.org/hook"])
    events: list[Event] = Field(
        min_length=1, max_length=16, description="The state changes to send: `job.<state>`."
    )


class LastDelivery(BaseModel):
    at: float = Field(description="When the last attempt ended (Unix seconds).")
    status: int | None = Field(description="The receiver's HTTP status; null: no answer.")
    error: str | None = Field(description="Why it was not a success; null when it was.")


class WebhookInfo(BaseModel):
    id: str
    url: str
    events: list[str]
    created_at: str
    delivered: int = Field(description="Deliveries the receiver accepted (2xx).")
    failed: int = Field(description="Deliveries given up after the retry window (24 h).")
    pending: int = Field(description="Deliveries not made yet (due, or waiting for a retry).")
    last_delivery: LastDelivery | None = None


class WebhookCreated(BaseModel):
    id: str
    url: str
    events: list[str]
    secret: str = Field(description="`whsec_<base64 key>`: shown this once; verify with it.")


class WebhookList(BaseModel):
    items: list[WebhookInfo]
