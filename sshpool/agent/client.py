"""Agent mode, the pool's side: one executor per connection, commands multiplexed over its channel.

`start_agent(conn)` runs the executor (`executor.py`, beside this file) on one session channel of
a backend connection: the login shell runs once, `exec`s the host's `python3` with a one-line
bootstrap that reads the executor's source from stdin (nothing is written to disk), and the
executor greets with a HELLO frame. From then on `AgentConnection` is a `Connection` like the
backend's own: `exec(line)` runs the line under the account's login shell through the executor
(the pool's wrapper, marker and kill lines work unchanged), and `run_argv` starts an argv with
no shell at all, its process group reported by the executor. SFTP sessions still open channels of
their own on the backend connection.

Invariants:
- every frame the executor sends is bounded (MAX_FRAME); a longer one, or one that does not
  parse, ends the agent (the connection is then dead to the pool, as a lost one);
- a job's output is acknowledged once its captures took half the executor's window of it (the
  executor stops reading a command past a whole window unacknowledged, so it never waits for
  an ACK it would need): the window is the only buffer between a command and the pool, and a
  command with little output costs no ACK frame at all;
- when the executor's channel ends, every running job fails with ConnectionLost(started=True)
  and the connection reports itself dead: the next command gets a fresh connection and executor;
- an executor that died without killing its commands' process groups (SIGKILL, the OOM killer)
  while its connection lives: those groups are killed first, over a channel of their own on
  that connection (TERM, KILL after 1 s), and the jobs fail with `remote_killed` set; the
  connection is closed only once that kill ended (or REAP_TIMEOUT passed);
- a cancelled job is killed (KILL frame: TERM, KILL after a grace period) and forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import struct
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from sshpool.backends.base import Connection, Exit, SFTPSession
from sshpool.command import Capture, Stdin, command_line, kill_group_line, new_marker, wrap
from sshpool.errors import AgentUnavailable, ChannelRefused, ConnectionLost, SSHPoolError

log = logging.getLogger("sshpool")

# The executor's frames (executor.py has the same numbers; a test checks).
HEADER = struct.Struct(">IBI")
START, STDIN, EOF, KILL, ACK = 1, 2, 3, 4, 5
HELLO, STARTED, OUT, ERR, EXIT, REFUSED, PROTO = 16, 17, 18, 19, 20, 21, 22
# The largest frame either side sends (the executor accepts 1 MiB; its output frames are 64 KiB).
MAX_FRAME = 1 << 20
STDIN_CHUNK = 256 << 10
# The kill of a dead executor's groups: the kill line's 1 s grace, and the channel's open.
REAP_TIMEOUT = 5.0

SOURCE = resources.files(__package__).joinpath("executor.py").read_bytes()
# Read exactly the executor's source (its length is argv[1]) and run it. The pool sends nothing
# else until the executor's HELLO, so the buffered read takes no byte of a frame.
BOOTSTRAP = "import sys;exec(sys.stdin.buffer.read(int(sys.argv[1])))"
# Isolated (-I: no PYTHON* variables, no user site, not the home directory on sys.path; 3.4+)
# and without site (-S: no sitecustomize, usercustomize or .pth file): nothing the account's
# files hold runs in the executor, whatever a token with only files scopes wrote there.
ISOLATED = ("-I", "-S")


def launch_argv(python: str, max_jobs: int) -> list[str]:
    """The executor's command line: the bootstrap under `python`, isolated."""
    return [python, *ISOLATED, "-c", BOOTSTRAP, str(len(SOURCE)), str(max_jobs)]


def launch_line(python: str, max_jobs: int) -> str:
    """The line the login shell runs: the executor, in place of the shell."""
    return "exec " + command_line(launch_argv(python, max_jobs))


