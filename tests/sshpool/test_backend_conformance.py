"""One conformance suite for the three SSH backends (asyncssh, paramiko, ssh2) against real sshd.

Each test runs once per backend; the command tests (`exec_conn`, `mode`) run once more per
backend in agent mode, through the executor (sshpool.agent), which must behave the same.
Backends are driven directly (connect, exec with captures) where the pool is not needed; remote
kills and bursts go through `Pool(backend=...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import asyncssh
import psutil
import pytest

from sshpool import (
    AuthenticationFailed,
    ChannelRefused,
    CommandTimeout,
    ConnectError,
    ConnectionLost,
    ConnectTimeout,
    HostKeyMismatch,
    Pool,
    Target,
)
from sshpool.agent import start_agent
from sshpool.backends import BACKENDS as REGISTRY
from sshpool.backends import Backend, Connection, Exit, load_backend
from sshpool.certificates import Credentials, UserCA
from sshpool.command import Capture, new_marker, wrap
from sshpool.devhost import LocalHost

MakeHost = Callable[..., LocalHost]
BACKENDS = list(REGISTRY)  # every backend the registry knows
MB = 1 << 20


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    return load_backend(request.param)


@pytest.fixture(params=["keys", "certificate"])
async def conn(
    backend: Backend, stock_host: LocalHost, request: pytest.FixtureRequest
) -> AsyncIterator[Connection]:
    """A connection to the stock host, closed after the test: logged in with the host's key
    file, or with a fresh certificate of its user CA."""
    certificate = request.param == "certificate"
    target = stock_host.certificate_target() if certificate else stock_host.target()
    connection = await backend.connect(target)
    yield connection
    await connection.close()


@pytest.fixture(params=["channel", "agent"])
def mode(request: pytest.FixtureRequest) -> str:
    """How commands reach the host: a channel each, or through the executor (agent mode)."""
    return str(request.param)


@pytest.fixture
async def exec_conn(
    backend: Backend, stock_host: LocalHost, mode: str
) -> AsyncIterator[Connection]:
    """A connection to the stock host in `mode`, closed after the test."""
    connection: Connection = await backend.connect(stock_host.target())
    if mode == "agent":
        connection = await start_agent(connection, 16)
    yield connection
    await connection.close()


def marker() -> str:
    """A unique word to find a test's remote processes with pgrep."""
    return f"sshapi-conf-{uuid.uuid4().hex[:12]}"


async def run(
    conn: Connection, command: str, stdin: bytes | None = None, cap: int = MB
) -> tuple[Exit, Capture, Capture]:
    out, err = Capture(cap), Capture(cap)
    async with asyncio.timeout(60):
        end = await conn.exec(command, stdin, out, err)
    return end, out, err


async def gone(host: LocalHost, pattern: str, within: float = 2.0) -> bool:
    """True once no process of the host account matches `pattern` (polled up to `within` s)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not host.processes(pattern):
            return True
        await asyncio.sleep(0.05)
    return not host.processes(pattern)


async def dead(conn: Connection, within: float) -> bool:
    """True once the connection reports itself dead (polled up to `within` s)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not conn.is_alive():
            return True
        await asyncio.sleep(0.05)
    return not conn.is_alive()


def sessions(host: LocalHost) -> list[psutil.Process]:
    """The per-connection sshd processes under the host's listener."""
    assert host.pid is not None
    return psutil.Process(host.pid).children(recursive=True)


