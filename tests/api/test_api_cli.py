"""The `sshapi` command line: token minting matches the local server; hosts check."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
from api_helpers import serve

from api.app import create_app
from api.settings import Settings
from sshpool.devhost import LocalHost

SSHAPI = str(Path(sys.executable).parent / "sshapi")


async def run(*args: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        SSHAPI,
        *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(60):
        out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_token_command_mints_what_the_default_server_accepts(tmp_path: Path) -> None:
    """With only the data dir in common, `sshapi token` output is accepted by a server built
    from the default configuration (the secret is generated once in the data dir)."""
    data = tmp_path / "data"
    code, out = await run(
        "token",
        "--sub",
        "alice",
        "--scope",
        "jobs:read jobs:write",
        env={"SSHAPI_DATA_DIR": str(data)},
    )
    assert code == 0, out
    token = out.strip()
    assert (data / "jwt_secret").stat().st_mode & 0o077 == 0
    app = create_app(Settings(data_dir=data, replica="cli-test"))
    async with serve(app) as url, httpx.AsyncClient() as client:
        r = await client.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text
        r = await client.get(f"{url}/v1/jobs", headers={"Authorization": "Bearer x" + token})
        assert r.status_code == 401


async def test_hosts_check_reports_each_host(config_file: Path, tuned_host: LocalHost) -> None:
    """`sshapi hosts check` connects to every configured host: ok for the live ones, FAIL and
    exit status 1 for the one on a closed port."""
    code, out = await run(
        "hosts", "check", "--timeout", "5", env={"SSHAPI_CONFIG": str(config_file)}
    )
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert code == 1, out
    assert " ok " in lines["local"]
    assert "FAIL" in lines["down"]
