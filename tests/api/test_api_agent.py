"""The job contract in agent mode: the API's own tests of it (submit, exit status, stdin, argv,
caps, cancel and timeout kills, live output) run again against host `local` configured with
`exec_mode = "agent"` (sshpool/agent), once per SSH backend (the executor's channel is the
backend's). Nothing above the pool may notice the difference."""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import test_api_batch as contract_batch
import test_api_files as contract_files
import test_api_input as contract_input
import test_api_jobs as contract_jobs
import test_api_live as contract_live
from api_helpers import (
    Api,
    Keys,
    config_toml,
    eventually,
    host_toml,
    make_settings,
    running_api,
    write_batch_config,
)

from sshpool.backends import BACKENDS
from sshpool.devhost import LatencyRelay, LocalHost, RelayedHost


@pytest.fixture(params=list(BACKENDS))
async def agent_api(
    tuned_host: LocalHost,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> AsyncIterator[Api]:
    """The API on SQLite, its host `local` in agent mode over each backend."""
    text = config_toml(tuned_host, secret_file, keys)
    table = f'[hosts.local]\nexec_mode = "agent"\nbackend = "{request.param}"\n'
    text = text.replace("[hosts.local]\n", table, 1)
    path = tmp_path / "sshapi.toml"
    path.write_text(text)
    settings = make_settings(tmp_path, path, "sqlite", None)
    async with running_api(settings, keys, secret) as running:
        yield running


AGENT = '[hosts.local]\nexec_mode = "agent"\n'


@pytest.fixture
async def agent_batch_api(
    slurm_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    """The API with the Slurm login host as `local`, a batch host in agent mode (asyncssh)."""
    path = write_batch_config(tmp_path / "sshapi.toml", slurm_host, secret_file, keys)
    path.write_text(path.read_text().replace("[hosts.local]\n", AGENT, 1))
    settings = make_settings(tmp_path, path, "sqlite", None)
    async with running_api(settings, keys, secret) as running:
        yield running


async def test_commands_run_through_an_executor(agent_api: Api, tuned_host: LocalHost) -> None:
    """The API's pool runs `local`'s commands through an executor on the host: its python3
    runs there, and a job's parent is that executor, not an sshd session's shell."""
    assert agent_api.config.hosts["local"].exec_mode == "agent"
    r = await agent_api.submit({"host": "local", "argv": ["sh", "-c", "ps -o args= -p $PPID"]})
    assert r.status_code == 201, r.text
    assert "sys.stdin.buffer.read" in r.json()["stdout"]
    assert tuned_host.processes("sys.stdin.buffer.read")


async def test_submit_returns_201_with_the_result(agent_api: Api) -> None:
    await contract_jobs.test_submit_returns_201_with_the_result(agent_api)


async def test_nonzero_exit_is_state_failed(agent_api: Api) -> None:
    await contract_jobs.test_nonzero_exit_is_state_failed(agent_api)


async def test_argv_elements_arrive_byte_exact(agent_api: Api) -> None:
    await contract_input.test_argv_elements_arrive_byte_exact(agent_api)


async def test_stdin_reaches_the_command(agent_api: Api) -> None:
    await contract_input.test_stdin_reaches_the_command(agent_api)


async def test_output_beyond_the_policy_cap_is_truncated(agent_api: Api) -> None:
    await contract_input.test_output_beyond_the_policy_cap_is_truncated(agent_api)


async def test_cancel_kills_the_remote_process_tree(agent_api: Api, tuned_host: LocalHost) -> None:
    await contract_jobs.test_cancel_kills_the_remote_process_tree(agent_api, tuned_host)


async def test_timeout_kills_the_command_and_reports_timed_out(
    agent_api: Api, tuned_host: LocalHost
) -> None:
    await contract_jobs.test_timeout_kills_the_command_and_reports_timed_out(agent_api, tuned_host)


async def test_follow_streams_bytes_before_the_job_ends(agent_api: Api) -> None:
    await contract_live.test_follow_streams_bytes_before_the_job_ends(agent_api)


async def test_events_carry_states_and_output_and_end(agent_api: Api) -> None:
    await contract_live.test_events_carry_states_and_output_and_end(agent_api)


async def test_past_the_cap_followers_see_everything_and_the_job_counts_it(
    agent_api: Api,
) -> None:
    await contract_live.test_past_the_cap_followers_see_everything_and_the_job_counts_it(agent_api)


async def test_executor_killed_mid_job_ends_lost_with_its_group_killed(
    agent_api: Api, tuned_host: LocalHost
) -> None:
    """The executor running a job SIGKILLed (no chance to clean up): the job ends `lost`, its
    error says its remote process group was killed, and nothing of the job runs on."""
    marker = f"{time.time_ns() % 10**6 + 5_000_000}"
    line = f"sleep {marker}1 & sleep {marker}2; wait"
    r = await agent_api.submit({"host": "local", "command": line}, wait=0)
    job_id = r.json()["id"]
    await eventually(lambda: len(tuned_host.processes(f"^sleep {marker}")) == 2)
    sleep = psutil.Process(tuned_host.processes(f"^sleep {marker}")[0])
    executor = next(p for p in sleep.parents() if "sys.stdin.buffer.read" in " ".join(p.cmdline()))
    os.kill(executor.pid, signal.SIGKILL)
    job = await agent_api.until_final(job_id)
    assert job["state"] == "lost" and "was killed" in job["error"], job
    assert not tuned_host.processes(f"sleep {marker}")


async def test_batch_job_and_its_output_are_unchanged(agent_batch_api: Api, workdir: str) -> None:
    """A batch job (sbatch, the tracker's polls, the output read back in ranges) in agent mode."""
    assert agent_batch_api.config.hosts["local"].exec_mode == "agent"
    await contract_batch.test_batch_job_completes_and_its_output_reads_back_in_ranges(
        agent_batch_api, workdir
    )


async def test_files_are_unchanged(agent_api: Api, tuned_host: LocalHost) -> None:
    """Files (SFTP channels beside the executor's): upload, download whole and by range."""
    for user in contract_files.make_user(agent_api, tuned_host):
        await contract_files.test_upload_then_download_whole_and_by_range(user)


RTT_MS = 50.0  # well above this loaded box's own jitter, so that round trips can be counted


async def test_through_a_wan_a_job_costs_fewer_round_trips_in_agent_mode(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """Jobs through the API to a host behind the rig's relay (50 ms RTT), on warm connections,
    interleaved: the relay's delay applies (every p50 >= RTT); in channel mode a job pays the
    channel's open and the exec's reply before its output (p50 >= 2 RTT), in agent mode one
    frame each way (p50 < channel's - RTT / 2)."""
    with LatencyRelay((tuned_host.address, tuned_host.port), RTT_MS) as relay:
        far = RelayedHost(tuned_host, relay)
        agent_table = host_toml("wanagent", far)
        agent_table = agent_table.replace("[hosts.wanagent]\n", AGENT.replace("local", "wanagent"))
        path = tmp_path / "sshapi.toml"
        path.write_text(
            config_toml(tuned_host, secret_file, keys)
            + host_toml("wanchannel", far).replace(
                "[hosts.wanchannel]\n", '[hosts.wanchannel]\nexec_mode = "channel"\n'
            )
            + agent_table
        )
        settings = make_settings(tmp_path, path, "sqlite", None)
        walls: dict[str, list[float]] = {"wanchannel": [], "wanagent": []}
        async with running_api(settings, keys, secret) as api:
            for round_ in range(8):
                for host in walls:
                    start = time.perf_counter()
                    r = await api.submit(
                        {"host": host, "argv": ["echo", "far"]}, sub="anyhost", wait=30
                    )
                    wall = (time.perf_counter() - start) * 1000
                    assert r.status_code == 201 and r.json()["stdout"] == "far\n", r.text
                    if round_:  # the first: the connection's handshake (and the executor)
                        walls[host].append(wall)
    channel, agent = (statistics.median(walls[h]) for h in ("wanchannel", "wanagent"))
    assert agent >= RTT_MS and channel >= 2 * RTT_MS, walls
    assert agent < channel - RTT_MS / 2, walls
