"""A researcher's loop end to end against the real sshd and Slurm: upload an input over the
files API, run a batch job that reads it and writes a result, download the result by ranges."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_helpers import Api

from sshpool.devhost import LocalHost

pytestmark = pytest.mark.timeout(120)

FILES = "files:read files:write"


@pytest.fixture
def api(batch_api: Api) -> Api:
    """This module's API: the session's `sshapi serve` in front of Slurm (conftest.py)."""
    return batch_api


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
