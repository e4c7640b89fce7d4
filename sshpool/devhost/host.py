"""The local HPC host: a real OpenSSH sshd on a loopback address, for development, tests and
benchmarks (docs/pool.md, "The local host rig").

```python
with LocalHost("hpc1", profile="stock", data_dir=Path(".data")) as host:
    target = host.target(max_sessions=8)   # an sshpool Target: address, port, user, keys
    ...
```

Everything lives under ``<data_dir>/hosts/<name>/``; the caller chooses ``data_dir`` (the API
passes its own data dir, the tests a temporary one):

* ``sshd/``: sshd's own files, owned by the host account: ``sshd_config``, the ed25519 host key,
  ``authorized_keys`` (the client public key), ``trusted_user_ca_keys`` (the user CA's public
  key: sshd accepts any certificate it signed whose principals name the account), ``sshd.pid``,
  ``sshd.log``.
* ``client/``: what the API needs, owned by the API's user: ``id_ed25519`` (mode 600, no
  passphrase), ``user_ca`` (the user CA's private key, mode 600: ``host.certificate_target()``
  logs in with a fresh certificate of it per connection) and ``known_hosts`` with one
  ``[address]:port`` entry for the host key.

Keys are made once and reused across restarts and runs.

The account: sshd runs unprivileged, as the account it logs in. Run as a normal user, that is the
current user (an unprivileged sshd can only log in the user it runs as). Run as root, it is the
dedicated account ``sshapi-hpc`` (created with ``useradd`` when missing, shell ``/bin/sh``, its own
home), never root. ``shell="/bin/tcsh"`` (root only) logs in ``sshapi-hpc-tcsh`` instead, whose
login shell is that one: quoting is tested through every shell a site may give its users.

Profiles: ``stock`` sets only what running unprivileged on a loopback port needs and leaves
everything that matters to load at OpenSSH's defaults (MaxStartups 10:30:100, MaxSessions 10,
LoginGraceTime 120, no ClientAlive; on OpenSSH >= 9.8 that includes PerSourcePenalties, so
repeated failed logins from 127.0.0.1 get it refused for a while). ``tuned`` adds the settings of
``tuned_config`` (default ``TUNED_CONFIG``: the repository's ``sshd_config.tuned``, shipped in
this package), minus keywords the installed sshd is too old to know.
``overrides`` (any sshd_config keywords) apply last.

``researchers=True`` (root only) runs sshd as root, as a site's is, so that it logs in the host
account and the rig's researcher accounts too (``sshpool.devhost.accounts``: ``sshapi-r0001``...,
each with its key in its own ``~/.ssh/authorized_keys``): one sshd, many accounts. Its
certificates are trusted through the shipped Match block (``CERTIFICATES_CONFIG``:
deploy/sshd_config.certificates, line for line, with the rig's addresses, CA file, principals
command and account put in: ``certificate_block``), so what is tested is what sites get. An
unprivileged sshd (logging in only its own account) trusts the CA for that account, globally.

``stop()`` ends only the sshd listener, as ``systemctl restart ssh`` does: established connections
and their commands live on (each is its own sshd process) until the client closes them.
``stop(kill_sessions=True)`` kills them too, like a host going down.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from sshpool.certificates import UserCA
from sshpool.devhost import procs
from sshpool.target import Limits, Target

Profile = Literal["stock", "tuned"]

# The tuned profile's settings, shipped inside the package (a symlink to the repository's
# top-level sshd_config.tuned in a checkout, the file itself in a wheel). Its drop-ins for newer
# sshd sit beside it as `sshd_config.tuned-X.Y`, applied when sshd >= X.Y.
TUNED_CONFIG = Path(__file__).with_name("sshd_config.tuned")
# The rig's user CA's key type (docs/operations.md, "The CA key").
USER_CA_TYPE = "ecdsa-sha2-nistp256"
# The certificate Match block sites append to sshd_config, and its principals command (symlinks
# to deploy/ in a checkout, like TUNED_CONFIG).
CERTIFICATES_CONFIG = Path(__file__).with_name("sshd_config.certificates")
PRINCIPALS_COMMAND = Path(__file__).with_name("sshapi-principals")
# The service account CERTIFICATES_CONFIG names, replaced by the host's.
EXAMPLE_SERVICE_ACCOUNT = "svc-sshapi"
# Where a root sshd of the rig runs PRINCIPALS_COMMAND from: sshd runs it only from a path whose
# every directory only root may write (not /tmp, where data dirs usually are).
PRINCIPALS_INSTALLED = Path("/run/sshapi-devhost/sshapi-principals")
# The API's addresses as the rig's certificate block names them: the API runs on this machine.
RIG_API_ADDRESSES = "127.0.0.0/8,::1"
# The account sshd runs as (and logs in) when we are root. SSHPOOL_DEVHOST_ACCOUNT names another:
# the suite's parallel workers each take their own (tests/conftest.py), because tests plant files
# in that account's home and two workers sharing it would see each other's.
ACCOUNT = os.environ.get("SSHPOOL_DEVHOST_ACCOUNT", "sshapi-hpc")
ACCOUNT_SHELL = "/bin/sh"
# The researcher accounts a `researchers` host logs in (sshpool.devhost.accounts names them).
ACCOUNTS_PATTERN = "sshapi-r*"
PRIVSEP_DIR = "/run/sshd"
START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0

# sshd refuses keywords it does not know: the first OpenSSH version of each newer keyword that
# sshd_config.tuned may hold. Older sshd get the file without those lines.
KEYWORD_MIN_VERSION: dict[str, tuple[int, int]] = {
    "persourcemaxstartups": (8, 5),
    "persourcenetblocksize": (8, 5),
    "channeltimeout": (9, 2),
    "unusedconnectiontimeout": (9, 2),
    "persourcepenalties": (9, 8),
    "persourcepenaltyexemptlist": (9, 8),
}

# The per-connection programs of newer sshd: keyword, program, first version.
SSHD_HELPERS = (("SshdSessionPath", "sshd-session", (9, 8)), ("SshdAuthPath", "sshd-auth", (10, 0)))


class LocalHostError(RuntimeError):
    """The local sshd could not be prepared, started or stopped."""


# --------------------------------------------------------------------------------------------
# sshd binary, version, config parsing


def sshd_binary(explicit: str | None = None) -> str:
    """Path of the sshd binary: ``explicit`` when given, else ``sshd`` on PATH or in /usr/sbin,
    /sbin."""
    if explicit:
        return explicit
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"])
    found = shutil.which("sshd", path=search)
    if found is None:
        raise LocalHostError(
            "sshd not found: install OpenSSH's server (Debian: apt-get install openssh-server); "
            "`make test` and `make run` do it for you"
        )
    return found


@functools.cache
def sshd_version(sshd: str | None = None) -> tuple[int, int]:
    """(major, minor) of the installed sshd, e.g. (9, 2). Read from ``sshd -V``; sshd older than
    9.1 has no -V and prints its version in the usage text, which is read the same way."""
    binary = sshd or sshd_binary()
    out = subprocess.run([binary, "-V"], capture_output=True, text=True, check=False, timeout=10)
    match = re.search(r"OpenSSH_(\d+)\.(\d+)", out.stdout + out.stderr)
    if match is None:
        raise LocalHostError(f"cannot tell the version of {binary}: {out.stderr.strip()!r}")
    return int(match.group(1)), int(match.group(2))


def parse_sshd_config(text: str) -> list[tuple[str, str]]:
    """(keyword, arguments) of each setting line of an sshd_config fragment, comments dropped.
    Only flat settings are supported (no Match, no Include): a fragment for sshd_config.d/."""
    settings: list[tuple[str, str]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"(\S+?)(?:\s*=\s*|\s+)(.*)$", line)
        if match is None or not match.group(2).strip():
            raise LocalHostError(f"line {number}: expected 'Keyword arguments', got {raw!r}")
        keyword, args = match.group(1), match.group(2).strip()
        if keyword.lower() in {"match", "include"}:
            raise LocalHostError(f"line {number}: {keyword} is not supported in a tuned fragment")
        settings.append((keyword, args))
    return settings


def tuned_files(version: tuple[int, int], path: Path = TUNED_CONFIG) -> list[Path]:
    """``path`` and, in version order, its drop-ins ``<name>-X.Y`` that sshd ``version`` is new
    enough for (sshd refuses to start on a keyword it does not know)."""
    dropins: list[tuple[tuple[int, int], Path]] = []
    for dropin in path.parent.glob(f"{path.name}-*"):
        match = re.fullmatch(r"(\d+)\.(\d+)", dropin.name.removeprefix(f"{path.name}-"))
        if match is not None:
            dropins.append(((int(match.group(1)), int(match.group(2))), dropin))
    return [path, *(dropin for since, dropin in sorted(dropins) if version >= since)]


def tuned_settings(
    version: tuple[int, int] | None = None, path: Path = TUNED_CONFIG
) -> tuple[list[tuple[str, str]], list[str]]:
    """The settings of the tuned config ``path`` and its drop-ins that sshd ``version``
    (default: the installed sshd's) knows, and the keywords left out."""
    current = version if version is not None else sshd_version()
    kept: list[tuple[str, str]] = []
    skipped: list[str] = []
    text = "".join(f.read_text() for f in tuned_files(current, path))
    for keyword, args in parse_sshd_config(text):
        needed = KEYWORD_MIN_VERSION.get(keyword.lower())
        if needed is not None and current < needed:
            skipped.append(keyword)
        else:
            kept.append((keyword, args))
    return kept, skipped


def certificate_block(
    *, addresses: str, ca_keys: str, command: str, service: str, path: Path = CERTIFICATES_CONFIG
) -> list[str]:
    """The setting lines of the shipped certificate Match block ``path`` (comments dropped),
    with a site's values put in: the API's ``addresses``, the CA's public key file ``ca_keys``,
    the principals ``command``'s path and the ``service`` account. Every other word as shipped."""
    lines: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, *words = line.split()
        match keyword.lower():
            case "match":
                words = ["Address", addresses]
            case "trustedusercakeys":
                words = [ca_keys]
            case "authorizedprincipalscommand":
                args = (service if w == EXAMPLE_SERVICE_ACCOUNT else w for w in words[1:])
                words = [command, *args]
        lines.append(" ".join([keyword, *words]))
    return lines


def install_principals_command(target: Path = PRINCIPALS_INSTALLED) -> Path:
    """PRINCIPALS_COMMAND copied where a root sshd runs it (root-owned, 0755), atomically: rig
    processes running side by side write the same bytes."""
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(target.parent, 0o755)
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    staging.write_bytes(PRINCIPALS_COMMAND.read_bytes())
    os.chmod(staging, 0o755)
    os.replace(staging, target)
    return target


# --------------------------------------------------------------------------------------------
# The host account


@dataclass(frozen=True, slots=True)
class Account:
    """The unprivileged account sshd runs as and logs in."""

    name: str
    uid: int
    gid: int
    home: str
    shell: str

    @classmethod
    def from_pwd(cls, entry: pwd.struct_passwd) -> Account:
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir, entry.pw_shell)

    @property
    def is_self(self) -> bool:
        """True when this is the account this process runs as (no user switch needed)."""
        return self.uid == os.geteuid()


