"""Headers on every response, health, metrics, OpenAPI docs, hosts."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from api_helpers import Api, Keys, config_toml, make_settings, running_api

from sshpool.devhost import LocalHost


async def test_request_id_is_echoed_or_generated(api: Api) -> None:
    """A sane X-Request-ID is echoed; a missing or unsafe one is replaced by a fresh id."""
    r = await api.client.get(f"{api.url}/healthz", headers={"X-Request-ID": "trace-42"})
    assert r.headers["X-Request-ID"] == "trace-42"
    r = await api.client.get(f"{api.url}/healthz")
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["X-Request-ID"])
    r = await api.client.get(f"{api.url}/healthz", headers={"X-Request-ID": "bad id\twith tab"})
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["X-Request-ID"])
    r = await api.client.get(f"{api.url}/v1/jobs")  # errors carry it too
    assert r.status_code == 401 and "X-Request-ID" in r.headers


async def test_server_timing_names_every_stage_of_a_finished_job(api: Api) -> None:
    """A job answered 201 reports auth, queue, connect, open, exec and store in Server-Timing."""
    r = await api.submit({"host": "local", "argv": ["true"]})
    stages = dict(part.strip().split(";dur=") for part in r.headers["Server-Timing"].split(","))
    assert set(stages) == {"auth", "queue", "connect", "open", "exec", "store"}
    assert all(float(v) >= 0 for v in stages.values())


async def test_health_and_readiness_need_no_token(api: Api) -> None:
    """/healthz and /readyz answer 200 without a token while the store and pool are up."""
    assert (await api.client.get(f"{api.url}/healthz")).json() == {"status": "ok"}
    assert (await api.client.get(f"{api.url}/readyz")).json() == {"status": "ready"}


async def test_metrics_expose_requests_jobs_and_pool(api: Api) -> None:
    """/metrics has request counts by route template, finished jobs and pool gauges."""
    await api.submit({"host": "local", "argv": ["true"]})
    job_id = (await api.submit({"host": "local", "argv": ["false"]})).json()["id"]
    await api.client.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth())
    r = await api.client.get(f"{api.url}/metrics")
    assert r.status_code == 200
    text = r.text
    assert 'sshapi_http_requests_total{method="GET",route="/v1/jobs/{job_id}",status="200"}' in text
    assert 'sshapi_jobs_finished_total{host="local",state="failed"} 1.0' in text
    assert re.search(r'sshpool_connections\{host="local"\} [1-9]', text)
    # The host's sshd, over all its accounts: the job's connection, the handshake it took.
    assert re.search(r'sshpool_sshd_connections\{host="local",state="(busy|idle)"\} [1-9]', text)
    assert re.search(r'sshpool_sshd_handshakes_granted_total\{host="local"\} [1-9]', text)
    assert "sshapi_job_stage_seconds_bucket" in text


async def test_openapi_documents_the_job_api_with_examples(api: Api) -> None:
    """/docs is served and /openapi.json carries request examples and the 202 answer."""
    assert (await api.client.get(f"{api.url}/docs")).status_code == 200
    spec = (await api.client.get(f"{api.url}/openapi.json")).json()
    post = spec["paths"]["/v1/jobs"]["post"]
    examples = post["requestBody"]["content"]["application/json"]["examples"]
    assert {"argv", "command", "template"} <= set(examples)
    assert {"201", "202", "429", "503"} <= set(post["responses"])
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    # The /docs badge shows the package's version (it said 1.0.0 while the package was 0.1.0).
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert spec["info"]["version"] == pyproject["project"]["version"]


async def test_hosts_lists_what_the_caller_may_use(api: Api) -> None:
    """A user sees the hosts their policy grants (not `secret`); an admin sees all."""
    r = await api.client.get(f"{api.url}/v1/hosts", headers=api.auth())
    assert [h["name"] for h in r.json()] == ["local", "tiny", "down"]
    # Where a host is (hostname, port) is for admins (api.host_details_require_admin).
    assert {(h["hostname"], h["port"]) for h in r.json()} == {(None, None)}
    r = await api.client.get(f"{api.url}/v1/hosts", headers=api.auth("ops", "admin"))
    assert [h["name"] for h in r.json()] == ["local", "tiny", "down", "secret"]
    assert all(h["hostname"] and h["port"] for h in r.json())
    r = await api.client.get(f"{api.url}/v1/hosts/secret", headers=api.auth())
    assert r.status_code == 404


async def test_host_shows_health_and_pool_stats_after_use(api: Api) -> None:
    """After a job, the host is `ok` with its pool statistics."""
    await api.submit({"host": "local", "argv": ["true"]})
    r = await api.client.get(f"{api.url}/v1/hosts/local", headers=api.auth())
    host = r.json()
    assert host["health"] == "ok" and host["shell"] is True
    assert host["pool"][0]["connections"] >= 1


async def test_unknown_route_is_a_problem(api: Api) -> None:
    """A path that does not exist is a 404 problem, like every other error."""
    r = await api.client.get(f"{api.url}/v2/nothing", headers=api.auth())
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"


async def test_metrics_are_for_admins_by_default(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """With the shipped default (api.metrics_require_admin = true), /metrics without a token is
    401, with a researcher's token 403, and an admin reads the pool's figures."""
    config = tmp_path / "sshapi.toml"
    text = config_toml(tuned_host, secret_file, keys)
    assert "metrics_require_admin = false" in text
    config.write_text(text.replace("metrics_require_admin = false", ""))
    async with running_api(make_settings(tmp_path, config, "sqlite", None), keys, secret) as api:
        r = await api.client.get(f"{api.url}/metrics")
        assert r.status_code == 401
        r = await api.client.get(f"{api.url}/metrics", headers=api.auth())
        assert r.status_code == 403
        assert r.json()["type"].endswith("insufficient-scope")
        assert "sshpool_" not in r.text
        r = await api.client.get(f"{api.url}/metrics", headers=api.auth("ops", "admin"))
        assert r.status_code == 200 and "sshpool_" in r.text
