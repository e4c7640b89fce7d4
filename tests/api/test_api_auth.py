"""JWT validation: the rejection matrix, asymmetric keys, scopes, JWKS rotation and flood."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import time
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import jwt
import pytest
from api_helpers import (
    AUDIENCE,
    KEYS_ISS,
    LOCAL_ISS,
    Api,
    Keys,
    config_toml,
    free_port,
    make_settings,
    running_api,
    serve,
)
from cryptography.hazmat.primitives.asymmetric import rsa
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from api.auth import Principal, VerifiedTokens
from sshpool.devhost import LocalHost


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def claims(**over: Any) -> dict[str, Any]:
    now = int(time.time())
    base: dict[str, Any] = {
        "iss": "test-local",
        "aud": AUDIENCE,
        "sub": "alice",
        "scope": "jobs:read",
        "iat": now,
        "exp": now + 300,
    }
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def handmade(
    header: dict[str, Any], payload: dict[str, Any], sign: Callable[[bytes], bytes]
) -> str:
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"
    return f"{signing_input}.{b64(sign(signing_input.encode()))}"


def rejected_tokens(api: Api) -> dict[str, tuple[str, str]]:
    """name -> (token, what the problem's detail must say)."""
    now = int(time.time())
    rsa_public_pem = Keys.public_pem(api.keys.rsa)
    other_rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return {
        "alg none": (
            handmade({"alg": "none", "typ": "JWT"}, claims(), lambda _: b""),
            "algorithm not allowed",
        ),
        "HS256 signed with the RSA public key": (
            handmade(
                {"alg": "HS256", "typ": "JWT"},
                claims(iss=KEYS_ISS),
                lambda m: hmac.new(rsa_public_pem, m, hashlib.sha256).digest(),
            ),
            # An asymmetric issuer cannot list HS256 at all (refused at load).
            "algorithm not allowed",
        ),
        "expired": (api.token(exp=now - 3600, iat=now - 7200), "expired"),
        "not yet valid": (api.token(nbf=now + 3600), "not yet valid"),
        "missing exp": (api.token(exp=None), "missing claim 'exp'"),
        "missing iat": (api.token(iat=None), "missing claim 'iat'"),
        "missing aud": (api.token(aud=None), "missing claim 'aud'"),
        "missing iss": (api.token(iss=None), "issuer"),
        "missing sub": (api.token(sub=None), "missing claim 'sub'"),
        "wrong audience": (api.token(aud="someone-else"), "wrong audience"),
        "unknown issuer": (api.token(iss="https://evil.example"), "issuer"),
        "bad signature": (
            api.token(key="another-secret-that-is-long-enough-to-sign-with"),
            "bad signature",
        ),
        "RS256 from an unknown key": (
            jwt.encode(claims(iss=KEYS_ISS), other_rsa, algorithm="RS256"),
            "bad signature",
        ),
        "algorithm not configured": (
            jwt.encode(claims(iss=KEYS_ISS), api.keys.rsa, algorithm="RS512"),
            "algorithm not allowed",
        ),
        "garbage": ("not-a-token", "malformed"),
        "three garbage parts": ("aaa.bbb.ccc", "malformed"),
    }


async def test_bad_tokens_are_401_with_www_authenticate(api: Api) -> None:
    """Every token of the rejection matrix is 401 problem+json with a Bearer challenge."""
    for name, (token, why) in rejected_tokens(api).items():
        r = await api.client.get(f"{api.url}/v1/jobs", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 401, (name, r.text)
        assert r.headers["WWW-Authenticate"].startswith("Bearer "), name
        assert 'error="invalid_token"' in r.headers["WWW-Authenticate"], name
        assert r.headers["content-type"] == "application/problem+json", name
        assert why in r.json()["detail"], (name, r.json())


async def test_missing_token_is_401_without_error_code(api: Api) -> None:
    """No Authorization header: 401 with a bare Bearer challenge (RFC 6750 section 3.1)."""
    r = await api.client.get(f"{api.url}/v1/jobs")
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == 'Bearer realm="sshapi"'


@pytest.mark.parametrize("alg", ["RS256", "ES256", "EdDSA"])
async def test_tokens_signed_with_configured_public_keys_are_accepted(api: Api, alg: str) -> None:
    """RS256, ES256 and EdDSA tokens verify against the issuer's PEM public keys."""
    by_alg: dict[str, Any] = {"RS256": api.keys.rsa, "ES256": api.keys.ec, "EdDSA": api.keys.ed}
    key = by_alg[alg]
    token = jwt.encode(claims(iss=KEYS_ISS), key, algorithm=alg)
    r = await api.client.get(f"{api.url}/v1/jobs", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text


def joserfc_token(api: Api, alg: str, **over: Any) -> str:
    """A token minted by joserfc, a JOSE implementation independent of the PyJWT we verify with."""
    from joserfc import jwk
    from joserfc import jwt as jose_jwt
    from joserfc.errors import SecurityWarning

    keys: dict[str, Any] = {
        "HS256": jwk.OctKey.import_key(api.secret),
        "RS256": jwk.RSAKey.import_key(api.keys.rsa),
        "ES256": jwk.ECKey.import_key(api.keys.ec),
        "EdDSA": jwk.OKPKey.import_key(api.keys.ed),
    }
    issuer = LOCAL_ISS if alg == "HS256" else KEYS_ISS
    with warnings.catch_warnings():
        # joserfc flags "EdDSA" as superseded by "Ed25519" (RFC 9864); identity providers and
        # our configuration still use "EdDSA".
        warnings.simplefilter("ignore", SecurityWarning)
        return jose_jwt.encode(
            {"alg": alg}, claims(iss=issuer, **over), keys[alg], algorithms=[alg]
        )


@pytest.mark.parametrize("alg", ["HS256", "RS256", "ES256", "EdDSA"])
async def test_tokens_minted_by_another_jose_library_interoperate(api: Api, alg: str) -> None:
    """joserfc's tokens verify for every configured algorithm, and its expired or
    wrong-audience tokens are refused like PyJWT's: the checks are the standard's, not one
    library's."""
    url = f"{api.url}/v1/jobs"

    async def status(token: str) -> int:
        r = await api.client.get(url, headers={"Authorization": f"Bearer {token}"})
        return r.status_code

    now = int(time.time())
    assert await status(joserfc_token(api, alg)) == 200
    assert await status(joserfc_token(api, alg, exp=now - 3600, iat=now - 7200)) == 401
    assert await status(joserfc_token(api, alg, aud="someone-else")) == 401


async def test_identity_is_issuer_and_subject(api: Api) -> None:
    """The same `sub` from two issuers is two people: neither sees the other's jobs."""
    r = await api.submit({"host": "local", "argv": ["true"]}, sub="carol")
    job_id = r.json()["id"]
    token = jwt.encode(claims(iss=KEYS_ISS, sub="carol"), api.keys.rsa, algorithm="RS256")
    r = await api.client.get(
        f"{api.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 404


async def test_read_scope_cannot_submit(api: Api) -> None:
    """jobs:read alone may list but not submit: 403 insufficient-scope."""
    headers = {"Authorization": f"Bearer {api.token(scope='jobs:read')}"}
    r = await api.client.post(
        f"{api.url}/v1/jobs", json={"host": "local", "argv": ["true"]}, headers=headers
    )
    assert r.status_code == 403
    assert r.json()["type"].endswith("insufficient-scope")
    assert (await api.client.get(f"{api.url}/v1/jobs", headers=headers)).status_code == 200


async def test_token_without_scopes_cannot_read(api: Api) -> None:
    """A valid token with no known scope is 403 on every job route."""
    headers = {"Authorization": f"Bearer {api.token(scope='openid profile')}"}
    assert (await api.client.get(f"{api.url}/v1/jobs", headers=headers)).status_code == 403


class JwksServer:
    """A JWKS endpoint whose keys a test can swap, counting its hits."""

    def __init__(self) -> None:
        self.keys: list[dict[str, Any]] = []
        self.hits = 0
        self.app = Starlette(routes=[Route("/jwks.json", self.jwks)])

    async def jwks(self, request: Request) -> JSONResponse:
        self.hits += 1
        return JSONResponse({"keys": self.keys})

    def publish(self, kid: str, key: rsa.RSAPrivateKey) -> None:
        jwk = jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
        self.keys = [{**jwk, "kid": kid, "alg": "RS256", "use": "sig"}]


@asynccontextmanager
async def api_with_jwks(
    url: str,
    min_refresh: float,
    tuned_host: LocalHost,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> AsyncIterator[Api]:
    extra = f"""
[[issuers]]
issuer = "test-jwks"
audience = "{AUDIENCE}"
algorithms = ["RS256"]
jwks_url = "{url}"
jwks_min_refresh_seconds = {min_refresh}
jwks_cache_seconds = 600
"""
    path = tmp_path / "jwks.toml"
    path.write_text(config_toml(tuned_host, secret_file, keys, extra))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        yield api


def jwks_token(key: rsa.RSAPrivateKey, kid: str) -> dict[str, str]:
    token = jwt.encode(claims(iss="test-jwks"), key, algorithm="RS256", headers={"kid": kid})
    return {"Authorization": f"Bearer {token}"}


async def test_jwks_key_rotation_is_picked_up(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """After the IdP rotates keys, a token with the new kid triggers a refetch and verifies;
    the retired key no longer does."""
    jwks = JwksServer()
    old = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    new = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwks.publish("old", old)
    async with (
        serve(jwks.app) as base,
        api_with_jwks(
            f"{base}/jwks.json", 0.2, tuned_host, secret_file, secret, keys, tmp_path
        ) as api,
    ):
        url = f"{api.url}/v1/jobs"
        assert (await api.client.get(url, headers=jwks_token(old, "old"))).status_code == 200
        jwks.publish("new", new)
        await asyncio.sleep(0.3)
        assert (await api.client.get(url, headers=jwks_token(new, "new"))).status_code == 200
        assert (await api.client.get(url, headers=jwks_token(old, "old"))).status_code == 401
        assert jwks.hits == 2


async def test_unknown_kid_flood_does_not_flood_the_jwks_server(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """200 tokens with made-up kids (concurrently) cause no refetch within the refresh
    interval: the JWKS server is hit once, for the first token."""
    jwks = JwksServer()
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwks.publish("real", key)
    async with (
        serve(jwks.app) as base,
        api_with_jwks(
            f"{base}/jwks.json", 30, tuned_host, secret_file, secret, keys, tmp_path
        ) as api,
    ):
        url = f"{api.url}/v1/jobs"
        assert (await api.client.get(url, headers=jwks_token(key, "real"))).status_code == 200
        answers = await asyncio.gather(
            *(api.client.get(url, headers=jwks_token(key, f"fake-{n}")) for n in range(200))
        )
        assert {r.status_code for r in answers} == {401}
        assert jwks.hits == 1


async def test_unreachable_jwks_fails_closed(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """With the JWKS URL unreachable and no cached key, tokens of that issuer are refused."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    url = f"http://127.0.0.1:{free_port()}/jwks.json"
    async with api_with_jwks(url, 0, tuned_host, secret_file, secret, keys, tmp_path) as api:
        r = await api.client.get(f"{api.url}/v1/jobs", headers=jwks_token(key, "k"))
        assert r.status_code == 401


async def test_jwks_server_down_keeps_cached_keys_and_fails_closed_for_new_ones(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """The identity provider's JWKS endpoint goes down: tokens signed with a key fetched
    before keep working from the cache; a token naming a key id never seen is refused."""
    jwks = JwksServer()
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    unseen = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwks.publish("known", key)
    idp = serve(jwks.app)
    base = await idp.__aenter__()
    try:
        async with api_with_jwks(
            f"{base}/jwks.json", 0.1, tuned_host, secret_file, secret, keys, tmp_path
        ) as api:
            url = f"{api.url}/v1/jobs"
            assert (await api.client.get(url, headers=jwks_token(key, "known"))).status_code == 200
            await idp.__aexit__(None, None, None)
            await asyncio.sleep(0.2)  # past the refresh interval: a refetch would be tried
            for _ in range(3):
                r = await api.client.get(url, headers=jwks_token(key, "known"))
                assert r.status_code == 200
            r = await api.client.get(url, headers=jwks_token(unseen, "rotated-in"))
            assert r.status_code == 401
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
    finally:
        with contextlib.suppress(Exception):  # already closed in the normal path
            await idp.__aexit__(None, None, None)


async def test_placeholder_secret_is_refused() -> None:
    """SSHAPI_JWT_SECRET=changeme (or anything short) does not even load."""
    from pydantic import ValidationError

    from api.settings import Settings

    for bad in ("changeme", "short"):
        with pytest.raises(ValidationError):
            Settings(jwt_secret=bad)  # type: ignore[arg-type]


async def test_a_token_seen_before_is_refused_once_past_expiry_and_leeway(api: Api) -> None:
    """A token verified (and remembered) while inside the leeway is refused once past it."""
    exp = int(time.time()) - 3  # the test issuers' leeway is 5 s
    headers = {"Authorization": f"Bearer {api.token(exp=exp)}"}
    for _ in range(2):
        r = await api.client.get(f"{api.url}/v1/jobs", headers=headers)
        assert r.status_code == 200, r.text
    await asyncio.sleep(exp + 5 + 0.5 - time.time())
    r = await api.client.get(f"{api.url}/v1/jobs", headers=headers)
    assert r.status_code == 401 and "expired" in r.json()["detail"]


def test_verified_tokens_are_remembered_until_exp_and_bounded() -> None:
    """The cache answers until `exp`, forgets after it, and keeps the most recently used."""
    who = Principal("iss", "alice", frozenset({"jobs:read"}))
    cache = VerifiedTokens(size=2)
    a, b, c = (VerifiedTokens.digest(t) for t in ("a", "b", "c"))
    cache.put(a, who, exp=100.0, generation=3)
    assert cache.get(a, now=99.9) == (who, 3)
    assert cache.get(a, now=100.0) is None and len(cache) == 0
    cache.put(a, who, 200.0)
    cache.put(b, who, 200.0)
    assert cache.get(a, 150.0) == (who, 0)  # a is now the most recently used
    cache.put(c, who, 200.0)
    assert len(cache) == 2 and cache.get(b, 150.0) is None and cache.get(a, 150.0) == (who, 0)
