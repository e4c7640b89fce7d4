"""A single-node Slurm for the local HPC host, from the OS packages, configured by this code.

```python
with LocalSlurm(data_dir=data) as slurm:        # munged, slurmctld, slurmd; a trivial job ran
    host = LocalHost("hpc1", data_dir=data, overrides=slurm.sshd_overrides())  # sees SLURM_CONF
    ...                                         # sbatch/squeue/scancel work over SSH
```

Everything lives under ``<data_dir>/slurm/<name>/`` (``data_dir``: the caller's, as for LocalHost):

* ``etc/slurm.conf``: written at every start (readable by everyone: clients need it).
* ``munge/``: our own munge key (made once), munged's socket, pid, log and seed. Slurm finds the
  socket through ``AuthInfo=socket=...``, so the system's munged (if any) is never used.
* ``state/`` (slurmctld's StateSaveLocation), ``spool/`` (SlurmdSpoolDir), ``log/``, ``run/``.

Choices that make Slurm work in a container without systemd or a writable cgroup tree, and keep
it private to loopback:

* ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``,
  ``JobAcctGatherType=jobacct_gather/none``: no cgroup plugin is ever loaded.
* ``SlurmUser=root`` (slurmd must be root anyway to start jobs as other users); jobs run as the
  submitting account.
* ``SlurmctldHost=<hostname>(127.0.0.1)``, ``NodeAddr=127.0.0.1`` and
  ``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny``: slurmctld and slurmd bind 127.0.0.1
  (without NoCtldInAddrAny, slurmctld 22.05 listens on 0.0.0.0). Ports are picked free below the
  ephemeral range and remembered.
* ``SlurmdParameters=config_overrides``: the node announces ``CPUS`` CPUs whatever the machine
  has, so many small test jobs run at once on a 2-core box.
* No slurmdbd: ``AccountingStorageType=accounting_storage/none``. Finished jobs stay visible to
  ``squeue --states=all`` / ``scontrol show job`` for ``MinJobAge`` seconds (set to an hour here;
  Slurm's default is 300).
* ``KillWait=2``: a job past its time limit gets SIGKILL 2 s after SIGTERM, not 30 s.
* ``SchedulerParameters=batch_sched_delay=0``: when jobs end, waiting ones start at the next
  second, not up to 3 s later (100 short jobs on 16 CPUs: 18 s -> 6 s).

Clients find the configuration through ``SLURM_CONF``; the local sshd sets it for every session
(``sshd_overrides()``, sshd's ``SetEnv``), as ``/etc/slurm/slurm.conf`` does on a real login host.

Needs root (slurmd starts jobs as other users) and the packages ``slurmctld slurmd slurm-client
munge``: ``python -m sshpool.devhost.slurm install`` installs them when missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from sshpool.devhost import procs
from sshpool.devhost.host import host_account

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = {
    "munged": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "scontrol": "slurm-client",
}
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
# The longest path a Unix socket may have (sun_path holds 108 bytes with the final NUL).
SOCKET_PATH_MAX = 107
# How long finished jobs stay in slurmctld's memory (squeue --states=all, scontrol show job).
MIN_JOB_AGE = 3600


class LocalSlurmError(RuntimeError):
    """The local Slurm could not be installed, configured, started or stopped."""


def _which(name: str, search_path: str = SBIN_PATH) -> str | None:
    return shutil.which(name, path=search_path)


def missing_packages(search_path: str = SBIN_PATH) -> list[str]:
    """OS packages whose programs are not installed (looked up on `search_path`)."""
    return sorted(
        {package for binary, package in BINARIES.items() if _which(binary, search_path) is None}
    )


def install_packages(search_path: str = SBIN_PATH, *, sudo: bool | None = None) -> None:
    """Install Slurm and munge from the OS packages (apt-get) when any program is missing from
    `search_path`; through sudo when `sudo` (None: when not root).

    Debian's packages try to start their services on install; policy-rc.d or the lack of
    systemd stops that, and we never use those services: LocalSlurm runs its own daemons."""
    if not missing_packages(search_path):
        return
    # apt-get by name through `env`, which also sets DEBIAN_FRONTEND for apt-get itself: sudo
    # resets the environment, so a variable given to sudo's own environment never reaches it.
    if shutil.which("apt-get", path=f"{os.environ.get('PATH', '')}:{SBIN_PATH}") is None:
        raise LocalSlurmError(
            f"Slurm is missing ({', '.join(missing_packages(search_path))}) and apt-get is not "
            f"available: install {' '.join(PACKAGES)} with your package manager"
        )
    if sudo is None:
        sudo = os.geteuid() != 0
    apt = [*(["sudo"] if sudo else []), "env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]
    for argv in (
        [*apt, "update", "-q"],
        [*apt, "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise LocalSlurmError(f"{' '.join(argv)} failed ({done.returncode}):\n{tail}")
    if missing := missing_packages(search_path):
        raise LocalSlurmError(f"still missing after install: {', '.join(missing)}")


# --------------------------------------------------------------------------------------------
# Files


def _make_traversable(path: Path) -> None:
    """Add search (x, never read) permission for everyone to ``path`` and its ancestors: job
    accounts must reach slurm.conf and munged's socket (pytest's /tmp/pytest-of-root is mode
    700), and munged refuses a socket below any directory without x for user, group and other."""
    for directory in [path, *path.parents]:
        mode = stat.S_IMODE(directory.stat().st_mode)
        if mode & 0o111 != 0o111:
            os.chmod(directory, mode | 0o111)


# --------------------------------------------------------------------------------------------
# The cluster


class LocalSlurm:
    """munged + slurmctld + one slurmd on this machine, on loopback, with partitions ``debug``
    (the default) and ``batch``."""

    def __init__(
        self,
        name: str = "local",
        *,
        data_dir: Path | str,
        cpus: int = 16,
        account: str | None = None,
    ) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9-]*", name):
            raise ValueError(f"cluster name {name!r}: use lower-case letters, digits and '-'")
        if cpus < 1:
            raise ValueError("cpus must be at least 1")
        self.name = name
        self.cpus = cpus
        self.dir = Path(data_dir).absolute() / "slurm" / name
        self.node = f"{name}-node"
        # The account whose trivial job proves the cluster works (the one sshd logs in).
        self.account = account or host_account().name
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._ctld_port = self._pick_port("slurmctld")
        self._slurmd_port = self._pick_port("slurmd")

    # ---- paths and what clients need

    @property
    def conf_path(self) -> Path:
        return self.dir / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.sockets_dir / "munge" / "munge.socket.2"

    @property
    def sockets_dir(self) -> Path:
        """Where the directories holding Unix sockets live: munged's socket, and slurmd's spool,
        where slurmstepd makes one per step (``<node>_<job>.<step>``, step ids of 10 digits). A
        socket's path holds at most 107 bytes: under a deep data dir (pytest's per-worker temp
        dirs) they move to a short directory in /tmp, named after the data dir so that a restart
        finds it again, removed at stop."""
        longest = f"spool/{self.node}_{'9' * 10}.{'9' * 10}"
        if len(f"{self.dir}/{longest}") <= SOCKET_PATH_MAX:
            return self.dir
        digest = hashlib.sha256(str(self.dir).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"sshapi-slurm-{digest}"

    @property
    def spool_dir(self) -> Path:
        return self.sockets_dir / "spool"

    @property
    def log_dir(self) -> Path:
        return self.dir / "log"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm's client commands on this machine."""
        return {"SLURM_CONF": str(self.conf_path)}

    def sshd_overrides(self) -> dict[str, str]:
        """sshd_config settings for a LocalHost whose sessions use this cluster."""
        return {"SetEnv": f"SLURM_CONF={self.conf_path}"}

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs.values())

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<LocalSlurm {self.name} 127.0.0.1:{self._ctld_port} {self.cpus} cpus {state}>"

    # ---- configuration

    def render_config(self) -> str:
        d = self.dir
        host = socket.gethostname().split(".")[0]
        lines = [
            f"# Generated by sshpool.devhost.slurm for cluster {self.name!r}; rewritten at start.",
            f"ClusterName=sshapi-{self.name}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self._ctld_port}",
            f"SlurmdPort={self._slurmd_port}",
            "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
            "MailProg=/bin/true",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={self.spool_dir}",
            f"SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log_dir / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=batch_sched_delay=0",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            f"MinJobAge={MIN_JOB_AGE}",
            "KillWait=2",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            f"NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname={host} CPUs={self.cpus} "
            "RealMemory=1024 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=1:00:00 State=UP",
            f"PartitionName=batch Nodes={self.node} MaxTime=INFINITE State=UP",
        ]
        return "\n".join(lines) + "\n"

    def _prepare(self) -> None:
        missing = missing_packages()
        if missing:
            raise LocalSlurmError(
                f"Slurm is not installed (missing {', '.join(missing)}): run "
                "`python -m sshpool.devhost.slurm install` (`make test` does) or "
                f"apt-get install {' '.join(PACKAGES)}"
            )
        if os.geteuid() != 0:
            raise LocalSlurmError("LocalSlurm needs root: slurmd starts jobs as other accounts")
        for sub in ("etc", "state", "spool", "log", "run"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.spool_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.conf_path.write_text(self.render_config())
        os.chmod(self.conf_path, 0o644)
        self._prepare_munge()
        _make_traversable(self.dir / "etc")
        _make_traversable(self.munge_socket.parent)

    def _prepare_munge(self) -> None:
        """Our own key (made once), in a directory munged owns: munged refuses a key or socket
        directory that others may write."""
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(mode=0o755, exist_ok=True)
        key = munge_dir / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
        user = self._munge_user()
        for path in (munge_dir, key):
            os.chown(path, user.pw_uid, user.pw_gid)
        os.chmod(munge_dir, 0o755)  # clients connect to the socket inside
        os.chmod(key, 0o600)

    @staticmethod
    def _munge_user() -> pwd.struct_passwd:
        """munged runs as the ``munge`` account the package creates (it will not run as root)."""
        try:
            return pwd.getpwnam("munge")
        except KeyError:
            raise LocalSlurmError(
                "the 'munge' account is missing: reinstall the munge package"
            ) from None

    def _pick_port(self, daemon: str) -> int:
        """A free port for ``daemon``, preferring the one it used last."""
        remembered = self.dir / f"{daemon}.port"
        port = procs.pick_port("127.0.0.1", self.dir, remembered)
        remembered.parent.mkdir(parents=True, exist_ok=True)
        remembered.write_text(f"{port}\n")
        return port

    # ---- lifecycle

    def start(self) -> Self:
        """Start munged, slurmctld and slurmd; return once a trivial job of the account has run.
        Idempotent."""
        if self.running:
            return self
        self.stop()
        self._prepare()
        procs.stop_at_exit(self)
        try:
            self._start_munged()
            self._start_daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf_path)])
            self._wait_for("slurmctld answers", self._ctld_answers)
            self._start_daemon(
                "slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf_path)]
            )
            self._wait_for("the node is idle", self._node_idle)
            self._run_trivial_job()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel every job, stop slurmd, slurmctld and munged (ours, or left over by a crashed
        run of this data dir). Idempotent."""
        daemons, self._procs = self._procs, {}
        procs.forget_at_exit(self)
        if daemons.get("slurmctld") is not None and daemons["slurmctld"].poll() is None:
            # Job steps are daemons of their own (slurmstepd): cancel through Slurm first...
            self._client(["scancel", "--full", f"--user={self.account}"], timeout=5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = daemons.get(name)
            if proc is not None:
                procs.terminate(proc, STOP_TIMEOUT)
        # ...and kill whatever is left: stale daemons and job steps of this configuration.
        ours = [pid for pid in procs.pids() if pid != os.getpid() and self._is_ours(pid)]
        procs.signal_all(ours, signal.SIGTERM)
        procs.signal_all(procs.wait_gone(ours, 3.0), signal.SIGKILL)
        procs.wait_gone(ours, 2.0)
        self.munge_socket.unlink(missing_ok=True)
        if self.sockets_dir != self.dir:
            shutil.rmtree(self.sockets_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every daemon's log, for error messages."""
        parts = []
        for log in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = self.log_dir / log
            try:
                text = path.read_text(errors="replace")
            except OSError:
                text = "(no log)"
            parts.append(f"--- {path}\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(parts)

    # ---- running Slurm's commands here

    def run_as_account(
        self, argv: Sequence[str], *, input: str | None = None, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command on this machine as the job account, without SSH."""
        entry = pwd.getpwnam(self.account)
        env = {
            **self.env,
            "PATH": SBIN_PATH,
            "HOME": entry.pw_dir,
            "USER": entry.pw_name,
            "LOGNAME": entry.pw_name,
        }
        return subprocess.run(
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            cwd=entry.pw_dir if os.path.isdir(entry.pw_dir) else "/",
            env=env,
            user=entry.pw_uid,
            group=entry.pw_gid,
            extra_groups=os.getgrouplist(entry.pw_name, entry.pw_gid),
        )

    def _client(
        self, argv: Sequence[str], timeout: float = 10.0
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm command as root (the SlurmUser: sees and may do everything)."""
        env = {**self.env, "PATH": SBIN_PATH, "HOME": "/root"}
        try:
            return subprocess.run(
                list(argv), capture_output=True, text=True, check=False, timeout=timeout, env=env
            )
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(list(argv), 124, "", f"timed out: {exc}")

    # ---- internals

    def _start_munged(self) -> None:
        munge_dir = self.munge_socket.parent
        user = self._munge_user()
        log = self.log_dir / "munged.log"
        log.touch()
        os.chown(log, user.pw_uid, user.pw_gid)
        self._popen(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={munge_dir / 'munge.key'}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
                f"--log-file={log}",
            ],
            user=user,
        )
        self._wait_for("munged's socket", self.munge_socket.exists)

    def _start_daemon(self, name: str, argv: list[str]) -> None:
        self._popen(name, argv)

    def _popen(self, name: str, argv: list[str], user: pwd.struct_passwd | None = None) -> None:
        binary = _which(argv[0])
        if binary is None:
            raise LocalSlurmError(f"{argv[0]} not found")
        env = {**self.env, "PATH": SBIN_PATH, "LANG": "C.UTF-8"}
        with open(self.log_dir / f"{name}.out", "ab") as out:
            self._procs[name] = subprocess.Popen(
                [binary, *argv[1:]],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                cwd="/",
                env=env,
                close_fds=True,
                start_new_session=True,
                user=None if user is None else user.pw_uid,
                group=None if user is None else user.pw_gid,
                extra_groups=None if user is None else [],
            )

    def _is_ours(self, pid: int) -> bool:
        """A daemon of this configuration or one of its job steps (they inherit SLURM_CONF)."""
        cmdline = procs.cmdline(pid)
        if str(self.conf_path) in cmdline or str(self.munge_socket) in cmdline:
            return True
        return cmdline.startswith("slurmstepd") and procs.environ_has(
            pid, f"SLURM_CONF={self.conf_path}".encode()
        )

    def _ctld_answers(self) -> bool:
        return self._client(["scontrol", "ping"], timeout=5).stdout.count("UP") > 0

    def _node_idle(self) -> bool:
        done = self._client(["sinfo", "--noheader", "--nodes", self.node, "--format=%T"])
        return done.returncode == 0 and done.stdout.strip().startswith("idle")

    def _run_trivial_job(self) -> None:
        """Submit ``true`` as the account and wait until Slurm says it completed: proves munge,
        the config, scheduling and job launch as that account."""
        done = self.run_as_account(
            ["sbatch", "--parsable", "--output=/dev/null", "--job-name=sshapi-ready", "--wrap=true"]
        )
        if done.returncode != 0:
            raise LocalSlurmError(
                f"{self!r}: sbatch as {self.account} failed: {done.stderr.strip()}\n"
                f"{self.log_tails()}"
            )
        job_id = done.stdout.strip().split(";")[0]

        def completed() -> bool:
            out = self._client(["scontrol", "--oneliner", "show", "job", job_id]).stdout
            state = re.search(r"\bJobState=(\S+)", out)
            if state is not None and state.group(1) not in ("PENDING", "RUNNING", "COMPLETING"):
                if state.group(1) != "COMPLETED":
                    raise LocalSlurmError(
                        f"{self!r}: trivial job {job_id} ended {state.group(1)}: {out.strip()}\n"
                        f"{self.log_tails()}"
                    )
                return True
            return False

        self._wait_for(f"trivial job {job_id} to complete", completed)

    def _wait_for(self, what: str, check: object) -> None:
        assert callable(check)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise LocalSlurmError(
                        f"{self!r}: {name} exited with status {proc.returncode} while waiting for "
                        f"{what}\n{self._out_tail(name)}\n{self.log_tails()}"
                    )
            if check():
                return
            if time.monotonic() > deadline:
                raise LocalSlurmError(
                    f"{self!r}: no {what} within {START_TIMEOUT:.0f} s\n{self.log_tails()}"
                )
            time.sleep(0.1)

    def _out_tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.out"
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace")
            return f"--- {path}\n" + "\n".join(text.splitlines()[-lines:])
        return ""


# --------------------------------------------------------------------------------------------
# python -m sshpool.devhost.slurm install | run


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sshpool.devhost.slurm")
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser(
        "install", help="install Slurm and munge from the OS packages when missing"
    )
    install.add_argument(
        "--search-path", default=SBIN_PATH, help="where to look for the programs (PATH syntax)"
    )
    install.add_argument(
        "--sudo",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="install through sudo (default: when not root; the Makefile passes its choice)",
    )
    run = sub.add_parser("run", help="run the local Slurm in the foreground until interrupted")
    run.add_argument("--name", default="local")
    run.add_argument(
        "--data-dir", type=Path, default=Path(".data"), help="default: .data in this directory"
    )
    run.add_argument("--cpus", type=int, default=16)
    args = parser.parse_args(argv)
    if args.command == "install":
        install_packages(args.search_path, sudo=args.sudo)
        print("slurm and munge are installed")
        return 0
    # SIGTERM stops it like Ctrl-C. (Not by blocking signals and sigwait: the daemons would
    # inherit the blocked mask and ignore our SIGTERM at stop.)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    cluster = LocalSlurm(args.name, data_dir=args.data_dir, cpus=args.cpus)
    with contextlib.suppress(KeyboardInterrupt), cluster:
        print(f"{cluster!r}; export SLURM_CONF={cluster.conf_path}", flush=True)
        while True:
            signal.pause()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
