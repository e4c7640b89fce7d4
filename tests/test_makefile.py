"""Every install recipe of the Makefile works as root (no sudo) and through sudo.

Each recipe is run for real by make, with its tool checks pointed at absent paths (the make
variables *_BIN, SLURM_SEARCH_PATH, PG_BIN_DIR) and `apt-get` and `sudo` replaced by recording
programs first on PATH. The fake sudo resets the environment as the real one does (env_reset), so
a variable set before `sudo` is lost, and a recipe that expands to `-E apt-get` (empty $(SUDO))
exits 127. The fake apt-get records its argv and environment and "installs" each package by
creating the programs the recipes check, so a second run must install nothing: the checked paths
and the installed packages agree. `sh -n` alone accepts all of those bugs.

`services` goes further: its fake packages link to this machine's real PostgreSQL and Redis
programs, and its ports are free ones, so the recipe really starts the test run's own servers
(stopped after each test) while the system's servers on 5432 and 6379 are only ever connected to.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
import redis

from sshpool.devhost import services
from sshpool.devhost.slurm import BINARIES as SLURM_BINARIES

ROOT = Path(__file__).resolve().parents[1]

# recipe -> {package: [programs it installs that the recipe checks, by make variable]}
RECIPES: dict[str, dict[str, dict[str, str]]] = {
    "python-venv": {"python3-venv": {"ENSUREPIP_MAIN": "ensurepip-main"}},
    "sshd": {"openssh-server": {"SSHD_BIN": "sshd"}},
    "load-tools": {"curl": {"CURL_BIN": "curl"}},
    "deploy-tools": {
        "nginx": {"NGINX_BIN": "nginx"},
        "systemd": {"SYSTEMD_ANALYZE_BIN": "systemd-analyze"},
    },
    "shells": {"zsh": {"ZSH_BIN": "zsh"}, "tcsh": {"TCSH_BIN": "tcsh"}},
    "browser": {
        "chromium": {"CHROMIUM_BIN": "chromium"},
        "chromium-driver": {"CHROMEDRIVER_BIN": "chromedriver"},
    },
    "node": {"nodejs": {"NODE_BIN": "node"}, "npm": {"NPM_BIN": "npm"}},
    "prometheus": {"prometheus": {"PROMETHEUS_BIN": "prometheus", "PROMTOOL_BIN": "promtool"}},
    "slurm": {
        package: {
            f"SLURM_{program}": program for program, p in SLURM_BINARIES.items() if p == package
        }
        for package in sorted(set(SLURM_BINARIES.values()))
    },
    "services": {
        "postgresql": {"PG_BIN_DIR": "pgbin"},
        "redis-server": {"REDIS_SERVER_BIN": "redis-server"},
    },
}
# Fake packages whose program is a link to the real one: `services` runs what it installs.
REAL_PG_BIN = services.pg_bin_dir(None)
LINKS = {"pgbin": str(REAL_PG_BIN), "redis-server": services.REDIS_SERVER}
# Variables the recipe must pass to apt-get install beyond DEBIAN_FRONTEND.
EXTRA_ENV = {
    "deploy-tools": {"RUNLEVEL": "1"},
    "services": {"RUNLEVEL": "1"},
    "prometheus": {"RUNLEVEL": "1"},
}

FAKE_APT = """\
#!{python}
import json, os, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": args, "env": {{k: os.environ.get(k) for k in
        ("DEBIAN_FRONTEND", "RUNLEVEL", "SUDO_COMMAND")}}}}) + "\\n")