@pytest.mark.parametrize("name", ["paramiko", "ssh2"])
def test_missing_library_names_the_extra(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Choosing a backend whose library is not installed says which extra to install."""
    # For both, the backend, the library's import name and the extra share one name.
    monkeypatch.setitem(sys.modules, name, None)  # makes `import <name>` fail
    monkeypatch.delitem(sys.modules, f"sshpool.backends.{name}", raising=False)
    with pytest.raises(ImportError, match=re.escape(f"pip install 'sshapi[{name}]'")):
        load_backend(name)


# ---- commands


@pytest.mark.parametrize("profile", ["stock", "tuned"])
async def test_output_and_exit_status(
    backend: Backend, profile: str, request: pytest.FixtureRequest
) -> None:
    """stdout and stderr come back apart, with the exit status, on both sshd profiles."""
    host: LocalHost = request.getfixturevalue(f"{profile}_host")
    conn = await backend.connect(host.target())
    try:
        end, out, err = await run(conn, "printf 'a\\0b'; echo oops >&2; exit 0")
    finally:
        await conn.close()
    assert end == Exit(status=0)
    assert (out.getvalue(), err.getvalue()) == (b"a\0b", b"oops\n")


async def test_nonzero_exit_status(exec_conn: Connection) -> None:
    """A failing command reports its exit status, not an error."""
    end, _, err = await run(exec_conn, "echo bad >&2; exit 42")
    assert end == Exit(status=42)
    assert err.getvalue() == b"bad\n"


async def test_stdin_is_written_then_closed(exec_conn: Connection) -> None:
    """stdin arrives byte-exact (2 MB, past one SSH window) and is followed by EOF."""
    data = os.urandom(2 * MB)
    end, out, _ = await run(exec_conn, "cat; echo done >&2", stdin=data, cap=4 * MB)
    assert end == Exit(status=0)
    assert out.getvalue() == data


async def test_command_that_stops_reading_stdin_still_returns(exec_conn: Connection) -> None:
    """A command that exits after reading 3 bytes of a 4 MB stdin returns normally."""
    end, out, _ = await run(exec_conn, "head -c 3", stdin=b"abc" + bytes(4 * MB))
    assert (end, out.getvalue()) == (Exit(status=0), b"abc")


async def test_no_stdin_means_eof_at_once(exec_conn: Connection) -> None:
    """Without stdin a command reading it sees EOF immediately instead of hanging."""
    end, out, _ = await run(exec_conn, "wc -c")
    assert (end, out.getvalue().strip()) == (Exit(status=0), b"0")


async def test_ten_megabytes_on_both_streams_at_once(exec_conn: Connection) -> None:
    """10 MB on stdout and on stderr, written concurrently, drain without a hang."""
    size = 10 * 1000 * 1000
    started = time.monotonic()
    end, out, err = await run(
        exec_conn, f"head -c {size} /dev/zero & head -c {size} /dev/zero >&2; wait", cap=MB
    )
    assert end == Exit(status=0)
    assert (out.total, err.total) == (size, size)
    assert time.monotonic() - started < 20


async def test_caps_keep_the_head_and_count_everything(exec_conn: Connection) -> None:
    """Past its cap a capture keeps the first bytes, counts them all and says it truncated."""
    out, err = Capture(10), Capture(10)
    end = await exec_conn.exec("printf 0123456789abcdef; printf short >&2", None, out, err)
    assert end == Exit(status=0)
    assert (out.getvalue(), out.total, out.truncated) == (b"0123456789", 16, True)
    assert (err.getvalue(), err.total, err.truncated) == (b"short", 5, False)


async def test_output_is_observed_as_it_arrives_not_at_the_end(
    backend: Backend, tuned_host: LocalHost, mode: str
) -> None:
    """Pool.run's on_output sees each line while the command still runs, both streams, all of
    the bytes past the cap too, while the result keeps only the capped head."""
    seen: list[tuple[str, bytes, float]] = []
    line = "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.3; done; head -c 5000 /dev/zero"
    async with Pool(backend=backend) as pool:
        result = await pool.run(
            replace(tuned_host.target(), exec_mode=mode),
            line,
            max_output=8,
            on_output=lambda stream, data: seen.append((stream, data, time.monotonic())),
        )
    ended = time.monotonic()
    out = b"".join(d for s, d, _ in seen if s == "stdout")
    err = b"".join(d for s, d, _ in seen if s == "stderr")
    assert out == b"out1\nout2\nout3\n" + bytes(5000)
    assert err == b"err1\nerr2\nerr3\n"
    assert (result.stdout, result.stdout_bytes, result.stdout_truncated) == (
        b"out1\nout",
        len(out),
        True,
    )
    first_out = next(t for s, _, t in seen if s == "stdout")
    first_err = next(t for s, _, t in seen if s == "stderr")
    # The loop sleeps 0.9 s in all: the first lines arrived well before the end.
    assert ended - first_out > 0.5 and ended - first_err > 0.5


async def test_failing_output_hook_never_breaks_the_command(exec_conn: Connection) -> None:
    """An on_data hook that raises is dropped; the capture and the exec go on."""

    def broken(data: bytes) -> None:
        raise RuntimeError("observer bug")

    out, err = Capture(MB, on_data=broken), Capture(MB)
    end = await exec_conn.exec("echo a; sleep 0.1; echo b", None, out, err)
    assert (end, out.getvalue(), out.on_data) == (Exit(status=0), b"a\nb\n", None)


async def test_marker_line_gives_the_process_group(exec_conn: Connection) -> None:
    """Through the pool's wrapper the first line is the remote process group id, not output."""
    token = new_marker()
    out, err = Capture(MB, marker=token), Capture(MB)
    end = await exec_conn.exec(wrap("echo hi", token), None, out, err)
    assert end == Exit(status=0)
    assert out.pgid is not None and out.pgid > 1
    assert out.getvalue() == b"hi\n"


async def test_killed_shell_reports_the_signal(
    backend: Backend, exec_conn: Connection, mode: str
) -> None:
    """A command whose shell dies of a signal reports it (exit status -1, as asyncssh does)."""
    end, _, _ = await run(exec_conn, "kill -KILL $$")
    if backend.name == "ssh2" and mode == "channel":
        # Documented limitation: ssh2-python's get_exit_signal drops the signal name, and
        # libssh2's exit status defaults to 0. This assertion fails once that is fixed. (In
        # agent mode the executor reports the signal in its own frame.)
        assert end == Exit(status=0)
    else:
        assert end == Exit(status=-1, signal="KILL")


# ---- multiplexing


async def test_many_concurrent_execs_share_one_connection(
    backend: Backend, tuned_host: LocalHost
) -> None:
    """16 commands run at once on one connection (tuned MaxSessions 16): each waits until all
    16 have started (a barrier of files), which only channels running together can pass; one
    after another, the first waits forever. (Before: 16 x 0.5 s within 4 s, a bound the box's
    load could break.)"""
    barrier = f"barrier-{uuid.uuid4().hex[:8]}"
    # Each gives up after 120 s (2,400 naps): a run cut short leaves no process looping on.
    wait_all = (
        f"n=0; until [ $(ls {barrier} 2>/dev/null | wc -l) -ge 16 ]; "
        "do [ $n -ge 2400 ] && exit 1; n=$((n+1)); sleep 0.05; done"
    )
    join = f"mkdir -p {barrier}; touch {barrier}/$$"  # every slot in use: no extra channel
    conn = await backend.connect(tuned_host.target())
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(run(conn, f"{join}; {wait_all}; echo {i}") for i in range(16))),
            120,  # not a speed bound: 16 commands that never meet wait here forever
        )
    finally:
        await conn.close()
        shutil.rmtree(Path(tuned_host.account.home, barrier), ignore_errors=True)
    assert [out.getvalue() for _, out, _ in results] == [f"{i}\n".encode() for i in range(16)]
    assert all(end == Exit(status=0) for end, _, _ in results)


