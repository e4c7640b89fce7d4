"""The local HPC host itself: real sshd instances, checked with the real OpenSSH client."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sshpool.devhost.host import (
    TUNED_CONFIG,
    LocalHost,
    LocalHostError,
    parse_sshd_config,
    sshd_binary,
    sshd_version,
    tuned_settings,
)
from sshpool.target import Target

MakeHost = Callable[..., LocalHost]  # the make_host fixture (tests/conftest.py)


def ssh(host: LocalHost, command: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        host.ssh_argv(command), capture_output=True, text=True, timeout=timeout, check=False
    )


def _kill(host: LocalHost, marker: str) -> None:
    """Remove what a test left running on the host (a remote command outlives its client)."""
    for pid in host.processes(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_real_ssh_client_logs_in_as_the_unprivileged_account(stock_host: LocalHost) -> None:
    # The client flags spelled out, so the test does not lean on ssh_argv.
    argv = [
        "ssh", "-F", "none",
        "-i", stock_host.client_key,
        "-o", f"UserKnownHostsFile={stock_host.known_hosts}",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes",
        "-p", str(stock_host.port),
        f"{stock_host.username}@{stock_host.address}",
        "id -un; id -u; echo $0",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    name, uid, shell = done.stdout.split()
    assert name == stock_host.username
    assert name != "root" and int(uid) != 0
    assert shell == "sh"  # the account's shell is /bin/sh: no heavy rc files per command


def test_openssh_client_logs_in_with_a_certificate_of_the_rig_ca(
    stock_host: LocalHost, tmp_path: Path
) -> None:
    """OpenSSH's own client, given a certificate the rig's CA minted, logs in as the account."""
    creds = stock_host.certificate_target("ssh-client").credentials()
    assert creds is not None
    key = tmp_path / "id"
    key.write_bytes(creds.private_key)
    key.chmod(0o600)
    (tmp_path / "id-cert.pub").write_bytes(creds.certificate)
    argv = [str(key) if a == stock_host.client_key else a for a in stock_host.ssh_argv("id -un")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == stock_host.username
    assert f"ID {creds.key_id} " in stock_host.log_tail(30)


def test_openssh10_runs_beside_the_system_sshd(make_host: MakeHost, openssh10_sshd: str) -> None:
    """The unpacked OpenSSH 10.0 runs the rig (its own sshd-session and sshd-auth, penalties
    on by default) while the system's sshd keeps its version."""
    host = make_host("stock", sshd=openssh10_sshd)
    assert sshd_version(openssh10_sshd) == (10, 0)
    assert sshd_version() < (10, 0) or sshd_binary() != openssh10_sshd
    config = host.effective_config()
    assert config["sshdsessionpath"].startswith(str(Path(openssh10_sshd).parents[1]))
    assert "authfail:" in config["persourcepenalties"]
    done = subprocess.run(host.ssh_argv("id -un"), capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == host.username, done.stderr


def test_files_layout_and_modes(stock_host: LocalHost) -> None:
    client_key = Path(stock_host.client_key)
    assert client_key.parent == stock_host.host_dir / "client"
    assert client_key.stat().st_mode & 0o777 == 0o600
    assert stock_host.config_path.parent == stock_host.host_dir / "sshd"
    assert stock_host.config_path.stat().st_uid == stock_host.account.uid
    assert stock_host.host_key_path.stat().st_uid == stock_host.account.uid
    assert stock_host.host_key_path.stat().st_mode & 0o777 == 0o600
    known = Path(stock_host.known_hosts).read_text().split()
    assert known[0] == f"[{stock_host.address}]:{stock_host.port}"
    assert " ".join(known[1:3]) == stock_host.host_public_key()
    assert stock_host.pid is not None
    assert int(stock_host.pid_path.read_text()) == stock_host.pid


def test_target(tuned_host: LocalHost) -> None:
    target = tuned_host.target(max_sessions=4, max_connections=2)
    assert isinstance(target, Target)
    assert (target.host, target.port, target.username) == (
        tuned_host.address,
        tuned_host.port,
        tuned_host.username,
    )
    assert target.client_keys == (tuned_host.client_key,)
    assert target.known_hosts == tuned_host.known_hosts
    assert (target.limits.max_sessions, target.limits.max_connections) == (4, 2)


def test_stock_profile_has_openssh_defaults(stock_host: LocalHost) -> None:
    config = stock_host.effective_config()
    assert config["maxsessions"] == "10"
    assert config["maxstartups"] == "10:30:100"
    assert config["logingracetime"] == "120"
    assert config["clientaliveinterval"] == "0"
    assert config["usepam"] == "no"
    assert config["passwordauthentication"] == "no"


def test_tuned_profile_applies_sshd_config_tuned(tuned_host: LocalHost) -> None:
    config = tuned_host.effective_config()
    expected, skipped = tuned_settings()
    assert expected, "sshd_config.tuned has no settings"
    assert skipped == tuned_host.skipped_settings
    for keyword, value in expected:
        assert config[keyword.lower()].lower() == value.lower(), keyword
    assert config["maxsessions"] != "10"
    assert config["maxstartups"] != "10:30:100"


def test_tuned_keywords_follow_the_sshd_version() -> None:
    def keywords(version: tuple[int, int]) -> set[str]:
        kept, _ = tuned_settings(version)
        return {keyword.lower() for keyword, _ in kept}

    assert "persourcepenaltyexemptlist" not in keywords((9, 7))
    assert "persourcepenaltyexemptlist" in keywords((9, 8))
    assert {"maxsessions", "maxstartups", "logingracetime"} <= keywords((7, 4))
    # The installed sshd accepts what it is given (start() runs `sshd -t` first).
    assert sshd_version() >= (7, 0)


def test_every_tuned_setting_is_commented() -> None:
    lines = TUNED_CONFIG.read_text().splitlines()
    settings = parse_sshd_config(TUNED_CONFIG.read_text())
    assert settings
    for index, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        # Walk up over the other settings of the same group to the comment that explains them.
        above = index - 1
        while above >= 0 and lines[above].strip() and not lines[above].startswith("#"):
            above -= 1
        assert above >= 0 and lines[above].startswith("#"), f"uncommented setting: {line!r}"
        # Only settings an operator can drop into sshd_config.d: no paths.
        assert "/" not in line.split(None, 1)[1]


def test_parse_rejects_match_blocks() -> None:
    assert parse_sshd_config("# c\nMaxSessions 4\nUseDNS=no\n") == [
        ("MaxSessions", "4"),
        ("UseDNS", "no"),
    ]
    with pytest.raises(LocalHostError, match="Match"):
        parse_sshd_config("Match User x\n  MaxSessions 2\n")


def test_overrides_apply_last(make_host: MakeHost) -> None:
    host = make_host("tuned", overrides={"MaxStartups": "10:30:60", "MaxSessions": "4"})
    config = host.effective_config()
    assert config["maxstartups"] == "10:30:60"
    assert config["maxsessions"] == "4"
    # The rest of the tuned profile stays.
    assert config["logingracetime"] == "30"
    assert ssh(host, "true").returncode == 0


def test_restart_keeps_port_and_keys(make_host: MakeHost) -> None:
    host = make_host()
    host_key = host.host_key_path.read_text()
    client_key = Path(host.client_key).read_text()
    known_hosts = Path(host.known_hosts).read_text()
    port, old_pid = host.port, host.pid
    host.restart()
    assert host.running and host.pid != old_pid
    assert host.port == port
    assert host.host_key_path.read_text() == host_key
    assert Path(host.client_key).read_text() == client_key
    assert Path(host.known_hosts).read_text() == known_hosts
    assert ssh(host, "true").returncode == 0


def test_a_new_instance_reuses_keys_and_port(make_host: MakeHost, tmp_path: Path) -> None:
    first = make_host(name="again", data_dir=tmp_path / "again")
    key, port = first.host_public_key(), first.port
    first.stop()
    second = make_host(name="again", data_dir=tmp_path / "again")
    assert second.host_public_key() == key
    assert second.port == port
    assert ssh(second, "true").returncode == 0


def test_replace_host_key_fails_host_key_verification(make_host: MakeHost) -> None:
    host = make_host()
    assert ssh(host, "true").returncode == 0
    old_key = host.host_public_key()
    host.replace_host_key()
    assert host.running
    assert host.host_public_key() != old_key
    done = ssh(host, "touch /tmp/should-not-run")
    assert done.returncode == 255
    assert "Host key verification failed" in done.stderr
    host.trust_host_key()
    assert ssh(host, "true").returncode == 0


def test_two_hosts_at_once(
    stock_host: LocalHost, tuned_host: LocalHost, make_host: MakeHost
) -> None:
    other = make_host("stock", address="127.0.0.2")
    hosts = [stock_host, tuned_host, other]
    assert len({(h.address, h.port) for h in hosts}) == 3
    for host in hosts:
        assert host.running
        done = ssh(host, "echo ok")
        assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr
    # Each host trusts only its own key: another host's known_hosts does not fit.
    assert stock_host.host_public_key() != other.host_public_key()


def test_stop_is_idempotent_and_leaves_sessions_unless_asked(make_host: MakeHost) -> None:
    host = make_host()
    marker = f"sshapi-marker-{host.port}"
    session = subprocess.Popen(
        host.ssh_argv(f"sleep 30 # {marker}"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not host.processes(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host.processes(marker)
        host.stop()
        host.stop()
        assert not host.running and host.pid is None
        assert host.processes(marker), "stop() must leave established sessions alone"
        host.start()
        host.stop(kill_sessions=True)
        # The earlier session belongs to the first listener, not this one: still alive.
        assert host.processes(marker)
        host.start()
    finally:
        session.kill()
        session.wait()
        _kill(host, marker)


def test_stop_kill_sessions_drops_connections(make_host: MakeHost) -> None:
    host = make_host()
    marker = f"sshapi-kill-{host.port}"
    session = subprocess.Popen(
        host.ssh_argv(f"sleep 30 # {marker}"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not host.processes(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host.processes(marker)
        host.stop(kill_sessions=True)
        assert session.wait(10) != 0
        assert host.processes(marker) == []
    finally:
        session.kill()
        session.wait()
        _kill(host, marker)


def test_run_local_and_processes_run_as_the_account(stock_host: LocalHost) -> None:
    done = stock_host.run_local(["id", "-un"])
    assert (done.returncode, done.stdout.strip()) == (0, stock_host.username)
    assert stock_host.pid in stock_host.processes(re.escape(str(stock_host.config_path)))


def test_bad_override_fails_start_with_sshd_message(make_host: MakeHost) -> None:
    with pytest.raises(LocalHostError, match="NoSuchKeyword"):
        make_host(overrides={"NoSuchKeyword": "1"})


def test_port_in_use_is_a_clear_error(stock_host: LocalHost, tmp_path: Path) -> None:
    clash = LocalHost("clash", "stock", port=stock_host.port, data_dir=tmp_path)
    with pytest.raises(LocalHostError, match="already in use"):
        clash.start()
    assert not clash.running
