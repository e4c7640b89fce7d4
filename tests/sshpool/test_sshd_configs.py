"""The sshd files we ship and document, against real sshd: each loads (`sshd -t`) with Debian
12's OpenSSH 9.2 and with 10.0; the certificate Match block, as the docs show it and as the rig
runs it, refuses certificates for root and for the host's service account and lets a
researcher's in."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from sshpool import AuthenticationFailed, Pool
from sshpool.devhost import ensure_accounts, sshd_binary, sshd_version
from sshpool.devhost.host import (
    CERTIFICATES_CONFIG,
    PRINCIPALS_INSTALLED,
    RIG_API_ADDRESSES,
    TUNED_CONFIG,
    LocalHost,
    certificate_block,
    tuned_files,
)

MakeHost = Callable[..., LocalHost]  # the make_host fixture (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SSHAPI_CONF = ROOT / "deploy" / "sshd_config.sshapi"
OPERATIONS = ROOT / "docs" / "operations.md"


@pytest.fixture(params=["system", "openssh10"])
def sshd(request: pytest.FixtureRequest) -> str:
    """Each sshd a site may run: the system's (Debian 12: 9.2) and OpenSSH 10.0."""
    if request.param == "system":
        return sshd_binary()
    return str(request.getfixturevalue("openssh10_sshd"))


def setting_lines(text: str) -> list[str]:
    """The lines of an sshd_config text that set something, stripped (comments dropped)."""
    stripped = (line.strip() for line in text.splitlines())
    return [line for line in stripped if line and not line.startswith("#")]


def sshd_check(sshd: str, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sshd, "-t", "-f", str(config)], capture_output=True, text=True, timeout=30
    )


def test_every_shipped_sshd_file_loads(sshd: str, tmp_path: Path) -> None:
    """sshd_config.tuned as shipped, with the drop-ins this sshd is new enough for and the
    certificate Match block after it (as a site's sshd_config.d/ and sshd_config hold them),
    and deploy/sshd_config.sshapi (including this machine's sshd_config): `sshd -t` passes."""
    key = tmp_path / "host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    files = tuned_files(sshd_version(sshd))
    version = ".".join(map(str, sshd_version(sshd)))
    tuned = tmp_path / "tuned"
    tuned.write_text(f"HostKey {key}\n" + "".join(f.read_text() for f in files))
    with_block = tmp_path / "with_block"
    with_block.write_text(tuned.read_text() + CERTIFICATES_CONFIG.read_text())
    for config in (tuned, with_block, SSHAPI_CONF):
        done = sshd_check(sshd, config)
        assert done.returncode == 0, (version, config.name, done.stderr)


def test_drop_ins_follow_the_sshd_version() -> None:
    """sshd_config.tuned-9.8 (PerSourcePenaltyExemptList: 9.2 refuses to start on it) goes with
    9.8 and later only."""
    dropin = TUNED_CONFIG.with_name("sshd_config.tuned-9.8")
    assert tuned_files((9, 2)) == [TUNED_CONFIG]
    assert tuned_files((9, 8)) == tuned_files((10, 0)) == [TUNED_CONFIG, dropin]
    assert "PerSourcePenaltyExemptList" in dropin.read_text()
    assert not any(k.startswith("PerSource") for k in setting_lines(TUNED_CONFIG.read_text()))


def test_the_docs_show_the_shipped_certificate_block() -> None:
    """docs/operations.md's block is deploy/sshd_config.certificates, line for line."""
    text = OPERATIONS.read_text()
    blocks = [b for b in re.findall(r"^```text\n(.*?)^```", text, re.M | re.S) if "Match " in b]
    assert len(blocks) == 1
    assert setting_lines(blocks[0]) == setting_lines(CERTIFICATES_CONFIG.read_text())
    assert "AuthorizedPrincipalsFile" not in "".join(setting_lines(blocks[0]))


async def test_certificates_for_root_and_the_service_account_are_refused(
    make_host: MakeHost, tmp_path: Path
) -> None:
    """A root sshd with the shipped block, on top of Debian's defaults (root may log in with a
    key or certificate, every account allowed): certificates of the trusted CA for root and
    for the service account are refused (whatever key id), a researcher's logs in as that
    researcher, and the API's own certificate (key id "sshapi/...") as the service account."""
    (researcher,) = ensure_accounts(1, data_dir=tmp_path / "accounts")
    debian = {"PermitRootLogin": "prohibit-password", "AllowUsers": "*"}
    host: LocalHost = make_host("stock", researchers=True, overrides=debian)
    # The rig runs the shipped lines, with only its addresses, paths and account put in.
    shipped = certificate_block(
        addresses=RIG_API_ADDRESSES,
        ca_keys=str(host.ca_keys_path),
        command=str(PRINCIPALS_INSTALLED),
        service=host.username,
    )
    assert setting_lines(host.config_path.read_text())[-len(shipped) :] == shipped
    mallory = "mallory@https:%2F%2Fidp.example.org"
    refused = [("root", mallory), ("root", "sshapi"), (host.username, mallory)]
    async with Pool() as pool:
        for account, identity in refused:
            target = host.certificate_target(identity, username=account)
            with pytest.raises(AuthenticationFailed):
                await pool.run(target, ["id", "-un"], timeout=30)
        for account, identity in ((researcher.name, "alice@idp"), (host.username, "sshapi")):
            target = host.certificate_target(identity, username=account)
            result = await pool.run(target, ["id", "-un"], timeout=30)
            assert result.stdout.decode().strip() == account
    log = host.log_tail(400)
    assert not re.search(r"Accepted publickey for root ", log)
    assert re.search(rf"Accepted publickey for {researcher.name} .* ID alice@idp/", log)
