"""Bearer JWT validation (docs/http-api.md, "Authentication").

The token's `iss` (read before verification, only to pick the configuration) selects an issuer
entry; everything else comes from that entry: the fixed algorithm list, the audience, the keys.
The key is chosen by the algorithm family, so an HS256 token can never be checked against an RSA
public key used as an HMAC secret. Required claims: exp, iat, sub, aud, iss. Any doubt is a 401:
unknown issuer, unknown key id after a (rate-limited) JWKS refresh, JWKS unreachable with no
cached key.

A verified token is remembered by its SHA-256 digest until its `exp` (`VerifiedTokens`): a
portal sends the same token with many requests, and a cache hit costs one hash instead of three
base64 and JSON decodes and a signature check. Only successes are kept (a refusal is decided
again every time, so a key that appears later in the JWKS is picked up), the cache is bounded,
an entry never outlives the token's own expiry, and an entry verified under a JWKS key set that
has been refetched since is checked again (so a retired key stops verifying at the refetch,
as without the cache).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey
from cryptography.hazmat.primitives.asymmetric.ed448 import Ed448PublicKey
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from api.config import SCOPES as KNOWN_SCOPES
from api.config import SYMMETRIC, IssuerConfig
from api.problems import unauthorized
from api.settings import read_secret_file

log = logging.getLogger("sshapi.auth")

REQUIRED_CLAIMS = ["exp", "iat", "sub", "aud", "iss"]
# The issuer of job handles' principals: not a URL, so no configured issuer can be it.
HANDLE_ISSUER = "sshapi:handle"
# Checked before any decoding: a real token is well under 2 KiB, and decoding one of megabytes
# (base64 + JSON, twice) costs seconds of CPU for a 401.
MAX_TOKEN_BYTES = 8 << 10
MAX_SUBJECT = 512
SCOPES = frozenset(KNOWN_SCOPES)

# Which public key types can verify which algorithms.
KEY_TYPES: dict[str, tuple[type, ...]] = {
    "RS": (RSAPublicKey,),
    "PS": (RSAPublicKey,),
    "ES": (EllipticCurvePublicKey,),
    "Ed": (Ed25519PublicKey, Ed448PublicKey),
}


@dataclass(frozen=True, slots=True)
class HandleGrant:
    """What a job handle (api/handles.py) lets its bearer do: read job `job_id`, and cancel it
    when `cancel`; on behalf of `creator`, whose revocation ends it and whose buckets pay."""

    id: str
    job_id: str
    cancel: bool
    creator: Principal


# The widest account claim the store keeps with a record (its owner_account columns).
MAX_KEPT_ACCOUNT = 64


@dataclass(frozen=True, slots=True)
class Principal:
    """A verified caller. Identity is (issuer, subject): `key`. `account`: the Unix account its
    issuer's `account_claim` names, unchecked (api/policy.py checks it against the host): None
    when the issuer has no such claim or the token lacks it, "" when it is not a string.

    `handle`: set for the bearer of a job handle, whose identity is the handle's own
    (HANDLE_ISSUER, the handle's id): no policy rule, host, account or job list is theirs, so
    every feature keyed by identity refuses them by default; the job service lets them read the
    one job the grant names (api/jobs/service.py `get`)."""

    issuer: str
    subject: str
    scopes: frozenset[str]
    account: str | None = None
    handle: HandleGrant | None = None

    @property
    def kept_account(self) -> str | None:
        """The account claim as records keep it (a handle's or a webhook's creator, for
        revocations by account): None when longer than the store's column, 64 characters, as
        no host account or revocation can name such a claim."""
        return self.account if self.account and len(self.account) <= MAX_KEPT_ACCOUNT else None

    @property
    def accountable(self) -> Principal:
        """Who answers for this caller's use: a handle's creator, else the caller."""
        return self.handle.creator if self.handle is not None else self

    @property
    def key(self) -> tuple[str, str]:
        """The caller's identity wherever one is kept or compared: a job's owner (the store's
        `owner_iss`, `owner_sub`), the quota's buckets and capped sets, listing snapshots."""
        return (self.issuer, self.subject)

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes

    def has(self, scope: str) -> bool:
        return self.is_admin or scope in self.scopes


def scopes_of(claims: dict[str, Any]) -> frozenset[str]:
    """OAuth `scope` (space separated) or `scp` (a list), keeping only the scopes we know."""
    raw = claims.get("scope", claims.get("scp", ""))
    items: Iterable[Any] = (
        raw.split() if isinstance(raw, str) else raw if isinstance(raw, list) else ()
    )
    return frozenset(s for s in items if isinstance(s, str) and s in SCOPES)


class JwksCache:
    """Keys from a JWKS URL. Refetched when older than `cache_seconds`, or for an unknown `kid`
    at most once per `min_refresh_seconds`, one fetch at a time: a flood of tokens with made-up
    key ids costs the identity provider one request per interval. A failed fetch keeps the keys
    already known; with none known, every token is refused."""

    def __init__(self, issuer: IssuerConfig, client: httpx.AsyncClient) -> None:
        assert issuer.jwks_url
        self.url = issuer.jwks_url
        self.cache_seconds = issuer.jwks_cache_seconds
        self.min_refresh = issuer.jwks_min_refresh_seconds
        self.timeout = issuer.jwks_timeout
        self._client = client
        self._keys: dict[str | None, Any] = {}
        self._fetched_at = -float("inf")
        self._attempted_at = -float("inf")
        self._lock = asyncio.Lock()
        # Bumped by every successful fetch: a token verified under an older key set is checked
        # again (a retired key stops verifying even for tokens seen before).
        self.generation = 0

    async def fresh_generation(self) -> int:
        """The key set's generation, after a refetch if it is older than `cache_seconds` (at
        most once per `min_refresh_seconds`, as for unknown key ids)."""
        now = time.monotonic()
        if now - self._fetched_at > self.cache_seconds and now - self._attempted_at >= (
            self.min_refresh
        ):
            await self._refresh(now)
        return self.generation

    async def keys(self, kid: str | None) -> list[Any]:
        now = time.monotonic()
        stale = now - self._fetched_at > self.cache_seconds or kid not in self._keys
        if stale and now - self._attempted_at >= self.min_refresh:
            await self._refresh(now)
        if kid is None:
            return list(self._keys.values())
        key = self._keys.get(kid)
        return [key] if key is not None else []

    async def _refresh(self, asked_at: float) -> None:
        async with self._lock:
            if self._attempted_at >= asked_at:
                return  # someone refreshed while we waited for the lock
            self._attempted_at = time.monotonic()
            try:
                response = await self._client.get(self.url, timeout=self.timeout)
                response.raise_for_status()
                keyset = jwt.PyJWKSet.from_dict(response.json())
            except (httpx.HTTPError, ValueError, jwt.PyJWTError) as exc:
                log.warning("JWKS fetch from %s failed: %s", self.url, exc)
                return
            self._keys = {k.key_id: k.key for k in keyset.keys}
            self._fetched_at = time.monotonic()
            self.generation += 1


class IssuerKeys:
    """The verification material of one issuer."""

    def __init__(self, issuer: IssuerConfig, secret: str | None, client: httpx.AsyncClient) -> None:
        self.config = issuer
        self.secret = secret
        self.public = [load_pem_public_key(p.read_bytes()) for p in issuer.public_keys]
        self.jwks = JwksCache(issuer, client) if issuer.jwks_url else None

    async def generation(self) -> int:
        """Changes whenever the verification keys may have: a JWKS refetch. Fixed keys: 0."""
        return 0 if self.jwks is None else await self.jwks.fresh_generation()

    async def candidates(self, alg: str, kid: str | None) -> list[Any]:
        if alg in SYMMETRIC:
            return [self.secret] if self.secret else []
        types = KEY_TYPES[alg[:2]]
        keys: list[Any] = [k for k in self.public if isinstance(k, types)]
        if self.jwks is not None:
            keys += [k for k in await self.jwks.keys(kid) if isinstance(k, types)]
        return keys


class VerifiedTokens:
    """Principals of verified tokens by token digest, each until its `exp` (Unix seconds);
    least recently used first out beyond `size`."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._entries: OrderedDict[bytes, tuple[Principal, float, int]] = OrderedDict()

    @staticmethod
    def digest(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()

    def get(self, digest: bytes, now: float) -> tuple[Principal, int] | None:
        """The principal and the key generation it was verified under; None once past exp."""
        entry = self._entries.get(digest)
        if entry is None:
            return None
        principal, exp, generation = entry
        if now >= exp:
            del self._entries[digest]
            return None
        self._entries.move_to_end(digest)
        return principal, generation

    def put(self, digest: bytes, principal: Principal, exp: float, generation: int = 0) -> None:
        self._entries[digest] = (principal, exp, generation)
        self._entries.move_to_end(digest)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class Authenticator:
    def __init__(
        self,
        issuers: list[IssuerConfig],
        local_secret: Callable[[], str],
        client: httpx.AsyncClient,
    ) -> None:
        self._issuers: dict[str, IssuerKeys] = {}
        seen: set[str] = set()
        for issuer in issuers:
            secret = None
            if issuer.symmetric:
                # Only the local issuer may go without a secret_file (api/config.py checks it).
                secret = (
                    read_secret_file(issuer.secret_file) if issuer.secret_file else local_secret()
                )
                if secret in seen:
                    raise ValueError(f"issuer {issuer.issuer!r} shares its secret with another")
                seen.add(secret)
            self._issuers[issuer.issuer] = IssuerKeys(issuer, secret, client)
        self.verified = VerifiedTokens()

    async def authenticate(self, token: str) -> Principal:
        if len(token) > MAX_TOKEN_BYTES:
            raise unauthorized(f"token too large (at most {MAX_TOKEN_BYTES} bytes)")
        digest = self.verified.digest(token)
        known = self.verified.get(digest, time.time())
        if known is not None:
            principal, generation = known
            if await self._issuers[principal.issuer].generation() == generation:
                return principal
        try:
            header = jwt.get_unverified_header(token)
            # Unverified read, only to choose the issuer configuration; verified below.
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise unauthorized("malformed token") from None
        iss = unverified.get("iss")
        keys = self._issuers.get(iss) if isinstance(iss, str) else None
        if keys is None:
            raise unauthorized("unknown or missing issuer")
        issuer = keys.config
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in issuer.algorithms:
            raise unauthorized("algorithm not allowed")
        kid = header.get("kid")
        generation = await keys.generation()  # before the keys: never newer than they are
        candidates = await keys.candidates(alg, kid if isinstance(kid, str) else None)
        if not candidates:
            raise unauthorized("no key to verify this token")
        claims = self._verify(token, alg, issuer, candidates)
        sub = claims.get("sub")
        if not isinstance(sub, str) or not sub:
            raise unauthorized("missing subject")
        if len(sub) > MAX_SUBJECT or not sub.isprintable():
            # Stored with every job and used in keys: NUL, control characters and lone
            # surrogates cannot go into PostgreSQL text or UTF-8 (they were 500s).
            raise unauthorized(f"invalid subject (printable, at most {MAX_SUBJECT} characters)")
        if issuer.clients is not None:
            # A token issued to another client of the same IdP (a portal's, a CLI's) is not
            # one for this API: 401, as for a wrong audience (RFC 6750 invalid_token: the
            # caller needs another token, not other rights).
            client = claims.get("azp", claims.get("client_id"))
            if not isinstance(client, str) or client not in issuer.clients:
                raise unauthorized("token issued to a client not allowed here (azp)")
        # An issuer grants only the scopes its entry lists: another IdP cannot mint admins.
        scopes = scopes_of(claims) & frozenset(issuer.scopes)
        account = None
        if issuer.account_claim is not None and issuer.account_claim in claims:
            value = claims[issuer.account_claim]
            account = value if isinstance(value, str) else ""
        principal = Principal(issuer=issuer.issuer, subject=sub, scopes=scopes, account=account)
        exp = claims.get("exp")
        if isinstance(exp, int | float) and not isinstance(exp, bool):
            # Until `exp` itself, not `exp + leeway`: the leeway is for clock skew at
            # verification, and a cached answer must never be more lenient than a fresh one.
            self.verified.put(digest, principal, float(exp), generation)
        return principal

    @staticmethod
    def _verify(token: str, alg: str, issuer: IssuerConfig, keys: list[Any]) -> dict[str, Any]:
        for key in keys:
            try:
                return jwt.decode(
                    token,
                    key,
                    algorithms=[alg],
                    audience=issuer.audience,
                    issuer=issuer.issuer,
                    leeway=issuer.leeway,
                    options={"require": REQUIRED_CLAIMS},
                )
            except (jwt.InvalidSignatureError, jwt.InvalidKeyError):
                continue  # another key of this issuer may match
            except jwt.ExpiredSignatureError:
                raise unauthorized("token expired") from None
            except jwt.ImmatureSignatureError:
                raise unauthorized("token not yet valid") from None
            except jwt.MissingRequiredClaimError as exc:
                raise unauthorized(f"missing claim {exc.claim!r}") from None
            except jwt.InvalidAudienceError:
                raise unauthorized("wrong audience") from None
            except jwt.InvalidIssuerError:
                raise unauthorized("wrong issuer") from None
            except jwt.PyJWTError as exc:
                raise unauthorized(f"invalid token: {type(exc).__name__}") from None
        raise unauthorized("bad signature")
