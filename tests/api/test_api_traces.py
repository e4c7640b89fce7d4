"""Traces (issue 42): a job submitted with a W3C `traceparent` is one trace with its SSH stages,
delivered by the standard OTLP/HTTP exporter (configured by OTEL_* variables alone) to a real
HTTP receiver (tests/api/otlp_receiver.py), for channel and agent modes over every backend,
across two replicas for a cancel; off without OTEL_* variables; hostile headers and a hanging
exporter endpoint cost the jobs nothing.

The SDK's tracer provider is per process: the first traced app of this module installs it,
exporting to this module's receiver (the variables are set for the module). Apps without the
variables (the off test, the rest of the suite) make no span: the request span is per app, and
the pool's spans are made only under a recording one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from api_helpers import (
    Api,
    Keys,
    config_toml,
    eventually,
    host_toml,
    make_settings,
    replicas,
    running_api,
    write_batch_config,
)
from opentelemetry import trace
from otlp_receiver import Receiver, Span
from test_api_certificates import CLAIM, researcher_rig

from sshpool.backends import BACKENDS
from sshpool.devhost import LocalHost

# Fast export for the tests: the batch processor sends every 50 ms (default 5 s).
OTEL_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_EXPORTER_OTLP_TIMEOUT": "5"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        env = {**OTEL_ENV, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": r.url}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield r
        finally:
            r.hang.clear()
            r.released.set()
            flush()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def flush() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush()


def traceparent() -> tuple[str, str, str]:
    """A caller's sampled traceparent: (header, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def children(spans: list[Span], parent: Span) -> set[str]:
    return {s.name for s in spans if s.parent_id == parent.span_id}


async def spans_of(receiver: Receiver, trace_id: str, *names: str) -> list[Span]:
    """The trace's spans once every one of `names` arrived."""
    await eventually(lambda: set(names) <= receiver.names(trace_id), timeout=20)
    return receiver.spans(trace_id)


def host_config(host: LocalHost, backend: str, mode: str) -> str:
    """Host `traced` with no connection kept open, so the first job waits for its handshake."""
    text = host_toml("traced", host, min_connections=0, max_connections=2, max_sessions=8)
    head = f'[hosts.traced]\nbackend = "{backend}"\nexec_mode = "{mode}"\n'
    return text.replace("[hosts.traced]\n", head, 1)


@pytest.fixture
def traced_config(
    tuned_host: LocalHost, secret_file: Path, keys: Keys, tmp_path: Path
) -> Callable[[str, str], Path]:
    def make(backend: str, mode: str) -> Path:
        text = config_toml(tuned_host, secret_file, keys, host_config(tuned_host, backend, mode))
        text = text.replace('hosts = ["local", "tiny", "down"]', 'hosts = ["*"]')
        path = tmp_path / f"sshapi-{backend}-{mode}.toml"
        path.write_text(text)
        return path

    return make


async def post(api: Api, body: dict[str, Any], parent: str | None, **headers: str) -> Any:
    sent = {**api.auth(), "Prefer": "wait=20", **headers}
    if parent is not None:
        sent["traceparent"] = parent
    return await api.client.post(f"{api.url}/v1/jobs", json=body, headers=sent)


@pytest.mark.parametrize("mode", ["channel", "agent"])
@pytest.mark.parametrize("backend", list(BACKENDS))
async def test_a_job_with_a_traceparent_is_one_trace_with_its_ssh_stages(
    receiver: Receiver,
    traced_config: Callable[[str, str], Path],
    tuned_host: LocalHost,
    secret: str,
    keys: Keys,
    tmp_path: Path,
    backend: str,
    mode: str,
) -> None:
    """The caller's trace holds the request (a child of the caller's span), the admission, the
    store writes and the job, and under it the queue wait with the handshake it waited for
    (TCP connect, key exchange, authentication; agent mode: the executor's start), the channel
    open or the executor's START, the command and its first output byte; the pool's spans name
    the sshd (server.address, server.port); no span carries the command's arguments."""
    word = f"arg-{uuid.uuid4().hex}"
    settings = make_settings(tmp_path, traced_config(backend, mode), "sqlite", None)
    async with running_api(settings, keys, secret) as api:
        parent, trace_id, caller_span = traceparent()
        r = await post(api, {"host": "traced", "argv": ["echo", word]}, parent)
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["state"] == "succeeded" and job["trace_id"] == trace_id
        opened = "ssh.agent_start" if mode == "agent" else "ssh.channel_open"
        stages = ["ssh.connect", "ssh.key_exchange", "ssh.authentication"]
        if mode == "agent":
            stages.append("ssh.executor_start")
        spans = await spans_of(
            receiver,
            trace_id,
            "POST /v1/jobs",
            "admission",
            "store INSERT",
            "job",
            "ssh.pool.wait",
            "ssh.handshake",
            *stages,
            opened,
            "ssh.command",
            "ssh.first_output",
            "store UPDATE",
        )
    server = one(spans, "POST /v1/jobs")
    assert server.parent_id == caller_span
    assert server.attributes["http.response.status_code"] == 201
    job_span = one(spans, "job")
    assert job_span.parent_id == server.span_id
    assert job_span.attributes["sshapi.job.id"] == job["id"]
    assert job_span.attributes["sshapi.job.state"] == "succeeded"
    assert {"ssh.pool.wait", opened, "ssh.command", "store UPDATE"} <= children(spans, job_span)
    wait = one(spans, "ssh.pool.wait")
    assert wait.attributes["server.address"] == tuned_host.address
    assert wait.attributes["server.port"] == tuned_host.port
    handshake = one(spans, "ssh.handshake")
    assert handshake.parent_id == wait.span_id
    assert handshake.attributes["sshpool.backend"] == backend
    assert set(stages) <= children(spans, handshake)
    assert one(spans, "ssh.command").attributes["process.exit.code"] == 0
    assert one(spans, "ssh.first_output").parent_id == one(spans, "ssh.command").span_id
    assert {s.resource["service.name"] for s in spans} == {"sshapi"}
    assert not [s.name for s in spans if word in repr(s.attributes)]


