"""`sshapi dev`: the local host and the API in one command, and nothing left behind."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import IO

import httpx
import psutil
import pytest
from api_helpers import SSHAPI, free_port

from loadtests.server import wait_ready


def printed_token(stdout: IO[str]) -> str:
    """The token of the `export TOKEN=` line `sshapi dev` prints."""
    while not (line := stdout.readline()).startswith("export TOKEN="):
        assert line, "sshapi dev printed no token"
    return line.split("=", 1)[1].strip()


def test_dev_answers_and_a_sigterm_stops_the_local_host_too(tmp_path: Path) -> None:
    """The one token `sshapi dev` prints runs a job and uploads and lists a file. systemd,
    `timeout` and CI stop a process with SIGTERM: the local sshd it started must go with it
    (uvicorn re-raises the signal after its own shutdown)."""
    data = tmp_path / "data"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The port from SSHAPI_PORT (`SSHAPI_PORT=N make run`); --port is the docs tests'.
    env = {
        **os.environ,
        "SSHAPI_DATA_DIR": str(data),
        "SSHAPI_LOG_LEVEL": "warning",
        "SSHAPI_PORT": str(port),
    }
    proc = subprocess.Popen([SSHAPI, "dev"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        wait_ready(proc, url)
        assert proc.stdout is not None
        printed = ""
        while "curl" not in printed and (line := proc.stdout.readline()):
            printed += line
        # What the client commands and the docs' examples need, naming this port.
        assert f"export SSHAPI_URL=http://127.0.0.1:{port} " in printed
        token = next(
            line.removeprefix("export TOKEN=")
            for line in printed.splitlines()
            if line.startswith("export TOKEN=")
        )
        auth = {"Authorization": f"Bearer {token}"}
        files = f"{url}/v1/hosts/local/files"
        name = f"sshapi-dev-test-{port}.txt"
        r = httpx.put(f"{files}/content?path={name}", content=b"one token", headers=auth)
        assert r.status_code == 201, r.text
        r = httpx.post(f"{url}/v1/jobs", json={"host": "local", "argv": ["cat", name]},
                       headers={**auth, "Prefer": "wait=20"}, timeout=30)  # fmt: skip
        assert r.json()["stdout"] == "one token", r.text
        # The default mode, auto: the rig's python3 answers, so the job's parent is the
        # executor of its connection, not a shell of sshd.
        parent = {"host": "local", "argv": ["sh", "-c", "ps -o args= -p $PPID"]}
        r = httpx.post(f"{url}/v1/jobs", json=parent, headers={**auth, "Prefer": "wait=20"},
                       timeout=30)  # fmt: skip
        assert "sys.stdin.buffer.read" in r.json()["stdout"], r.text
        assert httpx.delete(f"{files}?path={name}", headers=auth).status_code == 204

        def sshd_of_data_dir() -> list[psutil.Process]:
            found = []
            for p in psutil.process_iter(["cmdline"]):
                line = " ".join(p.info["cmdline"] or [])
                if "sshd" in line and str(data) in line:
                    found.append(p)
            return found

        assert sshd_of_data_dir(), "the local host's sshd is not running"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert not sshd_of_data_dir()
        # What it leaves is a plain configuration file that `sshapi serve` reads later.
        assert (data / "local.toml").is_file()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("how", ["make run PORT=N", "SSHAPI_PORT=N make run"])
def test_a_taken_port_fails_first_naming_it(how: str, tmp_path: Path) -> None:
    """Before: the token and a curl for the taken port were printed, the local host started,
    then uvicorn died with `[Errno 98] address already in use` and no hint."""
    root = Path(__file__).resolve().parents[2]
    data = tmp_path / "data"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "SSHAPI_DATA_DIR": str(data)}
        argv = ["make", "run"]
        if how.startswith("make"):
            argv.append(f"PORT={port}")
        else:
            env["SSHAPI_PORT"] = str(port)
        done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"port {port} on 127.0.0.1 is in use" in done.stderr
    assert "make run PORT=N" in done.stderr
    assert "TOKEN" not in done.stdout and "Local HPC host" not in done.stdout
    assert not (tmp_path / "data-hosts").exists()  # no local host started


def test_dev_accounts_prints_a_token_that_runs_as_its_own_account(tmp_path: Path) -> None:
    """`sshapi dev --accounts 2`: the printed token runs `id -un` as sshapi-r0001 on host `hpc`
    (a certificate per connection), and `sshapi token --account` mints one for the other."""
    data = tmp_path / "data"
    port = free_port()
    env = {**os.environ, "SSHAPI_DATA_DIR": str(data), "SSHAPI_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [SSHAPI, "dev", "--port", str(port), "--accounts", "2"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        assert proc.stdout is not None
        token = printed_token(proc.stdout)
        other = subprocess.run(
            [SSHAPI, "token", "--sub", "bob", "--account", "sshapi-r0002"],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        for tok, account in ((token, "sshapi-r0001"), (other, "sshapi-r0002")):
            r = httpx.post(
                f"{url}/v1/jobs",
                json={"host": "hpc", "argv": ["id", "-un"]},
                headers={"Authorization": f"Bearer {tok}", "Prefer": "wait=20"},
                timeout=30,
            )
            assert r.json()["stdout"].strip() == account, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_dev_in_agent_mode_runs_a_job_through_the_executor(tmp_path: Path) -> None:
    """`sshapi dev --exec-mode agent --rtt-ms 5`: the printed token submits a job, through the
    latency relay, and its parent on the local host is the executor (python3 reading its
    source from stdin), not a shell of sshd."""
    data = tmp_path / "data"
    port = free_port()
    env = {**os.environ, "SSHAPI_DATA_DIR": str(data), "SSHAPI_LOG_LEVEL": "warning"}
    out = tmp_path / "dev.out"
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            [SSHAPI, "dev", "--port", str(port), "--exec-mode", "agent", "--rtt-ms", "5"],
            env=env,
            stdout=sink,
        )
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")
        printed = out.read_text()
        assert "agent mode, 5 ms RTT through a relay" in printed
        token = re.search(r"^export TOKEN=(\S+)$", printed, re.M)
        assert token is not None, printed
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/jobs",
            json={"host": "local", "argv": ["sh", "-c", "ps -o args= -p $PPID"]},
            headers={"Authorization": f"Bearer {token[1]}"},
            timeout=60,
        )
        assert r.status_code == 201, r.text
        assert r.json()["exit_status"] == 0 and "sys.stdin.buffer.read" in r.json()["stdout"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.skipif(shutil.which("node") is None, reason="node missing")
def test_dev_oidc_signs_in_a_ci_client_and_a_sigterm_stops_the_provider(tmp_path: Path) -> None:
    """`sshapi dev --oidc` prints a client-credentials login that works against its API; the
    provider goes with it."""
    port = free_port()
    env = {**os.environ, "SSHAPI_DATA_DIR": str(tmp_path / "data"), "SSHAPI_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [SSHAPI, "dev", "--oidc", "--port", str(port)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")
        assert proc.stdout is not None
        while "--client-credentials" not in (line := proc.stdout.readline()):
            assert line, "sshapi dev --oidc printed no login"
        secret, *login = shlex.split(line)
        client = {k: v for k, v in os.environ.items() if not k.startswith("SSHAPI_")} | {
            "SSHAPI_URL": f"http://127.0.0.1:{port}",
            "SSHAPI_CLIENT_CONFIG": str(tmp_path / "client" / "client.toml"),
            secret.split("=", 1)[0]: secret.split("=", 1)[1],
        }
        done = subprocess.run([SSHAPI, *login[1:]], env=client, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        done = subprocess.run(
            [SSHAPI, "run", "-n", "local", "--", "echo", "signed in"],
            env=client, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert (done.returncode, done.stdout) == (0, "signed in\n"), done.stderr

        def provider() -> list[psutil.Process]:
            return [
                p
                for p in psutil.process_iter(["cmdline"])
                if "server.mjs" in " ".join(p.info["cmdline"] or [])
                and str(tmp_path) in " ".join(p.info["cmdline"] or [])
            ]

        assert provider(), "the OpenID provider is not running"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert not provider()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_dev_nodes_and_accounts_log_each_researcher_in_on_every_node(tmp_path: Path) -> None:
    """`sshapi dev --nodes 3 --accounts 2`: host `hpc` has the three login nodes, and a
    researcher runs as their own account on each (an admin drains their node, twice)."""
    data = tmp_path / "data"
    port = free_port()
    env = {**os.environ, "SSHAPI_DATA_DIR": str(data), "SSHAPI_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [SSHAPI, "dev", "--port", str(port), "--nodes", "3", "--accounts", "2"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        token = subprocess.run(
            [SSHAPI, "token", "--sub", "root", "--account", "sshapi-r0002",
             "--scope", "jobs:read jobs:write admin"],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        auth = {"Authorization": f"Bearer {token}"}
        seen = []
        for _ in range(3):
            r = httpx.post(
                f"{url}/v1/jobs",
                json={"host": "hpc", "argv": ["id", "-un"]},
                headers={**auth, "Prefer": "wait=20"},
                timeout=30,
            )
            assert r.json()["stdout"].strip() == "sshapi-r0002", r.text
            seen.append(r.json()["node"])
            drain = f"{url}/v1/admin/hosts/hpc/nodes/{seen[-1]}/drain"
            assert httpx.post(drain, headers=auth, timeout=10).status_code == 200
        assert sorted(seen) == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
