"""Researchers as themselves (issue 28): on a certificate host each caller runs as the account
their token names, logged in with a fresh certificate the API mints; a bad claim is refused
before any SSH work."""

from __future__ import annotations

import asyncio
import contextlib
import pwd
import re
import shutil
import tempfile
import time
import tomllib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from api_helpers import LOCAL_ISS, Api, Keys, config_toml, make_settings, running_api
from pydantic import ValidationError

from api.config import HostConfig, load_config
from api.credentials import ACCOUNT_PATTERN, DENY_ACCOUNTS
from api.doctor import Finding, check_host
from api.settings import Settings
from sshpool import Pool
from sshpool.certificates import UserCA
from sshpool.devhost import LocalHost
from sshpool.devhost.accounts import ensure_accounts
from sshpool.devhost.host import host_account

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


# Stands for the host in front of each command: counts (and, with a delay, slows) the
# account lookups, one `S <command>` line as each starts and an `E` as it ends.
LOOKUP_WRAPPER = """#!/bin/sh
case "$SSH_ORIGINAL_COMMAND" in
*getent*)
  printf 'S %s\\n' "$(printf %s "$SSH_ORIGINAL_COMMAND" | tr '\\n' ' ')" >> {log}
  sleep {delay}
  (eval "$SSH_ORIGINAL_COMMAND"); s=$?
  echo E >> {log}
  exit $s;;
esac
eval "$SSH_ORIGINAL_COMMAND"
"""


@dataclass
class Rig:
    api: Api
    host: LocalHost
    lookups: Path  # the wrapper's log of account lookups
    alice: str
    bob: str

    def looked_up(self, name: str) -> int:
        """How many times the host was asked for `name`'s passwd entry."""
        lines = self.lookups.read_text().splitlines()
        return sum(1 for line in lines if re.search(rf"getent.* {name}\b", line))

    def sshd_saw(self, since: int, *words: str) -> list[str]:
        """The lines sshd logged since offset `since` that name any of `words`."""
        text = self.host.log_path.read_bytes()[since:].decode(errors="replace")
        return [line for line in text.splitlines() if any(w in line for w in words)]


def lookup_wrapper(delay: float) -> tuple[Path, Path, Path]:
    """A directory every account reaches with LOOKUP_WRAPPER and its log: (dir, log, wrapper)."""
    where = Path(tempfile.mkdtemp(prefix="sshapi-lookups-"))
    where.chmod(0o755)
    log = where / "lookups.log"
    log.touch()
    log.chmod(0o666)  # every account's commands append to it
    wrapper = where / "wrap.sh"
    wrapper.write_text(LOOKUP_WRAPPER.format(log=log, delay=delay))
    wrapper.chmod(0o755)
    return where, log, wrapper


@contextlib.asynccontextmanager
async def researcher_rig(
    make_host: Callable[..., LocalHost],
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
    delay: float = 0,
    max_lookups: int | None = None,
    extra_issuer: str = "",
) -> AsyncIterator[Rig]:
    """A root sshd logging in two researcher accounts (alice, bob: real Unix accounts), each
    command through LOOKUP_WRAPPER; host `hpc` on it with certificates, and a policy rule that
    maps subject `ops` to bob there."""
    alice, bob = (a.name for a in ensure_accounts(2, data_dir=tmp_path / "accounts"))
    where, log, wrapper = lookup_wrapper(delay)
    host = make_host("stock", researchers=True, overrides={"ForceCommand": str(wrapper)})
    ops = f"""[[policy]]
issuer = "{LOCAL_ISS}"
subject = "ops"
hosts = ["hpc"]
[policy.accounts.hpc]
username = "{bob}"

"""
    lookups = f"max_lookups = {max_lookups}\n" if max_lookups is not None else ""
    text = cert_config(host, secret_file, keys, lookups)
    # Channels: the wrapper stands in front of each command, which sshd runs through
    # ForceCommand in channel mode only (an executor's commands pass it once per connection).
    text = text.replace("[hosts.hpc.credentials]", 'exec_mode = "channel"\n[hosts.hpc.credentials]')
    text = text.replace("[[policy]]", ops + "[[policy]]", 1)  # the first rule for `ops`
    issuer = f'account_claim = "{CLAIM}"\n'
    path = tmp_path / "sshapi.toml"
    path.write_text(text.replace(issuer, issuer + extra_issuer, 1))
    try:
        async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
            yield Rig(api, host, log, alice, bob)
    finally:
        shutil.rmtree(where)


