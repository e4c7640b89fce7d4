"""The client installs alone: `pip install sshapi` (no `server` extra) gives `api.client` and the
`sshapi` commands that talk to a server, without FastAPI, SQLAlchemy or asyncssh.

The install is built from what this test's environment already has, offline
(`loadtests.cli_startup.client_only_venv`): a venv whose only packages are the distributions the
core `dependencies` of pyproject.toml need (followed recursively through their metadata), linked
in, this repository's `api` package and an `sshapi` console script."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
from api_helpers import Api

from loadtests.cli_startup import client_only_venv


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a venv with the client's distributions and `api` only."""
    return client_only_venv(tmp_path_factory.mktemp("client-only")) / "python"


def run(python: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    done = subprocess.run(
        [python, *args], capture_output=True, text=True, timeout=60, cwd="/",
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), **(env or {})},
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


def test_the_client_alone_imports_and_the_server_is_not_there(client_venv: Path) -> None:
    code, out, err = run(client_venv, "-c", "import api.client; from api.client import Client")
    assert code == 0, err
    for server_package in ("fastapi", "sqlalchemy", "asyncssh", "sshpool"):
        code, _, _ = run(client_venv, "-c", f"import {server_package}")
        assert code == 1, f"{server_package} is importable: the test proves nothing"
    code, out, err = run(client_venv, str(client_venv.parent / "sshapi"), "--help")
    assert code == 0 and "files" in out and "jobs" in out, err
    # A server command says what to install instead of a traceback.
    for command in (["serve"], ["dev"], ["token", "--sub", "a"], ["hosts", "check"], ["doctor"],
                    ["db", "upgrade"]):  # fmt: skip
        code, out, err = run(client_venv, str(client_venv.parent / "sshapi"), *command)
        assert code == 2 and err.strip().endswith("pip install 'sshapi[server]'"), err


async def test_the_client_alone_lists_jobs_on_a_real_server(client_venv: Path, api: Api) -> None:
    r = await api.submit({"host": "local", "argv": ["echo", "from the client-only test"]}, wait=20)
    job = r.json()["id"]
    env = {"SSHAPI_URL": api.url, "SSHAPI_TOKEN": api.token("alice")}
    code, out, err = await asyncio.to_thread(
        run, client_venv, str(client_venv.parent / "sshapi"), "jobs", "list", env=env
    )
    assert code == 0 and job in out, err
