"""Processes, ports and clean-up for the dev rig: the one place LocalHost and LocalSlurm share.

* Ports: ``pick_port`` hands out loopback ports below the ephemeral range, remembered per owner
  (a host or cluster directory) so two rigs made in one process before either starts never
  share one, and the port used last is preferred (configs and known_hosts naming it stay valid).
* Processes, read from /proc: ``cmdline``, ``environ_has``, ``alive``, ``pids``, ``children``;
  and stopped: ``terminate`` (a child we started), ``kill_tree``, ``signal_all``, ``wait_gone``.
* ``stop_at_exit`` / ``forget_at_exit``: one registry of started things, stopped at interpreter
  exit (latest first), so no sshd, daemon or job outlives a run that forgot to stop it.

Linux only (/proc). Imports nothing of the rest of sshpool.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

# --------------------------------------------------------------------------------------------
# Ports

# Picked below Linux's ephemeral range (32768-60999), where outgoing connections and other
# programs' bind(0) take their ports: a port of ours stays free while its daemon restarts.
PORT_RANGE = (20000, 32000)

# Ports handed out by this process, and to which owner (a host or cluster directory).
_reserved_ports: dict[tuple[str, int], Path] = {}


def port_is_free(address: str, port: int) -> bool:
    """True when ``address:port`` can be bound now (TCP)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def pick_port(address: str, owner: Path, remembered: Path | None = None) -> int:
    """A free port on ``address`` for ``owner``, reserved for it in this process. Prefers the
    port written in the file ``remembered`` (the owner's last one) when it is still free and not
    handed to another owner; the caller writes the file."""
    if remembered is not None:
        with contextlib.suppress(OSError, ValueError):
            last = int(remembered.read_text())
            key = (address, last)
            if _reserved_ports.get(key, owner) == owner and port_is_free(*key):
                _reserved_ports[key] = owner
                return last
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(*PORT_RANGE)
        if (address, port) not in _reserved_ports and port_is_free(address, port):
            _reserved_ports[address, port] = owner
            return port
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        found: int = sock.getsockname()[1]
    _reserved_ports[address, found] = owner
    return found


# --------------------------------------------------------------------------------------------
# Processes, read from /proc


def pids() -> list[int]:
    """Every process id on the machine (of this pid namespace)."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def cmdline(pid: int) -> str:
    """The command line of ``pid``, arguments joined by spaces; "" when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def environ_has(pid: int, entry: bytes) -> bool:
    """True when the environment of ``pid`` holds ``entry`` (``b"NAME=value"``)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False


def alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie is dead for our purpose: its parent reaps it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """All descendants of ``pid``, deepest last."""
    parents: dict[int, list[int]] = {}
    for entry in pids():
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(entry)
    found: list[int] = []
    queue = [pid]
    while queue:
        for child in parents.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


# --------------------------------------------------------------------------------------------
# Stopping processes


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants. It is stopped first, so it forks no new child
    (an sshd listener accepting one more connection) while its tree is read."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    for child in children(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM a child we started, SIGKILL it if it outlives ``timeout``, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def signal_all(targets: Sequence[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each pid, skipping those already gone."""
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(targets: Sequence[int], timeout: float) -> list[int]:
    """Wait until none of ``targets`` is alive; the ones still alive at the deadline."""
    deadline = time.monotonic() + timeout
    left = list(targets)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if alive(pid)]
    return left


# --------------------------------------------------------------------------------------------
# Stopped at exit


class Stoppable(Protocol):
    def stop(self) -> None: ...


# Things started by this process and not yet stopped, in start order: held (a running host is
# never garbage collected with its sshd left behind) and stopped at interpreter exit.
_started: dict[Stoppable, None] = {}


def stop_at_exit(thing: Stoppable) -> None:
    """Stop ``thing`` at interpreter exit unless ``forget_at_exit`` is called first."""
    _started[thing] = None


def forget_at_exit(thing: Stoppable) -> None:
    """``thing`` was stopped: nothing left to do at exit."""
    _started.pop(thing, None)


@atexit.register
def _stop_all() -> None:
    # Latest first, as an ExitStack would: a host started on a cluster stops before the cluster.
    for thing in reversed(list(_started)):
        with contextlib.suppress(Exception):
            thing.stop()
