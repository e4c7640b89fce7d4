"""A real OpenID provider for the rig: panva's oidc-provider (npm, OpenID Certified) run by
node from ./oidc/ (server.mjs; its packages installed there with `npm ci` on first use). It
offers the device flow, refresh tokens, client credentials and JWT access tokens for the API
(`aud`, `scope`, `preferred_username`); any login and password pass its sign-in page.

Invariants: the provider listens on loopback only; `Provider.stop` ends the node process it
started and nothing else; `issuer_toml` is the `[[issuers]]` entry that makes the API trust it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent / "oidc"
AUDIENCE = "sshapi"
SCOPES = ["jobs:read", "jobs:write", "files:read", "files:write"]
CLI_CLIENT = "sshapi"  # the device-flow client `sshapi login` uses by default
CI_CLIENT = "ci"
# Written into node_modules when `npm ci` has finished there.
INSTALLED = ".sshapi-installed"


def install() -> None:
    """oidc-provider into ./oidc/node_modules, at the version package-lock.json pins: once,
    by whichever process asks first. The test workers of a fresh checkout ask at once, and a
    second `npm ci` deletes the tree the first is filling (or a provider starts from half of
    it), so the install holds a lock on ./oidc and ends by writing INSTALLED."""
    installed = HERE / "node_modules" / INSTALLED
    if installed.exists():
        return
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm not found: the rig's OpenID provider needs node and npm")
    fd = os.open(HERE, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not installed.exists():
            subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=HERE, check=True)
            installed.touch()
    finally:
        os.close(fd)  # and the lock with it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Provider:
    """One running provider; `ci_secret` is the client-credentials client's secret, whose
    tokens name `ci_account` as preferred_username."""

    issuer: str
    ci_secret: str
    ci_account: str
    process: subprocess.Popen[bytes] = field(repr=False)

    def issuer_toml(self, leeway: float = 30.0) -> str:
        return (
            f'[[issuers]]\nissuer = "{self.issuer}"\naudience = "{AUDIENCE}"\n'
            f'algorithms = ["RS256"]\njwks_url = "{self.issuer}/jwks"\n'
            f'account_claim = "preferred_username"\nleeway = {leeway}\n'
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start(
    run_dir: Path,
    resource: str,
    *,
    ci_secret: str,
    ci_account: str,
    access_ttl: int = 300,
    device_code_ttl: int = 600,
    port: int | None = None,
) -> Provider:
    """Start the provider (its settings and log in `run_dir`); returns once it answers."""
    install()
    port = port or free_port()
    issuer = f"http://127.0.0.1:{port}"
    conf = {
        "issuer": issuer,
        "host": "127.0.0.1",
        "port": port,
        "resource": resource,
        "audience": AUDIENCE,
        "scopes": SCOPES,
        "access_ttl": access_ttl,
        "device_code_ttl": device_code_ttl,
        "refresh_ttl": 14 * 86400,
        "clients": [
            {
                "client_id": CLI_CLIENT,
                "token_endpoint_auth_method": "none",
                "grant_types": ["urn:ietf:params:oauth:grant-type:device_code", "refresh_token"],
                "response_types": [],
                "redirect_uris": [],
            },
            {
                "client_id": CI_CLIENT,
                "client_secret": ci_secret,
                "grant_types": ["client_credentials"],
                "response_types": [],
                "redirect_uris": [],
                "scope": " ".join(SCOPES),
            },
        ],
        "client_accounts": {CI_CLIENT: ci_account},
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "oidc.json").write_text(json.dumps(conf))
    node = shutil.which("node") or "node"
    with (run_dir / "oidc.log").open("wb") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [node, str(HERE / "server.mjs"), str(run_dir / "oidc.json")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    provider = Provider(issuer, ci_secret, ci_account, process)
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"{issuer}/.well-known/openid-configuration", timeout=1):
                return provider
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                provider.stop()
                text = (run_dir / "oidc.log").read_text(errors="replace")
                raise RuntimeError(f"the OpenID provider did not start:\n{text}") from None
            time.sleep(0.1)
