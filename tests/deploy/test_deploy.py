"""deploy/: two replicas on PostgreSQL behind nginx (the shipped config) under Locust load with
one replica killed mid-run; the systemd units; the environment file."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from api.local import local_token, resolve_config
from api.settings import Settings
from loadtests.records import read_jsonl
from loadtests.replicas import PG_URL, cluster, finish, locust
from sshpool.devhost import LocalHost, tuned_settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


@pytest.fixture
def ran_file() -> Iterator[Path]:
    """A file every job appends one line to on the host: one line per execution."""
    path = Path(f"/tmp/sshapi-ran-{uuid.uuid4().hex}")
    yield path
    path.unlink(missing_ok=True)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


async def job_states(schema: str) -> dict[tuple[str, str], int]:
    conn = await asyncpg.connect(PG_URL.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        rows = await conn.fetch(
            f'SELECT replica, state, count(*) AS n FROM "{schema}".sshapi_jobs GROUP BY 1, 2'
        )
    finally:
        await conn.close()
    return {(r["replica"], r["state"]): r["n"] for r in rows}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_replicas_behind_nginx_lose_no_job_when_one_is_killed(
    tuned_host: LocalHost, tmp_path: Path, ran_file: Path
) -> None:
    """A burst and a sustained run through nginx; replica r1 is SIGKILLed mid-run. Only requests
    in flight on r1 fail; every answered job is in the store, succeeded; no command ran twice;
    r1's cut jobs turn `lost` when it restarts, none stays active."""
    # Half a second per job: at 10 req/s a few are always running on each replica.
    command = ("--remote-command", f"sh -c 'echo ran >> {ran_file}; sleep 0.5'")
    with cluster(tuned_host, tmp_path / "cluster", replicas=2) as c:
        env = {"SSHAPI_DATA_DIR": str(tmp_path / "cluster" / "r1"), **c.env}
        burst = finish(
            locust("burst.py", c.url, env, tmp_path / "burst", *command, "--burst-sizes", "40",
                   "--repeats", "1", "--cooldown", "0"),
            tmp_path / "burst", 90,
        )  # fmt: skip
        assert burst["exit_code"] == 0, burst["output"][-3000:]
        assert burst["ok"] == burst["requests"] == 40

        # smoke x0.6: a warm-up of 6 requests, then 60 at 10/s.
        run = locust("sustained.py", c.url, env, tmp_path / "sustained", *command,
                     "--duration-factor", "0.6")  # fmt: skip
        deadline = time.monotonic() + 60
        while lines(ran_file) < 40 + 6 + 25 and time.monotonic() < deadline:
            time.sleep(0.05)  # mid-run
        t_kill = time.time()
        c.kill("r1")
        sustained = finish(run, tmp_path / "sustained", 90)
        c.start_replica("r1")  # restarted under its name: marks what it left active `lost`
        states = asyncio.run(job_states(c.env["SSHAPI_DATABASE_SCHEMA"]))

    records = list(read_jsonl(Path(sustained["run_dir"]) / "records.jsonl"))
    failed = [r for r in records if not r.ok]
    for r in failed:  # each was on the wire when r1 died
        sent = r.t + r.lateness_ms / 1000
        assert sent <= t_kill + 0.2 and sent + r.service_ms / 1000 >= t_kill - 0.2, r
    assert len(failed) <= 15, sustained["errors"]  # 10/s x 0.5 s: a few in flight on r1
    assert sustained["requests"] == 60 and len(records) == 66

    sent = len(records) + burst["requests"]
    ok = len(records) - len(failed) + burst["ok"]
    total = sum(states.values())
    succeeded = sum(n for (_, state), n in states.items() if state == "succeeded")
    assert ok <= succeeded <= total <= sent  # every answered job kept; no POST made two jobs
    assert total - succeeded <= len(failed)
    assert {state for _, state in states} <= {"succeeded", "lost"}
    assert all(replica == "r1" for replica, state in states if state == "lost")
    assert succeeded <= lines(ran_file) <= total  # each job's command ran at most once


