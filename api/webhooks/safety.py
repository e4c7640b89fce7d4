"""Which webhook destinations may be called: a URL the configuration's `allowed_urls` patterns
match, whose host resolves only to global addresses or to the configuration's
`allowed_networks`. Checked when the webhook is created and again, after a fresh DNS lookup,
before every delivery; the delivery then connects to the very address checked (the URL's host
is kept as the `Host` header and the TLS server name), so a DNS answer that changes between the
check and the connection (rebinding) cannot send it elsewhere."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from fnmatch import fnmatchcase

import httpx

from api.webhooks.config import WebhooksConfig

MAX_URL = 2048
IP = ipaddress.IPv4Address | ipaddress.IPv6Address


class Refused(Exception):
    """A destination the configuration does not allow; the message says why (to its owner)."""


@dataclass(frozen=True, slots=True)
class Destination:
    """Where one delivery goes: the URL with the checked address as its host, and the name the
    receiver expects (`Host`, TLS server name)."""

    url: httpx.URL
    host_header: str
    server_name: str


def check_url(url: str, config: WebhooksConfig) -> httpx.URL:
    """The URL parsed, if its form and the allowed patterns admit it (no DNS yet)."""
    if len(url) > MAX_URL:
        raise Refused(f"the URL is longer than {MAX_URL} characters")
    try:
        parsed = httpx.URL(url)
    except Exception:
        raise Refused("not a valid URL") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise Refused("the URL must be http:// or https:// with a host")
    if parsed.userinfo:
        raise Refused("the URL may not carry credentials")
    if parsed.fragment:
        raise Refused("the URL may not have a fragment")
    if not any(fnmatchcase(url, pattern) for pattern in config.allowed_urls):
        raise Refused("the URL matches none of the allowed patterns: " + _patterns(config))
    return parsed


def _patterns(config: WebhooksConfig) -> str:
    return ", ".join(config.allowed_urls) or "(none: webhooks are off)"


def address_allowed(address: IP, config: WebhooksConfig) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is loopback
    for net in config.allowed_networks:
        if address in ipaddress.ip_network(net, strict=False):
            return True
    return address.is_global and not address.is_multicast


async def resolve(url: httpx.URL, config: WebhooksConfig) -> IP:
    """The address to connect to: every address the host resolves to must be allowed (one
    refused address refuses the URL: a resolver may hand out either)."""
    host = url.host
    try:
        literal: IP | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [literal]
    else:
        port = url.port or (443 if url.scheme == "https" else 80)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            raise Refused(f"the host {host!r} does not resolve") from None
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
        if not addresses:
            raise Refused(f"the host {host!r} does not resolve")
    for address in addresses:
        if not address_allowed(address, config):
            raise Refused(
                f"the host {host!r} resolves to {address}, a private, loopback, link-local or "
                "reserved address this server does not call"
            )
    return addresses[0]


async def destination(url: str, config: WebhooksConfig) -> Destination:
    parsed = check_url(url, config)
    address = await resolve(parsed, config)
    port = parsed.port
    netloc = parsed.host if port is None else f"{parsed.host}:{port}"
    if ":" in parsed.host:  # an IPv6 literal: httpx.URL.host has no brackets
        netloc = f"[{parsed.host}]" if port is None else f"[{parsed.host}]:{port}"
    return Destination(parsed.copy_with(host=str(address)), netloc, parsed.host)
