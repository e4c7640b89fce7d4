"""Where the client talks to and with which token: the environment, the client
configuration file's profiles, and the rules that keep a token from going where nobody chose."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from api.client.errors import InsecureHTTPWarning, SshapiError
from api.client.tls import loopback

# Where `sshapi dev` listens: only ever a suggestion in an error message, and the URL of a client
# made without a token (nothing to leak). A token is sent only to a URL somebody wrote down.
DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True, slots=True)
class Profile:
    url: str | None  # None: nobody named a server
    token: str | None
    allow_http: bool = False
    # The server the token was configured for (SSHAPI_URL beside SSHAPI_TOKEN, a profile's url
    # beside its token), and where it came from; None: set without a server.
    token_url: str | None = None
    token_from: str = ""
    # `sshapi login`'s file for this profile (api/client/login.py), when there is no token
    login: Path | None = None
    # That file when SSHAPI_TOKEN wins over it: said, or a login would seem ignored.
    overridden: Path | None = None
    issuer: str | None = None  # the OpenID provider `sshapi login` signs in with
    client_id: str | None = None
    name: str | None = None  # the profile chosen, None: none
    file: Path | None = None  # the client configuration file
    # Where `url` came from, for a message about a server that cannot be reached.
    url_from: str = ""


# The keys a profile of the client configuration file may have, and the type of each.
PROFILE_KEYS: dict[str, type] = {
    "url": str,
    "token": str,
    "token_file": str,
    "allow_http": bool,
    "issuer": str,
    "client_id": str,
}


def load_profile(name: str | None = None, path: str | None = None) -> Profile:
    """The server URL and token: SSHAPI_URL / SSHAPI_TOKEN, else the named profile (or the
    file's `default`) of the client configuration file (SSHAPI_CLIENT_CONFIG, else
    ~/.config/sshapi/client.toml):

        default = "dev"
        [profiles.dev]
        url = "http://127.0.0.1:8000"
        token_file = "~/.config/sshapi/dev.token"   # or: token = "..."
        # or neither: `sshapi login` with issuer = "https://..." (and client_id = "...")

    `url` is None when neither names a server: see `server_url`. `token_url` is the server the
    token was set up with (SSHAPI_URL beside SSHAPI_TOKEN, the profile's url beside its token):
    see `paired`.
    """
    import tomllib

    from api.client.login import kept_url, login_path, private

    file = Path(
        path
        or os.environ.get("SSHAPI_CLIENT_CONFIG")
        or Path.home() / ".config" / "sshapi" / "client.toml"
    ).expanduser()
    entry: dict[str, Any] = {}
    wanted: Any = None
    if file.is_file():
        # A hand-written file: whatever is wrong in it is an SshapiError naming the file and
        # the key (one line from the commands), never a traceback.
        try:
            data = tomllib.loads(file.read_text())
        except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not TOML
            raise SshapiError(f"{file}: not a valid client configuration: {exc}") from None
        profiles = data.get("profiles", {})
        if not isinstance(profiles, dict):
            raise SshapiError(f"{file}: `profiles` must be tables [profiles.NAME]")
        if any(isinstance(p, dict) and "token" in p for p in profiles.values()):
            private(file, f"replace its tokens, then chmod 600 {file}")
        wanted = name or os.environ.get("SSHAPI_PROFILE") or data.get("default")
        if wanted is not None:
            if not isinstance(wanted, str) or wanted not in profiles:
                raise SshapiError(f"no profile {wanted!r} in {file}")
            entry = profiles[wanted]
            if not isinstance(entry, dict):
                raise SshapiError(f"{file}: profiles.{wanted} must be a table")
            for key, value in entry.items():
                if key not in PROFILE_KEYS:
                    known = ", ".join(PROFILE_KEYS)
                    raise SshapiError(f"{file}: unknown key profiles.{wanted}.{key} ({known})")
                if not isinstance(value, PROFILE_KEYS[key]):
                    kind = "a boolean" if PROFILE_KEYS[key] is bool else "a string"
                    raise SshapiError(f"{file}: profiles.{wanted}.{key} must be {kind}")
    elif name is not None:
        raise SshapiError(f"no profile {name!r}: {file} does not exist")
    token = entry.get("token")
    if token is None and "token_file" in entry:
        token_file = Path(entry["token_file"]).expanduser()
        try:
            token = token_file.read_text().strip()
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else exc
            raise SshapiError(f"token_file {token_file}: {reason}") from None
    env_url = os.environ.get("SSHAPI_URL") or None
    url_from = "SSHAPI_URL" if env_url else f"the url of profile {wanted!r} in {file}"
    login: Path | None = None
    overridden: Path | None = None
    if env_token := os.environ.get("SSHAPI_TOKEN"):
        token, token_url, token_from = env_token, env_url, "SSHAPI_TOKEN"
        if (kept := login_path(file, wanted)).exists():
            overridden = kept
    else:
        token_url, token_from = entry.get("url"), f"profile {wanted!r} of {file}"
        if token is None and (kept := login_path(file, wanted)).exists():
            # A login is for the server it was made for, as a profile's token is.
            login, token, token_url = kept, "", kept_url(kept)
            token_from = f"the login {kept}"
            if not (env_url or entry.get("url")):
                env_url, url_from = token_url, f"the login {kept}"
    url = env_url or entry.get("url")
    return Profile(
        url=url,
        token=token,
        allow_http=entry.get("allow_http", False),
        token_url=token_url if token or login else None,
        token_from=token_from,
        login=login,
        overridden=overridden,
        issuer=entry.get("issuer"),
        client_id=entry.get("client_id"),
        name=wanted,
        file=file,
        url_from=url_from if url else "",
    )


def _origin(url: str) -> tuple[str, str, int | None]:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return ("", url, None)
    return (parsed.scheme, parsed.host, parsed.port)


def paired(found: Profile, url: str | None) -> str | None:
    """The configured token for a request to `url`, or an SshapiError when it was configured for
    another server (a profile's token with SSHAPI_URL set, SSHAPI_TOKEN with another URL given):
    a token goes to the server it was set up with, never on to another one. A login that
    names no server is refused for every one."""
    if found.login is not None and found.token_url is None:
        # Made by `sshapi login` before it required a server: it is for none, so for no one.
        raise SshapiError(
            f"the login {found.login} names no server, so its tokens go nowhere: sign in again "
            "with the server named (SSHAPI_URL or the profile's url, then `sshapi login`)"
        )
    if found.token is None or found.token_url is None or url is None:
        return found.token
    if _origin(found.token_url) != _origin(url):
        raise SshapiError(
            f"the token of {found.token_from} is for {found.token_url}, not {url}: give the "
            f"token for {url} (SSHAPI_TOKEN, token=) or unset what points elsewhere"
        )
    return found.token


def server_url(url: str | None, token: str | None, allow_http: bool = False) -> str:
    """The base URL to talk to, or an SshapiError when a token would go where nobody chose.

    A token is a password: it goes only to a URL given (argument, SSHAPI_URL or a profile), never
    to the default, which on a shared login node is whoever listens on that port first; over
    plain HTTP only to this machine's loopback, unless `allow_http` (SSHAPI_ALLOW_HTTP=1, a
    profile's `allow_http = true`) says so, with a warning: anyone on the path reads it."""
    if url is None:
        if token:
            raise SshapiError(
                f"no server URL given: the token is not sent to {DEFAULT_URL}, a default nobody "
                f"chose; name the server: export SSHAPI_URL={DEFAULT_URL} (as `sshapi dev` "
                "prints), a profile's url (--profile), or Client(url)"
            )
        return DEFAULT_URL
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise SshapiError(f"{url!r}: not a URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise SshapiError(f"{url!r}: not an http:// or https:// URL (SSHAPI_URL, --profile)")
    if parsed.scheme == "http" and token and not loopback(parsed.host):
        if not allow_http:
            raise SshapiError(
                f"{url}: the token is not sent over plain HTTP to another machine (anyone on "
                "the way reads it); use https://, or opt in with SSHAPI_ALLOW_HTTP=1 (a "
                "profile's allow_http = true)"
            )
        warnings.warn(
            f"the token goes over plain HTTP to {url}: anyone on the way can read it",
            InsecureHTTPWarning,
            stacklevel=4,
        )
    return url


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
