"""PostgreSQL and Redis for the test suite: installed from the OS packages and started when absent.

The suite expects PostgreSQL at ``postgresql+asyncpg://postgres@127.0.0.1:5432/test`` (the role
``postgres`` without a password) and Redis at
``redis://127.0.0.1:6379/0``. ``python -m sshpool.devhost.services install`` (``make services``,
which ``make test`` runs first) makes both answer. For each service, in this order:

1. **It answers** (PostgreSQL: ``postgres`` logs into ``test`` without a password; Redis: PING):
   nothing to do. A PostgreSQL that lets ``postgres`` in but has no ``test`` database gets one.
2. **Something else holds the port** (a PostgreSQL that asks for a password, a Redis that wants
   AUTH, another program): stop with a message saying what to change. A server we did not start
   is never reconfigured.
3. **Nothing listens**: install the OS packages when the programs are missing (apt-get, through
   sudo when not root), then start the test run's own server with its files under ``data_dir``
   (``/tmp/sshapi-services-<uid>`` from the Makefile: gone at reboot, like the processes). The
   cluster Debian's package makes on the port at that install is stopped and set to start
   manually (``quiet_new_cluster``): it asks for a password, and systemd would start it at boot.

Why the test run's own PostgreSQL rather than the system's cluster (``pg_lsclusters``): Debian's
cluster asks every TCP client for a password, and opening it to ``postgres`` without one would
change a machine's database for good. Ours trusts 127.0.0.1 (and its own socket, in its data
directory) only, and runs only while the machine is up.

Nothing here uses systemd or init scripts (a container has neither): the servers are started
directly and detach themselves (``pg_ctl start``, ``redis-server --daemonize yes``), so they
outlive ``make`` and serve the whole test run; ``stop`` ends them by their pid files.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGES = {"postgresql": "postgresql", "redis": "redis-server"}
HOST = "127.0.0.1"
PG_ROLE = "postgres"
PG_DATABASE = "test"
REDIS_SERVER = "/usr/bin/redis-server"
# Debian installs PostgreSQL's server programs per major version, off PATH.
PG_LIB = Path("/usr/lib/postgresql")
# Debian's clusters: <version>/<name>/ with postgresql.conf and start.conf (auto, manual).
PG_ETC = Path("/etc/postgresql")
START_TIMEOUT = 30.0
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ServicesError(RuntimeError):
    """A service could not be installed or started, or its port is held by something else."""


# --------------------------------------------------------------------------------------------
# Does it answer?


@dataclass(frozen=True)
class State:
    """``ok``: answers as the suite needs; ``down``: nothing listens; ``other``: the port is
    held by something the suite cannot use (``detail`` says what)."""

    kind: str
    detail: str = ""


def _pg_session(port: int, database: str, sql: str | None, timeout: float) -> tuple[str, str]:
    """Log in as ``postgres`` over PostgreSQL's wire protocol (version 3, no TLS, no password)
    and run `sql`, if any. ``("", "")`` on success, else (SQLSTATE or ``password``, message).

    By hand, like Redis's PING below: the rig imports no database client, and the servers must be
    checked before their programs (psql) are installed."""
    params = f"user\0{PG_ROLE}\0database\0{database}\0\0".encode()
    with socket.create_connection((HOST, port), timeout=timeout) as conn:
        conn.sendall(struct.pack("!ii", 8 + len(params), 3 << 16) + params)
        reader = conn.makefile("rb")
        queried = False
        while True:
            head = reader.read(5)
            if len(head) < 5:
                return "closed", "the server closed the connection"
            kind, length = head[:1], struct.unpack("!i", head[1:])[0]
            body = reader.read(length - 4)
            if kind == b"R" and struct.unpack("!i", body[:4])[0] != 0:  # not AuthenticationOk
                return "password", f"{PG_ROLE!r} must give a password"
            if kind == b"E":
                fields = {f[:1]: f[1:].decode(errors="replace") for f in body.split(b"\0") if f}
                return fields.get(b"C", "?"), fields.get(b"M", "")
            if kind == b"Z":  # ReadyForQuery: logged in, or the query is done
                if sql is None or queried:
                    conn.sendall(b"X\0\0\0\4")  # Terminate
                    return "", ""
                query = sql.encode() + b"\0"
                conn.sendall(b"Q" + struct.pack("!i", 4 + len(query)) + query)
                queried = True


def postgres_state(port: int, timeout: float = 5.0) -> State:
    """Log into ``test`` as ``postgres`` without a password; create ``test`` when only it is
    missing (a fresh cluster of ours, or a server that trusts ``postgres`` already)."""
    try:
        code, message = _pg_session(port, PG_DATABASE, None, timeout)
        if code == "3D000":  # invalid_catalog_name: no database "test"
            code, message = _pg_session(
                port, "postgres", f'CREATE DATABASE "{PG_DATABASE}"', timeout
            )
            if not code:
                return State("ok", f"created database {PG_DATABASE}")
    except ConnectionRefusedError:
        return State("down")
    except OSError as exc:
        return State("other", f"no PostgreSQL answer ({type(exc).__name__}: {exc})")
    return State("ok") if not code else State("other", f"{code}: {message}")


def redis_state(port: int, timeout: float = 5.0) -> State:
    """PING in Redis's protocol by hand: no client library, and an answer from anything that is
    not a password-free Redis is told apart."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as conn:
            conn.sendall(b"PING\r\n")
            reply = conn.recv(256)
    except ConnectionRefusedError:
        return State("down")
    except OSError as exc:
        return State("other", f"no Redis answer ({type(exc).__name__}: {exc})")
    if reply.startswith(b"+PONG"):
        return State("ok")
    return State("other", f"PING answered {reply[:80]!r}")


