"""Faults injected into real processes behind the API: the sshd process serving a running
command killed, the host key replaced, the API SIGKILLed under load and restarted, the job store
unreachable. Figures are printed as `FIGURE name: value` (see RELIABILITY.md)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from api_helpers import (
    PG_URL,
    Api,
    Keys,
    OwnHostApi,
    eventually,
    make_settings,
    pg_schema,
    running_api,
    server_process,
)
from faults import Proxy, figure

from api.config import load_config
from sshpool.devhost import LocalHost


def kill_sshd_sessions(host: LocalHost) -> None:
    """SIGKILL every live `sshd: ...` process under the host's sshd. A child that has just
    exited (another connection's, a probe's) is a zombie until sshd reaps it, or already gone:
    none of ours, skipped (under load a test met one: psutil.ZombieProcess)."""
    assert host.pid is not None
    killed = 0
    for proc in psutil.Process(host.pid).children(recursive=True):
        with contextlib.suppress(psutil.ZombieProcess, psutil.NoSuchProcess):
            if proc.cmdline()[:1] and proc.cmdline()[0].startswith("sshd:"):
                proc.send_signal(signal.SIGKILL)
                killed += 1
    assert killed, "no sshd session process to kill"


async def test_killed_sshd_session_makes_the_job_lost_and_names_the_orphan(
    api_with_own_host: OwnHostApi,
) -> None:
    """SIGKILL of the sshd process serving a running command: the job ends `lost` with no exit
    status (never `succeeded`), its error names the remote process group, and the orphaned
    command is found running in that group. Channel mode: with an executor (the default mode
    on this host) the executor's channel closing kills the group instead, tested next."""
    word = f"orphan-{uuid.uuid4().hex[:8]}"
    async with api_with_own_host("fragile", exec_mode="channel") as (api, fragile):
        r = await api.submit(
            {"host": "fragile", "command": f"sleep 300 # {word}"}, sub="anyhost", wait=0
        )
        job_id = r.json()["id"]
        await api.wait_state(job_id, ("running",), sub="anyhost")
        # Each connection is served by `sshd: user [priv]` and its child `sshd: user@notty`,
        # both holding the socket; the command's shell is a child of the latter.
        kill_sshd_sessions(fragile)
        job = await api.until_final(job_id, sub="anyhost")
    orphans = fragile.processes(word)
    try:
        assert job["state"] == "lost"
        assert job["exit_status"] is None
        pgid = int(job["error"].rsplit("process group ", 1)[1].split()[0])
        assert orphans and all(psutil.Process(pid).as_dict(["pid"]) for pid in orphans)
        assert {fragile.run_local(["ps", "-o", "pgid=", "-p", str(p)]).stdout.strip()
                for p in orphans} == {str(pgid)}  # fmt: skip
    finally:
        fragile.run_local(["pkill", "-f", word])
    figure("sshd session killed: job state, orphans found in the named group",
           (job["state"], len(orphans)))  # fmt: skip


async def test_killed_sshd_session_in_the_default_mode_leaves_no_orphan(
    api_with_own_host: OwnHostApi,
) -> None:
    """The same kill with the host in the default mode ("auto": its connection runs an
    executor): the job ends `lost` with no exit status, and nothing of it runs on (the
    executor, its channel closed, killed the command's group)."""
    word = f"orphan-{uuid.uuid4().hex[:8]}"
    async with api_with_own_host("fragile") as (api, fragile):
        r = await api.submit(
            {"host": "fragile", "command": f"sleep 300 # {word}"}, sub="anyhost", wait=0
        )
        job_id = r.json()["id"]
        await api.wait_state(job_id, ("running",), sub="anyhost")
        hosts = await api.client.get(
            f"{api.url}/v1/hosts/fragile", headers=api.auth("ops", "admin")
        )
        assert hosts.json()["connections_by_mode"] == {"agent": 1, "channel": 0}, hosts.text
        kill_sshd_sessions(fragile)
        job = await api.until_final(job_id, sub="anyhost")
    try:
        assert (job["state"], job["exit_status"]) == ("lost", None), job
        await eventually(lambda: not fragile.processes(word))
    finally:
        fragile.run_local(["pkill", "-f", word])


async def test_replaced_host_key_runs_nothing_and_is_502(api_with_own_host: OwnHostApi) -> None:
    """The host comes back with another host key: the next job is 502 host-key-mismatch with a
    detail that says so, the job is `error`, and the command never ran."""
    flag = f"ran-{uuid.uuid4().hex[:8]}"
    async with api_with_own_host("rekeyed") as (api, rekeyed):
        ok = await api.submit({"host": "rekeyed", "argv": ["true"]}, sub="anyhost")
        assert ok.status_code == 201
        rekeyed.stop(kill_sessions=True)
        rekeyed.replace_host_key()
        rekeyed.start()
        r = await api.submit({"host": "rekeyed", "argv": ["touch", flag]}, sub="anyhost")
        assert r.status_code == 502, r.text
        problem = r.json()
        assert problem["type"].endswith("host-key-mismatch")
        assert "host key" in problem["detail"].lower()
        assert (await api.job(problem["job_id"], sub="anyhost"))["state"] == "error"
    assert rekeyed.run_local(["test", "-e", flag]).returncode != 0
    figure("host key replaced: status, type", (r.status_code, problem["type"]))