async def test_a_cancel_through_another_replica_is_in_the_job_trace(
    receiver: Receiver, config_file: Path, keys: Keys, secret: str, tmp_path: Path
) -> None:
    """A job started on replica a and cancelled through replica b (a DELETE with no trace of
    its own): b's `job cancel` and its kill over b's pool are in the job's trace, linked to b's
    request span, and a's job span ends `cancelled`."""
    async with replicas(tmp_path, config_file, keys, secret) as (a, b):
        parent, trace_id, _ = traceparent()
        r = await post(a, {"host": "local", "command": "sleep 60"}, parent, Prefer="wait=0")
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        assert r.json()["trace_id"] == trace_id
        await b.wait_state(job_id, ("running",))
        r = await b.client.delete(f"{b.url}/v1/jobs/{job_id}", headers=b.auth())
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        assert r.json()["trace_id"] == trace_id
        spans = await spans_of(receiver, trace_id, "job", "job cancel", "ssh.kill", "ssh.command")
    job_span = one(spans, "job")
    assert job_span.attributes["sshapi.replica"] == "a"
    cancel = one(spans, "job cancel")
    assert cancel.attributes["sshapi.replica"] == "b"
    assert cancel.parent_id == job_span.span_id
    assert len(cancel.links) == 1  # b's DELETE, in a trace of its own
    assert "ssh.kill" in children(spans, cancel)
    await eventually(lambda: one(receiver.spans(trace_id), "job").end > 0)
    assert one(receiver.spans(trace_id), "job").attributes["sshapi.job.state"] == "cancelled"


