"""docs/deploy.md, run as written: each ```bash block in order, as root, from the checkout, after
the page's first block (its variables). A scratch PREFIX holds /etc, /opt, /var and /run (one
for both runs: the second finds the first's installed venv, see `prefix`); this machine is the
login host too: the page's own dedicated sshd on a free loopback port, with a
host key, a login account and a researcher's account made here as a site has them; the site's
identity provider is the rig's (sshpool/devhost/oidc.py), its sign-in approved in Chromium;
the accounts, PostgreSQL role and database are real and removed after. With INIT=systemd,
`systemctl` is tests/deploy/systemctl_shim.py (this machine's PID 1 is not systemd); with
INIT=none the page starts everything itself."""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from loadtests.replicas import PG_URL
from loadtests.server import free_port
from sshpool.devhost import oidc

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "deploy.md"


def bash_blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(), re.M | re.S)


def two_free_ports() -> int:
    """A port whose next one is free too: the page numbers the replicas' ports from the first."""
    import socket

    # Below Linux's ephemeral range (32768-60999), where outgoing connections take their ports.
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(20000, 32000)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no two consecutive free ports")


def fingerprint(public_key: Path) -> str:
    done = subprocess.run(["ssh-keygen", "-lf", str(public_key)], capture_output=True, text=True)
    return done.stdout.split()[1]


# What one run of the page leaves for the next (under $OPT): the venv and the wheel it installed.
KEPT = {("opt", "sshapi", ".venv"), ("opt", "sshapi", "dist")}