@pytest.mark.slow
async def test_api_sigkilled_under_load_keeps_every_acknowledged_job(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path, tuned_host: LocalHost
) -> None:
    """`sshapi serve` is SIGKILLed while 60 keyed requests stream in. After a restart every job
    answered 201/202 is in the store, and retrying all 60 with the same Idempotency-Keys runs
    no command twice (each command appends its key to a file on the host)."""
    settings = make_settings(tmp_path, config_file, "sqlite", None)
    config = load_config(config_file)
    log = f"sshapi-kill-{uuid.uuid4().hex[:8]}.log"
    keys_sent = [f"k{n:02d}-{uuid.uuid4().hex[:6]}" for n in range(60)]

    def body(key: str) -> dict[str, Any]:
        return {"host": "local", "command": f"sleep 0.2; echo {key} >> {log}"}

    acked: dict[str, str] = {}  # key -> job id
    async with httpx.AsyncClient(timeout=10) as client:
        with server_process(settings) as (_, url):
            api = Api(url, client, secret, config, settings, keys)

            async def send(n: int, key: str) -> None:
                await asyncio.sleep(n * 0.03)
                with contextlib.suppress(httpx.TransportError):
                    r = await api.submit(body(key), key=key, wait=0 if n % 2 else 5)
                    if r.status_code in (201, 202):
                        acked[key] = r.json()["id"]

            sending = [asyncio.create_task(send(n, k)) for n, k in enumerate(keys_sent)]
            await asyncio.sleep(0.9)  # about half sent; leaving the block SIGKILLs the server
        await asyncio.gather(*sending)
    with server_process(settings) as (_, url):
        async with httpx.AsyncClient(timeout=30) as client:
            api = Api(url, client, secret, config, settings, keys)
            stored = {k: (await client.get(f"{url}/v1/jobs/{j}", headers=api.auth())).status_code
                      for k, j in acked.items()}  # fmt: skip
            # wait=0: the retries answer at once and their jobs run side by side (each waited
            # for below), not one after the other behind the default wait.
            retries = [await api.submit(body(k), key=k, wait=0) for k in keys_sent]
            replayed = [k for k, r in zip(keys_sent, retries, strict=True)
                        if r.headers.get("Idempotent-Replayed") == "true"]  # fmt: skip
            for key, r in zip(keys_sent, retries, strict=True):
                assert r.status_code in (201, 202), r.text
                if key in acked:
                    assert r.json()["id"] == acked[key]
                await api.until_final(r.json()["id"])
            states = Counter([(await api.job(r.json()["id"]))["state"] for r in retries])
    ran = Counter(tuned_host.run_local(["cat", log]).stdout.split())
    tuned_host.run_local(["rm", "-f", log])
    figure("API SIGKILL: acknowledged before the kill, found in the store after",
           (len(acked), sum(code == 200 for code in stored.values())))  # fmt: skip
    figure("API SIGKILL: retries replayed, final states", (len(replayed), dict(states)))
    figure("API SIGKILL: commands run twice", sum(c > 1 for c in ran.values()))
    assert 0 < len(acked) < len(keys_sent)
    assert set(stored.values()) == {200}
    assert set(acked) <= set(replayed)
    assert max(ran.values()) == 1
    assert set(ran) <= set(keys_sent)


async def test_unreachable_store_is_503_and_runs_nothing(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path, tuned_host: LocalHost
) -> None:
    """PostgreSQL goes away (its connections reset, new ones refused): a job request is 503
    + Retry-After before anything is launched (a job handle's request too), /readyz says not
    ready, and nothing ran; once
    the store is back, jobs run again."""
    flag = f"unrecorded-{uuid.uuid4().hex[:8]}"
    async with Proxy("127.0.0.1", 5432) as proxy, pg_schema() as schema:
        settings = make_settings(tmp_path, config_file, "postgresql", schema)
        settings.database_url = PG_URL.replace(":5432/", f":{proxy.port}/")
        async with running_api(settings, keys, secret) as api:
            first = await api.submit({"host": "local", "argv": ["true"]})
            assert first.status_code == 201
            job_url = f"{api.url}/v1/jobs/{first.json()['id']}"
            made = await api.client.post(f"{job_url}/handles", json={"ttl": 60}, headers=api.auth())
            handle = {"Authorization": f"Bearer {made.json()['handle']}"}
            await proxy.cut()
            r = await api.submit({"host": "local", "argv": ["touch", flag]})
            # A job handle is checked against the store ahead of the app: the same 503.
            by_handle = await api.client.get(job_url, headers=handle)
            ready = await api.client.get(f"{api.url}/readyz")
            await proxy.restore()
            assert by_handle.status_code == 503, by_handle.text
            assert by_handle.json()["type"].endswith("store-unavailable")
            assert tuned_host.run_local(["test", "-e", flag]).returncode != 0
            assert r.status_code == 503, r.text
            assert r.headers["Content-Type"] == "application/problem+json"
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["type"].endswith("store-unavailable")
            assert ready.status_code == 503
            back = await api.submit({"host": "local", "argv": ["echo", "back"]})
            assert back.status_code == 201, back.text
    figure("store unreachable: status, type", (r.status_code, r.json()["type"]))
