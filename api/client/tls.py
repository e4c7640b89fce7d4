"""What the client trusts on the wire: the TLS verification context every httpx client of the
process uses (the client's and the server's: the server imports it from here), built once per
process, and the one host a secret may reach over plain HTTP, this machine (`loopback`)."""

from __future__ import annotations

import functools
import ipaddress
import ssl

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default verification (certifi's CAs, or SSL_CERT_FILE / SSL_CERT_DIR), shared.

    httpx loads the whole CA bundle for every client it makes with the default `verify=True`:
    tens of milliseconds of CPU each, paid by every app start (its JWKS client) and every
    `Client`. One
    context serves them all (httpx's advice for many clients); it is only read once built."""
    return httpx.create_ssl_context()


def verify_for(url: str) -> ssl.SSLContext:
    """The context for a client of `url`: `tls_context()` for https; for plain http (this
    machine's `sshapi dev`, the common case of a CLI call) a context that trusts no CA, made
    without reading the bundle (docs/benchmarks.md: CLI start-up). No TLS is made then; should
    one be, it fails verification: closed, never open."""
    if url.startswith("https:"):
        return tls_context()
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def loopback(host: str) -> bool:
    """Is `host` this machine (localhost, 127.0.0.0/8, ::1)? A token goes over plain HTTP only
    there unless the caller opts in (`allow_http`), a provider's secret only there, and no
    proxy of the environment stands between the client and it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
