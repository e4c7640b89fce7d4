"""What runs on the host: the wrapper around a command, output capture with caps, the result.

sshd starts every exec session with setsid(), so the login shell is the leader of a new process
group whose id is its pid. The wrapper prints that pid on a marker line; on timeout or cancel
the pool kills the whole group with it, because closing the channel leaves the remote command
running (measured: asyncssh `run(timeout=)` and paramiko leave orphans).

The marker line carries a random token made for each command (`new_marker`), so nothing that
runs before the wrapper (a `~/.ssh/rc`, a login script, a forced command printing `1`) can pass
for it: only `<token> <pid>` counts, and a pid <= 1 is refused (no group kill, only the SSH
signal), so a timeout can never become `kill -TERM -1`. Whatever came before the marker line is
not the command's output: it is kept apart in `Capture.preamble` (the pool logs it), up to
MAX_PREAMBLE bytes; with no marker within that many bytes, everything is output and the command
is killed by signal only.
"""

from __future__ import annotations

import logging
import secrets
import shlex
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

# Bytes every login shell (sh, bash, zsh, tcsh...) passes through single quotes untouched.
_INERT = frozenset(range(0x20, 0x7F)) - frozenset(b"'!\\%")


def _quote(arg: str) -> str:
    """shlex's quoting, and a word starting with `=` quoted too: shlex leaves `=0` bare, which
    zsh expands to the path of the command `0` (its EQUALS option) and tcsh to a directory of
    its stack (`=0`: the working directory)."""
    quoted = shlex.quote(arg)
    return f"'{arg}'" if quoted == arg and arg.startswith("=") else quoted


def command_line(argv: Sequence[str]) -> str:
    """Quote argv for the remote login shell so that every element arrives byte-exact.

    POSIX quoting (shlex) is enough for sh, bash and zsh. csh-family shells (tcsh) end a
    command at a newline and expand `!` even inside single quotes, so an argument holding them
    could run as a command of its own. Such a line is handed to /bin/sh as printf escapes
    instead, made only of bytes every shell leaves alone inside single quotes; `exec` keeps the
    login shell's process id (the pool's process group)."""
    if not argv:
        raise ValueError("argv must not be empty")
    for arg in argv:
        if "\0" in arg:
            raise ValueError("arguments cannot contain NUL bytes")
    line = " ".join(map(_quote, argv))
    if "\n" not in line and "!" not in line:
        return line
    escaped = "".join(
        "%%" if b == 0x25 else chr(b) if b in _INERT else f"\\{b:03o}" for b in line.encode()
    )
    return f"""exec /bin/sh -c 'eval "$(printf "$0")"' '{escaped}'"""


log = logging.getLogger("sshpool")

OutputStream = Literal["stdout", "stderr"]

MARKER_PREFIX = "sshpool-pgid-"
# Bytes looked through for the marker line before giving up on it (login noise is small).
MAX_PREAMBLE = 64 << 10


def new_marker() -> str:
    """A token for one command's marker line: unguessable by what runs before the wrapper."""
    return MARKER_PREFIX + secrets.token_hex(16)


def wrap(command: str, marker: str) -> str:
    """The line sent to sshd: report the process group id after `marker`, then run the
    command. `echo` and `$$` mean the same in sh, bash, zsh and tcsh."""
    return f"echo {marker} $$; " + command


def kill_group_line(*pgids: int, grace: float = 1.0) -> str:
    """A line that sends TERM to process groups, waits up to `grace` while any lives, then
    KILLs them.

    No `--` before a negative id: dash (Debian's /bin/sh, a common login shell for service
    accounts) rejects `kill -TERM -- -PGID` ("Illegal number: -"); `kill -TERM -PGID` works in
    dash, bash and zsh alike. It runs under /bin/sh whatever the login shell: csh-family shells
    (tcsh) know none of this syntax. Ids of 1 and below are never sent (`kill -1` is every
    process of the account)."""
    groups = [f"-{int(p)}" for p in pgids if int(p) > 1]
    if not groups:
        raise ValueError(f"no process group to kill in {pgids!r}")
    steps = max(1, int(grace / 0.05))
    g = " ".join(groups)
    alive = " || ".join(f"kill -0 {one}" for one in groups)
    script = (
        f"kill -TERM {g} 2>/dev/null; i=0; "
        f"while [ $i -lt {steps} ] && {{ {alive}; }} 2>/dev/null; do sleep 0.05; i=$((i+1)); "
        f"done; kill -KILL {g} 2>/dev/null; exit 0"
    )
    return f"exec /bin/sh -c '{script}'"


