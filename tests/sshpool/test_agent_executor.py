"""The executor on its own (sshpool/agent/executor.py): spoken to over pipes by a local python3,
frame by frame, hostile frames included. The pool's side over real sshd is test_agent.py."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import struct
import sys
import time
import uuid
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import psutil
import pytest

from sshpool.agent import client

SOURCE_TEXT = resources.files("sshpool.agent").joinpath("executor.py").read_text()
H = client.HEADER


def test_executor_is_python_36_syntax() -> None:
    """Login hosts run old interpreters: the executor parses under Python 3.6's grammar."""
    ast.parse(SOURCE_TEXT, feature_version=(3, 6))


def test_frame_numbers_match_the_client() -> None:
    """The executor and the pool's client agree on every frame type and the header."""
    ns: dict[str, Any] = {"__name__": "executor"}
    exec(compile(SOURCE_TEXT, "executor.py", "exec"), ns)
    for name in ("START", "STDIN", "EOF", "KILL", "ACK", "HELLO", "STARTED", "OUT", "ERR"):
        assert ns[name] == getattr(client, name), name
    for name in ("EXIT", "REFUSED", "PROTO", "MAX_FRAME"):
        assert ns[name] == getattr(client, name), name
    assert ns["HEADER"].format == client.HEADER.format


