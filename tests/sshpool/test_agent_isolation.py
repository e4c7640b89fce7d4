"""The executor under its own account's files and commands (sshpool/agent): nothing the account's
files hold runs inside it (a `usercustomize.py`, a `.pth` file, a `sitecustomize.py` on a
`PYTHONPATH` the login shell exports, a `json.py` in the home), and no command of the account
opens its channel through /proc to read other commands' stdin or forge their output and exit
status. The commands themselves keep the account's environment and stay debuggable."""

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
from sshpool.agent import client
from sshpool.devhost import LocalHost
from sshpool.devhost.accounts import Account, ensure_accounts

MakeHost = Callable[..., LocalHost]
# A researcher account of this test alone (its home gets Python start-up files and a .bashrc;
# a shared account would run them in other tests' and other checkouts' commands).
ACCOUNT_NUMBER = 9801


@pytest.fixture
def researcher(tmp_path: Path) -> Iterator[Account]:
    """The test's own account, with bash as its login shell (bash reads ~/.bashrc for every
    command sshd runs); its home as found afterwards (what the test made removed, its .bashrc
    put back)."""
    account = ensure_accounts(1, data_dir=tmp_path / "accounts", first=ACCOUNT_NUMBER)[0]
    subprocess.run(["usermod", "-s", "/bin/bash", account.name], check=True, capture_output=True)
    kept = {p.name for p in account.home.iterdir()}
    rc = account.home / ".bashrc"
    bashrc = rc.read_bytes() if rc.is_file() else None
    yield account
    for p in account.home.iterdir():
        if p.name not in kept:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    if bashrc is not None:
        rc.write_bytes(bashrc)