async def test_channels_past_maxsessions_are_refused(conn: Connection) -> None:
    """On stock sshd (MaxSessions 10) channel 11 and 12 raise ChannelRefused, the rest run."""
    results = await asyncio.gather(
        *(run(conn, "sleep 1") for _ in range(12)), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, ChannelRefused)]
    ran = [r for r in results if isinstance(r, tuple)]
    assert (len(refused), len(ran)) == (2, 10), results
    end, out, _ = await run(conn, "echo still")
    assert (end, out.getvalue()) == (Exit(status=0), b"still\n")


# ---- cancellation and kills


async def test_cancel_signals_the_shell_and_frees_the_exec(
    exec_conn: Connection, stock_host: LocalHost
) -> None:
    """Cancelling exec (in the middle of writing 4 MB of stdin the command does not read)
    returns at once, the TERM request ends the login shell, and the connection keeps working."""
    word = marker()
    running = asyncio.Event()
    token = new_marker()
    out = Capture(MB, marker=token, on_start=running.set)
    stdin = bytes(4 * MB)
    line = wrap(f"sleep 30; : {word}", token)
    task = asyncio.create_task(exec_conn.exec(line, stdin, out, Capture(MB)))
    await asyncio.wait_for(running.wait(), 10)
    assert out.pgid is not None
    await asyncio.sleep(0.2)  # let the stdin writes fill the channel window
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # At once, not after the 4 MB write the command never reads (which never ends) nor the
    # 30 s sleep: the bound leaves the loaded box its pauses (it was 2.5 s, which load broke).
    assert time.monotonic() - started < 10
    try:
        assert await gone(stock_host, word), "the TERM request did not reach the shell"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(out.pgid, signal.SIGKILL)  # the orphaned sleep: the pool's job, not ours
    end, again, _ = await run(exec_conn, "echo next")
    assert (end, again.getvalue()) == (Exit(status=0), b"next\n")
    assert exec_conn.is_alive()


async def test_timeout_kills_the_remote_tree_through_the_pool(
    backend: Backend, stock_host: LocalHost, mode: str
) -> None:
    """Pool.run past its timeout raises CommandTimeout and no process of it is left."""
    word = marker()
    async with Pool(backend=backend) as pool:
        with pytest.raises(CommandTimeout) as info:
            await pool.run(
                replace(stock_host.target(), exec_mode=mode),
                f"echo partial; sleep 60 & sleep 61 | cat # {word}",
                timeout=1,
            )
    assert info.value.result.stdout == b"partial\n"
    assert await gone(stock_host, word)