@functools.cache
def host_account(shell: str | None = None) -> Account:
    """The current user when not root; else the dedicated ``sshapi-hpc`` account, created once.
    With a login ``shell`` other than /bin/sh (to test quoting through bash, zsh, tcsh...), the
    account is ``sshapi-hpc-<shell name>``; that needs root."""
    if os.geteuid() != 0:
        account = Account.from_pwd(pwd.getpwuid(os.geteuid()))
        if shell is not None and shell != account.shell:
            raise LocalHostError(f"a login shell other than {account.shell} needs root")
    elif shell is None or shell == ACCOUNT_SHELL:
        account = _ensure_account(ACCOUNT)
    else:
        if not os.access(shell, os.X_OK):
            raise LocalHostError(f"login shell {shell} is not installed")
        account = _ensure_account(f"{ACCOUNT}-{Path(shell).name}", shell)
    if account.uid == 0:
        # Root logins have signal requests refused before OpenSSH 10, and we never want root.
        raise LocalHostError(f"the local host account {account.name!r} must not be root (uid 0)")
    return account


def _ensure_account(name: str, shell: str = ACCOUNT_SHELL) -> Account:
    try:
        return Account.from_pwd(pwd.getpwnam(name))
    except KeyError:
        pass
    useradd = shutil.which("useradd", path="/usr/sbin:/sbin:/usr/bin:/bin") or "useradd"
    done = subprocess.run(
        [
            useradd,
            "--create-home",
            "--shell",
            shell,
            "--user-group",
            "--comment",
            "sshapi local HPC host",
            name,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    # 9: the name exists (another process created it meanwhile).
    if done.returncode not in (0, 9):
        raise LocalHostError(f"useradd {name} failed: {done.stderr.strip()}")
    if done.returncode == 0:
        # '*' instead of useradd's '!': no password can match, yet the account is not "locked"
        # (sshd without PAM refuses locked accounts when it can read the shadow file).
        subprocess.run(["usermod", "-p", "*", name], capture_output=True, check=False)
        adopt_home(name)
    return Account.from_pwd(pwd.getpwnam(name))


def adopt_home(name: str) -> None:
    """Give account ``name`` its home back when an earlier account of that name left it (the
    machine's accounts were made again, the home kept): useradd keeps an existing home as it is,
    owned by the old uid, and every write of the new account there fails."""
    entry = pwd.getpwnam(name)
    home = Path(entry.pw_dir)
    if home.is_dir() and home.stat().st_uid != entry.pw_uid:
        for directory, dirs, files in os.walk(home):
            for path in (directory, *(os.path.join(directory, f) for f in dirs + files)):
                os.lchown(path, entry.pw_uid, entry.pw_gid)


# --------------------------------------------------------------------------------------------
# Helpers


def _read_banner(address: str, port: int, timeout: float = 1.0) -> bytes | None:
    """The SSH identification line the server sends first, or None when it does not."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            data = b""
            while b"\n" not in data and len(data) < 1024:
                chunk = sock.recv(256)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    for line in data.splitlines():
        if line.startswith(b"SSH-"):
            return line
    return None


def _keygen(path: Path, comment: str, kind: Sequence[str] = ("-t", "ed25519")) -> None:
    for stale in (path, path.with_name(path.name + ".pub")):
        stale.unlink(missing_ok=True)
    done = subprocess.run(
        ["ssh-keygen", "-q", *kind, "-N", "", "-C", comment, "-f", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise LocalHostError(f"ssh-keygen for {path} failed: {done.stderr.strip()}")


def _public_key(private: Path) -> str:
    """'type base64' of a key pair, from its .pub file (made again from the private key if lost)."""
    pub = private.with_name(private.name + ".pub")
    if not pub.exists():
        out = subprocess.run(
            ["ssh-keygen", "-y", "-f", str(private)], capture_output=True, text=True, check=True
        )
        pub.write_text(out.stdout)
    key_type, key_data = pub.read_text().split()[:2]
    return f"{key_type} {key_data}"


# --------------------------------------------------------------------------------------------
# The host


class LocalHost:
    """One sshd on a loopback address and port, with its keys, account and profile."""

    def __init__(
        self,
        name: str = "local",
        profile: Profile = "tuned",
        *,
        address: str = "127.0.0.1",
        port: int | None = None,
        data_dir: Path | str,
        overrides: Mapping[str, str] | None = None,
        shell: str | None = None,
        sshd: str | None = None,
        tuned_config: Path = TUNED_CONFIG,
        researchers: bool = False,
        client_dir: Path | None = None,
    ) -> None:
        """``data_dir``: where the host keeps its files (``<data_dir>/hosts/<name>/``).
        ``client_dir``: another host's client directory, to share its client key and
        known_hosts (a cluster's login nodes: `sshpool.devhost.cluster`).
        ``sshd``: the sshd binary (default: ``sshd`` on PATH or in /usr/sbin, /sbin).
        ``tuned_config``: the sshd_config fragment of the ``tuned`` profile.
        ``researchers``: sshd runs as root and also logs in the researcher accounts."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError(f"host name {name!r}: use letters, digits, '.', '_' and '-'")
        if profile not in ("stock", "tuned"):
            raise ValueError(f"profile must be 'stock' or 'tuned', not {profile!r}")
        self.name = name
        self.profile: Profile = profile
        self._address = address
        self._data_dir = Path(data_dir).absolute()
        self._host_dir = self._data_dir / "hosts" / name
        self._sshd_dir = self._host_dir / "sshd"
        self._client_dir = client_dir or self._host_dir / "client"
        self.overrides: dict[str, str] = dict(overrides or {})
        self._sshd = sshd
        self.tuned_config = tuned_config
        self._account = host_account(shell)
        if researchers and os.geteuid() != 0:
            raise LocalHostError("logging in researcher accounts needs an sshd run as root")
        self.researchers = researchers
        self._port = port if port is not None else self._pick_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ca: UserCA | None = None
        #: Keywords of sshd_config.tuned left out because the installed sshd is too old.
        self.skipped_settings: list[str] = []

    # ---- paths and identity

    @property
    def sshd_binary(self) -> str:
        """The sshd this host runs (resolved at each use: a missing sshd fails at start)."""
        return sshd_binary(self._sshd)

    @property
    def address(self) -> str:
        return self._address

    @property
    def port(self) -> int:
        return self._port

    @property
    def username(self) -> str:
        return self._account.name

    @property
    def account(self) -> Account:
        return self._account

    @property
    def host_dir(self) -> Path:
        return self._host_dir

    @property
    def sshd_dir(self) -> Path:
        return self._sshd_dir

    @property
    def config_path(self) -> Path:
        return self._sshd_dir / "sshd_config"

    @property
    def log_path(self) -> Path:
        return self._sshd_dir / "sshd.log"

    @property
    def pid_path(self) -> Path:
        return self._sshd_dir / "sshd.pid"

    @property
    def host_key_path(self) -> Path:
        return self._sshd_dir / "ssh_host_ed25519_key"

    @property
    def client_key(self) -> str:
        return str(self._client_dir / "id_ed25519")

    @property
    def known_hosts(self) -> str:
        return str(self._client_dir / "known_hosts")

    @property
    def user_ca_key(self) -> str:
        """The user CA's private key, which this host's sshd trusts (TrustedUserCAKeys)."""
        return str(self._client_dir / "user_ca")

    @property
    def ca_keys_path(self) -> Path:
        """The user CA's public key as sshd reads it (TrustedUserCAKeys)."""
        return self._sshd_dir / "trusted_user_ca_keys"

    @property
    def host_pattern(self) -> str:
        """How known_hosts names this host: ``[address]:port`` unless the port is 22."""
        return self._address if self._port == 22 else f"[{self._address}]:{self._port}"

    @property
    def pid(self) -> int | None:
        """The sshd listener's pid while running."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return (
            f"<LocalHost {self.name} {self.profile} {self.username}@{self._address}:{self._port}"
            f" {state}>"
        )

    # ---- what pools and clients need

    def target(self, **limits: object) -> Target:
        """An sshpool Target for this host; keyword arguments go to ``Limits``."""
        return Target(
            host=self._address,
            username=self.username,
            client_keys=(self.client_key,),
            known_hosts=self.known_hosts,
            port=self._port,
            limits=Limits(**limits),  # type: ignore[arg-type]
        )

    def certificate_target(
        self, identity: str = "tester", *, username: str | None = None, **limits: object
    ) -> Target:
        """A Target logging in with a fresh certificate of this host's user CA per connection,
        as ``username`` (default: the host's account), on behalf of ``identity``. Targets of
        one host share one ``UserCA`` (one serial counter); the host must have started once."""
        if self._ca is None:
            self._ca = UserCA(self.user_ca_key, replica=f"devhost-{self.name}")
        return Target(
            host=self._address,
            username=username or self.username,
            client_keys=(),
            known_hosts=self.known_hosts,
            port=self._port,
            limits=Limits(**limits),  # type: ignore[arg-type]
            ca=self._ca,
            identity=identity,
        )

    def ssh_argv(self, *remote: str, options: Sequence[str] = ()) -> list[str]:
        """argv of the OpenSSH client running ``remote`` on this host, with this host's key,
        known_hosts and strict host key checking (no prompt, no agent, no user config)."""
        settings = [
            "IdentitiesOnly=yes",
            f"UserKnownHostsFile={self.known_hosts}",
            "GlobalKnownHostsFile=none",
            "StrictHostKeyChecking=yes",
            "BatchMode=yes",
            "ConnectTimeout=10",
        ]
        argv = ["ssh", "-F", "none", "-i", self.client_key, "-p", str(self._port)]
        for setting in settings:
            argv += ["-o", setting]
        return [*argv, *options, f"{self.username}@{self._address}", *remote]

    # ---- the sshd configuration

    def settings(self) -> list[tuple[str, str]]:
        """The sshd_config lines this host runs with: the mechanical ones, then the profile's,
        then ``overrides``; a later keyword replaces an earlier one (sshd keeps the first it
        reads, so each keyword is written once)."""
        merged: dict[str, tuple[str, str]] = {}

        def put(keyword: str, value: str) -> None:
            merged[keyword.lower()] = (keyword, value)

        sshd = self._sshd_dir
        # What running unprivileged on a loopback port needs, and nothing that changes load limits.
        put("ListenAddress", self._address)
        put("Port", str(self._port))
        put("HostKey", str(self.host_key_path))
        put("PidFile", str(self.pid_path))
        if self.researchers:
            put("AuthorizedKeysFile", f".ssh/authorized_keys {sshd / 'authorized_keys'}")
            put("AllowUsers", f"{self.username} {ACCOUNTS_PATTERN}")
        else:
            put("AuthorizedKeysFile", str(sshd / "authorized_keys"))
            put("AllowUsers", self.username)
        if not self.researchers:
            # Certificates of the rig's user CA, principals = the account (no principals file);
            # a root sshd trusts them through the shipped Match block (render_config).
            put("TrustedUserCAKeys", str(self.ca_keys_path))
        put("PubkeyAuthentication", "yes")
        put("PasswordAuthentication", "no")
        put("KbdInteractiveAuthentication", "no")
        put("HostbasedAuthentication", "no")
        put("PermitRootLogin", "no")
        # No PAM: an unprivileged sshd cannot use it, and it would add a session stack per login.
        put("UsePAM", "no")
        # The files sit under the data dir (maybe /tmp): StrictModes would refuse world-writable
        # ancestors such as /tmp. The sshd dir itself is the account's, mode 700.
        put("StrictModes", "no")
        put("PrintMotd", "no")
        put("PrintLastLog", "no")
        put("X11Forwarding", "no")
        put("Subsystem", "sftp internal-sftp")
        put("LogLevel", "VERBOSE")
        # sshd >= 9.8 runs each connection in sshd-session (>= 10.0: and sshd-auth), at a path
        # compiled in; one unpacked elsewhere (sshpool.devhost.openssh) uses its own.
        binary = Path(self.sshd_binary)
        version = sshd_version(str(binary))
        for keyword, helper, since in SSHD_HELPERS:
            path = binary.parents[1] / "lib" / "openssh" / helper
            if version >= since and path.exists():
                put(keyword, str(path))
        if self.profile == "tuned":
            kept, self.skipped_settings = tuned_settings(
                sshd_version(self.sshd_binary), self.tuned_config
            )
            for keyword, value in kept:
                put(keyword, value)
        else:
            self.skipped_settings = []
        for keyword, value in self.overrides.items():
            put(keyword, value)
        return list(merged.values())

    def render_config(self) -> str:
        lines = [
            f"# Generated by sshpool.devhost for host {self.name!r}, profile {self.profile!r}.",
            "# Rewritten at every start: change the profile or the overrides instead.",
        ]
        if self.skipped_settings:
            version = ".".join(map(str, sshd_version(self.sshd_binary)))
            lines.append(
                f"# Left out of {self.tuned_config.name} (sshd {version} is too old): "
                f"{', '.join(self.skipped_settings)}"
            )
        lines += [f"{keyword} {value}" for keyword, value in self.settings()]
        if self.researchers:
            # Last: a Match block lasts to the end of the file.
            lines += self.certificate_lines()
        return "\n".join(lines) + "\n"

    def certificate_lines(self) -> list[str]:
        """The shipped certificate Match block as this host runs it (``researchers`` hosts)."""
        return certificate_block(
            addresses=RIG_API_ADDRESSES,
            ca_keys=str(self.ca_keys_path),
            command=str(PRINCIPALS_INSTALLED),
            service=self.username,
        )

    def effective_config(self) -> dict[str, str]:
        """sshd's own view of the configuration (``sshd -T``), keywords lower-case. Keywords
        given several times (HostKey, ListenAddress...) map to their values joined by newlines."""
        self._prepare()
        done = self._run_sshd_check("-T")
        if done.returncode != 0:
            raise LocalHostError(f"sshd -T failed: {done.stderr.strip()}")
        config: dict[str, str] = {}
        for line in done.stdout.splitlines():
            keyword, _, value = line.partition(" ")
            config[keyword] = f"{config[keyword]}\n{value}" if keyword in config else value
        return config

    # ---- lifecycle

    def start(self) -> Self:
        """Start sshd and wait until it answers with its SSH banner. Idempotent."""
        if self.running:
            return self
        self._prepare()
        self._kill_stale()
        check = self._run_sshd_check("-t")
        if check.returncode != 0:
            raise LocalHostError(
                f"{self!r}: sshd refuses its configuration {self.config_path}: "
                f"{(check.stderr or check.stdout).strip()}"
            )
        if not procs.port_is_free(self._address, self._port):
            raise LocalHostError(f"{self!r}: {self._address}:{self._port} is already in use")
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        user, group, extra_groups = (None, None, None) if self.researchers else self._switch_user()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [self.sshd_binary, "-D", "-f", str(self.config_path), "-E", str(self.log_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd="/",
                env=self._account_env(),
                close_fds=True,
                user=user,
                group=group,
                extra_groups=extra_groups,
            )
        procs.stop_at_exit(self)
        self._wait_ready(log_offset)
        return self

    def stop(self, *, kill_sessions: bool = False) -> None:
        """Stop the sshd listener. Idempotent.

        Established connections (each its own sshd process) and their commands are left alone,
        as a real ``systemctl restart ssh`` does, and end when their client closes them. With
        ``kill_sessions`` they are killed too (SIGKILL), like a host that goes down."""
        proc, self._proc = self._proc, None
        procs.forget_at_exit(self)
        if proc is None:
            self._kill_stale(kill_sessions=kill_sessions)
            return
        if kill_sessions and proc.poll() is None:
            procs.kill_tree(proc.pid)
        procs.terminate(proc, STOP_TIMEOUT)
        self.pid_path.unlink(missing_ok=True)

    def restart(self) -> Self:
        """Stop and start again: same address, port and keys."""
        self.stop()
        return self.start()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- keys

    def replace_host_key(self) -> None:
        """Make a new host key and restart if running. known_hosts keeps the old key, so clients
        now see a host key mismatch (until ``trust_host_key()``)."""
        self._prepare()
        _keygen(self.host_key_path, f"sshapi-local-host-{self.name}")
        self._chown_sshd_files()
        if self.running:
            self.restart()

    def trust_host_key(self) -> None:
        """Rewrite known_hosts with the current host key."""
        self._prepare()
        self._write_known_hosts()

    def known_hosts_line(self) -> str:
        """This host's known_hosts line: its pattern and host key."""
        return f"{self.host_pattern} {self.host_public_key()}"

    def host_public_key(self) -> str:
        return _public_key(self.host_key_path)

    # ---- running things on the host

    def run_local(
        self, argv: Sequence[str], *, input: str | None = None, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a command on this machine as the host account, without SSH (for tests: look at
        the account's processes, files...). Output is captured as text; never raises on exit
        status."""
        return self._run_as_account(argv, input=input, timeout=timeout)

    def processes(self, pattern: str) -> list[int]:
        """Pids of the host account's processes whose command line matches ``pattern``
        (``pgrep -u <account> -f pattern``)."""
        done = subprocess.run(
            ["pgrep", "-u", str(self._account.uid), "-f", pattern],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
        if done.returncode not in (0, 1):
            raise LocalHostError(f"pgrep failed: {done.stderr.strip()}")
        return [int(pid) for pid in done.stdout.split()]

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # ---- internals

    def _pick_port(self) -> int:
        """A free port, preferring the one this host used last (so known_hosts and configs
        that name it stay valid across runs)."""
        return procs.pick_port(self._address, self._host_dir, self._host_dir / "port")

    def _switch_user(self) -> tuple[int | None, int | None, list[int] | None]:
        """Popen's (user, group, extra_groups) that run a child as the host account, with the
        account's groups only (as initgroups would); all None when we are the account."""
        if self._account.is_self:
            return None, None, None
        account = self._account
        return account.uid, account.gid, os.getgrouplist(account.name, account.gid)

    def _run_sshd_check(self, flag: str) -> subprocess.CompletedProcess[str]:
        """``sshd -t`` or ``-T`` on our config, as the user sshd runs as."""
        argv = [self.sshd_binary, flag, "-f", str(self.config_path)]
        if not self.researchers:
            return self._run_as_account(argv)
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)

    def _account_env(self) -> dict[str, str]:
        account = self._account
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": account.home,
            "USER": account.name,
            "LOGNAME": account.name,
            "SHELL": account.shell,
            "LANG": "C.UTF-8",
        }

    def _run_as_account(
        self, argv: Sequence[str], *, input: str | None = None, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        home = self._account.home
        user, group, extra_groups = self._switch_user()
        return subprocess.run(
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            cwd=home if os.path.isdir(home) else "/",
            env=self._account_env(),
            user=user,
            group=group,
            extra_groups=extra_groups,
        )

    def _prepare(self) -> None:
        """Create the directories, keys, authorized_keys, known_hosts and sshd_config."""
        self._host_dir.mkdir(parents=True, exist_ok=True)
        self._sshd_dir.mkdir(mode=0o700, exist_ok=True)
        self._client_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self._client_dir, 0o700)
        (self._host_dir / "port").write_text(f"{self._port}\n")

        if not self.host_key_path.exists():
            _keygen(self.host_key_path, f"sshapi-local-host-{self.name}")
        client_key = Path(self.client_key)
        if not client_key.exists():
            _keygen(client_key, f"sshapi-client-{self.name}")
        os.chmod(client_key, 0o600)
        user_ca = Path(self.user_ca_key)
        # ECDSA P-256, as docs/operations.md advises a site's CA (an Ed25519 CA costs sshd more
        # per login); a rig made before keeps its data directory but gets the new kind of CA.
        if not user_ca.exists() or not _public_key(user_ca).startswith(USER_CA_TYPE):
            _keygen(user_ca, f"sshapi-user-ca-{self.name}", ("-t", "ecdsa", "-b", "256"))
        os.chmod(user_ca, 0o600)

        (self._sshd_dir / "authorized_keys").write_text(_public_key(client_key) + "\n")
        self.ca_keys_path.write_text(_public_key(user_ca) + "\n")
        if not self._known_hosts_has_entry():
            self._write_known_hosts()
        self.config_path.write_text(self.render_config())
        self.log_path.touch()
        if self.researchers:
            # A root sshd's privilege separation directory (systemd's unit makes it on a host).
            Path(PRIVSEP_DIR).mkdir(mode=0o755, exist_ok=True)
            install_principals_command()
        self._chown_sshd_files()
        self._make_traversable()

    def _known_hosts_has_entry(self) -> bool:
        try:
            text = Path(self.known_hosts).read_text()
        except OSError:
            return False
        return any(line.split(" ", 1)[0] == self.host_pattern for line in text.splitlines())

    def _write_known_hosts(self) -> None:
        path = Path(self.known_hosts)
        # Other hosts sharing this client directory keep their lines.
        old = path.read_text().splitlines() if path.exists() else []
        kept = [line for line in old if line.split(" ", 1)[0] != self.host_pattern]
        path.write_text("".join(f"{line}\n" for line in kept) + self.known_hosts_line() + "\n")
        os.chmod(path, 0o600)

    def _chown_sshd_files(self) -> None:
        """sshd's files belong to the account it runs as; private ones are 600."""
        uid, gid = self._account.uid, self._account.gid
        os.chmod(self._sshd_dir, 0o700)
        if not self._account.is_self:
            os.chown(self._sshd_dir, uid, gid)
        for path in self._sshd_dir.iterdir():
            if not self._account.is_self:
                os.chown(path, uid, gid)
            private = path.name in ("ssh_host_ed25519_key", "authorized_keys", "sshd.log")
            os.chmod(path, 0o600 if private else 0o644)

    def _make_traversable(self) -> None:
        """Let the account reach its sshd dir: add o+x (search, not read) to every ancestor it
        could not pass, e.g. pytest's /tmp/pytest-of-root (mode 700)."""
        if self._account.is_self:
            return
        account = self._account
        groups = set(os.getgrouplist(account.name, account.gid))
        for directory in [self._host_dir, *self._host_dir.parents]:
            st = directory.stat()
            if st.st_uid == account.uid:
                ok = bool(st.st_mode & stat.S_IXUSR)
            elif st.st_gid in groups:
                ok = bool(st.st_mode & stat.S_IXGRP)
            else:
                ok = bool(st.st_mode & stat.S_IXOTH)
            if not ok:
                os.chmod(directory, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)

    def _wait_ready(self, log_offset: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        proc = self._proc
        assert proc is not None
        while True:
            if proc.poll() is not None:
                self._proc = None
                procs.forget_at_exit(self)
                raise LocalHostError(
                    f"{self!r}: sshd exited with status {proc.returncode} at start; "
                    f"log {self.log_path}:\n{self._log_since(log_offset)}"
                )
            banner = _read_banner(self._address, self._port, timeout=0.5)
            if banner is not None and proc.poll() is None:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise LocalHostError(
                    f"{self!r}: sshd did not answer on {self._address}:{self._port} within "
                    f"{START_TIMEOUT:.0f} s; log {self.log_path}:\n{self._log_since(log_offset)}"
                )
            time.sleep(0.02)

    def _log_since(self, offset: int, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(log empty)"

    def _kill_stale(self, *, kill_sessions: bool = False) -> None:
        """Stop an sshd of this host left by another process (a crashed run, another instance),
        recognised by the pid file and its command line naming our config."""
        try:
            pid = int(self.pid_path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        if str(self.config_path) not in procs.cmdline(pid):
            self.pid_path.unlink(missing_ok=True)
            return
        if kill_sessions:
            procs.kill_tree(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while procs.cmdline(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if procs.cmdline(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.pid_path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# python -m sshpool.devhost.host: run one host in the foreground, for trying things by hand.


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m sshpool.devhost.host",
        description="Run a local HPC host (a real sshd on loopback) until interrupted.",
    )
    parser.add_argument("--name", default="local")
    parser.add_argument("--profile", choices=["stock", "tuned"], default="tuned")
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument(
        "--data-dir", type=Path, default=Path(".data"), help="default: .data in this directory"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEYWORD=VALUE", help="an sshd override"
    )
    args = parser.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.set)
    host = LocalHost(
        args.name,
        args.profile,
        address=args.address,
        port=args.port,
        data_dir=args.data_dir,
        overrides=overrides,
    )
    with host:
        print(f"{host!r}")
        print("try: " + " ".join(host.ssh_argv("id -un")), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    raise SystemExit(main())
