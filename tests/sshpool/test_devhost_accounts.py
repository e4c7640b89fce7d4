"""The rig's researcher accounts: real Unix accounts on one root sshd, each logged in with its
own key through the pool, made idempotently and removed with userdel."""

from __future__ import annotations

import pwd
from collections.abc import Callable
from pathlib import Path

import pytest

from sshpool import AuthenticationFailed, Pool
from sshpool.devhost.accounts import AccountError, account_names, ensure_accounts, remove_accounts
from sshpool.devhost.host import LocalHost

MakeHost = Callable[..., LocalHost]  # the make_host fixture (tests/conftest.py)

# The removal test's own account numbers: other runs (other helpers, the other tests here)
# share sshapi-r0001..., which must not vanish under them.
REMOVED_FIRST = 9901


async def test_each_account_logs_in_as_itself_with_its_key(
    make_host: MakeHost, tmp_path: Path
) -> None:
    accounts = ensure_accounts(6, data_dir=tmp_path)
    assert [a.name for a in accounts] == account_names(6)
    host = make_host("stock", researchers=True)
    async with Pool() as pool:
        for account in accounts:
            result = await pool.run(account.target(host), "id -un; echo $HOME", timeout=30)
            assert result.stdout.decode().split() == [account.name, str(account.home)]
        # The host account still logs in beside them.
        own = await pool.run(host.target(), "id -un", timeout=30)
        assert own.stdout.decode().strip() == host.username
    # One account's key does not open another's.
    other = accounts[1].target(host)
    stolen = type(other)(
        host=other.host,
        username=other.username,
        client_keys=(str(accounts[0].key),),
        known_hosts=other.known_hosts,
        port=other.port,
    )
    async with Pool() as pool:
        with pytest.raises(AuthenticationFailed):
            await pool.run(stolen, "true", timeout=30)


def test_ensure_is_idempotent_and_keys_of_two_data_dirs_coexist(tmp_path: Path) -> None:
    first = ensure_accounts(2, data_dir=tmp_path / "a")
    key = first[0].key.read_bytes()
    again = ensure_accounts(2, data_dir=tmp_path / "a")
    assert again == first and again[0].key.read_bytes() == key
    second = ensure_accounts(2, data_dir=tmp_path / "b")
    assert [a.uid for a in second] == [a.uid for a in first]
    authorized = (first[0].home / ".ssh" / "authorized_keys").read_text()
    assert str(first[0].key) in authorized and str(second[0].key) in authorized
    assert oct((first[0].home / ".ssh" / "authorized_keys").stat().st_mode & 0o777) == "0o600"
    assert first[0].key.stat().st_mode & 0o077 == 0


def test_remove_accounts_deletes_account_home_and_key(tmp_path: Path) -> None:
    made = ensure_accounts(2, data_dir=tmp_path, first=REMOVED_FIRST)
    assert remove_accounts([a.name for a in made], data_dir=tmp_path) == 2
    for account in made:
        with pytest.raises(KeyError):
            pwd.getpwnam(account.name)
        assert not account.home.exists() and not account.key.exists()
    assert remove_accounts([a.name for a in made], data_dir=tmp_path) == 0
    with pytest.raises(ValueError):
        remove_accounts(["root"], data_dir=tmp_path)
    with pytest.raises(ValueError):
        account_names(2, first=9999)


def test_only_root_creates_accounts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(AccountError):
        ensure_accounts(1, data_dir=tmp_path)


def test_an_account_made_again_gets_back_the_home_its_name_left(tmp_path: Path) -> None:
    """The machine's accounts made again while /home was kept (a new uid for the same name):
    useradd keeps the old home, owned by the old uid, where the new account could write nothing
    (every file test of a run failed so). The rig gives it to the new account."""
    (name,) = account_names(1, REMOVED_FIRST + 2)
    remove_accounts([name], data_dir=tmp_path)
    home = Path("/home") / name
    (home / ".ssh").mkdir(parents=True)
    (home / "kept").write_text("from before")
    try:
        (account,) = ensure_accounts(1, data_dir=tmp_path, first=REMOVED_FIRST + 2)
        assert account.home == home and home.stat().st_uid == account.uid
        assert (home / "kept").stat().st_uid == account.uid
        assert (home / ".ssh" / "authorized_keys").stat().st_uid == account.uid
    finally:
        remove_accounts([name], data_dir=tmp_path)
