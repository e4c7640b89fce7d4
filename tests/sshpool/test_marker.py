"""The process-group marker against a host whose login prints before the command (issue 15
item 16): a forced command in the host's authorized_keys prints `1` and junk first, as a
`~/.ssh/rc` or a login script would, then runs the session's command. The pool must still find
its own marker line (a per-command random token), return the command's output unchanged, and
kill only the command's own process group on timeout, never `kill -TERM -1`. The same in agent
mode (sshpool/agent), where the noise comes before the executor starts: it is the login's, logged
once, and never a command's output."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from sshpool import CommandTimeout, Pool, Target
from sshpool.command import Capture, new_marker, wrap
from sshpool.devhost import LocalHost

MakeHost = Callable[..., LocalHost]
# What sshd runs instead of the command: noise first, then the command itself, by `exec` so the
# command keeps the session's process (and group). A fake marker line with a small pid too.
NOISY_LOGIN = (
    "command=\"echo 1; printf 'sshpool-pgid-0 2\\\\njunk before\\\\n'; "
    'exec /bin/sh -c \\"$SSH_ORIGINAL_COMMAND\\"" '
)


@pytest.fixture(params=["channel", "agent"])
def mode(request: pytest.FixtureRequest) -> str:
    """How commands reach the host: a channel each, or through the executor (agent mode)."""
    return str(request.param)


def in_mode(target: Target, mode: str) -> Target:
    return replace(target, exec_mode=mode)  # type: ignore[arg-type]


@pytest.fixture
def noisy_host(make_host: MakeHost) -> LocalHost:
    """A tuned host of the test's own whose every session prints `1` and junk first."""
    host = make_host("tuned")
    keys = host.sshd_dir / "authorized_keys"
    keys.write_text(NOISY_LOGIN + keys.read_text())
    return host


async def test_command_output_is_exact_and_the_group_is_its_own_despite_a_noisy_login(
    noisy_host: LocalHost, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`1` and a fake marker printed before the wrapper are neither the pgid nor output; the
    noise is logged once per connection."""
    groups: list[int] = []
    target = in_mode(noisy_host.target(max_connections=1), mode)
    with caplog.at_level(logging.WARNING, logger="sshpool"):
        async with Pool() as pool:
            for _ in range(3):
                result = await pool.run(target, ["printf", "%s", "exact"], on_started=groups.append)
                assert (result.exit_status, result.stdout) == (0, b"exact")
            assert pool.stats()[target]["exec_mode"] == mode
    assert len(groups) == 3 and min(groups) > 2
    noise = [r.message for r in caplog.records if "the login printed" in r.message]
    assert len(noise) == 1 and "junk before" in noise[0], noise


async def test_timeout_kills_only_the_commands_own_group_under_a_noisy_login(
    noisy_host: LocalHost, mode: str
) -> None:
    """A command past its timeout is killed; a second command of the same account, running
    meanwhile, survives (a `kill -TERM -1` would have ended it, and sshd with it)."""
    word = f"{time.time_ns() % 10**6 + 8_000_000}"
    async with Pool() as pool:
        target = in_mode(noisy_host.target(), mode)
        survivor = asyncio.create_task(pool.run(target, f"sleep {word}2; echo survived"))
        await asyncio.sleep(0.5)
        with pytest.raises(CommandTimeout):
            await pool.run(target, f"sleep {word}1", timeout=1)
        deadline = time.monotonic() + 10
        while noisy_host.processes(f"sleep {word}1") and time.monotonic() < deadline:  # noqa: ASYNC110 (a remote process list: nothing to await)
            await asyncio.sleep(0.05)
        assert not noisy_host.processes(f"sleep {word}1")
        assert noisy_host.processes(f"sleep {word}2"), "the other command's group was killed"
        assert noisy_host.running
        noisy_host.run_local(["pkill", "-f", f"^sleep {word}2"])
        result = await survivor
        assert result.stdout == b"survived\n"


def test_only_a_line_with_this_commands_token_counts() -> None:
    """Another token, a bare number, or a pgid <= 1 are never taken as the group; what came
    before the marker is kept apart (`preamble`), not output."""
    token = new_marker()
    out = Capture(1 << 20, marker=token)
    out.feed(b"1\n" + new_marker().encode() + b" 77\njunk")
    assert out.pgid is None
    out.feed(f" {token} 4242\nhello\n".encode())
    assert out.pgid == 4242
    assert out.getvalue() == b"hello\n"
    assert out.preamble.startswith(b"1\n") and out.preamble.endswith(b"junk ")
    low = Capture(1 << 20, marker=token)
    low.feed(f"{token} 1\nrest".encode())
    assert low.pgid is None and low.getvalue() == b"rest"
    assert wrap("true", token).startswith(f"echo {token} $$;")
