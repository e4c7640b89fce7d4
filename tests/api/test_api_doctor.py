"""`sshapi doctor` against real sshd hosts: a healthy host passes; a noisy login, a wrong host
key and an SSH budget that does not fit each fail with a line saying what to change."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import asyncssh
import pytest

from api.config import HostConfig
from api.doctor import Finding, check_host, penalties_finding
from api.local import local_host_config
from api.settings import Settings
from sshpool import Limits, Pool
from sshpool.devhost import LocalHost
from tests.api.api_helpers import REDIS_URL

SSHAPI = str(Path(sys.executable).parent / "sshapi")
# sshd runs the command after this: a login whose rc prints (or sleeps) before every command.
NOISY = {"ForceCommand": 'echo "Welcome to the cluster"; eval "$SSH_ORIGINAL_COMMAND"'}
SLOW = {"ForceCommand": 'sleep 0.05; eval "$SSH_ORIGINAL_COMMAND"'}


def doctor(host: HostConfig, settings: Settings | None = None) -> dict[str, Finding]:
    """The host's findings by check (the last of each check)."""

    async def run() -> list[Finding]:
        async with Pool() as pool:
            return await check_host(pool, "h", host, settings or Settings(), 10.0)

    return {f.check: f for f in asyncio.run(run())}


def failures(found: dict[str, Finding]) -> list[str]:
    return [f.line() for f in found.values() if f.status == "FAIL"]


def test_healthy_host_passes_every_check(tuned_host: LocalHost) -> None:
    """The local host as `sshapi dev` configures it: reachable, key known, auth, silent shell,
    limits from the configuration (the account may not run sshd -T), budget fits."""
    found = doctor(local_host_config(tuned_host))
    assert failures(found) == []
    assert set(found) >= {"reachable", "host key", "auth", "login shell", "shell start"}
    assert found["login shell"].status == "ok"
    assert "configured [hosts.h.sshd]" in found["sshd limits"].detail
    assert found["budget"].status == "ok", found["budget"].line()
    assert found["agent"].status == "ok" and "runs the executor" in found["agent"].detail
    # `sshapi dev`'s host takes the default, "auto": agent mode where python3 answers.
    assert "exec_mode auto: agent mode here" in found["agent"].detail, found["agent"].line()
    assert "; max_sessions 8 where it does not start)" in found["budget"].detail


def test_auto_host_without_python3_warns_that_it_runs_as_channels(
    tuned_host: LocalHost,
) -> None:
    """A host in the default mode ("auto") whose interpreter is missing: a WARN saying it runs
    channels and how to give it agent mode or stop trying; nothing fails."""
    config = local_host_config(tuned_host).model_copy(
        update={"agent_python": "/nonexistent/python3"}
    )
    assert config.exec_mode == "auto"
    found = doctor(config)
    assert found["agent"].status == "WARN", found["agent"].line()
    assert "exec_mode auto runs channels here" in found["agent"].detail
    assert 'exec_mode = "channel" to stop trying' in found["agent"].detail
    assert failures(found) == []


def test_agent_host_without_python3_warns_that_it_runs_as_channels(
    tuned_host: LocalHost,
) -> None:
    """A host in agent mode whose interpreter is missing: a WARN naming it and what to set;
    its commands still run (as channels)."""
    config = local_host_config(tuned_host).model_copy(
        update={"exec_mode": "agent", "agent_python": "/nonexistent/python3"}
    )
    found = doctor(config)
    assert found["agent"].status == "WARN", found["agent"].line()
    assert "/nonexistent/python3" in found["agent"].detail
    assert "agent_python" in found["agent"].detail
    assert failures(found) == []
    # The budget counts agent mode's channels: the executor's and the SFTP sessions'.
    assert "1 executor + 7 SFTP channels" in found["budget"].detail, found["budget"].line()


def test_noisy_login_shell_fails_naming_what_it_prints(make_host: object) -> None:
    """A login that prints a banner before every command fails the `login shell` check, which
    quotes the noise and says to make the rc files silent."""
    host = make_host("tuned", overrides=NOISY)  # type: ignore[operator]
    found = doctor(local_host_config(host))
    assert found["login shell"].status == "FAIL"
    assert "Welcome to the cluster" in found["login shell"].detail
    assert "rc files silent" in found["login shell"].detail


def test_slow_login_shell_warns_with_its_start_time(make_host: object) -> None:
    """A login that takes 50 ms before every command warns past 20 ms, with the time."""
    host = make_host("tuned", overrides=SLOW)  # type: ignore[operator]
    found = doctor(local_host_config(host))
    assert found["shell start"].status == "WARN", found["shell start"].line()
    assert float(found["shell start"].detail.split(" ms")[0]) >= 50.0


def test_wrong_host_key_fails_and_stops_there(tuned_host: LocalHost, tmp_path: Path) -> None:
    """known_hosts holding another key for the host: `host key` fails, saying to verify and
    add the key, and no later check runs."""
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
    known = tmp_path / "known_hosts"
    known.write_text(f"[{tuned_host.address}]:{tuned_host.port} {other}")
    config = local_host_config(tuned_host).model_copy(update={"known_hosts": str(known)})
    found = doctor(config)
    assert found["host key"].status == "FAIL"
    assert "known_hosts" in found["host key"].detail
    assert "auth" not in found


