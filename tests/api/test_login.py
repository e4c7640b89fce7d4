"""`sshapi login` against a real OpenID provider (panva's oidc-provider, sshpool/devhost/oidc.py):
the client-credentials grant, the device flow approved in a headless Chromium, renewal of
short-lived access tokens, logout, and the hostile cases (exposed token file, an expired device
code, a provider answering garbage or naming another issuer)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from api_helpers import SSHAPI, Api, Keys, config_toml, make_settings, running_api

from api.client import AsyncClient, SshapiError
from api.client import login as oauth
from sshpool.devhost import oidc
from sshpool.devhost.host import LocalHost

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TTL = 3  # seconds an access token lives: a few calls outlive several
POLICY = """
[[policy]]
subject = "ci"
issuer = "*"
hosts = ["local"]
shell_hosts = ["local"]
"""
pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node missing")


@pytest.fixture
def device_ttl() -> int:
    return 120


@pytest.fixture
def provider(tmp_path: Path, device_ttl: int) -> Iterator[oidc.Provider]:
    started = oidc.start(
        tmp_path / "oidc",
        "http://127.0.0.1/",
        ci_secret="ci-" + "s" * 30,
        ci_account="anyhost",
        access_ttl=TTL,
        device_code_ttl=device_ttl,
    )
    yield started
    started.stop()


@pytest.fixture
async def api(
    provider: oidc.Provider,
    tuned_host: LocalHost,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> AsyncIterator[Api]:
    path = tmp_path / "oidc.toml"
    extra = provider.issuer_toml(leeway=0) + POLICY
    path.write_text(config_toml(tuned_host, secret_file, keys, extra))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        yield api


def env(api: Api, provider: oidc.Provider, tmp_path: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SSHAPI_")}
    return {
        **base,
        "SSHAPI_URL": api.url,
        "SSHAPI_CLIENT_CONFIG": str(tmp_path / "client" / "client.toml"),
        "SSHAPI_ISSUER": provider.issuer,
        "SSHAPI_CLIENT_SECRET": provider.ci_secret,
    }


async def sshapi(environ: dict[str, str], *args: str) -> tuple[int, str]:
    # stdin /dev/null: `sshapi run` sends a piped stdin to the command, as ssh does.
    proc = await asyncio.create_subprocess_exec(
        SSHAPI, *args, env=environ, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, (out + err).decode()


async def test_client_credentials_login_runs_jobs_across_expiry_and_logout_forgets_it(
    api: Api, provider: oidc.Provider, tmp_path: Path
) -> None:
    environ = env(api, provider, tmp_path)
    assert await sshapi(environ, "login", "--client-credentials", "--client-id", "ci") == (
        0,
        f"signed in with {provider.issuer}; the login is kept in "
        f"{tmp_path / 'client' / 'logins' / 'default.json'}\n",
    )
    kept = tmp_path / "client" / "logins" / "default.json"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE(kept.parent.stat().st_mode) == 0o700
    assert provider.ci_secret not in kept.read_text()
    first = oauth.load(kept)["access_token"]
    # The job outlives the first token; the CLI renews for the calls after it.
    code, out = await sshapi(environ, "run", "local", "--", "sh", "-c", f"sleep {TTL + 1}; echo hi")
    assert (code, out) == (0, "hi\n")
    assert oauth.load(kept)["access_token"] != first
    code, out = await sshapi(environ, "logout")
    assert code == 0 and not kept.exists()
    code, out = await sshapi(environ, "jobs", "list")
    assert code == 255 and "401" in out


async def test_an_exposed_login_file_is_refused(
    api: Api, provider: oidc.Provider, tmp_path: Path
) -> None:
    environ = env(api, provider, tmp_path)
    assert (await sshapi(environ, "login", "--client-credentials", "--client-id", "ci"))[0] == 0
    kept = tmp_path / "client" / "logins" / "default.json"
    kept.chmod(0o644)
    code, out = await sshapi(environ, "jobs", "list")
    assert code == 255 and f"{kept} is readable by others (mode 644)" in out


async def test_wrong_secret_and_a_provider_naming_another_issuer_or_answering_garbage(
    api: Api, provider: oidc.Provider, tmp_path: Path
) -> None:
    environ = {**env(api, provider, tmp_path), "SSHAPI_CLIENT_SECRET": "wrong"}
    code, out = await sshapi(environ, "login", "--client-credentials", "--client-id", "ci")
    assert code == 255 and "invalid_client: the client id or secret is wrong" in out

    def answer(doc: object) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, json=doc)))

    with pytest.raises(SshapiError, match=r"names issuer 'https://evil\.example', not"):
        oauth.discover(provider.issuer, answer({"issuer": "https://evil.example"}))
    with pytest.raises(SshapiError, match="not a JSON object"):
        oauth.discover(provider.issuer, answer(["garbage"]))
    doc = {"issuer": provider.issuer, "token_endpoint": "http://elsewhere.example/token"}
    with pytest.raises(SshapiError, match="no usable token_endpoint"):
        oauth.discover(provider.issuer, answer(doc))


@pytest.mark.parametrize("device_ttl", [4])
async def test_an_unapproved_device_code_expires_with_a_clear_message(
    api: Api, provider: oidc.Provider, tmp_path: Path
) -> None:
    code, out = await sshapi(env(api, provider, tmp_path), "login")
    assert code == 255
    assert "expired_token: the code expired before it was approved; run `sshapi login`" in out
    # While it polls it says so (before: the code's line, then silence until it expired).
    assert f"waiting for the approval: asking {provider.issuer} every " in out
    assert not (tmp_path / "client" / "logins" / "default.json").exists()


def approve(url: str, tmp_path: Path, account: str) -> None:
    """A researcher approving the code in a browser: confirm, sign in, allow."""
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.get(url)
        for _ in range(100):
            try:
                page = driver.find_element(By.TAG_NAME, "body").text
                if "Sign-in Success" in page:
                    return
                if fields := driver.find_elements(By.NAME, "login"):
                    fields[0].send_keys(account)
                    driver.find_element(By.NAME, "password").send_keys("any")
                driver.find_elements(By.TAG_NAME, "button")[0].click()
            except (WebDriverException, IndexError):
                pass  # the page changed under us: look again
            time.sleep(0.2)
        body = driver.find_element(By.TAG_NAME, "body").text
        raise AssertionError(f"not approved: {driver.current_url}: {body}")
    finally:
        driver.quit()


@pytest.mark.skipif(
    not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
    reason="chromium / chromium-driver missing: `make browser` installs them",
)
async def test_device_login_in_a_browser_follows_a_job_past_expiry_until_revoked(
    api: Api, provider: oidc.Provider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    environ = env(api, provider, tmp_path)
    proc = await asyncio.create_subprocess_exec(
        SSHAPI, "login", env=environ, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stderr is not None
    line = (await proc.stderr.readline()).decode()
    assert line.startswith(f"To sign in, open {provider.issuer}/device?user_code=")
    await asyncio.to_thread(approve, line.split()[4], tmp_path / "chromium", "anyhost")
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    kept = tmp_path / "client" / "logins" / "default.json"
    login = oauth.load(kept)
    assert login["refresh_token"] and login["client_id"] == oidc.CLI_CLIENT

    # AsyncClient (and Client: one source) renews the login's token mid-follow.
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    async with AsyncClient() as c:
        job = await c.submit("local", command=f"for i in 1 2 3; do sleep {TTL}; echo $i; done")
        got = b"".join([chunk async for chunk in c.follow(job.id)])
        assert got == b"1\n2\n3\n"
        assert (await c.get(job.id)).state == "succeeded"
    assert oauth.load(kept)["access_token"] != login["access_token"]

    # `sshapi logout` revokes the refresh token at the provider and forgets the login: the
    # provider refuses the token from then on, and a copy of the file kept from before (as a
    # stolen one would be) fails its next renewal, saying to sign in again.
    copy, refresh = kept.read_bytes(), oauth.load(kept)["refresh_token"]
    code, out = await sshapi(environ, "logout")
    assert code == 0 and not kept.exists(), out
    with httpx.Client() as http:
        token_url = oauth.discover(provider.issuer, http).token
    form = {"grant_type": "refresh_token", "refresh_token": refresh, "client_id": oidc.CLI_CLIENT}
    again = await asyncio.to_thread(httpx.post, token_url, data=form)
    assert (again.status_code, again.json()["error"]) == (400, "invalid_grant"), again.text
    kept.write_bytes(copy)
    kept.chmod(0o600)
    await asyncio.sleep(TTL)
    code, out = await sshapi(environ, "jobs", "list")
    assert code == 255
    assert "invalid_grant: the login expired or was revoked; run `sshapi login` again" in out


def test_a_token_naming_another_issuer_than_discovery_is_refused(
    provider: oidc.Provider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rig's real access token names its issuer; served by a provider whose discovery names
    another (a proxy, Keycloak reached by another hostname), the login is refused naming both,
    before the API would refuse every call with a bare 401. A token endpoint answering an HTML
    error page is named with its status."""
    monkeypatch.setenv("SSHAPI_CLIENT_SECRET", provider.ci_secret)
    with httpx.Client() as http:
        found = oauth.discover(provider.issuer, http)
        real = oauth.client_credentials_login(found, oidc.CI_CLIENT, None, http)["access_token"]
    assert oauth.token_issuer(real) == provider.issuer
    public = "https://login.example.org/realms/hpc"

    def proxy(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/.well-known/openid-configuration"):
            return httpx.Response(200, json={"issuer": public, "token_endpoint": f"{public}/t"})
        return httpx.Response(200, json={"access_token": real, "expires_in": 60})

    with httpx.Client(transport=httpx.MockTransport(proxy)) as http:
        found = oauth.discover(public, http)
        named = f"names issuer '{provider.issuer}', but discovery names {public}"
        with pytest.raises(SshapiError, match=named):
            oauth.client_credentials_login(found, oidc.CI_CLIENT, None, http)
    # A proxy's error page where the token answer should be: named, not a traceback.
    page = httpx.MockTransport(lambda r: httpx.Response(502, text="<html>Bad Gateway</html>"))
    with httpx.Client(transport=page) as http, pytest.raises(SshapiError, match="HTTP 502, not"):
        oauth.client_credentials_login(found, oidc.CI_CLIENT, None, http)
    assert oauth.token_issuer("opaque-token") is None
    assert oauth.token_issuer("a.!!!.c") is None


def test_a_provider_that_never_answers_fails_the_login_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(oauth, "TIMEOUT", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        issuer = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with httpx.Client() as http, pytest.raises(SshapiError, match=issuer):
            oauth.discover(issuer, http)
        assert time.monotonic() - started < 5
        # Its token and device endpoints the same: each grant gives up, naming the provider.
        found = oauth.Endpoints(issuer, f"{issuer}/token", f"{issuer}/device", None)
        monkeypatch.setenv("SSHAPI_CLIENT_SECRET", "s" * 32)
        for grant in (
            lambda http: oauth.client_credentials_login(found, "ci", None, http),
            lambda http: oauth.device_login(found, "sshapi", http, print),
        ):
            started = time.monotonic()
            with httpx.Client() as http, pytest.raises(SshapiError, match=issuer):
                grant(http)
            assert time.monotonic() - started < 5