@pytest.fixture(scope="module")
def prefix() -> Iterator[Path]:
    """The scratch PREFIX of both runs. Between them everything goes but KEPT, so the second
    run's install block, run as written, finds the package and its ~65 dependencies installed
    (pip: already satisfied) instead of installing and compiling them again, as when the page
    is run again on a machine that has it; the first run installs from nothing."""
    if os.geteuid() != 0:
        pytest.skip("the deploy page runs as root (useradd, runuser)")
    # Not under pytest's 0700 temp dir: the service account must reach its files. Not under
    # /tmp either: sshd runs the principals command only from directories only root may write.
    # Not named sshapi-*: the page's at_prefix would take /var/lib/sshapi-... for its state dir.
    path = Path(tempfile.mkdtemp(prefix="deploy-doc-", dir="/var/lib"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def remove_all_but(directory: Path, kept: set[tuple[str, ...]]) -> None:
    """Remove what `directory` holds but the paths `kept` names (each a tuple of names)."""
    for path in directory.iterdir():
        inner = {k[1:] for k in kept if k[0] == path.name}
        if () in inner:
            continue
        if path.is_dir() and not path.is_symlink():
            if inner:
                remove_all_but(path, inner)
            else:
                shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


@pytest.fixture(params=["systemd", "none"])
def site(request: pytest.FixtureRequest, prefix: Path) -> Iterator[dict[str, str]]:
    """The page's variables for this machine, and everything the page creates removed after
    (but KEPT)."""
    tag = uuid.uuid4().hex[:6]
    # The login host as a site has it: its host key, and the account jobs run as (its home
    # under the PREFIX, its authorized_keys filled in by "the administrator" below).
    ssh_etc = prefix / "etc" / "ssh"
    ssh_etc.mkdir(parents=True)
    host_key = ssh_etc / "ssh_host_ed25519_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
    login_user, researcher = f"svc-{tag}", f"r-{tag}"
    home = prefix / "home" / login_user
    home.parent.mkdir()
    for account in (login_user, researcher):  # uids from 1000: a researcher's range
        subprocess.run(
            ["useradd", "--create-home", "--home-dir", str(home.parent / account), "--shell",
             "/bin/sh", account],
            check=True,
        )  # fmt: skip
    (home / ".ssh").mkdir(mode=0o700)
    authorized = home / ".ssh" / "authorized_keys"
    authorized.touch(mode=0o600)
    shutil.chown(home / ".ssh", login_user, login_user)
    shutil.chown(authorized, login_user, login_user)
    state = prefix / "shim"
    state.mkdir()  # nginx's pid file goes there, with systemd or without
    shim = prefix / "bin"
    shim.mkdir()
    (shim / "systemctl").write_text(
        f'#!/bin/sh\nexec {sys.executable} {REPO / "tests/deploy/systemctl_shim.py"} "$@"\n'
    )
    (shim / "systemctl").chmod(0o755)
    nginx = prefix / "etc" / "nginx"
    (nginx / "conf.d").mkdir(parents=True)
    temp = "".join(f"    {k}_temp_path {prefix}/nginx-{k};\n" for k in ("client_body", "proxy"))
    (nginx / "nginx.conf").write_text(
        f"pid {state}/nginx.pid;\nerror_log {prefix}/nginx-error.log warn;\n"
        f"events {{ worker_connections 512; }}\n"
        f"http {{\n    access_log off;\n{temp}    include {nginx}/conf.d/*.conf;\n}}\n"
    )
    provider = oidc.start(
        prefix / "oidc", "http://127.0.0.1/", ci_secret="ci-" + "s" * 30, ci_account=researcher
    )
    pg = PG_URL.replace("postgresql+asyncpg://", "postgresql://")
    database = f"sshapi_deploy_{tag}"
    values = {
        "PREFIX": str(prefix),
        "SSHAPI_ACCOUNT": f"sshapi-{tag}",
        "REPLICAS": "2",
        "FIRST_PORT": str(two_free_ports()),
        "HOST_NAME": "login1",
        "LOGIN_HOST": "127.0.0.1",
        "LOGIN_PORT": str(free_port()),
        "LOGIN_LISTEN": "127.0.0.1",
        "LOGIN_USER": login_user,
        "LOGIN_FINGERPRINT": fingerprint(Path(f"{host_key}.pub")),
        "SERVER_NAME": "localhost",  # the researcher's client resolves it
        "HTTPS_PORT": str(free_port()),
        "DATABASE_URL": f"postgresql+asyncpg://{database}:pw-{tag}@127.0.0.1:5432/{database}",
        "PG_ADMIN_URL": pg.rsplit("/", 1)[0] + "/postgres",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "NGINX_CONF": str(nginx / "nginx.conf"),
        "INIT": request.param,
        "IDP_ISSUER": provider.issuer,
        "IDP_JWKS_URL": f"{provider.issuer}/jwks",
        "ACCOUNT_CLAIM": "preferred_username",
        "USERS_HOST_NAME": "hpc",
        "API_ADDRESSES": "127.0.0.1",
        "RESEARCHER": researcher,
        "SHIM_UNITS": str(prefix / "etc" / "systemd" / "system"),
        "SHIM_STATE": str(state),
        "AUTHORIZED_KEYS": str(authorized),
    }
    try:
        yield values
    finally:
        provider.stop()
        for pidfile in state.glob("*.pid") if state.exists() else []:
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                os.killpg(int(pidfile.read_text()), signal.SIGTERM)
        sshd_pid = prefix / "run" / "sshd-sshapi.pid"  # INIT=none: the sshd went on its own
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int(sshd_pid.read_text()), signal.SIGTERM)
        for account in (values["SSHAPI_ACCOUNT"], login_user, researcher):
            try:
                uid = pwd.getpwnam(account).pw_uid
            except KeyError:
                continue
            owned = [p for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid]
            for p in owned:
                p.terminate()
            _, alive = psutil.wait_procs(owned, timeout=15)
            for p in alive:  # a replica still in its shutdown grace
                p.kill()
            psutil.wait_procs(alive, timeout=5)
            subprocess.run(["userdel", account], check=True)  # a leftover must be noticed
        subprocess.run(
            ["psql", "-q", values["PG_ADMIN_URL"], "-c", f'DROP DATABASE IF EXISTS "{database}"',
             "-c", f'DROP ROLE IF EXISTS "{database}"'],
            check=False, capture_output=True,
        )  # fmt: skip
        remove_all_but(prefix, KEPT)


@pytest.mark.timeout(600)  # the first block installs the package: 2-4 min on a loaded box
def test_the_deploy_page_runs_as_written(site: dict[str, str]) -> None:
    """Every block succeeds in order, with systemd and without (INIT=none); then doctor passed
    (0 failures) and the job sent through nginx over TLS answered `deployed`; the replicas
    listen on the ports the page gave them; the login host's dedicated sshd listens on its own
    port only (no `Port 22` from the site's sshd_config); no block says `exit` (a pasted `exit`
    closes the root shell); the waits print their progress; /metrics through nginx wants an
    admin token; the backups (the secrets' tarball, the job dump) are root's alone although the
    blocks ran under umask 022; the page ends with a researcher who signed in at the provider
    (in Chromium) running as their own account, and their upload in their home, theirs."""
    variables, *steps = bash_blocks()
    assert not [b for b in (variables, *steps) if re.search(r"\bexit\b", b)]
    env = {**os.environ, **site, "PATH": f"{site['PREFIX']}/bin:{os.environ['PATH']}"}
    outputs = []
    logs = Path(site["SHIM_STATE"])
    for n, block in enumerate(steps, 1):
        started = time.monotonic()
        # Root's usual umask: what the blocks write must not depend on it.
        argv = ["bash", "-euo", "pipefail", "-c", f"umask 022\n{variables}\n{block}"]
        if '"$OPT/.venv/bin/sshapi" login' in block:
            done = signing_in(argv, env, site["RESEARCHER"], Path(site["PREFIX"]) / "chromium")
        else:
            done = subprocess.run(
                argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
            )
        assert done.returncode == 0, (
            f"block {n}:\n{block}\n{done.stdout}\n{done.stderr}\n"
            + "".join(f"\n{log.name}:\n{log.read_text()[-2000:]}" for log in logs.glob("*.log"))
        )
        outputs.append(done.stdout)
        print(f"block {n}: {time.monotonic() - started:.1f} s")
        if "keys/id_ed25519" in block:
            # The login host's administrator installs the account's public key.
            key = Path(site["PREFIX"], "etc/sshapi/keys/id_ed25519.pub").read_text()
            with open(site["AUTHORIZED_KEYS"], "a") as keys:
                keys.write(key)
    assert f"the host key of 127.0.0.1 is {site['LOGIN_FINGERPRINT']}: kept" in "".join(outputs)
    first = int(site["FIRST_PORT"])
    assert f"replica {first}: ready" in "".join(outputs) and f"replica {first + 1}: ready" in (
        "".join(outputs)
    )
    sshd_ports = {
        c.laddr.port
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.pid == sshd_pid(site)
    }
    assert sshd_ports == {int(site["LOGIN_PORT"])}
    checks = outputs[-2]  # doctor's lines, then the job's JSON
    assert "2 host(s): 0 failure(s)" in checks, checks
    assert '"stdout":"deployed\\n"' in checks.replace(" ", ""), checks
    for port in (first, first + 1):
        assert (
            subprocess.run(
                ["curl", "-sf", "-o", "/dev/null", f"http://127.0.0.1:{port}/healthz"]
            ).returncode
            == 0
        )
    metrics = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--cacert",
         f"{site['PREFIX']}/etc/sshapi/tls/fullchain.pem",
         f"https://localhost:{site['HTTPS_PORT']}/metrics"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert metrics.stdout == "401"
    # The researcher: signed in, ran as their own account, their file in their home, theirs.
    account = site["RESEARCHER"]
    assert outputs[-1].splitlines()[0] == account, outputs[-1]
    assert outputs[-1].splitlines()[-1] == f"{account} notes.txt", outputs[-1]
    notes = Path(site["PREFIX"], "home", account, "notes.txt")
    assert notes.read_text() == "from my laptop\n" and notes.owner() == account
    backups = Path(site["PREFIX"], "var/backups/sshapi")
    made = {p.name.split("-")[0]: stat.S_IMODE(p.stat().st_mode) for p in backups.iterdir()}
    assert (stat.S_IMODE(backups.stat().st_mode), made) == (0o700, {"jobs": 0o600, "etc": 0o600})


def sshd_pid(site: dict[str, str]) -> int:
    """The login host's dedicated sshd: its own pid file (INIT=none), or the stand-in's."""
    own = Path(site["PREFIX"], "run", "sshd-sshapi.pid")
    shim = Path(site["SHIM_STATE"], "sshd-sshapi.pid")
    return int((shim if shim.exists() else own).read_text())


def signing_in(
    argv: list[str], env: dict[str, str], account: str, profile: Path
) -> subprocess.CompletedProcess[str]:
    """The block whose `sshapi login` waits for the researcher: the link it prints is opened in
    Chromium, where they sign in as `account` and allow; then the block goes on."""
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("To sign in, open "):
            approve(line.split()[4], profile, account)
            break
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, out, "".join(seen) + err)


def approve(url: str, profile: Path, account: str) -> None:
    """A researcher approving the code in a browser: confirm, sign in, allow (the rig's
    provider takes any password; tests/api/test_login.py does the same)."""
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        driver.get(url)
        for _ in range(150):
            try:
                if "Sign-in Success" in driver.find_element(By.TAG_NAME, "body").text:
                    return
                if fields := driver.find_elements(By.NAME, "login"):
                    fields[0].send_keys(account)
                    driver.find_element(By.NAME, "password").send_keys("any")
                driver.find_elements(By.TAG_NAME, "button")[0].click()
            except (WebDriverException, IndexError):
                pass  # the page changed under us: look again
            time.sleep(0.2)
        raise AssertionError(f"not approved: {driver.current_url}")
    finally:
        driver.quit()