def test_budget_that_does_not_fit_fails_with_the_arithmetic(tuned_host: LocalHost) -> None:
    """3 replicas without Redis and a gate of 2 handshakes: each keeps one at least, 3 x 2 =
    6 >= MaxStartups 5, so the budget check fails and shows the product and what to lower;
    with 2 replicas they split the gate (one budget) and it passes."""
    base = local_host_config(tuned_host)
    config = base.model_copy(
        update={
            "limits": Limits(max_handshakes=2),
            "sshd": base.sshd.model_copy(update={"max_startups": 5}),
        }
    )
    found = doctor(config, Settings(replicas=3))
    line = found["budget"].line()
    assert found["budget"].status == "FAIL", line
    assert "3 replica(s) x 1 worker(s) = 3 process(es) sharing 3 budget(s)" in line
    assert "max_handshakes 2 >= MaxStartups 5" in line
    assert "lower [hosts.h.limits]" in line
    found = doctor(config, Settings(replicas=2))
    assert found["budget"].status == "ok", found["budget"].line()
    assert "2 process(es) sharing 1 budget(s) (static shares)" in found["budget"].line()


def test_budget_shared_through_redis_counts_once(tuned_host: LocalHost) -> None:
    """With SSHAPI_REDIS_URL, 4 replicas x 2 workers lease one budget: 1 x 6 handshakes <
    MaxStartups 10 passes, where 8 separate pools would have 48."""
    config = local_host_config(tuned_host)
    config = config.model_copy(update={"sshd": config.sshd.model_copy(update={"max_startups": 10})})
    found = doctor(config, Settings(replicas=4, workers=2, redis_url=REDIS_URL))
    line = found["budget"].line()
    assert found["budget"].status == "ok", line
    assert "8 process(es) sharing 1 budget(s) (leased through SSHAPI_REDIS_URL)" in line


def test_doctor_command_exits_1_and_names_the_failing_host(config_file: Path) -> None:
    """`sshapi doctor` over the test configuration: `local` passes, `down` (a closed port)
    fails as unreachable, exit status 1."""
    done = subprocess.run(
        [SSHAPI, "doctor", "--timeout", "5"],
        env={**os.environ, "SSHAPI_CONFIG": str(config_file)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.split()[:3] == ["local", "auth", "ok"] for line in lines), lines
    down = [line for line in lines if line.startswith("down ")]
    assert down and "reachable" in down[0] and "FAIL" in down[0], lines


@pytest.fixture(autouse=True)
def _no_env_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSHAPI_REPLICAS", raising=False)


# What OpenSSH 10.0's `sshd -T` prints about penalties (run on the rig's unpacked 10.0 sshd).
ON = (
    "persourcepenalties crash:90 authfail:5 noauth:1 grace-exceeded:10 refuseconnection:10 "
    "max:600 min:15 max-sources4:65536 max-sources6:65536 overflow:permissive "
    "overflow6:permissive"
)
SSHD_T_10 = "maxsessions 10\nmaxstartups 10:30:100\n" + ON + "\n"
BANNER_10 = "SSH-2.0-OpenSSH_10.0p2 Debian-5"
BANNER_9 = "SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3"


@pytest.mark.parametrize(
    ("sshd_t", "banner", "status", "says"),
    [
        (SSHD_T_10 + "persourcepenaltyexemptlist none", BANNER_10, "WARN", "is not exempt"),
        (SSHD_T_10 + "persourcepenaltyexemptlist 198.51.100.0/24", BANNER_10, "WARN", "not exempt"),
        (SSHD_T_10 + "persourcepenaltyexemptlist 10.0.0.0/8,192.0.2.7", BANNER_10, "ok", "is in"),
        ("maxsessions 10\nmaxstartups 10\npersourcepenalties no", BANNER_10, "ok", "no"),
        ("maxsessions 10\nmaxstartups 10:30:100", BANNER_9, "ok", "predates"),
        ("sh: sshd: Permission denied", BANNER_10, "WARN", "unknown"),
        ("sh: sshd: Permission denied", BANNER_9, "ok", "OpenSSH_9.2 predates"),
        ("sh: sshd: Permission denied", "SSH-2.0-dropbear", "WARN", "unknown"),
    ],
)
def test_penalties_say_whether_this_machine_is_exempt(
    sshd_t: str, banner: str, status: str, says: str
) -> None:
    """From `sshd -T` when the account may run it (on, off, this address exempt or not), else
    from the banner's version; a WARN says to exempt this machine's address."""
    found = penalties_finding("h", sshd_t, banner, ["192.0.2.7"])
    assert (found.status, says in found.detail) == (status, True), found.line()
    if status == "WARN":
        assert "PerSourcePenaltyExemptList" in found.detail and "192.0.2.7" in found.detail


def test_doctor_checks_penalties_on_the_rigs_sshd(tuned_host: LocalHost) -> None:
    """Debian 12's sshd (9.2), `sshd -T` not allowed to the account: no penalties, by its
    banner."""
    found = doctor(local_host_config(tuned_host))
    assert found["penalties"].status == "ok", found["penalties"].line()
    assert "predates PerSourcePenalties" in found["penalties"].detail
