"""What runs on the host: the wrapper around a command, output capture with caps, the result.

sshd starts every exec session with setsid(), so the login shell is the leader of a new process
group whose id is its pid. The wrapper prints that pid as the first line of stdout; on timeout or
cancel the pool kills the whole group with it, because closing the channel leaves the remote
command running (measured: asyncssh `run(timeout=)` and paramiko leave orphans).
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger("sshpool")

OutputStream = Literal["stdout", "stderr"]

# Bytes every login shell (sh, bash, zsh, tcsh...) passes through single quotes untouched.
_INERT = frozenset(range(0x20, 0x7F)) - frozenset(b"'!\\%")


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
    line = shlex.join(argv)
    if "\n" not in line and "!" not in line:
        return line
    escaped = "".join(
        "%%" if b == 0x25 else chr(b) if b in _INERT else f"\\{b:03o}" for b in line.encode()
    )
    return f"""exec /bin/sh -c 'eval "$(printf "$0")"' '{escaped}'"""


def wrap(command: str) -> str:
    """The line sent to sshd: report the process group id, then run the command."""
    return "echo $$; " + command


def kill_group_line(pgid: int, grace: float = 1.0) -> str:
    """A line that sends TERM to a process group, waits up to `grace`, then KILLs it.

    No `--` before the negative id: dash (Debian's /bin/sh, a common login shell for service
    accounts) rejects `kill -TERM -- -PGID` ("Illegal number: -"); `kill -TERM -PGID` works in
    dash, bash and zsh alike. It runs under /bin/sh whatever the login shell: csh-family shells
    (tcsh) know none of this syntax."""
    steps = max(1, int(grace / 0.05))
    g = f"-{int(pgid)}"
    script = (
        f"kill -TERM {g} 2>/dev/null || exit 0; i=0; "
        f"while [ $i -lt {steps} ] && kill -0 {g} 2>/dev/null; do sleep 0.05; i=$((i+1)); done; "
        f"kill -KILL {g} 2>/dev/null; exit 0"
    )
    return f"exec /bin/sh -c '{script}'"


class Capture:
    """Collects one output stream: keeps the first `cap` bytes, counts all of them.

    With `marker=True` the first line is the wrapper's process group id and is not output.

    `on_data(chunk)` observes the output as it arrives, whatever the cap: it is called on the
    event loop for every chunk the backend feeds (the marker line excluded), in order, before the
    cap applies. It runs inside the backend's drain loop, so it must be cheap and never block
    (append to a buffer, set an event); an exception it raises is logged and the hook dropped,
    never allowed to break the drain.
    """

    __slots__ = (
        "_buf",
        "_head",
        "cap",
        "marker",
        "on_data",
        "on_start",
        "pgid",
        "total",
        "truncated",
    )

    def __init__(
        self,
        cap: int,
        *,
        marker: bool = False,
        on_start: Callable[[], None] | None = None,
        on_data: Callable[[bytes], None] | None = None,
    ) -> None:
        self.cap = cap
        self.marker = marker
        # Called once when the marker line arrives: the remote command is running.
        self.on_start = on_start
        self.on_data = on_data
        self.pgid: int | None = None
        self.total = 0
        self.truncated = False
        self._buf = bytearray()
        self._head = bytearray()

    def feed(self, data: bytes) -> None:
        if self.marker and self.pgid is None:
            self._head += data
            line, sep, rest = self._head.partition(b"\n")
            if not sep:
                if len(self._head) > 64:  # no marker: something else printed first
                    self._give_up_marker()
                return
            try:
                self.pgid = int(line)
            except ValueError:
                self._give_up_marker()
                return
            self._head = bytearray()
            if self.on_start is not None:
                self.on_start()
            data = bytes(rest)
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
        # A login script printed before the wrapper: keep its bytes as output, kill by signal only.
        head, self._head, self.marker = bytes(self._head), bytearray(), False
        self.feed(head)

    def getvalue(self) -> bytes:
        return bytes(self._buf)


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
        )
