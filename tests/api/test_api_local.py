"""Local development wiring (api/local.py): serving never touches the dev rig, `sshapi dev`'s
configuration is a plain file, and tokens can be minted without the web stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from api_helpers import SSHAPI, free_port

from api.config import HostConfig, load_config
from api.local import LOCAL_LIMITS, default_config, write_local_config
from loadtests.server import stop_api, wait_ready

CHECK_IMPORTS = """
import sys
from api.settings import Settings
from api.app import create_app
import api.cli

create_app(Settings(data_dir=sys.argv[1], replica="local-test"))
rig = sorted(m for m in sys.modules if m.startswith("sshpool.devhost"))
assert not rig, rig
print("clean")
"""

MINT_LIGHT = """
import sys
from api.local import local_token, resolve_config
from api.settings import Settings

settings = Settings(data_dir=sys.argv[1])
token = local_token(settings, resolve_config(settings), "alice", ["jobs:read"], 60.0)
heavy = sorted(m for m in ("fastapi", "sqlalchemy", "starlette") if m in sys.modules)
assert not heavy, heavy
assert token.count(".") == 2
print("light")
"""


def leftover_dev_dir(data: Path, *, local_toml: bool) -> None:
    """What an earlier `sshapi dev` leaves: the local host's files and remembered port, and
    (since the configuration became a plain file) local.toml."""
    host = data / "hosts" / "local"
    host.mkdir(parents=True)
    (host / "port").write_text(str(free_port()))
    if local_toml:
        local = HostConfig(
            hostname="127.0.0.1",
            port=free_port(),  # nothing listens: the prewarm fails, which is not fatal
            username="nobody-here",
            client_keys=[str(host / "id_ed25519")],
            known_hosts=str(host / "known_hosts"),
            limits=LOCAL_LIMITS,
        )
        write_local_config(data, default_config(local))


def fake_useradd(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose PATH finds a `useradd` (and `adduser`) that only leaves a mark."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mark = tmp_path / "account-created"
    for name in ("useradd", "adduser"):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "$@" >> {mark}\n')
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("SSHAPI_CONFIG", None)
    return env, mark


def test_the_app_without_a_config_imports_nothing_of_the_dev_rig(tmp_path: Path) -> None:
    """create_app and the CLI module, with a leftover dev data dir and no SSHAPI_CONFIG, load no
    `sshpool.devhost` module (which could create the local host's account)."""
    data = tmp_path / "data"
    leftover_dev_dir(data, local_toml=True)
    env, mark = fake_useradd(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", CHECK_IMPORTS, str(data)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout
    assert not mark.exists()


def test_serve_uses_what_sshapi_dev_left_and_creates_no_account(tmp_path: Path) -> None:
    """`sshapi serve` (run as root here) with no SSHAPI_CONFIG and a leftover dev data dir
    serves the plain local.toml and runs no useradd."""
    data = tmp_path / "data"
    leftover_dev_dir(data, local_toml=True)
    env, mark = fake_useradd(tmp_path)
    port = free_port()
    env |= {"SSHAPI_DATA_DIR": str(data), "SSHAPI_PORT": str(port), "SSHAPI_LOG_LEVEL": "error"}
    proc = subprocess.Popen([SSHAPI, "serve"], env=env, stdin=subprocess.DEVNULL)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")
    finally:
        stop_api(proc)
    assert not mark.exists()


def test_serve_without_any_configuration_refuses_clearly(tmp_path: Path) -> None:
    """No SSHAPI_CONFIG and no local.toml (even with an old dev host's port file): exit 2 with a
    message naming both ways out, no traceback, no account."""
    data = tmp_path / "data"
    leftover_dev_dir(data, local_toml=False)
    env, mark = fake_useradd(tmp_path)
    env["SSHAPI_DATA_DIR"] = str(data)
    out = subprocess.run(
        [SSHAPI, "serve"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "SSHAPI_CONFIG" in out.stderr
    assert "sshapi dev" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not mark.exists()


def test_the_local_configuration_is_a_plain_file_the_loader_reads(tmp_path: Path) -> None:
    local = HostConfig(
        hostname="127.0.0.1",
        port=2222,
        username="dev",
        client_keys=["/k/id_ed25519", "/k/other key"],
        known_hosts='/k/known "hosts"',
        description="multi\nline",
        limits=LOCAL_LIMITS,
    )
    config = default_config(local)
    path = write_local_config(tmp_path, config)
    assert load_config(path) == config


def test_minting_a_token_needs_neither_fastapi_nor_sqlalchemy(tmp_path: Path) -> None:
    """What a Locust worker imports to mint its tokens stays light."""
    out = subprocess.run(
        [sys.executable, "-c", MINT_LIGHT, str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "light" in out.stdout
