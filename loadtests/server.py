"""Start the API for a measurement: a configuration for one LocalHost with the pool settings of
the experiment, served by the API's own `create_app` in a child process.

    python -m loadtests.server spec.json    # what start_api runs

The configuration is built here rather than in a TOML file because the per-request-connection
mode needs `Limits(reuse=False)`, which the API's `[hosts.*.limits]` table cannot express yet;
`PerRequestLimits` carries it through the API's own config classes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from api.config import LOCAL_AUDIENCE, LOCAL_ISSUER, Config, LimitsConfig

POOL_MODES = ("pooled", "per-request")
READY_TIMEOUT = 30.0


class PerRequestLimits(LimitsConfig):
    """The paper-era design: a new SSH connection per command, closed after it."""

    reuse: bool = False


def limits(mode: str, sshd_profile: str) -> LimitsConfig:
    """Pool limits per pool mode. `pooled` uses what the API uses for that sshd: the embedded
    host's limits for `tuned` (MaxSessions 16, MaxStartups 30:30:100), the pool's defaults for
    `stock`. `per-request` opens up to 64 connections at once, one command each, as the old
    design did (stock MaxStartups 10:30:100 starts refusing them at 10)."""
    if mode == "per-request":
        return PerRequestLimits(max_connections=64, max_sessions=1, max_handshakes=64)
    if mode != "pooled":
        raise ValueError(f"pool mode {mode!r} is not one of {POOL_MODES}")
    from api.app import LOCAL_LIMITS

    return LOCAL_LIMITS if sshd_profile == "tuned" else LimitsConfig()


def config_data(host: dict[str, Any]) -> dict[str, Any]:
    """A configuration with one host `local` and a policy that does not throttle the load
    generator (per-identity rate and concurrency limits are a policy feature, not the path
    under test)."""
    return {
        "issuers": [{"issuer": LOCAL_ISSUER, "audience": LOCAL_AUDIENCE, "algorithms": ["HS256"]}],
        "hosts": {"local": host},
        "policy": [{"hosts": ["*"], "rate": 1e6, "burst": 1_000_000, "max_concurrent": 1_000_000}],
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
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the API on 127.0.0.1 against a started LocalHost; returns the process and its base
    URL once /readyz answers. The caller stops the process."""
    lim = limits(pool_mode, local_host.profile)
    host = {
        "hostname": local_host.address,
        "port": local_host.port,
        "username": local_host.username,
        "client_keys": [local_host.client_key],
        "known_hosts": local_host.known_hosts,
        "limits": lim.model_dump(),
    }
    data_dir.mkdir(parents=True, exist_ok=True)
    spec = data_dir / "api-spec.json"
    spec.write_text(json.dumps({"config": config_data(host), "pool_mode": pool_mode}))
    port = port or free_port()
    env = {
        **os.environ,
        "SSHAPI_BACKEND": backend,
        "SSHAPI_DATA_DIR": str(data_dir),
        "SSHAPI_HOST": "127.0.0.1",
        "SSHAPI_PORT": str(port),
        "SSHAPI_LOG_LEVEL": "warning",
    }
    env.pop("SSHAPI_CONFIG", None)
    with log.open("ab") if log else open(os.devnull, "wb") as out:  # the child keeps its copy
        proc = subprocess.Popen(
            [sys.executable, "-m", "loadtests.server", str(spec)], env=env, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API exited with {proc.returncode} (log: {log})")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=1) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the API did not get ready in {READY_TIMEOUT:g} s (log: {log})")


def stop_api(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str]) -> None:
    from api.cli import _serve
    from api.settings import Settings

    spec = json.loads(Path(argv[0]).read_text())
    data = spec["config"]
    for host in data["hosts"].values():
        host["limits"].pop("reuse", None)  # not a key of the API's limits table
    config = Config.model_validate(data)
    if spec["pool_mode"] == "per-request":
        hosts = {
            name: h.model_copy(update={"limits": PerRequestLimits(**h.limits.model_dump())})
            for name, h in config.hosts.items()
        }
        config = config.model_copy(update={"hosts": hosts})
    _serve(Settings(), config)


if __name__ == "__main__":
    main(sys.argv[1:])