async def test_a_certificate_login_traces_its_minting(
    receiver: Receiver,
    make_host: Callable[..., LocalHost],
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """On a certificate host the job's handshake includes the certificate's minting."""
    async with researcher_rig(make_host, secret_file, secret, keys, tmp_path) as rig:
        parent, trace_id, _ = traceparent()
        token = rig.api.token("researcher-9", **{CLAIM: rig.alice})
        r = await rig.api.client.post(
            f"{rig.api.url}/v1/jobs",
            json={"host": "hpc", "argv": ["true"]},
            headers={"Authorization": f"Bearer {token}", "traceparent": parent},
        )
        assert r.status_code == 201 and r.json()["state"] == "succeeded", r.text
        spans = await spans_of(receiver, trace_id, "ssh.handshake", "ssh.certificate")
    # The account's lookup on the host (its own login) comes first, in the admission.
    handshakes = [s for s in spans if s.name == "ssh.handshake"]
    assert any("ssh.certificate" in children(spans, h) for h in handshakes)


@pytest.mark.parametrize(
    "header",
    ["00-" + "a" * 4000 + "-01", "00-zz-not-hex-01", "ff-" + "0" * 32 + "-" + "0" * 16 + "-01"],
    ids=["huge", "malformed", "invalid-version-and-ids"],
)
async def test_a_hostile_traceparent_starts_a_new_trace(
    receiver: Receiver, api_traced: Api, header: str
) -> None:
    """A huge, malformed or invalid traceparent is ignored: the job runs and is traced in a
    trace of its own (a fresh id, never the header's bytes)."""
    r = await post(api_traced, {"host": "local", "argv": ["true"]}, header)
    assert r.status_code == 201, r.text
    trace_id = r.json()["trace_id"]
    assert trace_id is not None and len(trace_id) == 32 and trace_id not in header
    spans = await spans_of(receiver, trace_id, "POST /v1/jobs", "job")
    assert one(spans, "POST /v1/jobs").parent_id == ""


@pytest.fixture
async def api_traced(
    receiver: Receiver, config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    settings = make_settings(tmp_path, config_file, "sqlite", None)
    async with running_api(settings, keys, secret) as api:
        yield api


async def test_log_lines_of_a_traced_job_carry_its_trace_id(
    api_traced: Api, caplog: pytest.LogCaptureFixture
) -> None:
    """The warning logged for a job whose host is down ends with the job's trace id."""
    parent, trace_id, _ = traceparent()
    with caplog.at_level(logging.WARNING, logger="sshapi"):
        r = await post(api_traced, {"host": "down", "argv": ["true"]}, parent)
        assert r.status_code in (502, 503, 504), r.text
        job_id = r.json()["job_id"]
        await eventually(lambda: any(job_id in rec.getMessage() for rec in caplog.records))
    lines = [rec for rec in caplog.records if job_id in rec.getMessage()]
    assert {getattr(rec, "trace", None) for rec in lines} == {f" trace_id={trace_id}"}


async def test_sftp_transfers_are_spans_of_their_requests(
    receiver: Receiver, api_traced: Api, tuned_host: LocalHost
) -> None:
    """An upload and a download with a traceparent are `sftp upload` and `sftp download` spans
    of their requests, beside the pool's wait for the session's slot; neither the file's path
    nor its contents are in any span."""
    name = f"sshapi-trace-{uuid.uuid4().hex}"
    path = str(Path(tuned_host.account.home) / name)
    content = uuid.uuid4().hex.encode()
    url = f"{api_traced.url}/v1/hosts/local/files/content"
    auth = api_traced.auth("files-user", "files:read files:write")
    try:
        up, up_id, _ = traceparent()
        r = await api_traced.client.put(
            url, params={"path": path}, content=content, headers={**auth, "traceparent": up}
        )
        assert r.status_code in (200, 201), r.text
        down, down_id, _ = traceparent()
        r = await api_traced.client.get(
            url, params={"path": path}, headers={**auth, "traceparent": down}
        )
        assert r.status_code == 200 and r.content == content
        # The request's own span ends after its answer is sent: it may come in a later batch.
        put, get = "PUT /v1/hosts/{host}/files/content", "GET /v1/hosts/{host}/files/content"
        uploads = await spans_of(receiver, up_id, "sftp upload", "ssh.pool.wait", put)
        downloads = await spans_of(receiver, down_id, "sftp download", get)
    finally:
        await asyncio.to_thread((Path(tuned_host.account.home) / name).unlink, missing_ok=True)
    sftp = one(uploads, "sftp upload")
    assert sftp.attributes["server.address"] == tuned_host.address
    assert sftp.parent_id == one(uploads, put).span_id
    assert one(downloads, "sftp download").parent_id == one(downloads, get).span_id
    for s in uploads + downloads:
        assert name not in repr(s.attributes) and content.decode() not in repr(s.attributes)


async def test_a_batch_jobs_slurm_calls_are_spans_of_its_trace(
    receiver: Receiver,
    slurm_host: LocalHost,
    workdir: str,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """A batch job with a traceparent: its sbatch (and the lookups around it) are `slurm
    <program>` spans under the job, named by program, never with their arguments."""
    config = write_batch_config(tmp_path / "sshapi.toml", slurm_host, secret_file, keys)
    settings = make_settings(tmp_path, config, "sqlite", None)
    word = f"batch-{uuid.uuid4().hex}"
    body = {"host": "local", "batch": {"script": f"#!/bin/sh\necho {word}\n", "workdir": workdir}}
    async with running_api(settings, keys, secret) as api:
        parent, trace_id, _ = traceparent()
        r = await post(api, body, parent, Prefer="wait=0")
        assert r.status_code in (201, 202), r.text
        spans = await spans_of(receiver, trace_id, "job", "slurm sbatch")
    sbatch = one(spans, "slurm sbatch")
    assert sbatch.parent_id == one(spans, "job").span_id
    assert sbatch.attributes["sshapi.slurm.program"] == "sbatch"
    assert "ssh.command" in children(spans, sbatch)
    assert not [s.name for s in spans if word in repr(s.attributes)]


async def test_without_otel_variables_nothing_is_traced(
    receiver: Receiver,
    config_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An app started without OTEL_* variables continues no trace and exports no span, even in
    a process where another app traces: the job's trace_id is null."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    settings = make_settings(tmp_path, config_file, "sqlite", None)
    async with running_api(settings, keys, secret) as api:
        parent, trace_id, _ = traceparent()
        r = await post(api, {"host": "local", "argv": ["true"]}, parent)
        assert r.status_code == 201 and r.json()["trace_id"] is None, r.text
    flush()
    assert receiver.spans(trace_id) == []


async def test_an_exporter_endpoint_that_hangs_holds_no_job(
    receiver: Receiver, api_traced: Api
) -> None:
    """While the collector accepts and never answers, jobs run and answer as before: spans
    leave in the SDK's own thread, through a bounded queue (this test is the module's last:
    the receiver hangs until the module ends)."""
    receiver.hang.set()
    answers = await asyncio.gather(
        *(post(api_traced, {"host": "local", "argv": ["true"]}, None) for _ in range(30))
    )
    assert [r.status_code for r in answers] == [201] * 30
    assert {r.json()["state"] for r in answers} == {"succeeded"}
