"""A host with several login nodes through the API (three real sshd, 127.0.0.2-4): a job says
its node; a node killed under a running job ends it `lost` with `node-failed`, and the same
Idempotency-Key runs it again on a node that is up; drain and undrain (admin only, 404s, the
state in /v1/hosts) hold across a restart."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from api.config import HostConfig
from sshpool.devhost import LocalCluster, LocalHost, LocalSlurm, Rig, RigSpec
from sshpool.devhost.accounts import Account
from tests.api.api_helpers import (
    LOCAL_ISS,
    Api,
    Keys,
    config_toml,
    eventually,
    make_settings,
    replicas,
    running_api,
)
from tests.sshpool.test_cluster_health import ATTACKS, OTHER_JOBS, TRIGGER, hostile_accounts

NAME = "hpc"


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[LocalCluster]:
    with Rig(RigSpec("api", "stock", nodes=3), data_dir=tmp_path / "rig") as rig:
        assert rig.cluster is not None
        yield rig.cluster


@pytest.fixture
def cluster_config(
    nodes: LocalCluster, tuned_host: LocalHost, secret_file: Path, keys: Keys, tmp_path: Path
) -> Path:
    path = tmp_path / "sshapi.toml"
    path.write_text(config_toml(tuned_host, secret_file, keys, cluster_toml(nodes)))
    return path


def cluster_toml(nodes: LocalCluster) -> str:
    return f"""
[hosts.{NAME}]
nodes = {list(nodes.addresses)!r}
port = {nodes.port}
username = "{nodes.username}"
client_keys = ["{nodes.client_key}"]
known_hosts = "{nodes.known_hosts}"
[hosts.{NAME}.limits]
breaker_backoff = 0.5
""".replace("'", '"')


@pytest.fixture
async def api(cluster_config: Path, secret: str, keys: Keys, tmp_path: Path) -> AsyncIterator[Api]:
    settings = make_settings(tmp_path, cluster_config, "sqlite", None)
    async with running_api(settings, keys, secret) as running:
        yield running


ADMIN = "jobs:read jobs:write admin"
# The jobs here are anyhost's read with admin's eyes: a job's `node` is a host detail, shown to
# admins only by default (test_a_job_says_its_node_to_admins_only).
SEES = {"sub": "anyhost", "scope": ADMIN}


def admin(api: Api) -> dict[str, str]:
    return {"Authorization": f"Bearer {api.token('root', ADMIN)}"}


async def run(
    api: Api, argv: list[str], key: str | None = None, wait: float = 10
) -> dict[str, object]:
    """The job's answer, waited for up to `wait` seconds (0: at once, whatever its state)."""
    r = await api.submit({"host": NAME, "argv": argv}, wait=wait, key=key, **SEES)
    assert r.status_code in (200, 201, 202), r.text
    return r.json()  # type: ignore[no-any-return]


async def test_a_job_says_its_node_to_admins_only(api: Api) -> None:
    """Host details are admin-only by default (`api.host_details_require_admin`), the same
    rule everywhere: a job's `node` (answer, list, events) and a pool's `sshd` (the login
    host's address) as the host's nodes' names. Before: a researcher saw both."""
    job = await run(api, ["sh", "-c", "echo $SSH_CONNECTION"])
    assert job["state"] == "succeeded"
    assert str(job["stdout"]).split()[2] == job["node"]
    r = await api.submit({"host": NAME, "argv": ["true"]}, sub="anyhost", wait=10)
    assert r.json()["state"] == "succeeded" and r.json()["node"] is None, r.text
    assert (await api.job(str(job["id"]), "anyhost"))["node"] is None
    r = await api.client.get(f"{api.url}/v1/jobs?limit=5", headers=api.auth("anyhost"))
    assert [j["node"] for j in r.json()["items"]] == [None, None]
    r = await api.client.get(f"{api.url}/v1/jobs/{job['id']}/events", headers=api.auth("anyhost"))
    state = r.text.split("event: state\ndata: ", 1)[1].split("\n", 1)[0]
    assert json.loads(state)["node"] is None, state
    r = await api.client.get(f"{api.url}/v1/hosts/{NAME}", headers=api.auth("anyhost"))
    nodes, pools = r.json()["nodes"], r.json()["pool"]
    assert [n["state"] for n in nodes] == ["up"] * 3
    # A node's name is a host name, its figures the admin's; the pool's sshd its address.
    assert set(nodes[0]) == {"state"} and pools and all("sshd" not in p for p in pools), r.text
    r = await api.client.get(f"{api.url}/v1/hosts/{NAME}", headers=admin(api))
    assert all("sshd" in p for p in r.json()["pool"]), r.text