class Agent:
    """A local executor under this machine's python3, and the frames it sent."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.frames: asyncio.Queue[tuple[int, int, bytes]] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while True:
            try:
                head = await self.proc.stdout.readexactly(H.size)
            except asyncio.IncompleteReadError:
                await self.frames.put((-1, 0, b""))
                return
            length, kind, rid = H.unpack(head)
            await self.frames.put((kind, rid, await self.proc.stdout.readexactly(length)))

    def send(self, kind: int, rid: int, payload: bytes = b"") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(H.pack(len(payload), kind, rid) + payload)

    def start(self, rid: int, **request: Any) -> None:
        self.send(client.START, rid, json.dumps(request).encode())

    async def next(self, timeout: float = 10) -> tuple[int, int, bytes]:
        return await asyncio.wait_for(self.frames.get(), timeout)

    async def until_exit(self, rid: int, ack: bool = True) -> tuple[dict[str, Any], bytes, bytes]:
        """Frames up to `rid`'s EXIT (acknowledging output): the exit, stdout, stderr."""
        out, err = bytearray(), bytearray()
        while True:
            kind, got, payload = await self.next()
            assert kind != -1, "the executor ended"
            if got != rid:
                continue
            if kind in (client.OUT, client.ERR):
                (out if kind == client.OUT else err).extend(payload)
                if ack:
                    self.send(client.ACK, rid, struct.pack(">I", len(payload)))
            elif kind == client.EXIT:
                return json.loads(payload), bytes(out), bytes(err)


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    source = SOURCE_TEXT.encode()
    proc = await asyncio.create_subprocess_exec(
        *client.launch_argv("python3", 4),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(source)
    a = Agent(proc)
    kind, _, hello = await a.next()
    assert kind == client.HELLO and json.loads(hello)["max_jobs"] == 4
    yield a
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
    a.reader.cancel()


def word() -> str:
    return f"sshapi-agent-{uuid.uuid4().hex[:12]}"


def alive(pattern: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(pattern in part for part in p.info["cmdline"] or ()):
            found.append(p)
    return found


async def gone(pattern: str, within: float = 3.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not alive(pattern):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_argv_stdin_exit_status_and_signal(agent: Agent) -> None:
    """argv arrives byte-exact, stdin goes in, the exit status and a signal name come out."""
    agent.start(1, argv=["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "'$x'"])
    end, out, _ = await agent.until_exit(1)
    assert (end["status"], out) == (0, b"['a b', \"'$x'\"]\n")
    agent.start(2, argv=["cat"], stdin=True)
    agent.send(client.STDIN, 2, b"hello ")
    agent.send(client.STDIN, 2, b"world")
    agent.send(client.EOF, 2)
    end, out, _ = await agent.until_exit(2)
    assert (end["status"], out) == (0, b"hello world")
    agent.start(3, line="echo oops >&2; exit 3")
    end, _, err = await agent.until_exit(3)
    assert (end["status"], err) == (3, b"oops\n")
    agent.start(4, argv=["sh", "-c", "kill -KILL $$"])
    end, _, _ = await agent.until_exit(4)
    assert (end["status"], end["signal"]) == (-1, "KILL")
    agent.start(5, argv=["no-such-program-sshapi"])
    end, _, err = await agent.until_exit(5)
    assert end["status"] == 127 and b"no-such-program-sshapi" in err


async def test_kill_and_timeout_end_the_whole_group(agent: Agent) -> None:
    """KILL and a timeout TERM the command's process group (children included)."""
    w1, w2 = word(), word()
    agent.start(1, line=f"sleep 60 & sleep 61 | cat; : {w1}")
    agent.start(2, line=f"sleep 60 & sleep 62; : {w2}", timeout=0.5)
    kind, _rid, started = await agent.next()
    assert kind == client.STARTED and json.loads(started)["pgid"] > 1
    await asyncio.sleep(0.3)
    agent.send(client.KILL, 1)
    ends = [await agent.until_exit(1), await agent.until_exit(2)]
    assert ends[0][0]["signal"] == "TERM"
    assert ends[1][0]["timed_out"] is True
    assert await gone(w1) and await gone(w2)


async def test_hostile_frames_are_refused_and_the_executor_lives(agent: Agent) -> None:
    """An oversized frame is skipped, a malformed start refused, an unknown type reported; the
    next command still runs."""
    agent.send(99, 7, b"x")
    kind, rid, payload = await agent.next()
    assert (kind, rid) == (client.PROTO, 7) and b"unknown frame type" in payload
    assert agent.proc.stdin is not None
    agent.proc.stdin.write(H.pack(client.MAX_FRAME + 1, client.START, 8))
    agent.proc.stdin.write(b"\0" * (client.MAX_FRAME + 1))
    kind, rid, payload = await agent.next()
    assert (kind, rid) == (client.PROTO, 8) and b"limit" in payload
    agent.send(client.START, 9, b"{not json")
    kind, rid, payload = await agent.next()
    assert (kind, rid) == (client.REFUSED, 9) and b"malformed" in payload
    agent.start(10, argv=[])
    kind, rid, _ = await agent.next()
    assert (kind, rid) == (client.REFUSED, 10)
    agent.send(client.ACK, 11, b"short")  # for no job: ignored
    agent.start(12, argv=["echo", "alive"])
    end, out, _ = await agent.until_exit(12)
    assert (end["status"], out) == (0, b"alive\n")


async def test_concurrency_cap_refuses_as_busy(agent: Agent) -> None:
    """Past its max_jobs (4 here) the executor refuses a start as busy."""
    for rid in range(1, 6):
        agent.start(rid, argv=["sleep", "0.5"])
    refused = []
    for _ in range(5):
        kind, rid, payload = await agent.next()
        if kind == client.REFUSED:
            refused.append((rid, json.loads(payload).get("busy")))
    assert refused == [(5, True)]


async def test_output_waits_for_acknowledgement(agent: Agent) -> None:
    """Without ACKs the executor sends one window and stops reading the command's pipe; with
    them, 20 MB flows and is counted. A cap keeps the bytes sent to the cap, counts the rest."""
    agent.start(1, argv=["head", "-c", "20000000", "/dev/zero"])
    sent = 0
    with pytest.raises(TimeoutError):
        while True:
            kind, _, payload = await agent.next(timeout=0.5)
            if kind == client.OUT:
                sent += len(payload)
    assert 0 < sent <= 256 << 10
    agent.send(client.ACK, 1, struct.pack(">I", sent))
    end, out, _ = await agent.until_exit(1)
    assert sent + len(out) == end["stdout_bytes"] == 20_000_000
    agent.start(2, argv=["head", "-c", "5000000", "/dev/zero"], cap=1000)
    end, out, _ = await agent.until_exit(2)
    assert (len(out), end["stdout_bytes"]) == (1000, 5_000_000)


async def test_detached_process_is_bounded_after_a_kill(agent: Agent) -> None:
    """A command that leaves its group (setsid, double fork) survives the group kill, as it
    would under sshd; its pipes are closed after the kill's grace, so the command still ends."""
    w = word()
    agent.start(1, line=f"setsid sh -c 'sleep 30; : {w}' & echo started")
    kind, _rid, _ = await agent.next()
    assert kind == client.STARTED
    await asyncio.sleep(0.3)
    agent.send(client.KILL, 1)
    t0 = time.monotonic()
    _end, out, _ = await agent.until_exit(1)
    # After the kill's grace, not when the detached sleep 30 ends (it was < 3 s, which a
    # loaded box's pauses could break).
    assert out == b"started\n" and time.monotonic() - t0 < 20
    survivors = alive(w)
    assert survivors, "the detached process is expected to survive (it left the group)"
    for p in survivors:
        p.kill()


async def test_channel_close_kills_every_group_and_exits(agent: Agent) -> None:
    """EOF on the executor's stdin (its channel closed): every group it started is killed,
    a TERM-ignoring one too, and the executor exits."""
    w1, w2 = word(), word()
    agent.start(1, line=f"sleep 60; : {w1}")
    agent.start(
        2,
        argv=[
            "python3",
            "-c",
            "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
            f" # {w2}",
        ],
    )
    for _ in range(2):
        assert (await agent.next())[0] == client.STARTED
    await asyncio.sleep(0.3)
    assert agent.proc.stdin is not None
    agent.proc.stdin.close()
    assert await asyncio.wait_for(agent.proc.wait(), 5) == 0
    assert await gone(w1) and await gone(w2)


async def test_term_to_the_executor_kills_its_groups(agent: Agent) -> None:
    """sshd's TERM (the pool cancelled the channel) ends the executor and what it started."""
    w = word()
    agent.start(1, line=f"sleep 60; : {w}")
    assert (await agent.next())[0] == client.STARTED
    os.kill(agent.proc.pid, signal.SIGTERM)
    await asyncio.wait_for(agent.proc.wait(), 5)
    assert await gone(w)


def test_standard_library_only_no_socket_no_file() -> None:
    """The executor imports the standard library only, and nothing that opens a socket or
    writes a file: it speaks on its stdin and stdout and nowhere else."""
    tree = ast.parse(SOURCE_TEXT)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= set(sys.stdlib_module_names)
    assert not imported & {"socket", "tempfile", "shutil", "ssl", "http", "urllib"}
    calls = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert "open" not in calls
