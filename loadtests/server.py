"""Start the API for a measurement: a configuration for one LocalHost with the pool settings of
the experiment, served by the API's own `create_app` in a child process.

    python -m loadtests.server spec.json    # what start_api runs

The per-request-connection mode is `[hosts.*.limits] reuse = false` with one session per
connection: the API's own configuration expresses it. The `agent` mode is the pooled limits with
`exec_mode = "agent"` (one executor per connection runs the commands: docs/pool.md), `auto` with
`exec_mode = "auto"` (the API's default: the executor where the host's python3 answers); the
other modes pin `exec_mode = "channel"`, so their figures stay channel mode's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api.config import Config
from api.local import LOCAL_AUDIENCE, LOCAL_ISSUER, LOCAL_LIMITS
from sshpool import Limits

if TYPE_CHECKING:
    from sshpool.devhost import LocalHost

POOL_MODES = ("pooled", "per-request", "agent", "auto", "channels", "per-account")
# How long a starting API may take before it counts as hung (an exit is seen at once). Not a
# speed claim: at load 10-20 on 2 cores `sshapi dev` (host keys, sshd, the app's imports) took
# 29 s to answer /readyz, so 30 s failed tests whose subject is not the start's speed.
READY_TIMEOUT = 120.0


@contextlib.contextmanager
def tuned_host(name: str) -> Iterator[tuple[LocalHost, Path]]:
    """A benchmark's own LocalHost (sshd_config.tuned) and a scratch directory, both gone on
    exit (the host's sessions killed)."""
    from sshpool.devhost import Rig, RigSpec

    with (
        tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp,
        Rig(RigSpec(name, "tuned"), data_dir=Path(tmp) / "hosts") as rig,
    ):
        yield rig.host, Path(tmp)


def limits(mode: str) -> Limits:
    """Pool limits per pool mode. `pooled` uses what the API uses with either sshd: the
    embedded host's limits, the pool's defaults with one connection kept open, as
    api/sshapi.example.toml deploys a host (without it, a burst on a fresh API waited 0.4-0.7 s
    for its first handshakes before any command ran: docs/benchmarks.md); so `stock` and `tuned`
    differ by sshd alone. `per-request` opens up to 64 connections at once, one command each, as
    the old design did (stock MaxStartups 10:30:100 starts refusing them at 10). `channels`
    keeps one connection and opens up to 16 channels on it: past stock MaxSessions 10, within
    sshd_config.tuned's 16. `per-account` is `pooled` as the pool was before its per-sshd
    budget: a gate of 4 and a connection count per account (`per_sshd=False`), for A/B
    comparisons."""
    if mode == "per-request":
        return Limits(max_connections=64, max_sessions=1, max_handshakes=64, reuse=False)
    if mode == "channels":
        return Limits(min_connections=1, max_connections=1, max_sessions=16)
    if mode == "per-account":
        return dataclasses.replace(LOCAL_LIMITS, max_handshakes=4, per_sshd=False)
    if mode not in ("pooled", "agent", "auto"):
        raise ValueError(f"pool mode {mode!r} is not one of {POOL_MODES}")
    return LOCAL_LIMITS


def config_data(host: dict[str, Any]) -> dict[str, Any]:
    """A configuration with one host `local` and a policy that does not throttle the load
    generator (per-identity rate and concurrency limits are a policy feature, not the path
    under test)."""
    return {
        "issuers": [
            {
                "issuer": LOCAL_ISSUER,
                "audience": LOCAL_AUDIENCE,
                "algorithms": ["HS256"],
                # The soak's watcher is admin; the files benchmark uploads and downloads.
                "scopes": ["jobs:read", "jobs:write", "files:read", "files:write", "admin"],
            }
        ],
        "hosts": {"local": host},
        "policy": [
            {
                "issuer": LOCAL_ISSUER,
                "hosts": ["*"],
                "file_roots": {"*": ["~"]},
                "rate": 1e6,
                "burst": 1_000_000,
                "max_concurrent": 1_000_000,
            }
        ],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_api(
    local_host: Any,
    *,
    backend: str,
    pool_mode: str,
    data_dir: Path,
    port: int | None = None,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    api: dict[str, Any] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the API on 127.0.0.1 against a started LocalHost; returns the process and its base
    URL once /readyz answers. `env` adds SSHAPI_* settings (a shared database, a replica name),
    `api` options of the configuration's `[api]` table (`transfer_lane`, ...).
    The caller stops the process."""
    lim = limits(pool_mode)
    host = {
        "hostname": local_host.address,
        "port": local_host.port,
        "username": local_host.username,
        "client_keys": [local_host.client_key],
        "known_hosts": local_host.known_hosts,
        "limits": dataclasses.asdict(lim),
        "exec_mode": pool_mode if pool_mode in ("agent", "auto") else "channel",
    }
    config = config_data(host)
    if api:
        config["api"] = api
    return serve_config(config, backend=backend, data_dir=data_dir, port=port, log=log, env=env)


def serve_config(
    config: dict[str, Any],
    *,
    backend: str,
    data_dir: Path,
    port: int | None = None,
    log: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """`start_api` with a configuration of the caller's (`config_data`'s shape, its own hosts
    and policy)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    spec = data_dir / "api-spec.json"
    spec.write_text(json.dumps({"config": config}))
    port = port or free_port()
    child = {
        **os.environ,
        "SSHAPI_BACKEND": backend,
        "SSHAPI_DATA_DIR": str(data_dir),
        "SSHAPI_HOST": "127.0.0.1",
        "SSHAPI_PORT": str(port),
        "SSHAPI_LOG_LEVEL": "warning",
        **(env or {}),
    }
    child.pop("SSHAPI_CONFIG", None)
    with log.open("ab") if log else open(os.devnull, "wb") as out:  # the child keeps its copy
        proc = subprocess.Popen(
            [sys.executable, "-m", "loadtests.server", str(spec)], env=child, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, log=log)
    return proc, url


def wait_ready(
    proc: subprocess.Popen[bytes], url: str, timeout: float = READY_TIMEOUT, log: Path | None = None
) -> None:
    """Return once the API process at `url` answers /readyz with 200; RuntimeError (the process
    killed) if it exits or is not ready within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API exited with {proc.returncode} (log: {log})")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the API did not get ready in {timeout:g} s (log: {log})")


def stop_api(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str]) -> None:
    # Imported here: the parent (start_api) needs neither FastAPI nor uvicorn.
    from api.settings import Settings
    from api.workers import serve

    spec = json.loads(Path(argv[0]).read_text())
    serve(Settings(), Config.model_validate(spec["config"]))


if __name__ == "__main__":
    main(sys.argv[1:])