if "install" in args:
    programs = json.load(open({programs!r}))
    links = json.load(open({links!r}))
    for package in args:
        for name, text in json.load(open({files!r})).get(package, {{}}).items():
            path = os.path.join({installed!r}, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as out:
                out.write(text)
        for program in programs.get(package, []):
            path = os.path.join({installed!r}, program)
            if program in links:
                os.symlink(links[program], path)
                continue
            with open(path, "w") as out:
                out.write("#!/bin/sh\\n")
            os.chmod(path, 0o755)
"""

# Records how Debian's cluster made by the fake postgresql package is stopped.
FAKE_PG_CTLCLUSTER = """\
#!{python}
import json, os, sys
with open({pg_log!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "sudo": os.environ.get("SUDO_COMMAND")}}) + "\\n")
sys.exit(2)  # "Cluster is not running", as without systemd
"""

# Like sudo's env_reset: the command gets PATH (secure_path) and sudo's own variables only.
FAKE_SUDO = """\
#!{python}
import os, sys
argv = sys.argv[1:]
os.execvpe(argv[0], argv, {{"PATH": os.environ["PATH"], "SUDO_COMMAND": " ".join(argv)}})
"""


def install_recipes() -> set[str]:
    """Targets whose recipe installs OS packages (apt-get directly or through a script)."""
    found: set[str] = set()
    target = ""
    for line in (ROOT / "Makefile").read_text().splitlines():
        if m := re.match(r"^([A-Za-z][\w-]*):", line):
            target = m.group(1)
        elif line.startswith("\t") and re.search(r"APT_GET|apt-get|(slurm|services) install", line):
            found.add(target)
    return found


def make(
    target: str, tmp: Path, sudo: str, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    installed = tmp / "installed"
    variables = {"SUDO": sudo, "SLURM_SEARCH_PATH": str(installed)}
    for packages in RECIPES.values():
        for programs in packages.values():
            variables |= {var: str(installed / prog) for var, prog in programs.items()}
    # The venv that runs this test, and stamps newer than pyproject.toml: no venv rebuild.
    run_stamp, stamp = tmp / "run-stamp", tmp / "stamp"
    run_stamp.touch()
    stamp.touch()
    variables |= {"VENV": str(Path(sys.executable).parent.parent), "STAMP": str(stamp)}
    variables["RUN_STAMP"] = str(run_stamp)
    # The test run's own servers on free ports, their files beside the fakes.
    variables |= json.loads((tmp / "services.json").read_text())
    variables["PG_ETC"] = str(installed / "pgetc")
    if target == "python-venv":  # what it installs is only needed to create a missing venv
        variables["VENV"] = str(tmp / "no-venv")
    env = {**os.environ, "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}"}
    env.pop("DEBIAN_FRONTEND", None)
    env.pop("RUNLEVEL", None)
    env.pop("SSHAPI_TEST_PG", None)
    # The recipe runs in a root shell of its own: when the suite itself runs through sudo
    # (`sudo make test`), sudo's variables would make the as-root case look as if it did too.
    for var in ("SUDO_COMMAND", "SUDO_USER", "SUDO_UID", "SUDO_GID"):
        env.pop(var, None)
    env |= env_extra or {}
    argv = ["make", "--no-print-directory", "-C", str(ROOT), target]
    argv += [f"{k}={v}" for k, v in variables.items()]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def calls(tmp: Path) -> list[dict[str, object]]:
    log = tmp / "apt.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def fakes() -> Iterator[Path]:
    """The fake programs' directory, with the test run's servers' files, stopped afterwards.
    In /tmp and traversable: as root, PostgreSQL runs as the postgres account, which must reach
    its programs (the fake package's link) and its cluster (pytest's basetemp is mode 700)."""
    tmp_path = Path(tempfile.mkdtemp(prefix="sshapi-make-"))
    tmp_path.chmod(0o755)
    try:
        yield from _fakes(tmp_path)
    finally:
        services.stop(tmp_path / "services")
        shutil.rmtree(tmp_path)


def _fakes(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "services.json").write_text(
        json.dumps(
            {
                "SERVICES_DIR": str(tmp_path / "services"),
                "PG_PORT": str(free_port()),
                "REDIS_PORT": str(free_port()),
            }
        )
    )
    (tmp_path / "bin").mkdir()
    (tmp_path / "installed").mkdir()
    programs = {
        package: list(progs.values())
        for packages in RECIPES.values()
        for package, progs in packages.items()
    }
    (tmp_path / "programs.json").write_text(json.dumps(programs))
    (tmp_path / "links.json").write_text(json.dumps(LINKS))
    # The postgresql package makes Debian's cluster 15/main on the tests' port (postinst).
    pg_port = settings(tmp_path)["PG_PORT"]
    cluster = {
        "pgetc/15/main/postgresql.conf": f"port = {pg_port}\n",
        "pgetc/15/main/start.conf": "auto\n",
    }
    (tmp_path / "files.json").write_text(json.dumps({"postgresql": cluster}))
    fill = {
        "python": sys.executable,
        "log": str(tmp_path / "apt.log"),
        "programs": str(tmp_path / "programs.json"),
        "links": str(tmp_path / "links.json"),
        "files": str(tmp_path / "files.json"),
        "pg_log": str(tmp_path / "pg_ctlcluster.log"),
        "installed": str(tmp_path / "installed"),
    }
    fakes = (("apt-get", FAKE_APT), ("sudo", FAKE_SUDO), ("pg_ctlcluster", FAKE_PG_CTLCLUSTER))
    for name, text in fakes:
        path = tmp_path / "bin" / name
        path.write_text(textwrap.dedent(text).format(**fill))
        path.chmod(0o755)
    yield tmp_path


def test_every_install_recipe_is_covered() -> None:
    """A new install recipe in the Makefile must be added here, so it is run both ways."""
    assert install_recipes() == set(RECIPES)


@pytest.mark.parametrize("sudo", ["", "sudo"], ids=["as-root", "through-sudo"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_install_recipe_installs_missing_packages(recipe: str, sudo: str, fakes: Path) -> None:
    """With its tools missing, the recipe runs apt-get update then a non-interactive install
    of its packages (through sudo when SUDO=sudo), exits 0, and a second run installs nothing."""
    done = make(recipe, fakes, sudo)
    assert done.returncode == 0, done.stdout + done.stderr
    recorded = calls(fakes)
    assert [c["argv"][0] for c in recorded] == ["update", "install"], recorded  # type: ignore[index]
    install = recorded[1]["argv"]
    assert set(RECIPES[recipe]) <= set(install), install  # type: ignore[arg-type]
    assert "-y" in install  # type: ignore[operator]
    for call in recorded:
        env = call["env"]
        assert env["DEBIAN_FRONTEND"] == "noninteractive", call  # type: ignore[index]
        assert (env["SUDO_COMMAND"] is not None) == bool(sudo), call  # type: ignore[index]
    for name, value in EXTRA_ENV.get(recipe, {}).items():
        assert recorded[1]["env"][name] == value, recorded[1]  # type: ignore[index]
    if recipe == "services":  # Debian's new cluster on the port: stopped and kept stopped
        stops = [
            json.loads(line) for line in (fakes / "pg_ctlcluster.log").read_text().splitlines()
        ]
        assert [c["argv"] for c in stops] == [["15", "main", "stop"]], stops
        assert (stops[0]["sudo"] is not None) == bool(sudo), stops
        assert (
            fakes / "installed" / "pgetc" / "15" / "main" / "start.conf"
        ).read_text() == "manual\n"

    again = make(recipe, fakes, sudo)
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(calls(fakes)) == len(recorded), "the second run installed again"


def settings(tmp: Path) -> dict[str, str]:
    return json.loads((tmp / "services.json").read_text())  # type: ignore[no-any-return]


def assert_answers(pg_port: str, redis_port: str) -> None:
    """Both servers answer as the suite uses them (tests/api/api_helpers.py's URLs)."""

    async def pg() -> None:
        conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{pg_port}/test")
        try:
            assert await conn.fetchval("SELECT current_database()") == "test"
        finally:
            await conn.close()

    with redis.Redis(host="127.0.0.1", port=int(redis_port)) as client:
        assert client.ping()
    asyncio.run(pg())


def test_services_already_answering_does_nothing(fakes: Path) -> None:
    """PostgreSQL and Redis answer on the suite's ports (this machine's own servers, which are
    only connected to): with their programs "absent", nothing is installed or started, and the
    recipe says so in one line."""
    ports = {"PG_PORT": "5432", "REDIS_PORT": "6379"}
    (fakes / "services.json").write_text(json.dumps(settings(fakes) | ports))
    done = make("services", fakes, "")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines() == [
        "PostgreSQL on 127.0.0.1:5432 and Redis on 127.0.0.1:6379 answer"
    ], done.stdout + done.stderr
    assert calls(fakes) == []
    assert not (fakes / "services").exists()


@pytest.mark.parametrize("sudo", ["", "sudo"], ids=["as-root", "through-sudo"])
def test_services_installed_but_stopped_are_started(sudo: str, fakes: Path) -> None:
    """Programs installed, nothing on the ports: the recipe starts the test run's own PostgreSQL
    (database test, postgres without a password) and Redis there, without apt-get; a second run
    finds them answering and leaves them as they are."""
    ports = settings(fakes)
    real = {"PG_BIN_DIR": str(REAL_PG_BIN), "REDIS_SERVER_BIN": services.REDIS_SERVER}
    (fakes / "services.json").write_text(json.dumps(ports | real))
    done = make("services", fakes, sudo)
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls(fakes) == []
    assert done.stdout.count("started ") == 2, done.stdout
    assert_answers(ports["PG_PORT"], ports["REDIS_PORT"])
    pid_files = [fakes / "services" / f for f in ("postgresql/postmaster.pid", "redis/redis.pid")]
    pids = [path.read_text().split()[0] for path in pid_files]

    again = make("services", fakes, sudo)
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(again.stdout.strip().splitlines()) == 1 and "answer" in again.stdout
    assert_answers(ports["PG_PORT"], ports["REDIS_PORT"])
    assert [path.read_text().split()[0] for path in pid_files] == pids, "restarted"
    assert services.stop(fakes / "services") == ["PostgreSQL", "Redis"]


def test_services_port_held_by_another_program_fails_clearly(fakes: Path) -> None:
    """A program that is not a password-free Redis holds the Redis port: the recipe fails,
    naming the port and what to do, and installs or starts nothing."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"-NOAUTH Authentication required.\r\n")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        port = str(listener.getsockname()[1])
        (fakes / "services.json").write_text(json.dumps(settings(fakes) | {"REDIS_PORT": port}))
        done = make("services", fakes, "")
        thread.join(10)
    assert done.returncode != 0
    assert f"Redis on 127.0.0.1:{port} cannot serve the tests" in done.stdout, done.stdout
    assert "NOAUTH" in done.stdout
    assert calls(fakes) == []
    assert not (fakes / "services").exists()


def test_services_leaves_postgresql_to_sshapi_test_pg(fakes: Path) -> None:
    """SSHAPI_TEST_PG gives the tests another PostgreSQL: the recipe neither installs nor starts
    one (nothing answers on its port here, and its programs are "absent")."""
    redis_answers = {"REDIS_PORT": "6379"}
    (fakes / "services.json").write_text(json.dumps(settings(fakes) | redis_answers))
    url = "postgresql+asyncpg://someone:secret@db.example:5432/elsewhere"
    done = make("services", fakes, "", {"SSHAPI_TEST_PG": url})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PostgreSQL: the tests use another server" in done.stdout, done.stdout
    assert calls(fakes) == []
    assert not (fakes / "services").exists()


FAKE_APT_DOWNLOAD = """\
#!{python}
import json, os, shutil, sys
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "sudo": os.environ.get("SUDO_COMMAND")}}) + "\\n")
if sys.argv[-2] == "download":
    shutil.copy({deb!r}, "openssh-server_1%3a10.0p1-7~bpo12+1_amd64.deb")
