"""Researchers as themselves (issue 28): on a certificate host each caller runs as the account
their token names, logged in with a fresh certificate the API mints; a bad claim is refused
before any SSH work."""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import tomllib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from api_helpers import LOCAL_ISS, Api, Keys, config_toml, make_settings, running_api
from pydantic import ValidationError

from api.config import HostConfig, load_config
from api.doctor import Finding, check_host
from api.settings import Settings
from sshpool import Pool
from sshpool.devhost import LocalHost
from sshpool.devhost.accounts import ensure_accounts

pytestmark = pytest.mark.timeout(120)

CLAIM = "preferred_username"


def cert_host_toml(host: LocalHost, ca_key: str, extra: str = "") -> str:
    return f"""
[hosts.hpc]
hostname = "{host.address}"
port = {host.port}
username = "{host.username}"
known_hosts = "{host.known_hosts}"
[hosts.hpc.credentials]
kind = "certificate"
ca_key = "{ca_key}"
cert_ttl = 120.0
idle_timeout = 5.0
{extra}
"""


def cert_config(host: LocalHost, secret_file: Path, keys: Keys, extra: str = "") -> str:
    """The test configuration plus host `hpc` (certificates, the stock sshd) for everyone, and
    the local issuer naming accounts by `preferred_username`."""
    text = config_toml(host, secret_file, keys, cert_host_toml(host, host.user_ca_key, extra))
    text = text.replace(
        'hosts = ["local", "tiny", "down"]', 'hosts = ["local", "tiny", "down", "hpc"]'
    )
    issuer = f'[[issuers]]\nissuer = "{LOCAL_ISS}"\n'
    return text.replace(issuer, issuer + f'account_claim = "{CLAIM}"\n', 1)