class _Job:
    __slots__ = ("done", "err", "on_pgid", "out", "pgid", "received", "unacked")

    def __init__(
        self, out: Capture, err: Capture, on_pgid: Callable[[int | None], None] | None
    ) -> None:
        self.out = out
        self.err = err
        self.on_pgid = on_pgid
        self.pgid: int | None = None  # the command's process group, once STARTED said it
        self.received = {OUT: 0, ERR: 0}
        self.unacked = 0
        self.done: asyncio.Future[Exit] = asyncio.get_running_loop().create_future()


class AgentConnection:
    """A backend connection whose commands run through its executor (module docstring)."""

    def __init__(self, inner: Connection, max_jobs: int) -> None:
        self.inner = inner
        self.max_jobs = max_jobs
        self.hello: dict[str, Any] = {}
        # Output taken before an ACK is sent: half the executor's window (from its HELLO).
        self._ack_every = 1
        self._feed = Stdin()
        self._buf = bytearray()
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self._broken: str | None = None
        self._greeted: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._out = Capture(0, marker=new_marker(), on_data=self._received)
        self._err = Capture(64 << 10)
        self._task: asyncio.Task[Exit] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def preamble(self) -> bytes:
        """What the login printed before the executor started (not any command's output)."""
        return self._out.preamble

    async def start(self, python: str, timeout: float) -> None:
        """Run the executor and wait for its HELLO; AgentUnavailable when it does not come."""
        assert self._out._marker is not None
        marker = self._out._marker.decode().strip()
        self._feed.write(SOURCE)
        line = wrap(launch_line(python, self.max_jobs), marker)
        self._task = asyncio.create_task(self.inner.exec(line, self._feed, self._out, self._err))
        self._task.add_done_callback(self._ended)
        try:
            async with asyncio.timeout(timeout):
                self.hello = await asyncio.shield(self._greeted)
        except (TimeoutError, SSHPoolError) as exc:
            ended = self._task.done()
            await self.stop()
            if not ended:
                # It never greeted and never exited (a python3 that hangs, or prints junk
                # forever): closing its channel leaves it running, holding a session slot of
                # this connection. Its login shell's group goes, as a timed-out command's.
                await self._kill_start()
            stderr = self._err.getvalue().decode(errors="replace").strip()[-300:]
            why = stderr or str(exc) or f"no answer in {timeout} s"
            raise AgentUnavailable(f"no usable {python} for agent mode: {why}"[:500]) from None
        self._ack_every = max(1, self.hello["window"] // 2)

    async def _kill_start(self) -> None:
        """Kill the process group of an executor's start that did not end (its pgid from the
        marker line), within REAP_TIMEOUT; a failure is logged, never raised."""
        pgid = self._out.pgid
        if pgid is None or pgid <= 1 or not self.inner.is_alive():
            return
        try:
            async with asyncio.timeout(REAP_TIMEOUT):
                await self.inner.exec(kill_group_line(pgid), None, Capture(4096), Capture(4096))
        except (SSHPoolError, TimeoutError) as exc:
            log.warning("could not kill the failed executor start's group %s: %s", pgid, exc)

    # ---- frames

    def _send(self, kind: int, rid: int, payload: bytes = b"") -> None:
        self._feed.write(HEADER.pack(len(payload), kind, rid) + payload)

    def _received(self, data: bytes) -> None:
        """The executor's channel delivered `data`: dispatch every whole frame in it."""
        self._buf += data
        while len(self._buf) >= HEADER.size and self._broken is None:
            length, kind, rid = HEADER.unpack_from(self._buf)
            if length > MAX_FRAME:
                self._break(f"the executor sent a frame of {length} bytes")
                return
            if len(self._buf) < HEADER.size + length:
                return
            payload = bytes(self._buf[HEADER.size : HEADER.size + length])
            del self._buf[: HEADER.size + length]
            try:
                self._dispatch(kind, rid, payload)
            except (ValueError, KeyError, TypeError) as exc:
                self._break(f"the executor sent a malformed frame: {exc}")

    def _dispatch(self, kind: int, rid: int, payload: bytes) -> None:
        if kind == HELLO:
            hello = json.loads(payload)
            # Whatever answers as python3 may send anything: a HELLO is an object whose window
            # is a positive int, or the executor is not ours (ValueError: `_break`).
            window = hello.get("window") if isinstance(hello, dict) else None
            if type(window) is not int or window < 1:
                raise ValueError(f"not the executor's HELLO: {payload[:100]!r}")
            if not self._greeted.done():
                self._greeted.set_result(hello)
            return
        if kind == PROTO:
            log.warning(
                "the executor dropped a request: %s", payload[:300].decode(errors="replace")
            )
            return
        job = self._jobs.get(rid)
        if job is None:
            return  # a job cancelled here: its last frames are of no use
        if kind in (OUT, ERR):
            job.received[kind] += len(payload)
            (job.out if kind == OUT else job.err).feed(payload)
            job.unacked += len(payload)
            if job.unacked >= self._ack_every:
                self._send(ACK, rid, struct.pack(">I", job.unacked))
                job.unacked = 0
        elif kind == STARTED:
            pgid = json.loads(payload)["pgid"]
            job.pgid = pgid if isinstance(pgid, int) and pgid > 1 else None
            if job.on_pgid is not None:
                job.on_pgid(pgid)
        elif kind == EXIT:
            end = json.loads(payload)
            del self._jobs[rid]
            # Output past the cap the executor was given: counted there, never sent.
            for capture, kind_, field in (
                (job.out, OUT, "stdout_bytes"),
                (job.err, ERR, "stderr_bytes"),
            ):
                dropped = int(end[field]) - job.received[kind_]
                if dropped > 0:
                    capture.total += dropped
                    capture.truncated = True
            status = end["status"]
            job.done.set_result(Exit(None if status is None else int(status), end["signal"]))
        elif kind == REFUSED:
            del self._jobs[rid]
            reason = json.loads(payload)
            if reason.get("busy"):
                job.done.set_exception(ChannelRefused("the executor is at its command limit"))
            else:
                job.done.set_exception(SSHPoolError(f"the executor refused: {reason['error']}"))
        else:
            raise ValueError(f"unknown frame type {kind}")

    def _break(self, why: str, killed: bool = False) -> None:
        """The executor is gone or not to be trusted: fail its jobs (`killed`: their groups
        were killed, `_reap`), stop using it."""
        self._mark_broken(why)
        if not self._greeted.done():
            # Broken before its HELLO (junk on the channel): the start fails now, not at its
            # timeout.
            self._greeted.set_exception(ConnectionLost(why, started=False))
            self._greeted.exception()  # retrieved: start() may be gone already
        jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            if not job.done.done():
                exc = ConnectionLost(f"the executor ended: {why}", started=True)
                exc.remote_killed = killed and job.pgid is not None
                job.done.set_exception(exc)
        self._feed.close()

    def _mark_broken(self, why: str) -> None:
        if self._broken is None:
            self._broken = why
            # Before its HELLO, the start fails with the reason (AgentUnavailable), which the
            # pool logs once per host: one line per connection here would repeat it.
            if not self._stopping and self._greeted.done():
                log.warning("the executor ended: %s", why)

    async def _reap(self, why: str, groups: list[int]) -> None:
        """The executor's channel closed under running commands while the connection lives: the
        executor may have had no chance to kill their groups (SIGKILL). Kill them over a channel
        of their own, then fail the jobs."""
        killed = False
        try:
            async with asyncio.timeout(REAP_TIMEOUT):
                await self.inner.exec(kill_group_line(*groups), None, Capture(4096), Capture(4096))
            killed = True
        except (SSHPoolError, TimeoutError) as exc:
            log.warning("could not kill the dead executor's process groups %s: %s", groups, exc)
        finally:
            self._break(why, killed)

    def _ended(self, task: asyncio.Task[Exit]) -> None:
        if task.cancelled():
            self._break("stopped")
        elif task.exception() is not None:
            self._break(f"its channel failed: {task.exception()}")
        else:
            end = task.result()
            stderr = self._err.getvalue().decode(errors="replace").strip()[-300:]
            why = f"its channel closed (exit {end.status}, signal {end.signal}) {stderr}"
            groups = [j.pgid for j in self._jobs.values() if j.pgid is not None]
            if groups and not self._stopping and self.inner.is_alive():
                self._mark_broken(why)  # no new job; the running ones fail after the kill
                self._reaper = asyncio.create_task(self._reap(why, groups))
            else:
                self._break(why)
        if not self._greeted.done():
            self._greeted.set_exception(ConnectionLost(self._broken or "ended", started=False))
            self._greeted.exception()  # retrieved: start() may be gone already

    # ---- the Connection interface

    def is_alive(self) -> bool:
        return self._broken is None and self.inner.is_alive()

    async def exec(
        self, command: str, stdin: bytes | Stdin | None, stdout: Capture, stderr: Capture
    ) -> Exit:
        """`command` under the account's login shell, as sshd would run it (no rc files for
        sh and bash: they are not interactive nor started by sshd)."""
        if isinstance(stdin, Stdin):
            raise TypeError("agent commands take stdin as bytes")
        return await self.run({"line": command}, stdin, stdout, stderr)

    async def run_argv(
        self,
        argv: Sequence[str],
        stdin: bytes | None,
        stdout: Capture,
        stderr: Capture,
        on_pgid: Callable[[int | None], None] | None = None,
    ) -> Exit:
        """`argv` started directly (no shell: PATH lookup as execvp), in a process group of its
        own; `on_pgid` gets the group once it runs (None when it could not start). A cap on
        the output is sent along when nobody watches it live (`on_data`)."""
        request: dict[str, Any] = {"argv": list(argv)}
        if stdout.on_data is None and stderr.on_data is None:
            request["cap"] = max(stdout.cap, stderr.cap)
        return await self.run(request, stdin, stdout, stderr, on_pgid)

    async def run(
        self,
        request: dict[str, Any],
        stdin: bytes | None,
        stdout: Capture,
        stderr: Capture,
        on_pgid: Callable[[int | None], None] | None = None,
    ) -> Exit:
        if not self.is_alive():
            raise ConnectionLost(f"the executor is gone: {self._broken}", started=False)
        rid = next(self._ids)
        job = self._jobs[rid] = _Job(stdout, stderr, on_pgid)
        self._send(START, rid, json.dumps({**request, "stdin": bool(stdin)}).encode())
        if stdin:
            for at in range(0, len(stdin), STDIN_CHUNK):
                self._send(STDIN, rid, stdin[at : at + STDIN_CHUNK])
            self._send(EOF, rid)
        try:
            return await asyncio.shield(job.done)
        except asyncio.CancelledError:
            if self._jobs.pop(rid, None) is not None and self.is_alive():
                self._send(KILL, rid)
            job.done.cancel()
            raise

    async def sftp(self) -> SFTPSession:
        return await self.inner.sftp()

    async def stop(self) -> None:
        """End the executor (EOF on its stdin: it kills what it started and exits)."""
        self._stopping = True
        self._feed.close()
        if self._task is not None and not self._task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait([self._task], timeout=2)
            if not self._task.done():
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)

    async def close(self) -> None:
        await self.stop()
        if self._reaper is not None:
            await asyncio.wait([self._reaper], timeout=REAP_TIMEOUT)
        await self.inner.close()

    def __repr__(self) -> str:
        return f"<agent on {self.inner!r}>"


async def start_agent(
    inner: Connection, max_jobs: int, *, python: str = "python3", timeout: float = 30.0
) -> AgentConnection:
    """An AgentConnection on `inner`, its executor greeted; AgentUnavailable (the executor's
    channel closed, e.g. no such python) leaves `inner` as it was, usable in channel mode."""
    agent = AgentConnection(inner, max_jobs)
    await agent.start(python, timeout)
    return agent
