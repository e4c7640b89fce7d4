"""The job contract in channel mode: the suite's host `local` takes the default mode, `auto`
(an executor per connection where python3 answers: on the rig, agent mode), so the API's own
tests of the contract (submit, exit status, stdin, argv, caps, cancel and timeout kills, live
output, files) run again here against `local` configured with `exec_mode = "channel"` (a
session channel per command), as test_api_agent.py does for `exec_mode = "agent"`. Nothing
above the pool may notice the difference."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import test_api_files as contract_files
import test_api_input as contract_input
import test_api_jobs as contract_jobs
import test_api_live as contract_live
from api_helpers import Api, Keys, config_toml, make_settings, running_api

from sshpool.devhost import LocalHost

CHANNEL = '[hosts.local]\nexec_mode = "channel"\n'


@pytest.fixture
async def channel_api(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    """The API on SQLite, its host `local` in channel mode."""
    text = config_toml(tuned_host, secret_file, keys).replace("[hosts.local]\n", CHANNEL, 1)
    path = tmp_path / "sshapi.toml"
    path.write_text(text)
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        yield api


async def test_commands_run_as_session_channels(channel_api: Api) -> None:
    """A job's parent is the login shell sshd started for its channel, not an executor; the
    host shows its connection in channel mode."""
    assert channel_api.config.hosts["local"].exec_mode == "channel"
    r = await channel_api.submit({"host": "local", "argv": ["sh", "-c", "ps -o args= -p $PPID"]})
    assert r.status_code == 201, r.text
    assert "sys.stdin.buffer.read" not in r.json()["stdout"]
    r = await channel_api.client.get(
        f"{channel_api.url}/v1/hosts/local", headers=channel_api.auth("ops", "admin")
    )
    assert r.json()["connections_by_mode"] == {"agent": 0, "channel": 1}, r.text


async def test_submit_returns_201_with_the_result(channel_api: Api) -> None:
    await contract_jobs.test_submit_returns_201_with_the_result(channel_api)


async def test_nonzero_exit_is_state_failed(channel_api: Api) -> None:
    await contract_jobs.test_nonzero_exit_is_state_failed(channel_api)


async def test_argv_elements_arrive_byte_exact(channel_api: Api) -> None:
    await contract_input.test_argv_elements_arrive_byte_exact(channel_api)


async def test_stdin_reaches_the_command(channel_api: Api) -> None:
    await contract_input.test_stdin_reaches_the_command(channel_api)


async def test_output_beyond_the_policy_cap_is_truncated(channel_api: Api) -> None:
    await contract_input.test_output_beyond_the_policy_cap_is_truncated(channel_api)


async def test_cancel_kills_the_remote_process_tree(
    channel_api: Api, tuned_host: LocalHost
) -> None:
    await contract_jobs.test_cancel_kills_the_remote_process_tree(channel_api, tuned_host)


async def test_timeout_kills_the_command_and_reports_timed_out(
    channel_api: Api, tuned_host: LocalHost
) -> None:
    await contract_jobs.test_timeout_kills_the_command_and_reports_timed_out(
        channel_api, tuned_host
    )


async def test_follow_streams_bytes_before_the_job_ends(channel_api: Api) -> None:
    await contract_live.test_follow_streams_bytes_before_the_job_ends(channel_api)


async def test_events_carry_states_and_output_and_end(channel_api: Api) -> None:
    await contract_live.test_events_carry_states_and_output_and_end(channel_api)


async def test_files_are_unchanged(channel_api: Api, tuned_host: LocalHost) -> None:
    """Files: upload, download whole and by range."""
    for user in contract_files.make_user(channel_api, tuned_host):
        await contract_files.test_upload_then_download_whole_and_by_range(user)