@pytest.fixture
async def rig(
    make_host: Callable[..., LocalHost],
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> AsyncIterator[Rig]:
    async with researcher_rig(make_host, secret_file, secret, keys, tmp_path) as running:
        yield running


def refused_account(r: Any) -> None:
    assert r.status_code == 403, r.text
    assert r.json()["type"].endswith(":account-refused"), r.text


async def run_as(api: Api, sub: str, argv: list[str], **claims: Any) -> Any:
    token = api.token(sub, **claims)
    r = await api.client.post(
        f"{api.url}/v1/jobs",
        json={"host": "hpc", "argv": argv},
        headers={"Authorization": f"Bearer {token}", "Prefer": "wait=20"},
    )
    return r


async def test_caller_runs_as_the_account_their_token_names(rig: Rig) -> None:
    """`id -un` answers the account of the claim (a researcher's), and sshd's log names the
    caller in the key id of the certificate it accepted."""
    r = await run_as(rig.api, "researcher-7", ["id", "-un"], **{CLAIM: rig.alice})
    assert r.status_code in (200, 201), r.text
    job = r.json()
    assert job["state"] == "succeeded", job
    assert job["stdout"].strip() == rig.alice
    log = rig.host.log_tail(200)
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


async def test_token_for_another_account_never_runs_as_this_one(rig: Rig) -> None:
    """A token naming an account that passes the API's checks but that sshd refuses (a normal
    account outside sshd's AllowUsers) fails its job: it never falls back to the host's
    account; a researcher's own caller is unaffected."""
    other = host_account("/bin/bash").name  # uid >= 1000, a login shell, not allowed by sshd
    r = await run_as(rig.api, "bob", ["id", "-un"], **{CLAIM: other})
    assert r.status_code in (200, 201, 502), r.text
    if r.status_code != 502:
        assert r.json()["state"] == "error", r.json()
        assert rig.host.username not in (r.json().get("stdout") or "")
    assert rig.looked_up(other) == 1
    ok = await run_as(rig.api, "owner", ["id", "-un"], **{CLAIM: rig.alice})
    assert ok.json()["stdout"].strip() == rig.alice, ok.text


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


def test_doctor_warns_of_an_ed25519_ca_and_passes_an_ecdsa_one(
    make_host: Callable[..., LocalHost], tmp_path: Path
) -> None:
    """The rig's CA is ECDSA P-256: `ca key` ok. An Ed25519 CA the host trusts logs in too,
    and `ca key` warns that it costs sshd more per login, naming the ECDSA command."""
    host = make_host("stock")
    config = HostConfig.model_validate(
        tomllib.loads(cert_host_toml(host, host.user_ca_key))["hosts"]["hpc"]
    )
    assert doctor(config)["ca key"].status == "ok"
    ed = tmp_path / "ed_ca"
    ed.write_bytes(asyncssh.generate_private_key("ssh-ed25519").export_private_key())
    ed.chmod(0o600)
    with host.ca_keys_path.open("a") as trusted:  # sshd reads the file at each login
        trusted.write(UserCA(ed).public_key + "\n")
    found = doctor(
        HostConfig.model_validate(tomllib.loads(cert_host_toml(host, str(ed)))["hosts"]["hpc"])
    )
    assert found["auth"].status == "ok", found["auth"].line()
    assert (
        found["ca key"].status == "WARN" and "ssh-keygen -t ecdsa -b 256" in found["ca key"].detail
    )


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
    make_host: Callable[..., LocalHost],
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
    alice = ensure_accounts(1, data_dir=tmp_path / "accounts")[0].name
    host = make_host("stock", researchers=True)
    path = tmp_path / "sshapi.toml"
    path.write_text(cert_config(host, secret_file, keys))
    settings = make_settings(tmp_path, path, "sqlite", None)
    for backend in ("asyncssh", "paramiko", "ssh2"):
        settings = settings.model_copy(update={"backend": backend})
        async with running_api(settings, keys, secret) as api:
            r = await run_as(api, f"k-{backend}", ["id", "-un"], **{CLAIM: alice})
            assert r.json()["stdout"].strip() == alice, r.text
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


# ---- which accounts a claim may name (issue 38, C1)


async def test_claims_of_the_hosts_own_and_mapped_accounts_are_refused_without_ssh_work(
    rig: Rig,
) -> None:
    """A claim naming the host's service account (`username`) or an account a policy rule maps
    to someone else (bob, `ops`'s) is 403 account-refused: no lookup, no login for the caller;
    `ops` still runs as bob through its rule."""
    before = rig.host.log_path.stat().st_size
    for name in (rig.host.username, rig.bob):
        refused_account(await run_as(rig.api, "mallory", ["id", "-un"], **{CLAIM: name}))
        assert rig.looked_up(name) == 0
    assert rig.sshd_saw(before, "mallory") == []
    r = await run_as(rig.api, "ops", ["id", "-un"], **{CLAIM: rig.alice})
    assert r.json()["stdout"].strip() == rig.bob, r.text  # the rule decides, not the claim


def system_account() -> str:
    """An account of this machine below uid 1000 that the fixed deny list does not name (avahi,
    mysql, uuidd, tss...: each machine has some)."""
    names = [
        p.pw_name
        for p in pwd.getpwall()
        if 0 < p.pw_uid < 1000
        and p.pw_name not in DENY_ACCOUNTS
        and re.fullmatch(ACCOUNT_PATTERN, p.pw_name)
    ]
    if not names:
        pytest.skip("no system account outside the deny list on this machine")
    return names[0]


async def test_claims_of_system_nologin_and_missing_accounts_are_refused_after_one_lookup(
    rig: Rig,
) -> None:
    """A system account (uid < 1000, not in the deny list), an account with a nologin shell and
    one that does not exist are each 403 account-refused before any certificate names them
    (sshd sees no login of the caller); each is looked up on the host once, and the answer is
    kept: asking again (a job, a file listing) costs no lookup. A researcher's own account runs,
    looked up once too."""
    nologin = host_account("/usr/sbin/nologin").name
    before = rig.host.log_path.stat().st_size
    names = [system_account(), nologin, "sshapi-r9999"]
    for name in names * 2:
        r = await run_as(rig.api, "mallory", ["id", "-un"], **{CLAIM: name})
        refused_account(r)
        assert ":x:" not in r.text and "/bin" not in r.text  # never getent's output
    claims: dict[str, Any] = {CLAIM: names[-1]}
    token = rig.api.token("mallory", "files:read", **claims)
    r = await rig.api.client.get(
        f"{rig.api.url}/v1/hosts/hpc/files",
        params={"path": "~"},
        headers={"Authorization": f"Bearer {token}"},
    )
    refused_account(r)  # the files API too, from the same kept answer
    assert rig.sshd_saw(before, "mallory", *(f"for {n} " for n in names)) == []
    assert [rig.looked_up(n) for n in names] == [1, 1, 1]
    took = []
    for _ in range(2):
        start = time.perf_counter()
        r = await run_as(rig.api, "alice-sub", ["id", "-un"], **{CLAIM: rig.alice})
        took.append(time.perf_counter() - start)
        assert r.json()["stdout"].strip() == rig.alice, r.text
    assert rig.looked_up(rig.alice) == 1
    print(f"first job as {rig.alice} {took[0]:.3f} s (with the lookup), next {took[1]:.3f} s")


async def test_a_flood_of_made_up_names_runs_a_bounded_number_of_lookups(
    make_host: Callable[..., LocalHost],
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """24 tokens at once, each naming another account that does not exist, on a host whose
    lookups take 2 s and run at most 2 at a time: never more than 2 `getent` run at once, each
    answer is 403 account-refused (looked up) or 503 account-lookups-busy with Retry-After,
    never a 500, never the host's output."""
    async with researcher_rig(
        make_host, secret_file, secret, keys, tmp_path, delay=2, max_lookups=2
    ) as rig:
        names = [f"sshapi-r{9000 + i}" for i in range(24)]
        answers = await asyncio.gather(
            *(run_as(rig.api, f"flood-{n}", ["true"], **{CLAIM: n}) for n in names)
        )
        kinds = [r.json()["type"].rpartition(":")[2] for r in answers]
        assert set(kinds) <= {"account-refused", "account-lookups-busy"}, kinds
        busy = [r for r in answers if r.status_code == 503]
        assert busy and all(r.headers["Retry-After"] == "1" for r in busy), kinds
        assert all(r.status_code == 403 for r in answers if r not in busy)
        assert all(":x:" not in r.text for r in answers)
        running, most = 0, 0
        for line in rig.lookups.read_text().splitlines():
            running += 1 if line.startswith("S ") else -1
            most = max(most, running)
        assert most <= 2
        print(f"{len(answers)} made-up names: {len(busy)} x 503, at most {most} getent at once")
        assert sum(rig.looked_up(n) for n in names) == len(answers) - len(busy)


async def test_an_issuers_clients_list_refuses_tokens_of_other_clients(
    make_host: Callable[..., LocalHost],
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """With `clients = ["portal"]`, a token whose `azp` (or, without one, `client_id`) is
    portal runs; another client's, or one naming none, is 401 before any SSH work."""
    async with researcher_rig(
        make_host, secret_file, secret, keys, tmp_path, extra_issuer='clients = ["portal"]\n'
    ) as rig:
        claims = {CLAIM: rig.alice}
        for ok in ({"azp": "portal"}, {"client_id": "portal"}):
            r = await run_as(rig.api, "alice-sub", ["id", "-un"], **claims, **ok)
            assert r.json()["stdout"].strip() == rig.alice, r.text
        for bad in (
            {"azp": "cli"},
            {"client_id": "cli"},
            {},
            {"azp": "cli", "client_id": "portal"},
        ):
            r = await run_as(rig.api, "alice-sub", ["id", "-un"], **claims, **bad)
            assert r.status_code == 401, r.text
            assert "client" in r.json()["detail"]