@pytest.fixture
async def cert_api(
    stock_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    path = tmp_path / "sshapi.toml"
    path.write_text(cert_config(stock_host, secret_file, keys))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        yield api


async def run_as(api: Api, sub: str, argv: list[str], **claims: Any) -> Any:
    token = api.token(sub, **claims)
    r = await api.client.post(
        f"{api.url}/v1/jobs",
        json={"host": "hpc", "argv": argv},
        headers={"Authorization": f"Bearer {token}", "Prefer": "wait=20"},
    )
    return r


async def test_caller_runs_as_the_account_their_token_names(
    cert_api: Api, stock_host: LocalHost
) -> None:
    """`id -un` answers the account of the claim, and sshd's log names the caller in the key
    id of the certificate it accepted."""
    r = await run_as(cert_api, "researcher-7", ["id", "-un"], **{CLAIM: stock_host.username})
    assert r.status_code in (200, 201), r.text
    job = r.json()
    assert job["state"] == "succeeded", job
    assert job["stdout"].strip() == stock_host.username
    log = stock_host.log_tail(200)
    assert re.search(rf"ID researcher-7@{LOCAL_ISS}/\S+/\d+ \(serial \d+\)", log), log[-2000:]


async def test_each_researcher_runs_as_their_own_account_and_never_another(
    make_host: Callable[..., LocalHost],
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """Two real accounts on one root sshd: alice's token runs as alice, bob's as bob; a token
    naming alice signed for bob's subject still runs as alice only (the claim decides, and the
    certificate names that account alone)."""
    alice, bob = (a.name for a in ensure_accounts(2, data_dir=tmp_path / "accounts"))
    host = make_host("stock", researchers=True)
    path = tmp_path / "sshapi.toml"
    path.write_text(cert_config(host, secret_file, keys))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        for sub, account in (("alice-sub", alice), ("bob-sub", bob), ("bob-sub", alice)):
            r = await run_as(api, sub, ["sh", "-c", "id -un; echo $HOME"], **{CLAIM: account})
            assert r.json()["stdout"].split() == [account, f"/home/{account}"], r.text
    log = host.log_tail(400)
    assert re.search(rf"Accepted publickey for {alice} .* ID alice-sub@{LOCAL_ISS}/", log)
    assert re.search(rf"Accepted publickey for {bob} .* ID bob-sub@{LOCAL_ISS}/", log)


HOSTILE_CLAIMS: list[Any] = [
    "..", "a/b", "alice\n", "al\0ice", "Alice", "x" * 300, "root", "daemon", "0", "", 0, 7,
    ["alice"], {"name": "alice"}, None,
]  # fmt: skip


@pytest.mark.parametrize("claim", HOSTILE_CLAIMS, ids=repr)
async def test_bad_account_claim_is_403_before_any_ssh_work(
    cert_api: Api, stock_host: LocalHost, claim: Any
) -> None:
    """A claim that is no allowed account name (path tricks, control characters, uppercase,
    too long, a system account, not a string, missing) is 403 `account-refused`, and sshd sees
    no login for it."""
    before = stock_host.log_path.stat().st_size
    claims = {} if claim is None else {CLAIM: claim}
    r = await run_as(cert_api, "mallory", ["id", "-un"], **claims)
    assert r.status_code == 403, r.text
    body = r.json()
    assert body["type"].endswith(":account-refused")
    if isinstance(claim, str) and len(claim) > 3:
        assert claim not in body.get("detail", "")  # the input is not echoed back
    assert "mallory" not in stock_host.log_path.read_bytes()[before:].decode(errors="replace")


async def test_token_for_another_account_never_runs_as_this_one(
    cert_api: Api, stock_host: LocalHost
) -> None:
    """A token naming an account sshd refuses (bob is not the host's account) fails its job:
    it never falls back to the host's account; the account's own caller is unaffected."""
    r = await run_as(cert_api, "bob", ["id", "-un"], **{CLAIM: "sshapi-nobody-bob"})
    assert r.status_code in (200, 201, 502), r.text
    if r.status_code != 502:
        assert r.json()["state"] == "error", r.json()
        assert stock_host.username not in (r.json().get("stdout") or "")
    ok = await run_as(cert_api, "owner", ["id", "-un"], **{CLAIM: stock_host.username})
    assert ok.json()["stdout"].strip() == stock_host.username, ok.text


def test_ca_key_readable_by_others_fails_the_start(
    stock_host: LocalHost, secret_file: Path, keys: Keys, tmp_path: Path
) -> None:
    loose = tmp_path / "user_ca"
    loose.write_bytes(Path(stock_host.user_ca_key).read_bytes())
    loose.chmod(0o640)
    path = tmp_path / "sshapi.toml"
    text = cert_config(stock_host, secret_file, keys).replace(stock_host.user_ca_key, str(loose))
    path.write_text(text)
    with pytest.raises(ValidationError, match="chmod 600"):
        load_config(path)
    loose.chmod(0o600)
    assert load_config(path).hosts["hpc"].certificates is not None


def doctor(host: HostConfig) -> dict[str, Finding]:
    async def run() -> list[Finding]:
        async with Pool() as pool:
            return await check_host(pool, "hpc", host, Settings(), 10.0)

    return {f.check: f for f in asyncio.run(run())}


def test_doctor_logs_in_with_a_certificate_and_names_what_to_check_when_refused(
    stock_host: LocalHost, tmp_path: Path
) -> None:
    """`sshapi doctor` mints a certificate and logs in as the host's account; a CA sshd does
    not trust fails `auth` with the CA's fingerprint and the causes to check, in words."""
    trusted = HostConfig.model_validate(
        tomllib.loads(cert_host_toml(stock_host, stock_host.user_ca_key))["hosts"]["hpc"]
    )
    found = doctor(trusted)
    assert found["auth"].status == "ok" and "a certificate of CA SHA256:" in found["auth"].detail
    other = tmp_path / "other_ca"
    other.write_bytes(asyncssh.generate_private_key("ssh-ed25519").export_private_key())
    other.chmod(0o600)
    untrusted = HostConfig.model_validate(
        tomllib.loads(cert_host_toml(stock_host, str(other)))["hosts"]["hpc"]
    )
    auth = doctor(untrusted)["auth"]
    assert auth.status == "FAIL"
    assert "the CA is not trusted" in auth.detail and untrusted.certificates is not None
    assert untrusted.certificates.ca.fingerprint in auth.detail
    assert "PerSourcePenaltyExemptList" in auth.detail and "clocks" in auth.detail


def test_doctor_reads_the_clock_of_a_certificate_host(
    stock_host: LocalHost, make_host: Callable[..., LocalHost]
) -> None:
    """The rig's clock is ours: ok. A host whose `date` is 120 s behind: WARN, saying that
    certificates are back-dated 60 s and to run NTP."""
    config = HostConfig.model_validate(
        tomllib.loads(cert_host_toml(stock_host, stock_host.user_ca_key))["hosts"]["hpc"]
    )
    clock = doctor(config)["clock"]
    assert clock.status == "ok" and "back-dated 60 s" in clock.detail, clock.line()
    fake = Path(tempfile.mkdtemp(prefix="sshapi-date-"))
    fake.chmod(0o755)
    (fake / "date").write_text("#!/bin/sh\necho $(( $(/bin/date +%s) - 120 ))\n")
    (fake / "date").chmod(0o755)
    command = f'PATH={fake}:$PATH; eval "$SSH_ORIGINAL_COMMAND"'
    late = make_host("stock", overrides={"ForceCommand": command})
    config = HostConfig.model_validate(
        tomllib.loads(cert_host_toml(late, late.user_ca_key))["hosts"]["hpc"]
    )
    clock = doctor(config)["clock"]
    shutil.rmtree(fake)
    # `date +%s` counts whole seconds: 120 or 121 s behind.
    assert clock.status == "WARN" and re.search("12[01] s behind", clock.detail), clock.line()
    assert "NTP" in clock.detail


async def test_no_user_key_material_on_disk_after_a_run(
    stock_host: LocalHost,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Jobs as certificate logins on all three backends leave no private key and no
    certificate in the API's data dir or its temporary directory (a private one, so that other
    programs' files cannot hide a leak or fake one)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    path = tmp_path / "sshapi.toml"
    path.write_text(cert_config(stock_host, secret_file, keys))
    settings = make_settings(tmp_path, path, "sqlite", None)
    for backend in ("asyncssh", "paramiko", "ssh2"):
        settings = settings.model_copy(update={"backend": backend})
        async with running_api(settings, keys, secret) as api:
            r = await run_as(api, f"k-{backend}", ["id", "-un"], **{CLAIM: stock_host.username})
            assert r.json()["stdout"].strip() == stock_host.username, r.text
    assert scan_for_keys(Path(settings.data_dir), temp) > 0  # the store's database at least


def scan_for_keys(*roots: Path) -> int:
    """Assert no file under `roots` holds a private key or a certificate; how many were read."""
    scanned = 0
    for root in roots:
        for file in root.rglob("*"):
            if file.is_file():
                scanned += 1
                data = file.read_bytes()
                assert b"PRIVATE KEY" not in data, file
                assert b"-cert-v01@openssh.com" not in data, file
    return scanned


async def test_an_idle_researcher_connection_closes_and_the_next_login_mints_anew(
    stock_host: LocalHost, secret_file: Path, keys: Keys, tmp_path: Path
) -> None:
    """A certificate host's targets take its short per-account idle_timeout and keep no
    connection open; after the idle close the next job logs in with a new certificate."""
    path = tmp_path / "sshapi.toml"
    path.write_text(cert_config(stock_host, secret_file, keys))
    host = load_config(path).hosts["hpc"]
    target = host.target(identity="idle-test")
    assert (target.limits.idle_timeout, target.limits.min_connections) == (5.0, 0)
    quick = replace(target, limits=replace(target.limits, idle_timeout=0.5))
    async with Pool() as pool:
        await pool.run(quick, ["true"], timeout=10)
        await asyncio.sleep(2.5)  # idle past 0.5 s: the maintenance pass closes it
        assert pool.stats()[quick]["connections"] == 0
        await pool.run(quick, ["true"], timeout=10)
        assert pool.stats()[quick]["counters"]["connects"] == 2
    ids = re.findall(r"ID idle-test/\S+/(\d+) ", stock_host.log_tail(200))
    assert len(set(ids)) >= 2, ids  # two certificates, two serials