async def test_a_node_killed_under_a_job_ends_it_lost_and_the_key_runs_it_again(
    api: Api, nodes: LocalCluster
) -> None:
    # wait=0: a job that sleeps 30 s would hold the answer the whole wait (10 s) otherwise.
    first = await run(api, ["sleep", "30"], key="k1", wait=0)
    job = await api.wait_state(str(first["id"]), ("running",), **SEES)
    node = next(n for n in nodes.nodes if n.address == job["node"])
    node.stop(kill_sessions=True)
    lost = await api.until_final(str(first["id"]), **SEES)
    assert lost["state"] == "lost" and lost["error_kind"] == "node-failed"
    assert lost["node"] == job["node"] and job["node"] not in lost["error"]
    # /metrics names the node that is down, its breaker open once a probe failed to connect;
    # the host's is closed: it takes work through the others.
    node_open = f'sshpool_node_breaker_open{{host="{NAME}",node="{job["node"]}"}} 1.0'
    async with asyncio.timeout(5):
        while node_open not in (text := (await api.client.get(f"{api.url}/metrics")).text):  # noqa: ASYNC110 (a scrape)
            await asyncio.sleep(0.1)
    for n in nodes.addresses:
        state = "down" if n == job["node"] else "up"
        assert f'sshpool_node_state{{host="{NAME}",node="{n}",state="{state}"}} 1.0' in text
    assert f'sshpool_breaker_open{{host="{NAME}"}} 0.0' in text
    assert f'sshpool_node_routed_total{{host="{NAME}",node="{job["node"]}"}} 1.0' in text
    again = await run(api, ["sleep", "30"], key="k1", wait=0)
    assert again["id"] != first["id"]
    running = await api.wait_state(str(again["id"]), ("running",), **SEES)
    assert running["node"] != job["node"]
    await api.client.delete(f"{api.url}/v1/jobs/{again['id']}", headers=api.auth("anyhost"))