"""


@pytest.mark.parametrize("sudo", ["", "sudo"], ids=["as-root", "through-sudo"])
def test_openssh10_unpacks_beside_the_system_sshd(sudo: str, fakes: Path) -> None:
    """`make openssh10` runs apt-get with its own sources list, lists and cache only (the
    system's apt state untouched, no sudo even when SUDO=sudo), unpacks the package into
    OPENSSH10_DIR, and a second run downloads nothing."""
    tree = fakes / "pkg"
    (tree / "usr" / "sbin").mkdir(parents=True)
    (tree / "usr" / "sbin" / "sshd").write_text("#!/bin/sh\n")
    (tree / "DEBIAN").mkdir()
    control = "Package: openssh-server\nVersion: 1:10.0p1\nArchitecture: all\nMaintainer: x\n"
    (tree / "DEBIAN" / "control").write_text(control + "Description: test\n")
    deb = fakes / "openssh-server.deb"
    subprocess.run(["dpkg-deb", "-b", str(tree), str(deb)], check=True, capture_output=True)
    apt = fakes / "bin" / "apt-download"
    log = fakes / "apt-download.log"
    apt.write_text(FAKE_APT_DOWNLOAD.format(python=sys.executable, log=str(log), deb=str(deb)))
    apt.chmod(0o755)
    target = fakes / "openssh10"
    extra = {"OPENSSH10_DIR": str(target), "OPENSSH10_APT": str(apt)}
    for _ in range(2):
        done = make("openssh10", fakes, sudo, env_extra=extra)
        assert done.returncode == 0, done.stdout + done.stderr
    assert (target / "root" / "usr" / "sbin" / "sshd").exists()
    recorded = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["argv"][-1] for c in recorded] == ["update", "openssh-server/bookworm-backports"]
    for call in recorded:
        options = " ".join(call["argv"])
        assert f"Dir::Etc::sourcelist={target}/sources.list" in options
        assert "Dir::Etc::sourceparts=-" in options
        assert f"Dir::State::Lists={target}/lists" in options
        assert call["sudo"] is None  # nothing to install: never through sudo
    assert "bookworm-backports main" in (target / "sources.list").read_text()


def test_openssh10_without_apt_get_says_why_and_succeeds(fakes: Path) -> None:
    extra = {"OPENSSH10_DIR": str(fakes / "o10"), "OPENSSH10_APT": str(fakes / "absent")}
    done = make("openssh10", fakes, "", env_extra=extra)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not found" in done.stderr and not (fakes / "o10" / "root").exists()


# A `pip` for a scratch venv: records each call, prints what pip prints while it fetches and
# installs (12 packages), exits FAKE_PIP_EXIT.
FAKE_PIP = """\
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if "--upgrade" not in sys.argv:
    for n in range(12):
        print(f"Collecting package{{n}}>=1.0 (from sshapi==0.1.0)")
        print("  Using cached package.whl (10 kB)")
    print("Installing collected packages: " + ", ".join(f"package{{n}}" for n in range(12)))
    print("Successfully installed ...")
sys.exit(int(os.environ.get("FAKE_PIP_EXIT", "0")))
"""


@pytest.fixture
def scratch_venv(tmp_path: Path) -> Path:
    """A venv whose pip is FAKE_PIP (no package is installed for real)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "pip").mkdir()
    (site / "pip" / "__init__.py").write_text("")
    (site / "pip" / "__main__.py").write_text(FAKE_PIP.format(log=str(tmp_path / "pip.log")))
    return venv