@pytest.mark.slow
async def test_cold_burst_of_200_on_stock_sshd_has_no_failures(
    backend: Backend, stock_host: LocalHost
) -> None:
    """200 commands released at once on a cold pool against stock sshd all succeed."""
    target = stock_host.target()
    async with Pool(backend=backend) as pool:
        async with asyncio.timeout(120):
            results = await asyncio.gather(
                *(pool.run(target, ["echo", str(i)]) for i in range(200)), return_exceptions=True
            )
        stats = pool.stats()[target]
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(200)]  # type: ignore[union-attr]
    assert stats["counters"].get("connects_failed", 0) == 0


# ---- connecting


async def test_replaced_host_key_is_a_mismatch(backend: Backend, make_host: MakeHost) -> None:
    """A host key that is not the one in known_hosts gives HostKeyMismatch."""
    host = make_host("stock")
    host.replace_host_key()
    with pytest.raises(HostKeyMismatch):
        await backend.connect(host.target())


async def test_host_missing_from_known_hosts_fails_closed(
    backend: Backend, stock_host: LocalHost, tmp_path: Path
) -> None:
    """A known_hosts without the host gives HostKeyMismatch: there is no trust-on-first-use."""
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyMismatch):
        await backend.connect(replace(stock_host.target(), known_hosts=str(empty)))


async def test_wrong_client_key_is_authentication_failed(
    backend: Backend, stock_host: LocalHost, tmp_path: Path
) -> None:
    """A client key the host does not accept gives AuthenticationFailed."""
    other = tmp_path / "other_key"
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)]
    await asyncio.to_thread(subprocess.run, keygen, check=True)
    with pytest.raises(AuthenticationFailed):
        await backend.connect(replace(stock_host.target(), client_keys=(str(other),)))


async def test_second_client_key_is_tried(
    backend: Backend, stock_host: LocalHost, tmp_path: Path
) -> None:
    """With a refused key first and the right one second, the connection authenticates."""
    other = tmp_path / "other_key"
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)]
    await asyncio.to_thread(subprocess.run, keygen, check=True)
    target = stock_host.target()
    conn = await backend.connect(replace(target, client_keys=(str(other), *target.client_keys)))
    try:
        end, out, _ = await run(conn, "echo in")
    finally:
        await conn.close()
    assert (end, out.getvalue()) == (Exit(status=0), b"in\n")


# ---- certificate logins


async def test_certificate_login_names_the_identity_in_sshd_log(
    backend: Backend, stock_host: LocalHost
) -> None:
    """A certificate login runs as the account, and sshd logs the key id naming the identity."""
    identity = marker()
    conn = await backend.connect(stock_host.certificate_target(identity))
    try:
        _, out, _ = await run(conn, "id -un")
    finally:
        await conn.close()
    assert out.getvalue().decode().strip() == stock_host.username
    assert re.search(rf"ED25519-CERT \S+ ID {identity}/devhost-\S+/\d+ ", stock_host.log_tail(400))


async def test_certificate_of_an_untrusted_ca_is_authentication_failed(
    backend: Backend, stock_host: LocalHost
) -> None:
    """A certificate signed by a CA sshd does not trust gives AuthenticationFailed."""
    other = UserCA(asyncssh.generate_private_key("ssh-ed25519").export_private_key())
    with pytest.raises(AuthenticationFailed):
        await backend.connect(replace(stock_host.certificate_target(), ca=other))


class _PastCA(UserCA):
    """Mints as if an hour ago: its certificates expired before they are used (a replay)."""

    def mint(self, account: str, identity: str, *, now: float | None = None) -> Credentials:
        return super().mint(account, identity, now=time.time() - 3600)


async def test_expired_certificate_is_authentication_failed(
    backend: Backend, stock_host: LocalHost
) -> None:
    """A certificate past its validity (ttl 300 s, minted an hour ago) is refused."""
    past = _PastCA(stock_host.user_ca_key)
    with pytest.raises(AuthenticationFailed):
        await backend.connect(replace(stock_host.certificate_target(), ca=past))
    assert "Certificate invalid: expired" in stock_host.log_tail(40)


async def test_certificate_from_another_source_address_is_refused(
    backend: Backend, stock_host: LocalHost
) -> None:
    """A certificate limited to another source address does not log in from loopback."""
    elsewhere = UserCA(stock_host.user_ca_key, source_address=["192.0.2.1/32"])
    with pytest.raises(AuthenticationFailed):
        await backend.connect(replace(stock_host.certificate_target(), ca=elsewhere))


