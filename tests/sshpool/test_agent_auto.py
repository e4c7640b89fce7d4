"""exec_mode "auto" through the pool against real sshd (sshpool/connect.py `AgentMode`): an
executor on each connection where the account's python3 answers, channels where it does not
(missing from the account's PATH, a script that hangs, one that prints junk), decided per
connection, logged once per host, and never a job that hangs or fails for it."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from sshpool import Pool, Target
from sshpool import connect as connect_module
from sshpool.devhost import LocalHost
from sshpool.devhost.accounts import Account, ensure_accounts

MakeHost = Callable[..., LocalHost]
# A researcher account of this module alone (its ~/.bashrc and ~/bin/python3 are rewritten).
ACCOUNT_NUMBER = 9841
# What stands for python3 in the account's PATH, per case: (the ~/.bashrc, ~/bin/python3).
# {w} is the test's word (a pgrep pattern for what the fake left running).
FAKES = {
    # No python3 anywhere on the account's PATH (echo is the login shell's builtin).
    "missing": ("export PATH=/nonexistent-sshapi\n", None),
    # A python3 that never answers nor exits: its start times out, its group is killed.
    "hangs": (
        'export PATH="$HOME/bin:$PATH"\n',
        "#!/bin/sh\nexec sh -c 'sleep 600; : {w}'\n",
    ),
    # Junk forever on stdout: not a frame the pool takes.
    "junk": (
        'export PATH="$HOME/bin:$PATH"\n',
        "#!/bin/sh\nwhile :; do echo 'junk {w}'; done\n",
    ),
    # A few bytes of junk (less than a frame's header), then silence.
    "junk-then-hangs": (
        'export PATH="$HOME/bin:$PATH"\n',
        "#!/bin/sh\nprintf 'hi'\nexec sh -c 'sleep 600; : {w}'\n",
    ),
    # A frame that parses as a HELLO, but not the executor's (no window).
    "fake-hello": (
        'export PATH="$HOME/bin:$PATH"\n',
        "#!/bin/sh\nprintf '\\000\\000\\000\\002\\020\\000\\000\\000\\000[]'\n"
        "exec sh -c 'sleep 600; : {w}'\n",
    ),
}


@pytest.fixture(autouse=True)
def fresh_announcements() -> Iterator[None]:
    """ "auto" logs once per host and process: each test starts with nothing announced."""
    connect_module.announced.clear()
    yield
    connect_module.announced.clear()


@pytest.fixture
def researcher(tmp_path: Path) -> Iterator[Account]:
    """The module's own account, bash as its login shell (bash reads ~/.bashrc for every
    session sshd starts); its ~/.bashrc and ~/bin put back as found afterwards."""
    account = ensure_accounts(1, data_dir=tmp_path / "accounts", first=ACCOUNT_NUMBER)[0]
    subprocess.run(["usermod", "-s", "/bin/bash", account.name], check=True, capture_output=True)
    rc = account.home / ".bashrc"
    bashrc = rc.read_bytes() if rc.is_file() else None
    yield account
    shutil.rmtree(account.home / "bin", ignore_errors=True)
    if bashrc is not None:
        rc.write_bytes(bashrc)
    else:
        rc.unlink(missing_ok=True)


def write_as(account: Account, path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    for p in (path, path.parent):
        shutil.chown(p, account.uid, account.gid)


def running(account: Account, pattern: str) -> list[str]:
    done = subprocess.run(
        ["pgrep", "-u", str(account.uid), "-f", pattern], capture_output=True, text=True
    )
    return done.stdout.split()


async def gone(account: Account, pattern: str, within: float = 10.0) -> bool:
    for _ in range(int(within / 0.1)):
        if not running(account, pattern):
            return True
        await asyncio.sleep(0.1)
    return False


def auto(target: Target, **limits: object) -> Target:
    return replace(target, exec_mode="auto", limits=replace(target.limits, **limits))  # type: ignore[arg-type]


async def test_auto_runs_an_executor_where_python3_answers(
    stock_host: LocalHost, caplog: pytest.LogCaptureFixture
) -> None:
    """The rig's account has python3: every connection runs an executor (the command's parent
    is python3, not a login shell), the stats count the connections by mode, and the host's
    outcome is logged once for two accounts' worth of pools."""
    target = auto(stock_host.target(), max_connections=2)
    other = replace(target, identity="second-pool")  # another pool key on the same host
    with caplog.at_level(logging.INFO, logger="sshpool"):
        async with Pool() as pool:
            for t in (target, other):
                result = await pool.run(t, ["sh", "-c", "ps -o args= -p $PPID"])
                assert b"sys.stdin.buffer.read" in result.stdout, result.stdout
                stats = pool.stats()[t]
                assert stats["exec_mode"] == "agent"
                assert stats["connections_by_mode"] == {"agent": 1, "channel": 0}
    lines = [r.message for r in caplog.records if "exec_mode auto" in r.message]
    assert len(lines) == 1 and "agent mode" in lines[0], lines


async def test_auto_with_one_session_per_connection_runs_channels(stock_host: LocalHost) -> None:
    """max_sessions 1 leaves no channel for SFTP beside an executor: "auto" runs channels."""
    target = auto(stock_host.target(), max_sessions=1)
    async with Pool() as pool:
        result = await pool.run(target, ["sh", "-c", "ps -o args= -p $PPID"])
        assert b"sys.stdin.buffer.read" not in result.stdout
        assert pool.stats()[target]["connections_by_mode"] == {"agent": 0, "channel": 1}
        assert pool.stats()[target]["counters"].get("agents_started", 0) == 0


@pytest.mark.parametrize("case", list(FAKES))
async def test_auto_without_a_usable_python3_runs_channels(
    case: str,
    make_host: MakeHost,
    researcher: Account,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The account's python3 is missing from its PATH, hangs, or answers junk: the connection
    falls back to channels (the jobs succeed, none waits past its connect_timeout for it), what
    the fake left running is killed, the log says so once for the host, and the account's next
    connection goes straight to channels."""
    w = f"sshapi-auto-{uuid.uuid4().hex[:12]}"
    rc, python = FAKES[case]
    write_as(researcher, researcher.home / ".bashrc", rc)
    if python is not None:
        write_as(researcher, researcher.home / "bin" / "python3", python.format(w=w), 0o755)
    host = make_host("stock", researchers=True)
    target = auto(researcher.target(host), max_connections=2, connect_timeout=3.0)
    with caplog.at_level(logging.INFO, logger="sshpool"):
        async with Pool() as pool:
            results = await asyncio.wait_for(
                asyncio.gather(*(pool.run(target, ["echo", "ok"]) for _ in range(12))), 60
            )
            assert {r.stdout for r in results} == {b"ok\n"}
            stats = pool.stats()[target]
            assert stats["connections_by_mode"]["agent"] == 0, stats
            assert stats["connections_by_mode"]["channel"] >= 1, stats
            assert stats["exec_mode"] == "channel" and stats["agent_error"], stats
            assert stats["counters"].get("connects_failed", 0) == 0, stats
            # The next connection does not try again (AUTO_RETRY): no second start to wait for.
            await pool.discard(target)
            result = await asyncio.wait_for(pool.run(target, ["echo", "again"]), 60)
            assert result.stdout == b"again\n"
            assert pool.stats()[target]["agent_error"] == stats["agent_error"]
    assert await gone(researcher, w), f"the fake python3 of {case} still runs"
    lines = [r.message for r in caplog.records if "exec_mode auto" in r.message]
    assert len(lines) == 1 and "run their commands as channels" in lines[0], lines
    assert not [r for r in caplog.records if "the executor ended" in r.message]