def make_stamp(venv: Path, stamp: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), f"VENV={venv}", str(venv / stamp)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def pip_calls(venv: Path) -> list[list[str]]:
    log = venv.parent / "pip.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_make_run_installs_the_server_alone_with_progress(scratch_venv: Path) -> None:
    """`make run`'s stamp installs the `server` extra only, printing what it does and a
    progress line as pip fetches; the test stamp then adds the test extras without installing
    the server again; neither installs twice."""
    done = make_stamp(scratch_venv, ".installed-run-stamp")
    assert done.returncode == 0, done.stdout + done.stderr
    assert pip_calls(scratch_venv) == [
        ["install", "--progress-bar", "off", "--no-compile", "-e", ".[server]"]
    ]
    out = done.stdout
    assert "installing the server into" in out
    assert "server: 10 packages fetched (package9)" in out, out
    assert "server: 12 fetched, installing 12" in out
    assert "server: done in" in out
    assert (scratch_venv / ".installed-run-stamp").exists()

    done = make_stamp(scratch_venv, ".installed-stamp")
    assert done.returncode == 0, done.stdout + done.stderr
    calls = pip_calls(scratch_venv)[1:]
    assert calls == [
        ["install", "-q", "--upgrade", "pip"],
        ["install", "--progress-bar", "off", "-e", ".[server,dev,paramiko,ssh2,loadtests]"],
    ]
    assert "tests: 12 fetched, installing 12" in done.stdout

    for stamp in (".installed-run-stamp", ".installed-stamp"):
        again = make_stamp(scratch_venv, stamp)
        assert again.returncode == 0, again.stdout + again.stderr
    assert len(pip_calls(scratch_venv)) == 3, "installed again"


def test_make_run_install_failure_shows_pips_output(scratch_venv: Path) -> None:
    """pip failing stops make, with pip's own output (the progress line alone hides why), and
    leaves no stamp, so the next `make run` tries again."""
    done = make_stamp(scratch_venv, ".installed-run-stamp", FAKE_PIP_EXIT="1")
    assert done.returncode != 0
    assert "Using cached package.whl" in done.stdout
    assert "server: pip failed (exit 1)" in done.stdout
    assert not (scratch_venv / ".installed-run-stamp").exists()