def plant(account: Account, path: Path, text: str) -> None:
    """Write `path` as the account would (its directories made, all owned by it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    for p in [path, *path.parents]:
        if p == account.home:
            break
        shutil.chown(p, account.uid, account.gid)


async def test_the_accounts_python_files_never_run_in_the_executor(
    make_host: MakeHost, researcher: Account
) -> None:
    """The account holds a usercustomize.py and a .pth file in its user site, a
    sitecustomize.py and a PYTHONSTARTUP file named by PYTHONPATH/PYTHONSTARTUP exports in its
    ~/.bashrc, and a json.py in its home (the executor's working directory): none of them runs
    when the executor starts (each would leave a marker), and the executor runs. The account's
    own commands are unchanged: they see the exported variables, and its python3 loads its
    user site."""
    home = researcher.home
    host = make_host("stock", researchers=True)
    target = researcher.target(host, max_connections=1)
    async with Pool() as pool:
        found = await pool.run(target, ["python3", "-c", "import site;print(site.USER_SITE)"])
        user_site = Path(found.stdout.decode().strip())
    assert user_site.is_relative_to(home), user_site
    markers = home / f"markers-{uuid.uuid4().hex[:8]}"
    plant(researcher, markers / ".keep", "")

    def marking(name: str) -> str:
        return f"open({str(markers / name)!r}, 'w').close()\n"

    plant(researcher, user_site / "usercustomize.py", marking("usercustomize"))
    plant(researcher, user_site / "sshapi-test.pth", "import os;" + marking("pth"))
    plant(researcher, home / "pypath" / "sitecustomize.py", marking("sitecustomize"))
    plant(researcher, home / "startup.py", marking("startup"))
    plant(researcher, home / "json.py", marking("json"))
    plant(
        researcher,
        home / ".bashrc",
        f"export PYTHONPATH={home}/pypath PYTHONSTARTUP={home}/startup.py\n",
    )
    async with Pool() as pool:
        agent = replace(target, exec_mode="agent")
        result = await pool.run(agent, ["printenv", "PYTHONPATH"])
        assert sorted(p.name for p in markers.iterdir()) == [".keep"]
        assert pool.stats()[agent]["exec_mode"] == "agent", pool.stats()[agent]["agent_error"]
        # The commands keep the account's environment and its python3 its user site.
        assert result.stdout.decode().strip() == f"{home}/pypath"
        await pool.run(agent, ["python3", "-c", "pass"])
    assert {"usercustomize", "pth", "sitecustomize"} <= {p.name for p in markers.iterdir()}


# Run by the hostile command, beside a victim command of the same executor: open the
# executor's stdout (its parent's fd 1) and write an OUT and an EXIT frame for every request id
# the connection may have given; open its stdin to read other commands' frames.
FORGE = f"""
import json, os, struct
H = struct.Struct({client.HEADER.format!r})
parent = os.getppid()
exit = json.dumps({{"status": 0, "signal": None, "stdout_bytes": 7, "stderr_bytes": 0}}).encode()
frames = b"".join(
    H.pack(7, {client.OUT}, rid) + b"forged\\n" + H.pack(len(exit), {client.EXIT}, rid) + exit
    for rid in range(1, 9)
)
for fd, mode in ((1, "wb"), (0, "rb")):
    try:
        with open("/proc/%d/fd/%d" % (parent, fd), mode, buffering=0) as f:
            f.write(frames) if fd == 1 else os.set_blocking(f.fileno(), False)
        print(fd, "opened")
    except OSError as exc:
        print(fd, exc.__class__.__name__)
print("self", os.stat("/proc/self/fd").st_uid == os.getuid())
"""


@pytest.fixture
def go() -> Iterator[Path]:
    """A path a waiting command polls for, removed afterwards."""
    path = Path(f"/tmp/sshapi-go-{uuid.uuid4().hex[:12]}")
    yield path
    path.unlink(missing_ok=True)


async def test_a_command_cannot_open_its_executors_channel(stock_host: LocalHost, go: Path) -> None:
    """Two commands on one executor (two identities mapped to one account): the hostile one
    cannot open the executor's stdout (to forge the other's output and exit status) nor its
    stdin (PermissionError on both), the victim's output and exit status are its own, and the
    hostile command's own /proc entries are its account's (commands stay debuggable)."""
    target: Target = replace(stock_host.target(max_connections=1), exec_mode="agent")
    wait = f"while [ ! -e {go} ]; do sleep 0.05; done; echo real; exit 3"
    async with Pool() as pool:
        await pool.run(target, ["true"])
        victim = asyncio.create_task(pool.run(target, ["sh", "-c", wait], timeout=60))
        hostile = await pool.run(target, ["python3", "-c", FORGE], timeout=60)
        await asyncio.to_thread(go.touch)  # the victim ends once the hostile command did
        real = await victim
        assert pool.stats()[target]["counters"]["agents_started"] == 1
    assert (real.exit_status, real.stdout) == (3, b"real\n")
    assert hostile.stdout.decode().split("\n")[:3] == [
        "1 PermissionError",
        "0 PermissionError",
        "self True",
    ], hostile


@pytest.fixture
def python_without_ctypes() -> Iterator[str]:
    """A python3 for the host account whose executor finds no ctypes (the bootstrap, its
    third argument after -I -S -c, gets `ctypes` blocked first)."""
    where = Path(f"/tmp/sshapi-noctypes-{uuid.uuid4().hex[:12]}")
    where.mkdir(mode=0o755)
    wrapper = where / "python3"
    block = "import sys;sys.modules['ctypes']=None;"
    wrapper.write_text(f'#!/bin/sh\nexec python3 "$1" "$2" "$3" "{block}$4" "$5" "$6"\n')
    wrapper.chmod(0o755)
    yield str(wrapper)
    shutil.rmtree(where)


async def test_an_executor_that_cannot_go_undumpable_says_so_once(
    stock_host: LocalHost, python_without_ctypes: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A host whose python3 has no ctypes (a stand-in for a kernel without prctl): its two
    executors still run the commands, and the log says once per host that they are exposed."""
    target = replace(
        stock_host.target(max_connections=2, agent_max_commands=1),
        exec_mode="agent",
        agent_python=python_without_ctypes,
    )
    with caplog.at_level(logging.WARNING, logger="sshpool"):
        async with Pool() as pool:
            results = await asyncio.gather(
                *(pool.run(target, ["sleep", "0.5"], timeout=60) for _ in range(4))
            )
            assert pool.stats()[target]["counters"]["agents_started"] == 2
            assert pool.stats()[target]["exec_mode"] == "agent"
    assert {r.exit_status for r in results} == {0}
    lines = [r.message for r in caplog.records if "undumpable" in r.message]
    assert len(lines) == 1 and "ctypes" in lines[0], lines
