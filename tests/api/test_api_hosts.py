"""/v1/hosts: each host shows its own pools and health, selected by Target, never by address."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from api_helpers import Api, Keys, config_toml, host_toml, make_settings, running_api
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from sshpool.devhost import LocalHost


def with_setting(name: str, host: LocalHost, setting: str, **limits: Any) -> str:
    """host_toml with one more `key = value` line in the host's table (before its limits)."""
    return host_toml(name, host, **limits).replace(
        f"[hosts.{name}.limits]", f"{setting}\n[hosts.{name}.limits]"
    )


@pytest.fixture
async def api(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    """The test configuration plus, on the same sshd (so the same user@host:port as `local`):
    `viaparamiko` (backend set) and `twin` (a key the host does not accept, breaker threshold 1)."""
    stranger = tmp_path / "stranger_key"
    stranger.write_bytes(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    stranger.chmod(0o600)
    twin = host_toml("twin", tuned_host, breaker_threshold=1).replace(
        f'client_keys = ["{tuned_host.client_key}"]', f'client_keys = ["{stranger}"]'
    )
    extra = with_setting("viaparamiko", tuned_host, 'backend = "paramiko"') + twin
    path = tmp_path / "hosts.toml"
    path.write_text(config_toml(tuned_host, secret_file, keys, extra))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as running:
        yield running


async def host(api: Api, name: str) -> Any:
    r = await api.client.get(f"{api.url}/v1/hosts/{name}", headers=api.auth("ops", "admin"))
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_host_with_its_own_backend_reads_its_own_pool(api: Api) -> None:
    """`backend = "paramiko"` makes the target's text `user@host:port (paramiko)`: the host
    still finds its pool (an address suffix match read it as `unknown`)."""
    r = await api.submit({"host": "viaparamiko", "argv": ["true"]}, sub="anyhost")
    assert r.status_code == 201, r.text
    info = await host(api, "viaparamiko")
    assert info["health"] == "ok"
    assert [p["backend"] for p in info["pool"]] == ["paramiko"]
    # `local`, on the same address, has run nothing: none of that pool is its.
    assert (await host(api, "local"))["pool"] == []


async def test_hosts_sharing_an_address_each_see_only_their_own_health(api: Api) -> None:
    """`local` and `twin` are the same user@host:port; twin's key is refused. Each host shows
    its own pool: local `ok` without twin's failures, twin `down` with them."""
    assert (await api.submit({"host": "local", "argv": ["true"]}, sub="anyhost")).status_code == 201
    r = await api.submit({"host": "twin", "argv": ["true"]}, sub="anyhost")
    assert r.status_code == 502, r.text
    local, twin = await host(api, "local"), await host(api, "twin")
    assert local["health"] == "ok"
    assert len(local["pool"]) == 1
    assert local["pool"][0]["breaker"] != "open"
    assert local["pool"][0]["counters"].get("connects_failed", 0) == 0
    assert twin["health"] == "down"
    assert len(twin["pool"]) == 1
    assert twin["pool"][0]["counters"]["connects_failed"] >= 1
    assert twin["pool"][0]["connections"] == 0


@pytest.fixture
async def modes_api(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    """The test configuration (host `local` in the default mode, "auto") plus, on the same
    sshd: `nopython` ("auto", its interpreter missing) and `channels` (exec_mode "channel")."""
    extra = with_setting(
        "nopython", tuned_host, 'agent_python = "/nonexistent/python3"'
    ) + with_setting("channels", tuned_host, 'exec_mode = "channel"')
    path = tmp_path / "modes.toml"
    path.write_text(config_toml(tuned_host, secret_file, keys, extra))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as running:
        yield running


async def test_hosts_show_the_mode_their_connections_are_in(modes_api: Api) -> None:
    """Jobs succeed on all three hosts; /v1/hosts shows each host's configured mode and its
    live connections by the mode they are in: `local` through an executor (the rig's python3
    answers), `nopython` and `channels` as channels. A non-admin sees their own account's
    counts, and no host details."""
    api = modes_api
    for name in ("local", "nopython", "channels"):
        r = await api.submit({"host": name, "argv": ["echo", name]}, sub="anyhost")
        assert r.status_code == 201, r.text
        assert r.json()["stdout"] == f"{name}\n"
    expected = {
        "local": ("auto", {"agent": 1, "channel": 0}),
        "nopython": ("auto", {"agent": 0, "channel": 1}),
        "channels": ("channel", {"agent": 0, "channel": 1}),
    }
    for name, (mode, counts) in expected.items():
        info = await host(api, name)
        assert (info["exec_mode"], info["connections_by_mode"]) == (mode, counts), info
    assert "/nonexistent/python3" in (await host(api, "nopython"))["pool"][0]["agent_error"]
    r = await api.client.get(f"{api.url}/v1/hosts/local", headers=api.auth("anyhost"))
    assert r.status_code == 200, r.text
    mine = r.json()
    assert mine["connections_by_mode"] == {"agent": 1, "channel": 0}
    assert mine["hostname"] is None and "target" not in mine["pool"][0]
