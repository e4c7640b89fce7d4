"""Helpers of the API tests: a uvicorn server in the test's event loop, the test configuration,
tokens, PostgreSQL schemas."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AsyncExitStack,
    asynccontextmanager,
    contextmanager,
    suppress,
)
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import jwt
import uvicorn
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from starlette.types import ASGIApp

from api.app import create_app
from api.client import tls_context
from api.config import Config, load_config
from api.settings import Settings
from loadtests.server import wait_ready
from sshpool.devhost import LocalHost, RelayedHost

PG_URL = os.environ.get("SSHAPI_TEST_PG", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
# Each xdist worker its own Redis database (gw0 and a lone process: 0, gwN: N), as it has its own
# rig account: the keys (job caps, sshd budgets, node health...) of one worker's servers are
# none of another's. Pub/sub channels span databases, but ours name the sshd or node
# (address:port, a port of this worker's rig) or only nudge a re-read (revocations, changes).
REDIS_DB = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
REDIS_URL = f"redis://127.0.0.1:6379/{REDIS_DB}"
AUDIENCE = "sshapi-test"
# The `api_with_own_host` fixture: name -> (the API, the host of that name).
OwnHostApi = Callable[..., AbstractAsyncContextManager[tuple["Api", LocalHost]]]
LOCAL_ISS = "test-local"
KEYS_ISS = "test-keys"
SSHAPI = str(Path(sys.executable).parent / "sshapi")


async def eventually(predicate: Callable[[], object], timeout: float = 60.0) -> None:
    """Poll a synchronous check (e.g. the host's process list) until it is true. `timeout` is a
    hang bound, never a speed claim: it was 10 s, which a loaded box (load 10-20, 2 cores) can
    spend before a queued job's processes show; a condition that never holds still fails."""
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 (an outside condition: nothing to await)
            await asyncio.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class _Server(uvicorn.Server):
    """uvicorn's server, stopped as soon as it can be: uvicorn's main loop polls `should_exit`
    every 0.1 s, and its shutdown sleeps 0.1 s after asking the connections to close, then
    polls them every 0.1 s: ~0.15 s per test, and hundreds of tests start a server. Here the
    loop wakes on `stop()` and the shutdown polls every 5 ms; its steps are uvicorn's (stop
    accepting, ask every connection to close, wait for the connections and tasks, then the
    app's lifespan shutdown)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self.should_exit = True
        self._stopping.set()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):  # the Date header, once a second
            counter = (counter + 1) % 864000
            with suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self._stopping.wait()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        state = self.server_state
        while (state.connections or state.tasks) and not self.force_exit:  # noqa: ASYNC110 (uvicorn has no event for these)
            await asyncio.sleep(0.005)
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()


@asynccontextmanager
async def serve(app: ASGIApp) -> AsyncIterator[str]:
    """Run `app` with uvicorn on a free 127.0.0.1 port in this event loop; yield its base URL."""
    # The served keep-alive timeout (75 s), not uvicorn's 5 s: at 5 s a test's httpx client
    # (which keeps idle connections 5 s too) sent its next request as the server closed the
    # connection, "Server disconnected without sending a response", after a wait of 5 s.
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        lifespan="on",
        log_level="warning",
        ws="none",
        timeout_keep_alive=Settings.model_fields["keepalive_timeout"].default,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(20):
        while not server.started:
            if task.done():
                task.result()  # startup failed: raise its error
                raise RuntimeError("uvicorn stopped during startup")
            await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        async with asyncio.timeout(30):
            await task


@dataclass
class Keys:
    """Signing keys for the asymmetric issuer, and their public PEM files."""

    rsa: rsa.RSAPrivateKey
    ec: ec.EllipticCurvePrivateKey
    ed: ed25519.Ed25519PrivateKey
    files: list[Path] = field(default_factory=list)

    @staticmethod
    def public_pem(key: Any) -> bytes:
        pem: bytes = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return pem


def host_toml(
    name: str, host: LocalHost | RelayedHost, port: int | None = None, **limits: Any
) -> str:
    lines = [
        f"[hosts.{name}]",
        f'hostname = "{host.address}"',
        f"port = {port or host.port}",
        f'username = "{host.username}"',
        f'client_keys = ["{host.client_key}"]',
        f'known_hosts = "{host.known_hosts}"',
        f"[hosts.{name}.limits]",
    ]
    lines += [f"{k} = {v}" for k, v in limits.items()]
    return "\n".join(lines) + "\n"


def config_toml(host: LocalHost, secret_file: Path, keys: Keys, extra: str = "") -> str:
    """The test configuration: host `local` (the tuned sshd), `tiny` (same sshd, one channel and
    one waiter: saturates at once), `down` (a closed port), `secret` (in nobody's policy), two
    issuers, templates, and policy rules per test subject."""
    pems = ", ".join(f'"{p}"' for p in keys.files)
    return (
        f"""
[api]
# The tests read /metrics without a token, and check what a host shows to whom.
metrics_require_admin = false
wait_default = 10
wait_max = 30
queue_timeout = 10
default_timeout = 60
max_body_bytes = 65536
max_stdin_bytes = 1024

[[issuers]]
issuer = "{LOCAL_ISS}"
audience = "{AUDIENCE}"
algorithms = ["HS256"]
secret_file = "{secret_file}"
scopes = ["jobs:read", "jobs:write", "files:read", "files:write", "admin"]
leeway = 5

[[issuers]]
issuer = "{KEYS_ISS}"
audience = "{AUDIENCE}"
# Asymmetric only: an issuer mixing HS with RS/ES/EdDSA is refused at load (one key family).
algorithms = ["RS256", "ES256", "EdDSA"]
public_keys = [{pems}]
leeway = 5

"""
        + host_toml("local", host, max_connections=2, max_sessions=8)
        + host_toml("tiny", host, max_connections=1, max_sessions=1, max_waiters=1)
        + host_toml("down", host, port=free_port(), breaker_threshold=1, connect_timeout=2.0)
        + host_toml("secret", host)
        + """
[templates.greet]
description = "printf a typed greeting"
argv = ["printf", "<%s|%s>", "{count}", "{word}"]
[templates.greet.params.count]
type = "int"
min = 1
max = 10
[templates.greet.params.word]
type = "str"
pattern = "[^/]*"

[templates.grep_null]
argv = ["grep", "-c", "--", "{pattern}", "/dev/null"]
[templates.grep_null.params.pattern]
type = "str"

[[policy]]
subject = "anyhost"
issuer = "*"
hosts = ["*"]
shell_hosts = ["*"]
file_roots = { "*" = ["~"] }
# Tests add templates-only rules on the same account: this suite's writers mean it.
allow_writes_on_templates_account = true

[[policy]]
subject = "noshell"
issuer = "*"
hosts = ["local"]

[[policy]]
subject = "slow"
issuer = "*"
hosts = ["local"]
# Batch scripts are shell: the batch output-read test submits one as `slow`.
shell_hosts = ["local"]
rate = 0.2
burst = 2

[[policy]]
subject = "solo"
issuer = "*"
hosts = ["local"]
shell_hosts = ["local"]
max_concurrent = 1

[[policy]]
subject = "*"
issuer = "*"
hosts = ["local", "tiny", "down"]
shell_hosts = ["local", "tiny"]
file_roots = { "*" = ["~"] }
# Tests add templates-only rules on the same account: this suite's writers mean it.
allow_writes_on_templates_account = true
max_timeout = 60
max_output = 65536
rate = 1000
burst = 1000
max_concurrent = 50
"""
        + extra
    )


# Host `local` as a batch host: fast scheduler polls, so tests see Slurm's states within a second.
SCHEDULER = """
[hosts.local.scheduler]
poll_interval = 0.3
max_poll_interval = 2.0
settle = 1.0
"""
# Batch jobs count against max_concurrent until final: the hundred-jobs test's subject may
# have them all active at once.
BULK = """[[policy]]
issuer = "*"
subject = "bulk"
hosts = ["local"]
shell_hosts = ["local"]
rate = 1000
burst = 1000
max_concurrent = 128

"""


def write_batch_config(path: Path, host: LocalHost, secret_file: Path, keys: Keys) -> Path:
    """The test configuration with `host` (a Slurm login host) as `local`, a batch host, and
    subject `bulk` allowed 128 active jobs."""
    text = config_toml(host, secret_file, keys, SCHEDULER)
    catch_all = '[[policy]]\nsubject = "*"'
    assert catch_all in text
    path.write_text(text.replace(catch_all, BULK + catch_all))
    return path


@dataclass
class Api:
    """A running API and what a test needs to talk to it."""

    url: str
    client: httpx.AsyncClient
    secret: str
    config: Config
    settings: Settings
    keys: Keys

    def token(
        self,
        sub: str | None = "alice",
        scope: str = "jobs:read jobs:write",
        *,
        iss: str | None = LOCAL_ISS,
        key: Any = None,
        alg: str = "HS256",
        headers: dict[str, Any] | None = None,
        **claims: Any,
    ) -> str:
        now = int(time.time())
        payload: dict[str, Any] = {
            "iss": iss,
            "aud": AUDIENCE,
            "sub": sub,
            "scope": scope,
            "iat": now,
            "exp": now + 300,
        }
        payload.update(claims)
        payload = {k: v for k, v in payload.items() if v is not None}
        return jwt.encode(payload, key or self.secret, algorithm=alg, headers=headers)

    def auth(self, sub: str = "alice", scope: str = "jobs:read jobs:write") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(sub, scope)}"}

    async def submit(
        self,
        body: dict[str, Any],
        *,
        sub: str = "alice",
        wait: float | None = None,
        key: str | None = None,
        scope: str = "jobs:read jobs:write",
    ) -> httpx.Response:
        headers = self.auth(sub, scope)
        if wait is not None:
            headers["Prefer"] = f"wait={wait:g}"
        if key is not None:
            headers["Idempotency-Key"] = key
        return await self.client.post(f"{self.url}/v1/jobs", json=body, headers=headers)

    async def job(
        self, job_id: str, sub: str = "alice", scope: str = "jobs:read jobs:write"
    ) -> Any:
        r = await self.client.get(f"{self.url}/v1/jobs/{job_id}", headers=self.auth(sub, scope))
        assert r.status_code == 200, r.text
        return r.json()

    async def wait_state(
        self,
        job_id: str,
        states: tuple[str, ...],
        sub: str = "alice",
        timeout: float = 20,
        scope: str = "jobs:read jobs:write",
    ) -> Any:
        """Poll the job until its state is one of `states`; return it (as `scope` sees it)."""
        async with asyncio.timeout(timeout):
            while (job := await self.job(job_id, sub, scope))["state"] not in states:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        return job

    async def until_final(
        self,
        job_id: str,
        sub: str = "alice",
        timeout: float = 20,
        scope: str = "jobs:read jobs:write",
    ) -> Any:
        """Poll the job until it leaves queued/running."""
        final = ("succeeded", "failed", "timed_out", "cancelled", "lost", "error")
        return await self.wait_state(job_id, final, sub, timeout, scope)


@asynccontextmanager
async def pg_schema() -> AsyncIterator[str]:
    """A fresh PostgreSQL schema for one test, dropped after it (parallel runs never collide)."""
    name = f"sshapi_test_{uuid.uuid4().hex[:12]}"
    dsn = PG_URL.replace("postgresql+asyncpg://", "postgresql://")
    try:
        yield name
    finally:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        finally:
            await conn.close()


@asynccontextmanager
async def running_api(settings: Settings, keys: Keys, secret: str) -> AsyncIterator[Api]:
    assert settings.config is not None
    config = load_config(settings.config)
    app = create_app(settings)
    async with serve(app) as url, httpx.AsyncClient(timeout=30, verify=tls_context()) as client:
        yield Api(url, client, secret, config, settings, keys)


def make_settings(tmp_path: Path, config_file: Path, db: str, schema: str | None) -> Settings:
    return Settings(
        data_dir=tmp_path / "data",
        config=config_file,
        database_url=PG_URL if db == "postgresql" else None,
        database_schema=schema,
        replica="test-replica",
        shutdown_grace=0.5,
    )


@asynccontextmanager
async def replicas(
    tmp_path: Path, config_file: Path, keys: Keys, secret: str, redis_url: str | None = None
) -> AsyncIterator[tuple[Api, Api]]:
    """Replicas `a` and `b` of `config_file` on one fresh PostgreSQL schema (and on Redis at
    `redis_url`, when given)."""
    async with pg_schema() as schema, AsyncExitStack() as stack:
        apis = []
        for name in ("a", "b"):
            base = make_settings(tmp_path / name, config_file, "postgresql", schema)
            settings = base.model_copy(update={"replica": name, "redis_url": redis_url})
            apis.append(await stack.enter_async_context(running_api(settings, keys, secret)))
        yield apis[0], apis[1]


@contextmanager
def server_process(
    settings: Settings, *, extra_env: dict[str, str] | None = None, wrapper: tuple[str, ...] = ()
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`sshapi serve` as its own process (to be SIGKILLed by a test), configured by `settings`
    through SSHAPI_* variables (plus `extra_env`), started through `wrapper` (e.g. `prlimit ...`);
    yields it and its base URL once /readyz answers 200. Killed on exit if still running."""
    port = free_port()
    env = {
        **os.environ,
        "SSHAPI_DATA_DIR": str(settings.data_dir),
        "SSHAPI_PORT": str(port),
        "SSHAPI_REPLICA": settings.replica,
        "SSHAPI_DATABASE_URL": settings.resolved_database_url,
        "SSHAPI_LOG_LEVEL": "warning",
        **(extra_env or {}),
    }
    if settings.config is not None:
        env["SSHAPI_CONFIG"] = str(settings.config)
    if settings.database_schema:
        env["SSHAPI_DATABASE_SCHEMA"] = settings.database_schema
    env["SSHAPI_WORKERS"] = str(settings.workers)
    proc = subprocess.Popen([*wrapper, SSHAPI, "serve"], env=env, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Parse a text/event-stream body into {"id", "event", "data"} dicts."""
    event: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if not line:
            if "data" in event:
                yield event
            event = {}
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(": ")
            event[name] = json.loads(value) if name == "data" else value
