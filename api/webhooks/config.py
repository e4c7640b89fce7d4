"""`[webhooks]` of the configuration (api/config.py includes it): its own module, as the
configuration module is at the layout's size limit."""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator

from api.credentials import Strict


class WebhooksConfig(Strict):
    """`[webhooks]`: where job state changes may be POSTed (api/webhooks/, docs/portals.md)."""

    # fnmatch patterns a webhook's URL must match (scheme included), e.g. "https://*.example.org/*".
    allowed_urls: list[str] = Field(default_factory=lambda: ["https://*"])
    # Networks a destination may resolve into although private, loopback, link-local or
    # otherwise not global (each address is checked at creation and again at every delivery).
    # `sshapi dev` allows loopback, so that `make run` can try a local receiver.
    allowed_networks: list[str] = Field(default_factory=list)
    max_per_identity: int = Field(default=10, ge=1, le=1000)
    # Deliveries one identity has in flight on one process at once; the process's own cap.
    max_in_flight_per_identity: int = Field(default=4, ge=1)
    max_in_flight: int = Field(default=64, ge=1)
    timeout: float = Field(default=10.0, gt=0, le=60)  # per attempt: connect to last byte
    max_response_bytes: int = Field(default=64 << 10, ge=0)  # read of the receiver's answer
    # Retries: first after `retry_first` seconds, doubling up to `retry_max`, for `retry_for`
    # seconds after the event (at least 24 h by default), then the delivery is `failed`.
    retry_first: float = Field(default=5.0, gt=0)
    retry_max: float = Field(default=3600.0, gt=0)
    retry_for: float = Field(default=86400.0 + 3600.0, gt=0)
    # How often a process looks for due deliveries when not woken by its own state changes.
    poll_interval: float = Field(default=1.0, gt=0, le=60)

    @field_validator("allowed_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for net in value:
            ipaddress.ip_network(net, strict=False)  # ValueError names the bad one
        return value
