"""The job contract in agent mode: the API's own tests of it (submit, exit status, stdin, argv,
caps, cancel and timeout kills, live output) run again against host `local` configured with
`exec_mode = "agent"` (sshpool/agent). Nothing above the pool may notice the difference."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import test_api_input as contract_input
import test_api_jobs as contract_jobs
import test_api_live as contract_live
from api_helpers import Api, Keys, config_toml, make_settings, running_api

from sshpool.devhost import LocalHost


@pytest.fixture
async def agent_api(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    """The API on SQLite, its host `local` in agent mode."""
    text = config_toml(tuned_host, secret_file, keys)
    text = text.replace("[hosts.local]\n", '[hosts.local]\nexec_mode = "agent"\n', 1)
    path = tmp_path / "sshapi.toml"
    path.write_text(text)
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
