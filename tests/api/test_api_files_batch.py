"""A researcher's loop end to end against the real sshd and Slurm: upload an input over the
files API, run a batch job that reads it and writes a result, download the result by ranges."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from api_helpers import Api, Keys, config_toml, make_settings, server_process

from api.config import load_config
from api.settings import Settings
from sshpool.devhost import LocalHost

pytestmark = pytest.mark.timeout(120)

SCHEDULER = """
[hosts.local.scheduler]
poll_interval = 0.3
max_poll_interval = 2.0
settle = 1.0
"""
FILES = "files:read files:write"


@pytest.fixture(scope="module")
def server(
    slurm_host: LocalHost, secret_file: Path, keys: Keys, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Settings]]:
    folder = tmp_path_factory.mktemp("files-batch-api")
    config = folder / "sshapi.toml"
    config.write_text(config_toml(slurm_host, secret_file, keys, SCHEDULER))
    settings = make_settings(folder, config, "sqlite", None)
    with server_process(settings) as (_, url):
        yield url, settings


@pytest.fixture
async def api(server: tuple[str, Settings], secret: str, keys: Keys) -> AsyncIterator[Api]:
    url, settings = server
    assert settings.config is not None
    async with httpx.AsyncClient(timeout=60) as client:
        yield Api(url, client, secret, load_config(settings.config), settings, keys)


@pytest.fixture
def jobdir(slurm_host: LocalHost) -> Iterator[str]:
    """A directory in the account's home (inside the default file root `~`) for one test."""
    path = Path(slurm_host.account.home) / f"sshapi-e2e-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    os.chown(path, slurm_host.account.uid, slurm_host.account.gid)
    yield str(path)
    shutil.rmtree(path, ignore_errors=True)


async def test_upload_run_a_batch_job_on_it_and_download_the_result_by_ranges(
    api: Api, jobdir: str
) -> None:
    """PUT an input, a Slurm batch job turns it into a result, two Range GETs bring the result
    back whole: its sha256 is the expected content's, and the host's checksum agrees."""
    files = f"{api.url}/v1/hosts/local/files"
    auth = api.auth("alice", FILES)
    data = base64.b64encode(os.urandom(3 << 20)) + b"\n"
    r = await api.client.put(
        f"{files}/content", params={"path": f"{jobdir}/in.txt"}, content=data, headers=auth
    )
    assert r.status_code == 201, r.text
    assert r.json()["sha256"] == hashlib.sha256(data).hexdigest()

    script = "#!/bin/sh\ntr 'a-z' 'A-Z' < in.txt > out.txt\n"
    r = await api.submit({"host": "local", "batch": {"script": script, "workdir": jobdir}})
    assert r.status_code == 202, r.text
    done = await api.until_final(r.json()["id"], timeout=60)
    assert (done["state"], done["exit_status"]) == ("succeeded", 0), done

    expected = data.upper()
    half = len(expected) // 2
    parts = []
    for span in (f"bytes=0-{half - 1}", f"bytes={half}-"):
        r = await api.client.get(
            f"{files}/content",
            params={"path": f"{jobdir}/out.txt"},
            headers={**auth, "Range": span},
        )
        assert r.status_code == 206, r.text
        parts.append(r.content)
    assert len(parts[0]) == half
    digest = hashlib.sha256(b"".join(parts)).hexdigest()
    assert digest == hashlib.sha256(expected).hexdigest()
    r = await api.client.get(
        f"{files}/checksum", params={"path": f"{jobdir}/out.txt"}, headers=auth
    )
    assert r.status_code == 200 and r.json()["checksum"] == digest, r.text
