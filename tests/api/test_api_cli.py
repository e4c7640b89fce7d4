"""The `sshapi` command line: token minting matches the local server; hosts check; an invalid
setting or configuration file is one line saying what is wrong."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import httpx
import jwt
import pytest
import typer
from api_helpers import serve
from typer.testing import CliRunner

from api import cli
from api.app import create_app
from api.cli import app
from api.settings import Settings
from sshpool import ExecMode
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


def test_the_default_token_carries_jobs_and_files_but_not_admin(tmp_path: Path) -> None:
    """One token for a researcher: without --scope, every scope the local issuer grants but
    admin, which is asked for by name."""
    env = {"SSHAPI_DATA_DIR": str(tmp_path / "data")}
    for argv, scopes in (
        ([], "jobs:read jobs:write files:read files:write"),
        (["--scope", "jobs:read admin"], "jobs:read admin"),
    ):
        result = CliRunner().invoke(app, ["token", "--sub", "alice", *argv], env=env)
        assert result.exit_code == 0, result.output
        claims = jwt.decode(result.stdout.strip(), options={"verify_signature": False})
        assert claims["scope"] == scopes


def test_the_cli_s_exec_modes_are_the_pool_s() -> None:
    """api/cli.py writes sshpool's ExecMode out (importing sshpool costs every call)."""
    assert get_args(cli.ExecMode) == get_args(ExecMode)