class Capture:
    """Collects one output stream: keeps the first `cap` bytes, counts all of them.

    With `marker` (the token `wrap` was given), the line `<marker> <pid>` is the wrapper's
    process group id and is not output; what came before it goes to `preamble` (module
    docstring).

    `on_data(chunk)` observes the output as it arrives, whatever the cap: it is called on the
    event loop for every chunk the backend feeds (the marker line excluded), in order, before the
    cap applies. It runs inside the backend's drain loop, so it must be cheap and never block
    (append to a buffer, set an event); an exception it raises is logged and the hook dropped,
    never allowed to break the drain.
    """

    __slots__ = (
        "_buf",
        "_head",
        "_marker",
        "cap",
        "on_data",
        "on_start",
        "pgid",
        "preamble",
        "total",
        "truncated",
    )

    def __init__(
        self,
        cap: int,
        *,
        marker: str | None = None,
        on_start: Callable[[], None] | None = None,
        on_data: Callable[[bytes], None] | None = None,
    ) -> None:
        self.cap = cap
        self._marker = marker.encode() + b" " if marker else None
        # Called once when the marker line arrives: the remote command is running.
        self.on_start = on_start
        self.on_data = on_data
        self.pgid: int | None = None
        # Printed before the marker line (login scripts, ~/.ssh/rc): not the command's output.
        self.preamble = b""
        self.total = 0
        self.truncated = False
        self._buf = bytearray()
        self._head = bytearray()

    def feed(self, data: bytes) -> None:
        if self._marker is not None:
            self._head += data
            at = self._head.find(self._marker)
            end = self._head.find(b"\n", at) if at >= 0 else -1
            if end < 0:
                if len(self._head) > MAX_PREAMBLE:
                    self._give_up_marker()
                return
            value = bytes(self._head[at + len(self._marker) : end])
            if not value.isdigit():
                self._give_up_marker()
                return
            pid = int(value)
            # A group id <= 1 would make the kill `kill -TERM -1` (every process of the account).
            self.pgid = pid if pid > 1 else None
            self.preamble = bytes(self._head[:at])
            data = bytes(self._head[end + 1 :])
            self._head, self._marker = bytearray(), None
            if self.on_start is not None:
                self.on_start()
            if not data:
                return
        if self.on_data is not None:
            try:
                self.on_data(data)
            except Exception:
                log.exception("output hook failed; output is still captured, no longer observed")
                self.on_data = None
        self.total += len(data)
        room = self.cap - len(self._buf)
        if room > 0:
            self._buf += data[:room]
        if len(data) > room:
            self.truncated = True

    def _give_up_marker(self) -> None:
        # No marker where it should be: keep every byte as output, kill by signal only.
        head, self._head, self._marker = bytes(self._head), bytearray(), None
        self.feed(head)

    def getvalue(self) -> bytes:
        return bytes(self._buf)


class Stdin:
    """stdin written while the command runs, for a channel that lives as long as its connection
    (agent mode's executor, `sshpool.agent`): `Connection.exec` takes one where it takes stdin
    bytes. The writer calls `write` and `close` on the event loop; the backend `take`s what was
    written, from the event loop or its own thread (paramiko), and learns of new data from the
    callback it `subscribe`d (called on the writer's side: it must not block)."""

    __slots__ = ("_buf", "_closed", "_lock", "_notify")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._closed = False
        self._lock = threading.Lock()
        self._notify: Callable[[], None] | None = None

    def subscribe(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        notify()  # what was written before the backend was ready

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._closed:
                return
            self._buf += data
        if self._notify is not None:
            self._notify()

    def close(self) -> None:
        """EOF once what was written has been sent."""
        with self._lock:
            self._closed = True
        if self._notify is not None:
            self._notify()

    def take(self, limit: int = 1 << 30) -> tuple[bytes, bool]:
        """Up to `limit` bytes written and not yet taken, and whether EOF follows them."""
        with self._lock:
            data = bytes(self._buf[:limit])
            del self._buf[:limit]
            return data, self._closed and not self._buf


@dataclass(slots=True)
class CommandResult:
    """The outcome of one command. Output is bytes; callers decide how to decode it."""

    exit_status: int | None
    exit_signal: str | None
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    stdout_truncated: bool
    stderr_truncated: bool
    # Seconds spent per stage: queue (waiting for a slot), connect, open (channel), exec.
    timings: dict[str, float] = field(default_factory=dict)
    # What the login (an rc file, ~/.ssh/rc) printed on stdout before the command started: not
    # output, kept apart so a host check can say the account is noisy (Capture.preamble).
    preamble: bytes = b""

    @property
    def ok(self) -> bool:
        return self.exit_status == 0

    @classmethod
    def from_captures(
        cls, exit_status: int | None, exit_signal: str | None, out: Capture, err: Capture
    ) -> CommandResult:
        return cls(
            exit_status=exit_status,
            exit_signal=exit_signal,
            stdout=out.getvalue(),
            stderr=err.getvalue(),
            stdout_bytes=out.total,
            stderr_bytes=err.total,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            preamble=out.preamble,
        )