async def test_drain_is_admin_only_and_survives_a_restart(
    api: Api, cluster_config: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    job = await run(api, ["true"])
    home = str(job["node"])
    url = f"{api.url}/v1/admin/hosts/{NAME}/nodes/{home}/drain"
    assert (await api.client.post(url, headers=api.auth("anyhost"))).status_code == 403
    bad_host = f"{api.url}/v1/admin/hosts/nope/nodes/{home}/drain"
    bad_node = f"{api.url}/v1/admin/hosts/{NAME}/nodes/10.9.9.9/drain"
    long_node = f"{api.url}/v1/admin/hosts/{NAME}/nodes/{'x' * 300}/drain"
    for wrong, kind in ((bad_host, "host-not-found"), (bad_node, "node-not-found")):
        r = await api.client.post(wrong, headers=admin(api))
        assert r.status_code == 404 and r.json()["type"].endswith(kind)
    assert (await api.client.post(long_node, headers=admin(api))).status_code == 422
    r = await api.client.post(url, headers=admin(api))
    assert r.status_code == 200 and r.json()["state"] == "drained"
    assert (await run(api, ["true"]))["node"] != home
    # A new process on the same store: still drained before its first job.
    settings = make_settings(tmp_path, cluster_config, "sqlite", None)
    async with running_api(settings, keys, secret) as again:
        hosts = await again.client.get(f"{again.url}/v1/hosts/{NAME}", headers=admin(again))
        states = {n["name"]: n["state"] for n in hosts.json()["nodes"]}
        assert states[home] == "drained"
        assert (await run(again, ["true"]))["node"] != home
        undrain = url.replace(api.url, again.url).replace("/drain", "/undrain")
        r = await again.client.post(undrain, headers=admin(again))
        assert r.status_code == 200 and r.json()["state"] == "up"
        assert (await run(again, ["true"]))["node"] == home


async def test_a_drain_holds_on_every_replica(
    cluster_config: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """Drained on replica a (twice: a no-op), drained on b within its poll; undrained on b,
    back on a."""
    async with replicas(tmp_path, cluster_config, keys, secret) as (a, b):
        home = str((await run(a, ["true"]))["node"])
        path = f"/v1/admin/hosts/{NAME}/nodes/{home}"
        for _ in range(2):
            r = await a.client.post(f"{a.url}{path}/drain", headers=admin(a))
            assert r.status_code == 200, r.text

        async def state(api: Api) -> str:
            r = await api.client.get(f"{api.url}/v1/hosts/{NAME}", headers=admin(api))
            return str({n["name"]: n["state"] for n in r.json()["nodes"]}[home])

        async def until(api: Api, wanted: str) -> None:
            async with asyncio.timeout(5):
                while await state(api) != wanted:  # noqa: ASYNC110 (another replica's poll)
                    await asyncio.sleep(0.1)

        await until(b, "drained")
        assert (await run(b, ["true"]))["node"] != home
        assert (await b.client.post(f"{b.url}{path}/undrain", headers=admin(b))).status_code == 200

        await until(a, "up")


async def test_a_job_on_a_login_node_is_cancelled_through_another_replica(
    nodes: LocalCluster, cluster_config: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """A job running on one login node, started by replica a, is cancelled through replica b:
    b's kill reaches the node the job runs on (the job's group id means nothing on another), the
    remote process ends and the job is `cancelled` on both replicas."""
    word = f"node-cancel-{uuid.uuid4().hex[:10]}"
    async with replicas(tmp_path, cluster_config, keys, secret) as (a, b):
        body = {"host": NAME, "command": f"sleep 60 # {word}"}
        r = await a.submit(body, sub="anyhost", wait=0)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        running = await b.wait_state(job_id, ("running",), **SEES)
        assert running["node"] in nodes.addresses
        assert nodes.nodes[0].processes(word)
        r = await b.client.delete(f"{b.url}/v1/jobs/{job_id}", headers=b.auth("anyhost"))
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "cancelled"
        await eventually(lambda: not nodes.nodes[0].processes(word))
        assert (await a.job(job_id, sub="anyhost"))["state"] == "cancelled"


async def test_batch_jobs_are_cluster_wide(
    slurm: LocalSlurm,
    workdir: str,
    tuned_host: LocalHost,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """A batch job submitted through one node is tracked, and its output read, through another
    once the first is drained: one Slurm behind every node."""
    spec = RigSpec("slurm", "stock", nodes=3, overrides=slurm.sshd_overrides())
    with Rig(spec, data_dir=tmp_path / "rig") as rig:
        c = rig.cluster
        assert c is not None
        scheduler = f"[hosts.{NAME}.scheduler]\npoll_interval = 0.3\nsettle = 1.0\n"
        path = tmp_path / "sshapi.toml"
        path.write_text(config_toml(tuned_host, secret_file, keys, cluster_toml(c) + scheduler))
        settings = make_settings(tmp_path, path, "sqlite", None)
        async with running_api(settings, keys, secret) as api:
            home = str((await run(api, ["true"]))["node"])
            script = "#!/bin/sh\nsleep 2; echo from-slurm\n"
            body = {"host": NAME, "batch": {"script": script, "workdir": workdir}}
            r = await api.submit(body, sub="anyhost")
            assert r.status_code in (201, 202), r.text
            job_id = r.json()["id"]
            drain = f"{api.url}/v1/admin/hosts/{NAME}/nodes/{home}/drain"
            assert (await api.client.post(drain, headers=admin(api))).status_code == 200
            job = await api.until_final(job_id, sub="anyhost", timeout=60)
            assert job["state"] == "succeeded", job
            out = await api.client.get(
                f"{api.url}/v1/jobs/{job_id}/output", headers=api.auth("anyhost")
            )
            assert out.status_code == 200 and b"from-slurm" in out.content


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hostname": "a", "nodes": ["b", "c"]}, "either `hostname`"),
        ({}, "either `hostname`"),
        ({"nodes": ["b", "b"]}, "distinct"),
        ({"nodes": ["b:port"]}, "optionally :port"),
    ],
)
def test_a_host_has_a_hostname_or_well_formed_nodes(
    fields: dict[str, object], message: str
) -> None:
    base = {"username": "u", "client_keys": ["k"], "known_hosts": "kh"}
    with pytest.raises(ValidationError, match=message):
        HostConfig.model_validate(base | fields)


async def test_an_admin_re_probes_a_node_and_a_node_back_up_is_up_at_once(
    api: Api, nodes: LocalCluster
) -> None:
    """`POST .../probe`: admin only, 404s as the drain's; a node killed answers `false` and is
    down, started again it answers `true` and is up at once (the probe over the host's own
    account, whatever the breakers of the accounts that failed there)."""
    home = str((await run(api, ["true"]))["node"])
    url = f"{api.url}/v1/admin/hosts/{NAME}/nodes/{home}/probe"
    assert (await api.client.post(url, headers=api.auth("anyhost"))).status_code == 403
    for wrong, kind in (
        (url.replace(f"/hosts/{NAME}/", "/hosts/nope/"), "host-not-found"),
        (url.replace(f"/nodes/{home}/", "/nodes/10.9.9.9/"), "node-not-found"),
    ):
        r = await api.client.post(wrong, headers=admin(api))
        assert r.status_code == 404 and r.json()["type"].endswith(kind)
    r = await api.client.post(url, headers=admin(api))
    assert r.status_code == 200
    assert r.json() == {"host": NAME, "node": home, "answered": True, "state": "up"}
    victim = next(n for n in nodes.nodes if n.address == home)
    victim.stop(kill_sessions=True)
    # The next job finds the node dead and goes elsewhere; the node's probe says it is down.
    assert (await run(api, ["true"]))["node"] != home
    r = await api.client.post(url, headers=admin(api))
    assert r.json()["answered"] is False and r.json()["state"] == "down"
    victim.start()
    await asyncio.sleep(1.1)  # past the last probe's spacing: this one is fresh
    r = await api.client.post(url, headers=admin(api))
    assert r.json() == {"host": NAME, "node": home, "answered": True, "state": "up"}
    assert (await run(api, ["true"]))["node"] == home


@pytest.fixture
def accounts(tmp_path: Path) -> Iterator[list[Account]]:
    with hostile_accounts(tmp_path) as made:
        yield made


async def test_a_researchers_login_shell_takes_no_node_down_through_the_api(
    accounts: list[Account],
    tuned_host: LocalHost,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """Issue 38 N1 through the API: three login nodes, each researcher as their own account
    (certificates); the attacker's `~/.bashrc` kills its own session on a trigger word and
    stalls `true`. Its jobs fail, its own; the nodes are probed over the host's own account
    and stay up; the other researchers' jobs all succeed."""
    attacker, *others = (a.name for a in accounts)
    spec = RigSpec("cert", "stock", nodes=3, researchers=True)
    with Rig(spec, data_dir=tmp_path / "rig") as rig:
        c = rig.cluster
        assert c is not None
        host = f"""
[hosts.{NAME}]
nodes = {list(c.addresses)!r}
port = {c.port}
username = "{c.username}"
known_hosts = "{c.known_hosts}"
# Channels: the attacker's ~/.bashrc judges each command, which bash reads per session in
# channel mode only (an executor reads it once per connection).
exec_mode = "channel"
[hosts.{NAME}.credentials]
kind = "certificate"
ca_key = "{c.nodes[0].user_ca_key}"
""".replace("'", '"')
        text = config_toml(tuned_host, secret_file, keys, host)
        text = text.replace('hosts = ["local", "tiny", "down"]', f'hosts = ["local", "{NAME}"]')
        issuer = f'[[issuers]]\nissuer = "{LOCAL_ISS}"\n'
        text = text.replace(issuer, issuer + 'account_claim = "preferred_username"\n', 1)
        path = tmp_path / "sshapi.toml"
        path.write_text(text)
        settings = make_settings(tmp_path, path, "sqlite", None)
        async with running_api(settings, keys, secret) as api:

            async def job(sub: str, account: str, argv: list[str]) -> dict[str, Any]:
                token = api.token(sub, preferred_username=account)
                r = await api.client.post(
                    f"{api.url}/v1/jobs",
                    json={"host": NAME, "argv": argv},
                    headers={"Authorization": f"Bearer {token}", "Prefer": "wait=30"},
                )
                assert r.status_code in (200, 201), r.text
                return r.json()  # type: ignore[no-any-return]

            for _ in range(ATTACKS):
                hit = await job("mallory", attacker, ["echo", TRIGGER])
                assert hit["state"] in ("lost", "error"), hit
            done = await asyncio.gather(
                *(
                    job(f"sub-{account}", account, ["echo", "ok"])
                    for account in others
                    for _ in range(OTHER_JOBS // 2)
                )
            )
            assert [j["state"] for j in done] == ["succeeded"] * OTHER_JOBS
            r = await api.client.get(f"{api.url}/v1/hosts/{NAME}", headers=admin(api))
            assert [n["state"] for n in r.json()["nodes"]] == ["up"] * 3