# --------------------------------------------------------------------------------------------
# Programs and packages


def pg_bin_dir(given: Path | None) -> Path | None:
    """The directory with ``initdb`` and ``pg_ctl``: `given`, else the newest major version
    Debian installed."""
    candidates = [given] if given is not None else []
    if given is None and PG_LIB.is_dir():
        versions = [p for p in PG_LIB.iterdir() if p.name.isdigit()]
        candidates = [v / "bin" for v in sorted(versions, key=lambda p: int(p.name), reverse=True)]
    for directory in candidates:
        if all(os.access(directory / prog, os.X_OK) for prog in ("initdb", "pg_ctl")):
            return directory
    return None


def install_packages(packages: Sequence[str], *, sudo: bool | None = None) -> None:
    """apt-get update, then install `packages` without starting their services.

    RUNLEVEL=1 makes the packages' invoke-rc.d skip starting PostgreSQL's and Redis's system
    services where there is no systemd (they would take the ports, and Debian's cluster asks for
    a password); under systemd they start, and the check after the install sees them."""
    if shutil.which("apt-get", path=f"{os.environ.get('PATH', '')}:{SBIN_PATH}") is None:
        raise ServicesError(
            f"{' and '.join(packages)} missing and apt-get is not available: install them with "
            "your package manager, or start PostgreSQL and Redis yourself"
        )
    if sudo is None:
        sudo = os.geteuid() != 0
    # `env` sets the variables for apt-get itself: sudo resets the environment.
    env = ["env", "DEBIAN_FRONTEND=noninteractive", "RUNLEVEL=1", "apt-get"]
    apt = [*(["sudo"] if sudo else []), *env]
    for argv in (
        [*apt, "update", "-q"],
        [*apt, "install", "-y", "-q", "--no-install-recommends", *packages],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise ServicesError(f"{' '.join(argv)} failed ({done.returncode}):\n{tail}")


def debian_clusters(pg_etc: Path) -> set[Path]:
    """The configuration directories of Debian's clusters (what ``pg_lsclusters`` lists)."""
    return {conf.parent for conf in pg_etc.glob("*/*/postgresql.conf")}


def _cluster_port(conf_dir: Path) -> int | None:
    found = re.search(r"^\s*port\s*=\s*(\d+)", (conf_dir / "postgresql.conf").read_text(), re.M)
    return int(found.group(1)) if found else None


def quiet_new_cluster(conf_dir: Path, *, sudo: bool | None = None) -> str:
    """Stop the cluster the package just made on the tests' port and keep it stopped at boot
    (``manual`` in its start.conf): it asks for a password, so the test run's own cluster must
    have the port. Where systemd is PID 1 the package started it; elsewhere it is stopped
    already. Only a cluster this install made, holding nothing yet, is touched."""
    if sudo is None:
        sudo = os.geteuid() != 0
    prefix = ["sudo"] if sudo else []
    version, name = conf_dir.parent.name, conf_dir.name
    # Exits 2 when the cluster is not running: nothing to stop.
    subprocess.run(
        [*prefix, "pg_ctlcluster", version, name, "stop"], capture_output=True, check=False
    )
    done = subprocess.run(
        [*prefix, "tee", str(conf_dir / "start.conf")],
        input="manual\n",
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise ServicesError(f"cannot write {conf_dir / 'start.conf'}: {done.stderr.strip()}")
    return (
        f"Debian's new cluster {version}/{name} stopped, to start manually: the port is the tests'"
    )


# --------------------------------------------------------------------------------------------
# Our own servers


def _own_dir(path: Path, mode: int) -> None:
    """Create `path` or accept it only as a real directory of ours: under /tmp anyone could have
    made it first (or a symlink in its place). `mode` is set on a directory it creates only (the
    umask narrows mkdir's): a SERVICES_DIR given by the caller keeps the caller's mode."""
    created = not path.exists()
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise ServicesError(f"{path} exists and is not a directory of this account")
    if created:
        os.chmod(path, mode)


def _run_as(argv: Sequence[str], user: pwd.struct_passwd | None) -> None:
    done = subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        check=False,
        cwd="/",  # the server account may not reach the caller's directory
        user=None if user is None else user.pw_uid,
        group=None if user is None else user.pw_gid,
        extra_groups=None if user is None else [],
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise ServicesError(f"{' '.join(argv)} failed ({done.returncode}):\n{tail}")


def _wait(what: str, check: Callable[[], State], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while (state := check()).kind != "ok":
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
            raise ServicesError(f"{what}: {state.kind} {state.detail}\n" + "\n".join(tail))
        time.sleep(0.2)


def _cluster_version(data: Path) -> str | None:
    try:
        return (data / "PG_VERSION").read_text().strip()
    except OSError:
        return None


def _server_version(bin_dir: Path) -> str:
    """The major version of the server programs: ``postgres (PostgreSQL) 15.20 (Debian ...)``."""
    out = subprocess.run(
        [str(bin_dir / "postgres"), "--version"], capture_output=True, text=True, check=False
    ).stdout
    found = re.search(r"\(PostgreSQL\) (\d+)", out)
    return found.group(1) if found else ""


def start_postgres(bin_dir: Path, data_dir: Path, port: int) -> None:
    """initdb (once) and start a cluster in ``data_dir/postgresql``, listening on 127.0.0.1:port
    and a socket in its own directory, trusting those two only; then create ``test``."""
    # PostgreSQL refuses to run as root: as root, the cluster belongs to the account the package
    # creates; anyone else runs it as themselves (no sudo needed).
    user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
    data = data_dir / "postgresql"
    if _cluster_version(data) != _server_version(bin_dir):
        # No cluster, a half-made one (an interrupted run), or one of another major version (the
        # packages changed): it holds only test data, so make it anew.
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(mode=0o700)
        if user is not None:
            os.chown(data, user.pw_uid, user.pw_gid)
        # C locale and UTF-8: a minimal machine may have no other locale generated.
        initdb = [str(bin_dir / "initdb"), "-D", str(data), "-U", PG_ROLE, "-A", "trust"]
        _run_as([*initdb, "-E", "UTF8", "--locale=C", "--no-instructions"], user)
        # Exactly what the suite needs, nothing from other hosts (it listens on 127.0.0.1 only).
        (data / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n")
    # Address, port and socket at every start: the port is the caller's choice each time, and
    # Debian's default socket directory may not exist or be writable by the account.
    options = f"-c listen_addresses={HOST} -c port={port} -c unix_socket_directories={data}"
    log = data / "server.log"
    pg_ctl = [str(bin_dir / "pg_ctl"), "start", "-w", "-t", str(int(START_TIMEOUT))]
    _run_as([*pg_ctl, "-D", str(data), "-l", str(log), "-o", options], user)
    _wait(f"PostgreSQL on {HOST}:{port}", lambda: postgres_state(port), log)


def start_redis(server: Path, data_dir: Path, port: int) -> None:
    """A Redis on 127.0.0.1:port that keeps nothing on disk (the suite's data is throwaway)."""
    redis_dir = data_dir / "redis"
    _own_dir(redis_dir, 0o700)
    log = redis_dir / "redis.log"
    argv = [str(server), "--daemonize", "yes", "--bind", HOST, "--port", str(port)]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(redis_dir)]
    argv += ["--pidfile", str(redis_dir / "redis.pid"), "--logfile", str(log)]
    _run_as(argv, None)
    _wait(f"Redis on {HOST}:{port}", lambda: redis_state(port), log)


def _stop_pid(pid_file: Path, expect: str) -> bool:
    """SIGINT (PostgreSQL's fast shutdown; Redis exits on it too) to the pid in `pid_file` when
    that process is still the expected program; wait until it is gone."""
    try:
        pid = int(pid_file.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return False
    if expect.encode() not in cmdline:
        return False
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + START_TIMEOUT
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return True


def stop(data_dir: Path) -> list[str]:
    """Stop the servers started under `data_dir`; the names of those that ran."""
    stopped = []
    if _stop_pid(data_dir / "postgresql" / "postmaster.pid", "postgres"):
        stopped.append("PostgreSQL")
    if _stop_pid(data_dir / "redis" / "redis.pid", "redis"):
        stopped.append("Redis")
    return stopped


# --------------------------------------------------------------------------------------------
# The whole decision


def ensure(
    *,
    data_dir: Path,
    pg_port: int = 5432,
    redis_port: int = 6379,
    pg_bin: Path | None = None,
    redis_server: Path = Path(REDIS_SERVER),
    pg_etc: Path = PG_ETC,
    manage_postgres: bool = True,
    sudo: bool | None = None,
) -> list[str]:
    """Make PostgreSQL and Redis answer as the suite needs (the module's docstring says how);
    return one line per thing done, or one line saying nothing was needed."""
    checks: dict[str, Callable[[], State]] = {
        "postgresql": lambda: postgres_state(pg_port),
        "redis": lambda: redis_state(redis_port),
    }
    if not manage_postgres:
        del checks["postgresql"]
    where = {
        "postgresql": f"PostgreSQL on {HOST}:{pg_port}",
        "redis": f"Redis on {HOST}:{redis_port}",
    }
    done: list[str] = []
    down = []
    for name, check in checks.items():
        state = check()
        if state.kind == "other":
            raise ServicesError(
                f"{where[name]} cannot serve the tests: {state.detail}\n{HINTS[name]}"
            )
        if state.kind == "down":
            down.append(name)
        elif state.detail:
            done.append(f"{where[name]}: {state.detail}")
    if not down:
        return done or [f"{' and '.join(where[n] for n in checks)} answer"]

    installed = {"postgresql": pg_bin_dir(pg_bin) is not None, "redis": redis_server.exists()}
    if missing := [PACKAGES[n] for n in down if not installed[n]]:
        clusters = debian_clusters(pg_etc)
        install_packages(missing, sudo=sudo)
        done.append(f"installed {' '.join(missing)}")
        for conf_dir in sorted(debian_clusters(pg_etc) - clusters):
            if _cluster_port(conf_dir) == pg_port:
                done.append(quiet_new_cluster(conf_dir, sudo=sudo))
    for name in down:
        # Under systemd the packages just installed start their own servers: use those.
        state = checks[name]()
        if state.kind == "ok":
            continue
        if state.kind == "other":
            raise ServicesError(
                f"{where[name]} cannot serve the tests: {state.detail}\n{HINTS[name]}"
            )
        _own_dir(data_dir, 0o755)  # the postgres account must reach its cluster inside
        if name == "postgresql":
            bin_dir = pg_bin_dir(pg_bin)
            if bin_dir is None:
                raise ServicesError(f"no initdb and pg_ctl in {pg_bin or PG_LIB} after install")
            start_postgres(bin_dir, data_dir, pg_port)
        else:
            start_redis(redis_server, data_dir, redis_port)
        done.append(f"started {where[name]} for the test run (files in {data_dir})")
    return done


HINTS = {
    "postgresql": (
        f"The tests log in as {PG_ROLE!r} without a password into {PG_DATABASE!r}. Either let that "
        f"role in from {HOST} (a first pg_hba.conf line `host all {PG_ROLE} {HOST}/32 trust`, "
        "then reload), or stop that server so the test run starts its own (Debian's cluster, "
        "which systemd starts on install: `pg_ctlcluster VERSION main stop`, and `manual` in its "
        "start.conf to keep it stopped at boot; docs/pool.md)."
    ),
    "redis": (
        "The tests use Redis without a password, database 0: stop that server so the test run "
        "starts its own, or let the tests in (no requirepass)."
    ),
}


# --------------------------------------------------------------------------------------------
# python -m sshpool.devhost.services install | stop


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sshpool.devhost.services")
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser(
        "install", help="make PostgreSQL and Redis answer for the tests (install, start)"
    )
    stop_cmd = sub.add_parser("stop", help="stop the servers started under --data-dir")
    for p in (install, stop_cmd):
        p.add_argument(
            "--data-dir", type=Path, required=True, help="where the test run's servers keep files"
        )
    install.add_argument("--pg-port", type=int, default=5432)
    install.add_argument("--redis-port", type=int, default=6379)
    install.add_argument(
        "--pg-bin-dir", type=Path, default=None, help=f"default: the newest {PG_LIB}/N/bin"
    )
    install.add_argument("--redis-server", type=Path, default=Path(REDIS_SERVER))
    install.add_argument("--pg-etc", type=Path, default=PG_ETC, help="Debian's cluster configs")
    install.add_argument(
        "--postgresql",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also PostgreSQL (the Makefile says no when the tests are given another server)",
    )
    install.add_argument(
        "--sudo",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="install through sudo (default: when not root; the Makefile passes its choice)",
    )
    args = parser.parse_args(argv)
    if args.command == "stop":
        print(f"stopped: {', '.join(stop(args.data_dir)) or 'nothing ran'}")
        return 0
    try:
        lines = ensure(
            data_dir=args.data_dir,
            pg_port=args.pg_port,
            redis_port=args.redis_port,
            pg_bin=args.pg_bin_dir,
            redis_server=args.redis_server,
            pg_etc=args.pg_etc,
            manage_postgres=args.postgresql,
            sudo=args.sudo,
        )
    except ServicesError as exc:
        print(f"services: {exc}")
        return 1
    if not args.postgresql:
        lines.append("PostgreSQL: the tests use another server, left to whoever runs it")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