def test_an_unreachable_server_is_named_with_where_its_url_comes_from() -> None:
    env = {"SSHAPI_URL": "http://127.0.0.1:9", "SSHAPI_TOKEN": "t",
           "SSHAPI_CLIENT_CONFIG": "/nonexistent/client.toml"}  # fmt: skip
    result = CliRunner().invoke(app, ["jobs", "list"], env=env)
    assert result.exit_code == 255
    first, came, how = result.stderr.splitlines()
    assert first.startswith("sshapi: GET http://127.0.0.1:9/v1/jobs: "), first
    assert came == "sshapi: http://127.0.0.1:9 came from SSHAPI_URL", came
    assert "SSHAPI_URL" in how and "profile" in how, how


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every command and group under `command` (typer's click), itself included."""
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_help_wraps_at_the_terminal_s_width_never_where_the_source_broke_lines() -> None:
    """Every command's and group's `--help` at 80 columns: a line of a description paragraph
    ends only where the next word would not fit (the docstrings' own line breaks, mid-sentence,
    never show: the issue saw them with typer's rich formatting), no line is wider than the
    terminal, and a command list shows each command's first sentence whole (no `...`)."""
    width = 78  # click's: the terminal's 80 columns less 2
    paths = list(_commands(typer.main.get_command(app)))
    assert len(paths) > 20 and ("files", "put") in paths
    for path in paths:
        result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, (path, result.output)
        lines = result.output.splitlines()
        assert max(map(len, lines)) <= 80, (path, result.output)
        # The description: after the usage line's blank, until the first section heading.
        start = lines.index("") + 1
        end = next((i for i, line in enumerate(lines) if line.endswith(":") and
                    not line.startswith(" ") and i > start), len(lines))  # fmt: skip
        description = lines[start:end]
        for line, after in itertools.pairwise(description):
            if line and after:
                words = after.split()
                assert len(line) + 1 + len(words[0]) > width, (path, line, after)
        listed = lines[lines.index("Commands:") + 1 :] if "Commands:" in lines else []
        assert not [line for line in listed if line.rstrip().endswith("...")], (path, listed)


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


# ---- an invalid setting or configuration file: one line naming the problem, exit 2

BROKEN_CONFIGS = {
    # file content -> what the error line names
    "malformed": ("[api]\nwait_default = \n", "not valid TOML"),
    "unknown-key": ("[api]\nwait_defualt = 5\n", "api.wait_defualt: Extra inputs"),
    "bad-value": ("[api]\nwait_default = 'soon'\n", "api.wait_default: Input should be"),
    "not-utf8": (b"\xff\xfe[api]\n", "utf-8"),
    "missing": (None, "No such file or directory"),
}


# The commands that read the configuration file: name -> argv.
CONFIG_COMMANDS = {
    "token": ["token", "--sub", "a"],
    "hosts check": ["hosts", "check"],
    "doctor": ["doctor"],
    "serve": ["serve"],
}


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
@pytest.mark.parametrize("case", BROKEN_CONFIGS)
def test_an_invalid_configuration_file_is_one_line_naming_it_and_exit_2(
    command: str, case: str, tmp_path: Path
) -> None:
    content, says = BROKEN_CONFIGS[case]
    path = tmp_path / "sshapi.toml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    env = {"SSHAPI_CONFIG": str(path), "SSHAPI_DATA_DIR": str(tmp_path / "data")}
    result = CliRunner().invoke(app, CONFIG_COMMANDS[command], env=env)
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith(f"sshapi {command}: {path}: "), lines
    assert says in lines[0], lines
    assert not result.stdout  # and no token, no host line


def test_an_invalid_setting_names_its_variable_and_exits_2(tmp_path: Path) -> None:
    env = {"SSHAPI_DATA_DIR": str(tmp_path), "SSHAPI_REPLICAS": "0"}
    for command, argv in {**CONFIG_COMMANDS, "dev": ["dev"]}.items():
        result = CliRunner().invoke(app, argv, env=env)
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == [
            f"sshapi {command}: invalid setting: SSHAPI_REPLICAS: "
            "Input should be greater than or equal to 1"
        ]


def test_an_in_memory_sqlite_store_is_refused_at_start(tmp_path: Path) -> None:
    """The store reads and writes on separate connections: an in-memory SQLite database
    would lose every job it wrote. Refused before anything starts, with what to set instead."""
    for url in ("sqlite+aiosqlite://", "sqlite+aiosqlite:///:memory:", "sqlite://"):
        env = {"SSHAPI_DATA_DIR": str(tmp_path), "SSHAPI_DATABASE_URL": url}
        result = CliRunner().invoke(app, ["serve"], env=env)
        assert result.exit_code == 2, (url, result.output)
        assert result.stderr.startswith(
            "sshapi serve: invalid setting: SSHAPI_DATABASE_URL: Value error, SQLite needs a "
            "database file"
        ), (url, result.stderr)
    # A file is fine, relative (three slashes) or absolute (four).
    for url in ("sqlite+aiosqlite:///jobs.sqlite3", f"sqlite+aiosqlite:///{tmp_path}/j.sqlite3"):
        assert Settings(database_url=url).resolved_database_url == url


def test_a_configuration_path_that_is_a_directory_is_named(tmp_path: Path) -> None:
    env = {"SSHAPI_CONFIG": str(tmp_path), "SSHAPI_DATA_DIR": str(tmp_path / "data")}
    result = CliRunner().invoke(app, ["hosts", "check"], env=env)
    assert result.exit_code == 2
    assert result.stderr == f"sshapi hosts check: {tmp_path}: Is a directory\n"


BROKEN_PROFILES = {
    "malformed": ('default = "x"\n[profiles\n', "not a valid client configuration"),
    "profiles-not-tables": ("profiles = 3\n", "`profiles` must be tables"),
    "profile-not-a-table": ('profiles.x = "http://h"\n', "profiles.x must be a table"),
    "unknown-key": ('[profiles.x]\ntokn = "abc"\n', "unknown key profiles.x.tokn"),
    "url-not-a-string": ("[profiles.x]\nurl = 5\n", "profiles.x.url must be a string"),
    "missing-token-file": ('[profiles.x]\ntoken_file = "/nonexistent/t"\n', "/nonexistent/t"),
}


@pytest.mark.parametrize("case", BROKEN_PROFILES)
def test_an_invalid_client_configuration_is_one_line_and_exit_255(
    case: str, tmp_path: Path
) -> None:
    """The client commands keep their own exit status for their errors (255, as ssh): 2 could
    be the remote command's."""
    content, says = BROKEN_PROFILES[case]
    path = tmp_path / "client.toml"
    path.write_text(content)
    env = {"SSHAPI_CLIENT_CONFIG": str(path), "SSHAPI_URL": "", "SSHAPI_TOKEN": ""}
    result = CliRunner().invoke(app, ["jobs", "list", "--profile", "x"], env=env)
    assert result.exit_code == 255, result.output
    assert len(result.stderr.splitlines()) == 1 and says in result.stderr, result.stderr
    assert result.stderr.startswith("sshapi: ")