@pytest.mark.timeout(120)
def test_nginx_streams_large_uploads_and_still_caps_json_bodies(
    tuned_host: LocalHost, tmp_path: Path
) -> None:
    """Through the shipped nginx: an 8 MiB upload (past the 1 MiB JSON cap) is stored whole
    (201, same sha256) and downloads back identical, and so is one sent as a resumable upload
    in two 4 MiB chunks (round robin over the two replicas), while a 2 MiB JSON body to
    /v1/jobs is still refused by nginx (413)."""
    data = os.urandom(8 << 20)
    remote = f"{tuned_host.account.home}/nginx-upload-{uuid.uuid4().hex[:8]}.bin"
    with cluster(tuned_host, tmp_path / "cluster", replicas=2) as c:
        settings = Settings(
            data_dir=tmp_path / "cluster" / "r1", jwt_secret=c.env["SSHAPI_JWT_SECRET"]
        )
        token = local_token(settings, resolve_config(settings), "uploader",
                            ["files:read", "files:write", "jobs:write"])  # fmt: skip
        headers = {"Authorization": f"Bearer {token}"}
        content = f"{c.url}/v1/hosts/local/files/content"
        try:
            with httpx.Client(timeout=60) as client:
                up = client.put(content, params={"path": remote}, content=data, headers=headers)
                down = client.get(content, params={"path": remote}, headers=headers)
                made = client.post(
                    f"{c.url}/v1/hosts/local/files/uploads",
                    params={"path": remote + ".chunks"},
                    headers={**headers, "Upload-Length": str(len(data))},
                )
                assert made.status_code == 201, made.text
                chunks = [
                    client.patch(
                        f"{c.url}{made.headers['location']}",
                        content=data[n : n + (4 << 20)],
                        headers={
                            **headers,
                            "Upload-Offset": str(n),
                            "Upload-Complete": "?1" if n else "?0",
                        },
                    )
                    for n in (0, 4 << 20)
                ]
                big = client.post(
                    f"{c.url}/v1/jobs",
                    json={"host": "local", "command": "true", "pad": "x" * (2 << 20)},
                    headers=headers,
                )
        finally:
            tuned_host.run_local(["rm", "-f", remote, remote + ".chunks"])
    assert up.status_code == 201, up.text
    assert [r.status_code for r in chunks] == [204, 201], chunks[-1].text
    assert chunks[1].json()["sha256"] == hashlib.sha256(data).hexdigest()
    assert up.json()["sha256"] == hashlib.sha256(data).hexdigest()
    assert down.status_code == 200
    assert down.content == data
    assert big.status_code == 413
    assert "nginx" in big.text  # nginx's own page: the body never reached a replica


def test_systemd_units_verify() -> None:
    """systemd-analyze accepts both units (the API's ExecStart pointed at this checkout's)."""
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze missing: `make test` installs systemd"
    sshapi = Path(sys.executable).parent / "sshapi"
    for unit in ("sshapi@.service", "sshd-sshapi.service"):
        text = (DEPLOY / unit).read_text().replace("/opt/sshapi/.venv/bin/sshapi", str(sshapi))
        folder = Path(f"/tmp/sshapi-units-{uuid.uuid4().hex}")
        folder.mkdir()
        try:
            name = unit.replace("@.", "@8001.")
            (folder / name).write_text(text)
            done = subprocess.run(
                [analyze, "verify", "--man=no", str(folder / name)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
        finally:
            shutil.rmtree(folder)
        problems = [line for line in done.stderr.splitlines() if unit.split("@")[0] in line]
        assert done.returncode == 0 and not problems, done.stderr


def test_dedicated_sshd_config_binds_its_own_port_only(tmp_path: Path) -> None:
    """deploy/sshd_config.sshapi on a login host whose own sshd_config says `Port 22`: `sshd -T`
    of the dedicated file listens on 2222 alone (before: it included the main file, whose `Port
    22` added up, and the second sshd failed to bind 22 beside the first), includes nothing, and
    runs every setting of sshd_config.tuned with the tuned value."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "key")], check=True
    )
    site = tmp_path / "sshd_config"  # the site's own, which the dedicated sshd must not read
    site.write_text(f"Port 22\nHostKey {tmp_path / 'key'}\nMaxSessions 10\n")
    shipped = (DEPLOY / "sshd_config.sshapi").read_text()
    assert not re.search(r"^\s*Include", shipped, re.M | re.I)
    conf = tmp_path / "sshd_config.sshapi"
    conf.write_text(
        shipped.replace("/etc/ssh/ssh_host_ed25519_key", str(tmp_path / "key")).replace(
            "/run/sshd-sshapi.pid", str(tmp_path / "sshd.pid")
        )
    )
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # the unit's RuntimeDirectory=sshd
    done = subprocess.run(
        ["/usr/sbin/sshd", "-T", "-f", str(conf)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("port ")] == ["port 2222"]
    assert [line for line in lines if line.startswith("listenaddress ")] == [
        "listenaddress [::]:2222",
        "listenaddress 0.0.0.0:2222",
    ]
    for keyword, value in tuned_settings()[0]:  # what this sshd knows
        assert f"{keyword.lower()} {value.lower()}" in lines, keyword
    assert "subsystem sftp /usr/lib/openssh/sftp-server" in lines
    assert "passwordauthentication no" in lines and "permitrootlogin no" in lines


def env_file() -> dict[str, tuple[str, bool]]:
    """SSHAPI_* name -> (value, commented out) from deploy/sshapi.env."""
    found = {}
    for line in (DEPLOY / "sshapi.env").read_text().splitlines():
        m = re.fullmatch(r"(#?)(SSHAPI_[A-Z_]+)=(.*)", line)
        if m:
            found[m.group(2)] = (m.group(3), m.group(1) == "#")
    return found


def test_env_file_names_every_setting_with_its_default() -> None:
    """Every Settings field is in deploy/sshapi.env; a commented line shows the real default,
    and the uncommented values are valid settings."""
    entries = env_file()
    fields = {f"SSHAPI_{name.upper()}": info for name, info in Settings.model_fields.items()}
    assert set(entries) == set(fields)
    for name, (value, commented) in entries.items():
        default: Any = fields[name].default
        if commented and default is not None and fields[name].default_factory is None:
            assert value == str(default), name
    given = {k.removeprefix("SSHAPI_").lower(): v for k, (v, c) in entries.items() if not c}
    settings = Settings.model_validate(given)
    assert settings.replicas == 2 and settings.redis_url
