"""A login node's health under a hostile researcher (issue 38, N1), on three real sshd that log
in the rig's researcher accounts: an account whose login shell is bash writes a `~/.bashrc`
that kills its own session when a command holds a trigger word and stalls `true` (what a probe
over that account would run). Its jobs fail, its alone: no node goes down, the other accounts'
jobs all run, whether the nodes are probed over the host's service account or at the SSH
banner. A node down comes back on the first probe that succeeds, and a real node kill is still
seen."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from sshpool import Pool, SSHPoolError, Target
from sshpool.devhost import LocalCluster, Rig, RigSpec
from sshpool.devhost.accounts import Account, ensure_accounts

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="researcher accounts need root")

TRIGGER = "n1-trigger"
# Kills the account's own session (sshd's process for its connection) before a command that
# names the trigger starts; `true` stalls (a probe over this account would never answer).
BASHRC = f"""case "$BASH_EXECUTION_STRING" in
  *{TRIGGER}*) kill -9 $PPID ;;
  *"; true") sleep 20 ;;
esac
"""
# Numbers of the rig's accounts no other test uses: the attacker's shell changes.
FIRST = 9301
ATTACKS = 6
OTHER_JOBS = 12


def _set_shell(name: str, shell: str) -> None:
    usermod = shutil.which("usermod", path="/usr/sbin:/sbin:/usr/bin:/bin") or "usermod"
    subprocess.run([usermod, "--shell", shell, name], check=True, capture_output=True)


@contextlib.contextmanager
def hostile_accounts(tmp_path: Path) -> Iterator[list[Account]]:
    """The attacker (bash, the crafted ~/.bashrc) and two other researchers (sh)."""
    made = ensure_accounts(3, data_dir=tmp_path / "accounts", first=FIRST)
    attacker = made[0]
    rc = attacker.home / ".bashrc"
    _set_shell(attacker.name, "/bin/bash")
    rc.write_text(BASHRC)
    os.chown(rc, attacker.uid, attacker.gid)
    try:
        yield made
    finally:
        rc.unlink(missing_ok=True)
        _set_shell(attacker.name, "/bin/sh")


@pytest.fixture
def accounts(tmp_path: Path) -> Iterator[list[Account]]:
    with hostile_accounts(tmp_path) as made:
        yield made


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    spec = RigSpec("n1", "stock", nodes=3, researchers=True)
    with Rig(spec, data_dir=tmp_path / "rig") as rig:
        assert rig.cluster is not None
        yield rig.cluster


def as_account(cluster: LocalCluster, account: Account) -> Target:
    return replace(cluster.target(), username=account.name, client_keys=(str(account.key),))


@pytest.mark.parametrize("probe", ["service account", "banner"])
async def test_one_researcher_takes_no_login_node_down(
    cluster: LocalCluster, accounts: list[Account], probe: str
) -> None:
    attacker, *others = (as_account(cluster, a) for a in accounts)
    service = cluster.target()
    async with Pool() as pool:
        if probe == "service account":
            pool.probe_with(service)
        # The attacker's jobs, each tried on every node: its own failures.
        for _ in range(ATTACKS):
            with pytest.raises(SSHPoolError):
                await pool.run(attacker, ["echo", TRIGGER], acquire_timeout=30)
        # Every probe the attack asked for has answered.
        await asyncio.gather(*(pool.reprobe(service, n) for n in service.nodes))
        jobs = [
            pool.run(target, ["echo", "ok"], acquire_timeout=30)
            for target in others
            for _ in range(OTHER_JOBS)
        ]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException) or not r.ok]
        nodes = pool.nodes(service)
        stats = pool.stats()
        attacked = {
            t.host: stats[t]["counters"].get("connections_lost", 0)
            for t in stats
            if t.username == attacker.username
        }
    assert failed == []
    assert {n: s["state"] for n, s in nodes.items()} == dict.fromkeys(service.nodes, "up")
    assert sum(s["counters"].get("downs", 0) for s in nodes.values()) == 0
    # The attacker's losses are its own account's (its breaker: tests/sshpool/test_pool_logic.py,
    # test_logins_lost_before_any_command_open_the_breaker_and_keep_its_backoff_growing). Its
    # breaker's state at this moment is not asserted: on a slow box its back-off may have
    # passed and a trial login closed it until that connection is lost in turn.
    assert attacked and all(lost >= 1 for lost in attacked.values()), attacked


@pytest.mark.parametrize("probe", ["service account", "banner"])
async def test_a_down_node_comes_back_on_the_first_probe_that_succeeds(
    cluster: LocalCluster, probe: str
) -> None:
    """A node killed (sshd and its sessions, SIGKILL) is down at the next command there; back
    up, the first probe (an admin's re-probe here) brings it back at once, whatever the
    breakers of the accounts that failed there."""
    target = cluster.target(breaker_backoff=30, breaker_threshold=1)
    async with Pool() as pool:
        if probe == "service account":
            pool.probe_with(target)
        home = (await pool.run(target, ["sh", "-c", "echo $SSH_CONNECTION"])).stdout.split()[2]
        node = home.decode()
        victim = cluster.nodes[cluster.addresses.index(node)]
        victim.stop(kill_sessions=True)
        # The next command finds the node dead, moves on, and the node is down.
        moved = await pool.run(target, ["sh", "-c", "echo $SSH_CONNECTION"], acquire_timeout=30)
        assert moved.stdout.split()[2] != home
        assert await pool.reprobe(target, node) is False
        assert pool.nodes(target)[node]["state"] == "down"
        victim.start()
        await asyncio.sleep(1.1)  # past the re-probe's spacing: a fresh probe, not the last
        assert await pool.reprobe(target, node) is True
        assert pool.nodes(target)[node]["state"] == "up"
        with pytest.raises(KeyError):
            await pool.reprobe(target, "127.0.0.99")


HOSTNAME = ["sh", "-c", "echo $SSH_CONNECTION"]


@pytest.fixture
def slow_account(tmp_path: Path) -> Iterator[Account]:
    """A researcher whose login shell, bash, reads a ~/.bashrc that notes each session in
    ~/rc-log, then takes 3 s: its commands wait there with their channel open, not started.
    (Not ~/.ssh/rc: the rig's root sshd has the shipped `PermitUserRC no`.)"""
    (account,) = ensure_accounts(1, data_dir=tmp_path / "accounts", first=FIRST + 3)
    rc, log = account.home / ".bashrc", account.home / "rc-log"
    _set_shell(account.name, "/bin/bash")
    rc.write_text(f'echo started >> "{log}"\nsleep 3\n')
    os.chown(rc, account.uid, account.gid)
    log.unlink(missing_ok=True)
    try:
        yield account
    finally:
        rc.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
        _set_shell(account.name, "/bin/sh")


async def test_work_whose_start_was_never_reported_moves_off_a_failed_node(
    cluster: LocalCluster, slow_account: Account
) -> None:
    """Issue 44 item 5: a node killed (sshd and sessions, SIGKILL) under commands whose
    channels were open but which had not started, and with commands submitted right after:
    every one runs on another node and reports its start; none ends NodeFailed (`lost`)."""
    target = as_account(cluster, slow_account)
    log = slow_account.home / "rc-log"
    async with Pool() as pool:
        home = (await pool.run(target, HOSTNAME, acquire_timeout=30)).stdout.split()[2]
        victim = cluster.nodes[cluster.addresses.index(home.decode())]
        started: list[str] = []
        waiting = [
            asyncio.create_task(
                pool.run(target, HOSTNAME, acquire_timeout=60, on_node=started.append)
            )
            for _ in range(4)
        ]
        async with asyncio.timeout(30):
            while len(log.read_text().splitlines()) < 5:  # noqa: ASYNC110 (a file on the host)
                await asyncio.sleep(0.05)
        # The first command's line and 4 more: channels open, not one command started.
        assert started == []
        victim.stop(kill_sessions=True)
        after = [
            asyncio.create_task(
                pool.run(target, HOSTNAME, acquire_timeout=60, on_node=started.append)
            )
            for _ in range(2)
        ]
        results = await asyncio.gather(*waiting, *after, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed == []
        ran_on = {r.stdout.split()[2] for r in results if not isinstance(r, BaseException)}
        assert home not in ran_on
        assert len(started) == 6 and home.decode() not in started
        assert pool.nodes(target)[home.decode()]["state"] == "down"


async def test_probes_asked_at_once_are_one_probe(cluster: LocalCluster) -> None:
    """Ten re-probes of a node at once (an admin's retries, several admins): one probe."""
    target = cluster.target()
    node = target.nodes[0]
    async with Pool() as pool:
        answers = await asyncio.gather(*(pool.reprobe(target, node) for _ in range(10)))
        assert answers == [True] * 10
        assert pool.nodes(target)[node]["counters"]["probes"] == 1
