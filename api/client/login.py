"""Signing in: tokens from the profile's OpenID provider, found by discovery
(`/.well-known/openid-configuration`), through the device authorization grant (RFC 8628: a
researcher approves in a browser) or the client-credentials grant (workflows, CI). A login is a
JSON file beside the client configuration (`logins/PROFILE.json`, mode 0600 in a 0700 directory)
that `LoginAuth` renews before the access token expires, for the CLI and for Client/AsyncClient
alike (httpx calls it for every request, streams included).

Invariants: a login file is written whole (a temporary file renamed) and never read when others
may read it; a client secret is never written (renewal reads it again from where login got it);
every provider answer is size-capped and checked, and a wrong one is an SshapiError naming the
provider, never a traceback.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from api.client.errors import SshapiError
from api.client.tls import loopback

if TYPE_CHECKING:
    import asyncio

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
SCOPE = "jobs:read jobs:write files:read files:write"
MAX_ANSWER = 64 * 1024  # a discovery document or token answer is a few KiB
TIMEOUT = 10.0  # a provider that answers slowly fails the login, not hangs it
RENEW_MARGIN = 60.0  # renew when less than this (or a quarter of the lifetime) remains


@dataclass(frozen=True, slots=True)
class Endpoints:
    """What discovery found: the issuer and where to ask it."""

    issuer: str
    token: str
    device: str | None
    revocation: str | None


def login_path(config_file: Path, profile: str | None) -> Path:
    """Where the login of `profile` (None: the configuration's default) is kept."""
    return config_file.parent / "logins" / f"{profile or 'default'}.json"


def _endpoint(doc: dict[str, Any], key: str, issuer: str) -> str | None:
    value = doc.get(key)
    if value is None:
        return None
    url = httpx.URL(value) if isinstance(value, str) else None
    # Secrets go to these: https, or plain http to this machine only (the rig).
    if url is None or not (url.scheme == "https" or (url.scheme == "http" and loopback(url.host))):
        raise SshapiError(f"{issuer}: discovery gives no usable {key} ({value!r})")
    return str(value)


def _json(response: httpx.Response, what: str) -> dict[str, Any]:
    if len(response.content) > MAX_ANSWER:
        raise SshapiError(f"{what}: answer over {MAX_ANSWER} bytes")
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise SshapiError(f"{what}: HTTP {response.status_code}, not a JSON object")
    return body


def discover(issuer: str, http: httpx.Client) -> Endpoints:
    """The provider's endpoints; its document must name `issuer` itself (RFC 8414 3.3): a
    document for another issuer would send tokens from elsewhere to the API."""
    issuer = issuer.rstrip("/")
    url = f"{issuer}/.well-known/openid-configuration"
    try:
        response = http.get(url, timeout=TIMEOUT)
    except httpx.HTTPError as exc:
        raise SshapiError(f"{url}: {exc or type(exc).__name__}") from None
    doc = _json(response, url)
    if response.status_code != 200:
        raise SshapiError(f"{url}: HTTP {response.status_code}")
    if not isinstance(doc.get("issuer"), str) or doc["issuer"].rstrip("/") != issuer:
        raise SshapiError(f"{url} names issuer {doc.get('issuer')!r}, not {issuer}")
    token = _endpoint(doc, "token_endpoint", issuer)
    if token is None:
        raise SshapiError(f"{issuer}: discovery gives no token_endpoint")
    return Endpoints(
        issuer=issuer,
        token=token,
        device=_endpoint(doc, "device_authorization_endpoint", issuer),
        revocation=_endpoint(doc, "revocation_endpoint", issuer),
    )


def token_issuer(access: str) -> str | None:
    """The `iss` a JWT access token names, unverified (the API verifies it), or None: OAuth
    leaves access tokens opaque to clients, though Keycloak's and the rig's are JWTs."""
    parts = access.split(".")
    if len(parts) != 3:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except ValueError:  # not base64, not UTF-8, not JSON
        return None
    issuer = claims.get("iss") if isinstance(claims, dict) else None
    return issuer if isinstance(issuer, str) else None


def _tokens(response: httpx.Response, what: str, issuer: str | None) -> dict[str, Any]:
    """A token answer's fields, or an SshapiError with the provider's `error`. A JWT access
    token naming another issuer than `issuer` (discovery's) is refused here: the API checks a
    token's `iss` against the issuers it trusts, so it would refuse every call with a bare 401
    (Keycloak reached by a hostname other than its configured one does this)."""
    body = _json(response, what)
    if response.status_code != 200:
        error = body.get("error")
        raise OAuthError(str(error) if isinstance(error, str) else "", what, response.status_code)
    access, expires = body.get("access_token"), body.get("expires_in")
    if not isinstance(access, str) or not access or len(access) > 16 * 1024:
        raise SshapiError(f"{what}: no access_token in the answer")
    named = token_issuer(access)
    if named is not None and issuer and named.rstrip("/") != issuer.rstrip("/"):
        raise SshapiError(
            f"{what}: the access token names issuer {named!r}, but discovery names {issuer}: "
            "the API would refuse it; make the provider's public URL one (docs/login.md)"
        )
    if not isinstance(expires, int | float) or isinstance(expires, bool) or expires <= 0:
        expires = 300  # RFC 6749 5.1: RECOMMENDED, not required; assume short
    refresh = body.get("refresh_token")
    return {
        "access_token": access,
        "expires_at": time.time() + float(expires),
        "lifetime": float(expires),
        "refresh_token": refresh if isinstance(refresh, str) else None,
    }


class OAuthError(SshapiError):
    """The provider refused: `error` is its OAuth error code (invalid_grant, expired_token...)."""

    def __init__(self, error: str, what: str, status: int) -> None:
        hint = {
            "invalid_grant": ": the login expired or was revoked; run `sshapi login` again",
            "expired_token": ": the code expired before it was approved; run `sshapi login` again",
            "access_denied": ": the request was denied",
            "invalid_client": ": the client id or secret is wrong",
        }.get(error, "")
        super().__init__(f"{what}: {error or f'HTTP {status}'}{hint}")
        self.error = error


def device_login(
    found: Endpoints,
    client_id: str,
    http: httpx.Client,
    show: Callable[[str], None],
    scope: str = SCOPE,
) -> dict[str, Any]:
    """RFC 8628: ask for a code, `show` where to approve it, poll until approved or expired."""
    if found.device is None:
        raise SshapiError(f"{found.issuer}: the provider offers no device authorization")
    try:
        response = http.post(
            found.device,
            data={"client_id": client_id, "scope": f"openid offline_access {scope}"},
            timeout=TIMEOUT,
        )
        body = _json(response, found.device)
        if response.status_code != 200:
            raise OAuthError(str(body.get("error", "")), found.device, response.status_code)
        code, user_code = body.get("device_code"), body.get("user_code")
        uri = body.get("verification_uri_complete") or body.get("verification_uri")
        if not (isinstance(code, str) and isinstance(user_code, str) and isinstance(uri, str)):
            raise SshapiError(f"{found.device}: not a device authorization answer")
        interval = body.get("interval", 5)
        interval = float(interval) if isinstance(interval, int) and 0 < interval < 60 else 5.0
        expires = body.get("expires_in", 600)
        deadline = time.monotonic() + (float(expires) if isinstance(expires, int) else 600.0)
        show(f"To sign in, open {uri} and check the code {user_code}")
        # A line, not silence: the command seems hung otherwise until the approval.
        minutes = (deadline - time.monotonic()) / 60
        show(
            f"waiting for the approval: asking {found.issuer} every {interval:g} s for the next "
            f"{minutes:.0f} min (Ctrl-C stops)"
        )
        while time.monotonic() < deadline:
            time.sleep(interval)
            data = {"grant_type": DEVICE_GRANT, "device_code": code, "client_id": client_id}
            try:
                answer = http.post(found.token, data=data, timeout=TIMEOUT)
                return _tokens(answer, found.token, found.issuer)
            except OAuthError as exc:
                if exc.error == "slow_down":
                    interval += 5  # RFC 8628 3.5
                elif exc.error != "authorization_pending":
                    raise
        raise OAuthError("expired_token", found.token, 400)
    except httpx.HTTPError as exc:
        raise SshapiError(f"{found.issuer}: {exc or type(exc).__name__}") from None


def client_secret(secret_file: str | None) -> str:
    """The client secret: the file's first line, else SSHAPI_CLIENT_SECRET."""
    if secret_file:
        try:
            return Path(secret_file).expanduser().read_text().strip()
        except OSError as exc:
            raise SshapiError(f"{secret_file}: {exc.strerror}") from None
    if secret := os.environ.get("SSHAPI_CLIENT_SECRET"):
        return secret
    raise SshapiError("no client secret: set SSHAPI_CLIENT_SECRET or give --client-secret-file")


def _renewal(login: dict[str, Any]) -> tuple[dict[str, str], httpx.Auth]:
    """The token request that renews `login`: its form and its client authentication (a
    public client, as the device flow's, has none: httpx.Auth() adds nothing)."""
    if login.get("grant") == "client_credentials":
        secret = client_secret(login.get("client_secret_file"))
        form = {"grant_type": "client_credentials", "scope": login["scope"]}
        return form, httpx.BasicAuth(login["client_id"], secret)
    if not login.get("refresh_token"):
        raise SshapiError("the login has expired and cannot be renewed: run `sshapi login`")
    form = {
        "grant_type": "refresh_token",
        "refresh_token": login["refresh_token"],
        "client_id": login["client_id"],
    }
    return form, httpx.Auth()


def client_credentials_login(
    found: Endpoints,
    client_id: str,
    secret_file: str | None,
    http: httpx.Client,
    scope: str = SCOPE,
) -> dict[str, Any]:
    """The client-credentials grant; the login keeps where the secret came from, not the secret."""
    login = {"grant": "client_credentials", "client_id": client_id, "scope": scope}
    if secret_file:
        login["client_secret_file"] = str(Path(secret_file).expanduser().resolve())
    form, auth = _renewal(login)
    try:
        response = http.post(found.token, data=form, auth=auth, timeout=TIMEOUT)
    except httpx.HTTPError as exc:
        raise SshapiError(f"{found.token}: {exc or type(exc).__name__}") from None
    return {**login, **_tokens(response, found.token, found.issuer)}


def save(path: Path, login: dict[str, Any]) -> None:
    """Write the login whole, mode 0600, in a 0700 directory."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(login, out)
    os.replace(temporary, path)


def private(path: Path, remedy: str) -> None:
    """An SshapiError when others than its owner may read `path`, a file holding tokens (as
    ssh refuses such a private key); `remedy` says what to do."""
    mode = path.stat().st_mode
    if mode & 0o077:
        raise SshapiError(
            f"{path} is readable by others (mode {mode & 0o777:o}): its tokens may have "
            f"leaked; {remedy}"
        )


def load(path: Path) -> dict[str, Any]:
    """The login kept at `path`; refused when others may read it (as ssh refuses such a key)."""
    try:
        private(path, f"run `sshapi logout`, then `sshapi login` (or chmod 600 {path})")
        login = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SshapiError(f"{path}: not a login ({exc}); run `sshapi login`") from None
    if not isinstance(login, dict) or not isinstance(login.get("access_token"), str):
        raise SshapiError(f"{path}: not a login; run `sshapi login`")
    return login


def kept_url(path: Path) -> str | None:
    """The server a kept login is for (unchecked: `load` checks the file before any use)."""
    try:
        url = json.loads(path.read_text()).get("url")
    except (OSError, ValueError, AttributeError):
        return None
    return str(url) if isinstance(url, str) else None


class LoginAuth(httpx.Auth):
    """Bearer auth from a login file, renewed before the access token expires (re-read from
    the file first: another process may have renewed it meanwhile)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.login = load(path)
        self.lock = threading.Lock()
        self.alock: asyncio.Lock | None = None

    def _stale(self) -> bool:
        margin = min(RENEW_MARGIN, float(self.login.get("lifetime", 300)) / 4)
        return float(self.login.get("expires_at", 0)) - time.time() < margin

    def _renewed(self, response: httpx.Response) -> None:
        what, issuer = self.login["token_endpoint"], self.login.get("issuer")
        login = {**self.login, **_tokens(response, what, issuer)}
        if not login.get("refresh_token"):  # a provider that does not rotate keeps the old one
            login["refresh_token"] = self.login.get("refresh_token")
        save(self.path, login)
        self.login = login

    def _bearer(self, request: httpx.Request) -> httpx.Request:
        request.headers["Authorization"] = f"Bearer {self.login['access_token']}"
        return request

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response]:
        with self.lock:
            if self._stale():
                self.login = load(self.path)
            if self._stale():
                form, auth = _renewal(self.login)
                try:
                    with httpx.Client(timeout=TIMEOUT) as http:
                        answer = http.post(self.login["token_endpoint"], data=form, auth=auth)
                except httpx.HTTPError as exc:
                    raise SshapiError(f"renewing the login: {exc or type(exc).__name__}") from None
                self._renewed(answer)
        yield self._bearer(request)

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        # asyncio loaded on first use: the `sshapi` commands (sync) never need it.
        from asyncio import Lock

        self.alock = self.alock or Lock()
        async with self.alock:
            if self._stale():
                self.login = load(self.path)
            if self._stale():
                form, auth = _renewal(self.login)
                try:
                    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                        answer = await http.post(self.login["token_endpoint"], data=form, auth=auth)
                except httpx.HTTPError as exc:
                    raise SshapiError(f"renewing the login: {exc or type(exc).__name__}") from None
                self._renewed(answer)
        yield self._bearer(request)


def revoke(login: dict[str, Any]) -> None:
    """Ask the provider to forget the refresh token (best effort: logout goes on regardless)."""
    endpoint, token = login.get("revocation_endpoint"), login.get("refresh_token")
    if not endpoint or not token:
        return
    form = {"token": token, "token_type_hint": "refresh_token", "client_id": login["client_id"]}
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(endpoint, data=form, timeout=TIMEOUT)
