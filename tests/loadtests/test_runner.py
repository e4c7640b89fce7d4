"""`python -m loadtests`: the one runner of the load suite's scenarios. `list` names every
scenario module with its tags, `run` writes a figures.json of the one schema, `compare` prints
two runs' figures side by side with their ratio."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loadtests import figures
from sshpool.devhost import sshd_version

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(
    p.stem for p in (REPO / "loadtests" / "scenarios").glob("*.py") if not p.stem.startswith("_")
)
# The cheapest scenario: the raw pool against the rig's host, a fraction of a second per level.
CHEAP = ["backend", "--backends", "asyncssh", "-d", "0.3", "--handshakes", "2"]


def loadtests(*args: str, timeout: float = 120.0) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "loadtests", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def run_cheap(report_dir: Path) -> Path:
    out = loadtests("run", "--report-dir", str(report_dir), *CHEAP)
    (line,) = [x for x in out.splitlines() if x.startswith("figures: ")]
    path = Path(line.removeprefix("figures: "))
    assert path.parent.parent == report_dir and path.name == "figures.json"
    return path


def test_list_shows_every_scenario_with_its_tags() -> None:
    assert len(SCENARIOS) >= 4
    lines = {line.split()[0]: line.split()[1] for line in loadtests("list").splitlines()}
    for name in SCENARIOS:
        module = importlib.import_module(f"loadtests.scenarios.{name}")
        assert lines.get(name) == ",".join(module.TAGS), f"{name} not listed with its tags"
    quick = loadtests("list", "--tag", "quick").split()
    assert "backend" in quick and "files" not in quick


@pytest.mark.timeout(240)
def test_run_writes_figures_of_the_schema_and_compare_prints_the_ratio(tmp_path: Path) -> None:
    first, second = run_cheap(tmp_path), run_cheap(tmp_path)
    assert first.parent != second.parent  # one run directory each
    a, b = (json.loads(p.read_text()) for p in (first, second))
    for doc in (a, b):
        assert figures.problems(doc) == []
        assert doc["scenario"] == "backend" and "quick" in doc["tags"]
        assert doc["arguments"]["backends"] == ["asyncssh"] and doc["arguments"]["duration"] == 0.3
        assert doc["versions"]["openssh"] == ".".join(map(str, sshd_version()))
        assert doc["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
        assert set(doc["versions"]["ssh_library"]) == {"asyncssh"}
        assert all(x >= 0 for x in doc["load_average"]["start"] + doc["load_average"]["end"])
        assert doc["machine"]["cores"] >= 1 and doc["machine"]["memory_bytes"] > 0
        handshake = doc["figures"]["asyncssh"]["handshake"]
        assert handshake["count"] == 2 and handshake["errors"] == 0 and handshake["p50_ms"] > 0
        assert doc["figures"]["asyncssh"]["32"]["count"] > 0
    out = loadtests("compare", str(first), str(second.parent))
    x, y = a["figures"]["asyncssh"]["32"]["rate"], b["figures"]["asyncssh"]["32"]["rate"]
    (row,) = [line.split() for line in out.splitlines() if line.startswith("asyncssh.32.rate ")]
    assert row[1:] == [f"{x:.4g}", f"{y:.4g}", f"{y / x:.3f}"]


def test_a_figures_json_without_its_load_average_or_versions_is_refused(tmp_path: Path) -> None:
    versions: dict[str, Any] = {"package": "0", "python": "3", "openssh": "9", "ssh_library": {}}
    doc = {
        "schema": 1,
        "scenario": "backend",
        "tags": [],
        "arguments": {},
        "started": "",
        "finished": "",
        "versions": versions,
        "machine": {"cores": 2, "memory_bytes": 1, "cpu_model": "x"},
        "load_average": {"start": [1.0, 1.0, 1.0], "end": [1.0, 1.0]},
        "figures": {"x": 1},
    }
    assert figures.problems(doc) == ["load_average.end: not three numbers"]
    del versions["openssh"]
    assert figures.problems(doc) == ["versions.openssh: missing"]
    (tmp_path / "figures.json").write_text(json.dumps(doc))
    done = subprocess.run(
        [sys.executable, "-m", "loadtests", "compare", str(tmp_path), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "versions.openssh: missing" in done.stderr


def test_the_package_docstring_names_every_module() -> None:
    """loadtests/__init__.py is the suite's map: every module (and the scenarios) is in it."""
    import loadtests

    doc = loadtests.__doc__ or ""
    modules = [p.stem for p in (REPO / "loadtests").glob("*.py") if p.stem != "__init__"]
    missing = [m for m in [*modules, "scenarios"] if f"`{m}`" not in doc]
    assert not missing, f"not in loadtests/__init__.py's docstring: {missing}"


@pytest.mark.skipif(os.geteuid() != 0, reason="creating accounts needs root")
@pytest.mark.timeout(240)
def test_the_accounts_scenario_runs_through_the_runner(tmp_path: Path) -> None:
    """`python -m loadtests run accounts`: the accounts program's own options, its cells as the
    figures (6 accounts through the pool with room for 2 connections: all succeed, at least 4
    evictions)."""
    out = loadtests(
        "run", "--report-dir", str(tmp_path / "runs"), "accounts", "--via", "pool",
        "--accounts", "6", "--modes", "budget", "--parts", "burst",
        "--max-total-connections", "2", "--pause", "0", "--data-dir", str(tmp_path / "data"),
        timeout=200,
    )  # fmt: skip
    (line,) = [x for x in out.splitlines() if x.startswith("figures: ")]
    doc = json.loads(Path(line.removeprefix("figures: ")).read_text())
    assert figures.problems(doc) == [] and doc["scenario"] == "accounts"
    (cell,) = doc["figures"]["cells"]
    assert cell["statuses"] == {"ok": 6} and cell["evictions"] >= 4, cell


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_replicas_scenario_runs_a_replica_behind_nginx(tmp_path: Path) -> None:
    """`python -m loadtests run replicas`: one replica behind nginx, the smoke profile cut to a
    fifth: a row per measured stage, every request answered."""
    out = loadtests(
        "run", "--report-dir", str(tmp_path), "replicas", "--replicas", "1",
        "--load-profile", "smoke", "--duration-factor", "0.2",
        timeout=280,
    )  # fmt: skip
    (line,) = [x for x in out.splitlines() if x.startswith("figures: ")]
    doc = json.loads(Path(line.removeprefix("figures: ")).read_text())
    assert figures.problems(doc) == [] and doc["scenario"] == "replicas"
    stages = doc["figures"]["stages"]
    assert stages and all(s["replicas"] == 1 and s["requests"] > 0 for s in stages), stages
    assert all(s["ok"] == s["requests"] and not s["errors"] for s in stages), stages
