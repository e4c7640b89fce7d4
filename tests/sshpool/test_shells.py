"""Property: argv sent through the pool arrives byte-exact, whatever login shell the account has.

sshd runs every command through the account's login shell (`$SHELL -c '<line>'`), so argv
quoting must survive the shells an HPC site gives its users: dash (/bin/sh), bash, zsh and tcsh
(Debian packages; `make test` installs zsh and tcsh). Each shell gets its own sshd and account
(`LocalHost(shell=...)`). The remote program is `printf '%s\\0' ARGS...`, which prints every
argument it received followed by a NUL: the received argv, exactly.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sshpool import CommandResult, CommandTimeout, Pool, Target
from sshpool.devhost import LocalHost, Rig, RigSpec

SHELLS = ["sh", "bash", "zsh", "tcsh"]
# Any text but NUL (refused with a clear error before anything is sent) and lone surrogates
# (not representable in UTF-8, so never in a JSON request).
ARG = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\0"), max_size=40)
# The characters shells treat specially, over-represented so every example is adversarial.
NASTY = st.text(st.sampled_from([*"'\"\\$`!*?[]{}()<>|&;#~%^= \t\n\r-", "é", "\u202e"]))


@pytest.fixture(scope="module", params=SHELLS)
def shell_host(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalHost]:
    path = shutil.which(request.param)
    if path is None:
        pytest.fail(f"{request.param} is missing: `make test` installs it", pytrace=False)
    spec = RigSpec(f"shell-{request.param}", "stock", shell=path)
    with Rig(spec, data_dir=tmp_path_factory.mktemp("sh")) as rig:
        yield rig.host


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    # Hypothesis drives a synchronous test; one loop (and one pool) serves all its examples.
    with asyncio.Runner() as loop:
        yield loop


@pytest.fixture(scope="module")
def pool(runner: asyncio.Runner) -> Iterator[Pool]:
    pool = Pool()
    yield pool
    runner.run(pool.close())


def run(
    runner: asyncio.Runner,
    pool: Pool,
    target: Target,
    command: str | list[str],
    timeout: float = 20,
) -> tuple[CommandResult, bool]:
    """The result, and whether the remote command started (the shell ran the pool's wrapper)."""
    started: list[bool] = []
    result = runner.run(
        pool.run(target, command, timeout=timeout, on_started=lambda _pgid: started.append(True))
    )
    return result, bool(started)


def test_login_shell_is_the_one_asked_for(
    shell_host: LocalHost, runner: asyncio.Runner, pool: Pool
) -> None:
    """The account really logs in with the shell under test (the matrix is not four dashes)."""
    result, _ = run(runner, pool, shell_host.target(), "echo $SHELL")
    assert result.stdout.decode().strip().endswith("/" + shell_host.name.removeprefix("shell-"))


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(args=st.lists(st.one_of(ARG, NASTY), min_size=1, max_size=6))
# Found by this test: under tcsh these ran `touch` as a command of its own (and `&` in the
# background) before the pool escaped newlines and `!` for csh-family shells.
@example(args=["x\n", "\ntouch injected\n"])
@example(args=["\n", "&\n", "!!"])
# Found by this test: shlex leaves `=0` unquoted; zsh expanded it to a command's path (or
# failed: "0 not found") and tcsh to its directory stack's first entry.
@example(args=["=0", "=printf", "a=b"])
def test_argv_round_trips_byte_exact(
    shell_host: LocalHost, runner: asyncio.Runner, pool: Pool, args: list[str]
) -> None:
    """Every argument, however hostile to a shell (newlines and `!` included, which tcsh treats
    as syntax even inside single quotes), reaches the remote program unchanged."""
    result, started = run(runner, pool, shell_host.target(), ["printf", "%s\\0", *args])
    expected = b"".join(a.encode() + b"\0" for a in args)
    assert (result.exit_status, result.stdout, started) == (0, expected, True), result.stderr


def test_timeout_kills_the_remote_command(
    shell_host: LocalHost, runner: asyncio.Runner, pool: Pool
) -> None:
    """The pool's kill line (TERM, then KILL, of the remote process group) works whatever the
    login shell, so a timeout leaves no command behind on a tcsh account either, even one that
    ignores TERM."""
    seconds = str(random.randrange(10**6, 10**7))  # names the remote sleep for pgrep
    word = f"sleep {seconds}"
    with pytest.raises(CommandTimeout):
        # TERM ignored (and inherited by sleep): only the kill line's KILL ends it.
        command = ["sh", "-c", f"trap '' TERM; {word}; true"]
        run(runner, pool, shell_host.target(), command, timeout=1)

    async def gone() -> bool:
        for _ in range(60):
            if not shell_host.processes(word):
                return True
            await asyncio.sleep(0.05)
        return False

    assert runner.run(gone())
