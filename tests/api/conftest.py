"""Fixtures for the API tests: a real uvicorn server on a free loopback port, in the test's event
loop, in front of the real sshd of `tuned_host`; tokens; a store on SQLite or PostgreSQL.

`api` uses SQLite; `api_any_store` runs the test once per store (SQLite, PostgreSQL).
`batch_api`: one `sshapi serve` process for the whole session whose host `local` is the Slurm
login host (`slurm_host`), shared by the batch tests of every module."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from api_helpers import (
    Api,
    Keys,
    OwnHostApi,
    config_toml,
    host_toml,
    make_settings,
    pg_schema,
    running_api,
    server_process,
    write_batch_config,
)
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from api.client import tls_context
from api.config import Config, load_config
from api.settings import Settings
from api.store import Store
from api.tasks import Supervisor, supervised
from sshpool.devhost import LocalHost


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    found = Keys(
        rsa=rsa.generate_private_key(public_exponent=65537, key_size=2048),
        ec=ec.generate_private_key(ec.SECP256R1()),
        ed=ed25519.Ed25519PrivateKey.generate(),
    )
    folder = tmp_path_factory.mktemp("jwt-keys")
    for name, key in (("rsa", found.rsa), ("ec", found.ec), ("ed", found.ed)):
        path = folder / f"{name}.pem"
        path.write_bytes(Keys.public_pem(key))
        found.files.append(path)
    return found


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "jwt_secret"
    path.write_text(secrets.token_urlsafe(48))
    path.chmod(0o600)
    return path


@pytest.fixture
def config_file(tuned_host: LocalHost, secret_file: Path, keys: Keys, tmp_path: Path) -> Path:
    path = tmp_path / "sshapi.toml"
    path.write_text(config_toml(tuned_host, secret_file, keys))
    return path


@pytest.fixture(scope="session")
def secret(secret_file: Path) -> str:
    return secret_file.read_text()


@pytest.fixture
async def api(config_file: Path, secret: str, keys: Keys, tmp_path: Path) -> AsyncIterator[Api]:
    """The API on SQLite."""
    settings = make_settings(tmp_path, config_file, "sqlite", None)
    async with running_api(settings, keys, secret) as running:
        yield running


@pytest.fixture(params=["sqlite", "postgresql"])
async def api_any_store(
    request: pytest.FixtureRequest,
    config_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> AsyncIterator[Api]:
    """The API, once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        settings = make_settings(tmp_path, config_file, "sqlite", None)
        async with running_api(settings, keys, secret) as running:
            yield running
        return
    async with pg_schema() as schema:
        settings = make_settings(tmp_path, config_file, "postgresql", schema)
        async with running_api(settings, keys, secret) as running:
            yield running


@pytest.fixture(params=["sqlite", "postgresql"])
async def store_settings(
    request: pytest.FixtureRequest, config_file: Path, tmp_path: Path
) -> AsyncIterator[Settings]:
    """Settings for a store on SQLite, then on PostgreSQL (a fresh schema)."""
    if request.param == "sqlite":
        yield make_settings(tmp_path, config_file, "sqlite", None)
        return
    async with pg_schema() as schema:
        yield make_settings(tmp_path, config_file, "postgresql", schema)


@pytest.fixture
async def tasks() -> AsyncIterator[Supervisor]:
    """A running supervisor, for an object a test uses on its own (a store's writer runs
    under one)."""
    async with supervised() as supervisor:
        yield supervisor


@pytest.fixture
async def store(store_settings: Settings, tasks: Supervisor) -> AsyncIterator[Store]:
    s = Store(store_settings.resolved_database_url, schema=store_settings.database_schema)
    await s.start(tasks)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
def api_with_own_host(
    make_host: Callable[..., LocalHost],
    tuned_host: LocalHost,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> OwnHostApi:
    """`async with api_with_own_host(name) as (api, host)`: the API (SQLite) with one more host
    `name`, a tuned sshd of the test's own that it may kill, restart or re-key. Policy subject
    `anyhost` may use it. `exec_mode`: the host's (unset: the default, "auto")."""

    @asynccontextmanager
    async def start(
        name: str, exec_mode: str | None = None
    ) -> AsyncIterator[tuple[Api, LocalHost]]:
        host = make_host("tuned")
        path = tmp_path / f"{name}.toml"
        table = host_toml(name, host)
        if exec_mode is not None:
            mode = f'exec_mode = "{exec_mode}"\n'
            table = table.replace(f"[hosts.{name}]\n", f"[hosts.{name}]\n{mode}")
        path.write_text(config_toml(tuned_host, secret_file, keys) + table)
        async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
            yield api, host

    return start


@pytest.fixture(scope="session")
def batch_server(
    slurm_host: LocalHost,
    secret_file: Path,
    keys: Keys,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Settings, Config]]:
    """`sshapi serve` (SQLite) with the Slurm login host as `local`: its URL, settings, config.
    Started once: the batch tests only add jobs of their own (unique markers, own dirs)."""
    folder = tmp_path_factory.mktemp("batch-api")
    config = write_batch_config(folder / "sshapi.toml", slurm_host, secret_file, keys)
    settings = make_settings(folder, config, "sqlite", None)
    with server_process(settings) as (_, url):
        yield url, settings, load_config(config)


@pytest.fixture(scope="session")
def overtime_job(
    batch_server: tuple[str, Settings, Config], secret: str, keys: Keys, workdir: str
) -> str:
    """A batch job past its one-minute time limit (`sleep 300`), submitted once per session as
    early as a module asks for it: Slurm ends it 60-90 s after it started."""

    async def submit() -> str:
        url, settings, config = batch_server
        async with httpx.AsyncClient(timeout=60) as client:
            api = Api(url, client, secret, config, settings, keys)
            body = {"script": "#!/bin/sh\nsleep 300\n", "workdir": workdir, "time_limit": 60}
            r = await api.submit({"host": "local", "batch": body})
            assert r.status_code == 202, r.text
            return str(r.json()["id"])

    return asyncio.run(submit())


@pytest.fixture
async def batch_api(
    batch_server: tuple[str, Settings, Config], secret: str, keys: Keys
) -> AsyncIterator[Api]:
    url, settings, config = batch_server
    async with httpx.AsyncClient(timeout=60, verify=tls_context()) as client:
        yield Api(url, client, secret, config, settings, keys)