async def test_refused_port_is_a_connect_error(backend: Backend, make_host: MakeHost) -> None:
    """Nothing listening gives ConnectError, not retried."""
    host = make_host("stock")
    host.stop()
    with pytest.raises(ConnectError) as info:
        await backend.connect(host.target())
    assert not info.value.retryable


@pytest.fixture
def resetting_server() -> Iterator[int]:
    """A port that accepts TCP connections and resets them before any banner, as sshd does
    past MaxStartups."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            client.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def target_at(host: LocalHost, port: int, directory: Path, **limits: float) -> Target:
    """The host's target moved to another loopback port, with a known_hosts that vouches for
    the host's key there."""
    known = directory / f"known_hosts.{port}"
    known.write_text(f"[127.0.0.1]:{port} {host.host_public_key()}\n")
    target = host.target(**limits)
    return replace(target, port=port, known_hosts=str(known))


async def test_reset_before_banner_is_a_retryable_connect_error(
    backend: Backend, stock_host: LocalHost, resetting_server: int, tmp_path: Path
) -> None:
    """A reset before the SSH banner (sshd's MaxStartups drop) gives a retryable ConnectError."""
    with pytest.raises(ConnectError) as info:
        await backend.connect(target_at(stock_host, resetting_server, tmp_path))
    assert not isinstance(info.value, (AuthenticationFailed, HostKeyMismatch))
    assert info.value.retryable


async def test_silent_server_is_a_connect_timeout(
    backend: Backend, stock_host: LocalHost, tmp_path: Path
) -> None:
    """A server that accepts TCP but never sends a banner gives ConnectTimeout on time."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        target = target_at(stock_host, silent.getsockname()[1], tmp_path, connect_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(ConnectTimeout):
            await backend.connect(target)
        # Its 0.5 s connect_timeout, not the default 10 s (nor never): the rest is the box's.
        assert time.monotonic() - started < 5


# ---- connection health


async def test_close_is_idempotent_and_ends_liveness(conn: Connection) -> None:
    """close() twice is fine; afterwards is_alive() is false and exec raises
    ConnectionLost(started=False)."""
    assert conn.is_alive()
    await conn.close()
    await conn.close()
    assert not conn.is_alive()
    with pytest.raises(ConnectionLost) as info:
        await run(conn, "true")
    assert not info.value.started


async def test_listener_restart_keeps_established_connections(
    backend: Backend, make_host: MakeHost
) -> None:
    """An sshd restart that keeps sessions (systemctl restart) leaves the connection working,
    and new connections work too."""
    host = make_host("stock")
    conn = await backend.connect(host.target())
    try:
        host.restart()
        end, out, _ = await run(conn, "echo kept")
        assert (end, out.getvalue()) == (Exit(status=0), b"kept\n")
    finally:
        await conn.close()
    fresh = await backend.connect(host.target())
    await fresh.close()


async def test_sshd_restart_killing_sessions_marks_connection_dead(
    backend: Backend, make_host: MakeHost
) -> None:
    """When sshd restarts and its sessions die, the idle connection reports itself dead and an
    exec on it raises ConnectionLost(started=False); a new connection works."""
    host = make_host("stock")
    conn = await backend.connect(host.target())
    try:
        await run(conn, "true")
        host.stop(kill_sessions=True)
        host.start()
        assert await dead(conn, within=5)
        with pytest.raises(ConnectionLost) as info:
            await run(conn, "true")
        assert not info.value.started
    finally:
        await conn.close()
    fresh = await backend.connect(host.target())
    try:
        end, _, _ = await run(fresh, "true")
    finally:
        await fresh.close()
    assert end == Exit(status=0)


async def test_frozen_peer_is_detected_by_keepalive(backend: Backend, make_host: MakeHost) -> None:
    """A peer that stops answering (its sshd frozen, TCP still up) is declared dead after about
    keepalive_interval x (keepalive_count_max + 1), while a healthy idle one stays alive."""
    host = make_host("stock")
    conn = await backend.connect(host.target(keepalive_interval=0.5, keepalive_count_max=2))
    frozen: list[psutil.Process] = []
    try:
        await asyncio.sleep(2.0)
        assert conn.is_alive(), "an idle, healthy connection must stay alive"
        # Listed now, not at connect: sshd forks the connection's session process after auth.
        frozen = sessions(host)
        for proc in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        assert await dead(conn, within=6)
        assert time.monotonic() - started >= 0.5
    finally:
        for proc in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)
        await conn.close()
