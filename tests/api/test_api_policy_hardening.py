"""Hostile input against caps, policy and secrets (issue 15, items 7-11, 15, 17): each test
reproduces one way around a limit through the real API (real sshd, real Slurm, Redis,
PostgreSQL) and checks it is closed."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from api_helpers import (
    LOCAL_ISS,
    Api,
    Keys,
    config_toml,
    make_settings,
    pg_schema,
    running_api,
)

from api.quota import PREFIX
from sshpool.devhost import LocalHost

pytestmark = pytest.mark.timeout(180)

REDIS_URL = "redis://127.0.0.1:6379/0"
SCHEDULER = """
[hosts.local.scheduler]
poll_interval = 0.3
max_poll_interval = 1.0
settle = 1.0
"""


def with_rule(text: str, rule: str) -> str:
    """The test configuration with `rule` tried before the catch-all rule."""
    marker = '[[policy]]\nissuer = "*"\nsubject = "*"'
    if marker not in text:
        marker = '[[policy]]\nsubject = "*"'
    assert marker in text
    return text.replace(marker, rule + "\n" + marker)


@asynccontextmanager
async def redis_replicas(
    path: Path, tmp_path: Path, keys: Keys, secret: str
) -> AsyncIterator[tuple[Api, Api]]:
    """Replicas `a` and `b` of the configuration at `path`, sharing PostgreSQL and Redis."""
    async with pg_schema() as schema, AsyncExitStack() as stack:
        apis = []
        for name in ("a", "b"):
            base = make_settings(tmp_path / name, path, "postgresql", schema)
            settings = base.model_copy(update={"replica": name, "redis_url": REDIS_URL})
            apis.append(await stack.enter_async_context(running_api(settings, keys, secret)))
        yield apis[0], apis[1]


# ---- item 7: batch jobs count against max_concurrent until final


async def test_batch_jobs_count_against_the_concurrent_cap_until_final_across_replicas(
    slurm_host: LocalHost,
    workdir: str,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """Cap 8: of 12 batch jobs sent to two replicas 8 are accepted and 4 get 429; a command
    job is 429 too while they are active; once one batch job finishes its slot is free."""
    sub = f"cap-{uuid.uuid4().hex[:8]}"
    rule = f"""[[policy]]
issuer = "{LOCAL_ISS}"
subject = "cap-*"
hosts = ["local"]
rate = 1000
burst = 1000
max_concurrent = 8
"""
    path = tmp_path / "cap.toml"
    path.write_text(with_rule(config_toml(slurm_host, secret_file, keys, SCHEDULER), rule))

    def job(seconds: int) -> dict[str, object]:
        script = f"#!/bin/sh\nsleep {seconds}\n"
        return {"host": "local", "batch": {"script": script, "workdir": workdir}}

    accepted: list[str] = []
    async with redis_replicas(path, tmp_path, keys, secret) as (a, b):
        try:
            codes = []
            # The first job ends soon by itself; the others would run for five minutes.
            for n in range(12):
                r = await (a, b)[n % 2].submit(job(2 if n == 0 else 300), sub=sub)
                codes.append(r.status_code)
                if r.status_code == 202:
                    accepted.append(r.json()["id"])
                else:
                    assert r.json()["type"].endswith(":too-many-jobs"), r.text
            assert codes == [202] * 8 + [429] * 4
            # Submitted (sbatch answered) and still pending or running: they still count.
            for job_id in accepted:
                await a.wait_state(job_id, ("queued", "running"), sub=sub)
            r = await b.submit({"host": "local", "argv": ["true"]}, sub=sub)
            assert r.status_code == 429, r.text
            # A finished batch job frees its slot, on either replica.
            done = await a.until_final(accepted[0], sub=sub, timeout=60)
            assert done["state"] == "succeeded"
            r = await b.submit({"host": "local", "argv": ["true"]}, sub=sub)
            assert r.status_code == 201, r.text
        finally:
            for job_id in accepted[1:]:
                await a.client.delete(f"{a.url}/v1/jobs/{job_id}", headers=a.auth(sub))
            r = aioredis.from_url(REDIS_URL)
            for kind in ("rate", "active"):
                await r.delete(f"{PREFIX}{kind}:{LOCAL_ISS}\0{sub}")
            await r.aclose()


async def test_batch_job_cancelled_frees_its_slot(
    slurm_host: LocalHost,
    workdir: str,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """Cap 1: a pending/running batch job blocks a second one; cancelling it frees the slot."""
    rule = f"""[[policy]]
issuer = "{LOCAL_ISS}"
subject = "one-batch"
hosts = ["local"]
max_concurrent = 1
"""
    path = tmp_path / "one.toml"
    path.write_text(with_rule(config_toml(slurm_host, secret_file, keys, SCHEDULER), rule))
    body = {"host": "local", "batch": {"script": "#!/bin/sh\nsleep 300\n", "workdir": workdir}}
    settings = make_settings(tmp_path, path, "sqlite", None)
    async with running_api(settings, keys, secret) as api:
        r = await api.submit(body, sub="one-batch")
        assert r.status_code == 202, r.text
        first = r.json()["id"]
        await asyncio.sleep(0.5)  # sbatch has answered: the job left the submit step
        r = await api.submit(body, sub="one-batch")
        assert r.status_code == 429, r.text
        r = await api.client.delete(f"{api.url}/v1/jobs/{first}", headers=api.auth("one-batch"))
        assert r.status_code == 200, r.text
        r = await api.submit(body, sub="one-batch")
        assert r.status_code == 202, r.text
        await api.client.delete(
            f"{api.url}/v1/jobs/{r.json()['id']}", headers=api.auth("one-batch")
        )
