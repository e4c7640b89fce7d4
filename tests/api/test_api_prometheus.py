"""deploy/prometheus/ and deploy/grafana/ against a real Prometheus (Debian's package, `make
prometheus`): promtool passes the rules and the configuration; then Prometheus, run from the
shipped configuration with a 1-s interval, scrapes a running API after a few jobs (one failed),
a transfer and a follower, and every alert rule's expression and every dashboard panel's query
is answered through its HTTP API: the rules without error, the panels with series."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from api_helpers import REDIS_URL, Api, Keys, config_toml, make_settings, running_api

from loadtests.panels import run_prometheus
from sshpool.devhost import LocalHost

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
PROMETHEUS = os.environ.get("PROMETHEUS_BIN", "/usr/bin/prometheus")
PROMTOOL = os.environ.get("PROMTOOL_BIN", "/usr/bin/promtool")
# What Grafana puts in for its variables here: the rig's one host, four 1-s scrapes at least.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$host": "local"}
# Alerts a loaded box may set pending on a healthy rig (see the end of the last test).
LOAD_DEPENDENT = {
    "SshapiPoolWaitP99High",
    "SshapiPoolSaturated",
    "SshapiPoolQueueTimeouts",
    "SshapiStoreSlowCommits",
}
DEADLINE = 90.0  # seconds for Prometheus to start, scrape and answer everything

needs_prometheus = pytest.mark.skipif(
    not (os.access(PROMETHEUS, os.X_OK) and os.access(PROMTOOL, os.X_OK)),
    reason="prometheus / promtool missing: `make prometheus` installs them",
)
pytestmark = pytest.mark.deploy

FILES_POLICY = """
[[policy]]
subject = "prom-*"
issuer = "*"
hosts = ["local"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }
rate = 1000
burst = 1000
"""


def rules() -> list[dict[str, Any]]:
    text = (PROMETHEUS_DIR / "sshapi-rules.yml").read_text()
    return [rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"]]


def panel_queries() -> dict[str, str]:
    """'dashboard / panel / refId' -> the query with Grafana's variables put in."""
    found = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        model = yaml.safe_load(path.read_text())  # JSON is YAML
        for panel in model["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for name, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(name, value)
                assert "$" not in expr, (path.name, expr)
                found[f"{path.stem} / {panel['title']} / {target['refId']}"] = expr
    return found


def test_the_committed_dashboards_are_what_the_generator_makes() -> None:
    """deploy/grafana/dashboards/ is scripts/gen_dashboards.py's output, every panel has a
    query and a description, and the six dashboards the operator needs are there."""
    spec = importlib.util.spec_from_file_location(
        "gen_dashboards", ROOT / "scripts" / "gen_dashboards.py"
    )
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    generated = generator.generate()
    assert {p.name: p.read_text() for p in DASHBOARDS.glob("*.json")} == generated
    names = {name.removesuffix(".json") for name in generated}
    assert names == {
        f"sshapi-{n}" for n in ("jobs", "pool", "handshakes", "transfers", "live", "replicas")
    }
    for text in generated.values():
        for panel in yaml.safe_load(text)["panels"]:
            assert panel["targets"] and panel["title"], panel


def test_every_alert_says_what_to_do() -> None:
    """Each rule is an alert with a severity, a `summary` (what to do) and a `description`."""
    found = rules()
    assert len(found) >= 12
    for rule in found:
        assert rule["alert"].startswith("Sshapi"), rule
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule
        assert len(rule["annotations"]["summary"]) > 40, rule
        assert rule["annotations"]["description"], rule


@needs_prometheus
def test_promtool_passes_the_rules_and_the_configuration(tmp_path: Path) -> None:
    """`promtool check rules`; `promtool test rules` (deploy/prometheus/sshapi-rules.test.yml:
    series as the API exposes them, the alerts that fire and when); and `promtool check
    config` on the shipped configuration with its token file where this test can write one
    (promtool checks that it exists)."""
    done = subprocess.run(
        [PROMTOOL, "check", "rules", str(PROMETHEUS_DIR / "sshapi-rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout
    # The alerts fire when they should, with their annotations filled in, and only then.
    done = subprocess.run(
        [PROMTOOL, "test", "rules", "sshapi-rules.test.yml"],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
    shutil.copy(PROMETHEUS_DIR / "sshapi-rules.yml", tmp_path)
    token = tmp_path / "sshapi.token"
    token.write_text("token\n")
    text = (PROMETHEUS_DIR / "prometheus.yml").read_text()
    assert "/etc/prometheus/sshapi.token" in text
    (tmp_path / "prometheus.yml").write_text(
        text.replace("/etc/prometheus/sshapi.token", str(token))
    )
    done = subprocess.run(
        [PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
async def api(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    """The API with Redis (the sshd budget's leases, sshapi_redis_up) and a files policy."""
    text = config_toml(tuned_host, secret_file, keys).replace(
        "[[policy]]", FILES_POLICY + "[[policy]]", 1
    )
    path = tmp_path / "sshapi.toml"
    path.write_text(text)
    settings = make_settings(tmp_path, path, "sqlite", None)
    settings = settings.model_copy(update={"redis_url": REDIS_URL})
    async with running_api(settings, keys, secret) as running:
        yield running


@pytest.fixture
def file_root(tuned_host: LocalHost) -> Iterator[tuple[str, Path]]:
    sub = f"prom-{uuid.uuid4().hex[:10]}"
    root = Path(tuned_host.account.home) / "sshapi-files" / sub
    tuned_host.run_local(["mkdir", "-p", str(root)])
    try:
        yield sub, root
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture
def prometheus(api: Api, tmp_path: Path) -> Iterator[str]:
    """Prometheus on 127.0.0.1 (a free port), its own storage under tmp_path, from the
    shipped configuration with a 1-s interval and the API as its only target, scraping with
    an admin token as the shipped configuration says; stopped at the end."""
    target = api.url.removeprefix("http://")
    with run_prometheus(target, api.token("prometheus", "admin"), tmp_path) as url:
        yield url


async def query(client: httpx.AsyncClient, url: str, expr: str) -> dict[str, Any]:
    r = await client.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    answer: dict[str, Any] = r.json()
    return answer


async def use_the_api(api: Api, sub: str, root: Path) -> None:
    """A few jobs (one fails), reads, a path no route takes, an upload and its download, a
    follower of a finished job's events."""
    for argv in (["true"], ["false"], ["echo", "hello"]):
        assert (await api.submit({"host": "local", "argv": argv})).status_code == 201
    job_id = (await api.submit({"host": "local", "argv": ["true"]})).json()["id"]
    assert (await api.client.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth())).is_success
    assert (await api.client.get(f"{api.url}/nowhere")).status_code == 404
    files = f"{api.url}/v1/hosts/local/files/content"
    headers = api.auth(sub, "files:read files:write")
    params = {"path": f"{root}/m.bin"}
    r = await api.client.put(files, params=params, content=b"z" * 4096, headers=headers)
    assert r.status_code == 201, r.text
    assert (await api.client.get(files, params=params, headers=headers)).content == b"z" * 4096
    url = f"{api.url}/v1/jobs/{job_id}/events"
    async with api.client.stream("GET", url, headers=api.auth()) as r:
        assert r.status_code == 200
        await r.aread()


@needs_prometheus
async def test_prometheus_answers_every_rule_and_every_panel_from_the_api(
    api: Api, file_root: tuple[str, Path], prometheus: str, tmp_path: Path
) -> None:
    """Every panel's query has series, every rule evaluates (health ok) and answers the query
    API without error, and none that says the rig is broken is even pending."""
    await use_the_api(api, *file_root)
    client = api.client
    panels = panel_queries()
    alerts = {rule["alert"]: rule["expr"] for rule in rules()}
    empty: dict[str, str] = dict(panels)
    failing: dict[str, Any] = {}
    # Until every panel has series and every rule has been evaluated once: Prometheus starts,
    # scrapes each second, evaluates each second; rates need two scrapes in their window.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    scraped = False
    while loop.time() < deadline:
        await asyncio.sleep(1.0)
        try:
            up = await query(client, prometheus, 'up{job="sshapi"}')
            evaluated = (await client.get(f"{prometheus}/api/v1/rules", timeout=10)).json()
        except httpx.TransportError:  # not listening yet
            continue
        scraped = bool(up["data"]["result"]) and up["data"]["result"][0]["value"][1] == "1"
        if not scraped:
            continue
        for name, expr in list(empty.items()):
            if (await query(client, prometheus, expr))["data"]["result"]:
                del empty[name]
        states = [r for g in evaluated["data"]["groups"] for r in g["rules"]]
        failing = {r["name"]: r.get("lastError") for r in states if r["health"] != "ok"}
        if not empty and len(states) == len(alerts) and not failing:
            break
    assert scraped, (tmp_path / "prometheus.log").read_text()
    assert not failing, failing
    assert not empty, empty
    # Each alert's expression through the query API (what `promtool check rules` cannot see:
    # the names and labels it reads exist): no error, and no alert fires on a healthy rig.
    for name, expr in alerts.items():
        answer = await query(client, prometheus, expr)
        assert answer["status"] == "success", (name, answer)
    # Nothing that says the rig is broken is even pending. The pool's wait p99, saturation and
    # commit time depend on the box's load (a first job waits for its handshake), so they are
    # not judged here: sshapi-rules.test.yml fires them on series of their own.
    alerting = await client.get(f"{prometheus}/api/v1/alerts", timeout=10)
    names = {a["labels"]["alertname"] for a in alerting.json()["data"]["alerts"]}
    assert names <= LOAD_DEPENDENT, names
