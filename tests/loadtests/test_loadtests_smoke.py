"""A short headless Locust run in a subprocess against the real API and sshd. Locust is never
imported into the pytest process (it monkey-patches it with gevent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.records import read_jsonl
from loadtests.schedule import PROFILES, arrivals, scaled
from loadtests.server import free_port, start_api, stop_api
from loadtests.summary import summarize
from sshpool.devhost import LocalHost

REPO = Path(__file__).resolve().parents[2]
LOCUST = Path(sys.executable).parent / "locust"
FACTOR = 0.5  # the smoke profile at half length: 1 s warm-up, 5 s measured


@pytest.fixture
def api(tuned_host: LocalHost, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    data = tmp_path / "api"
    proc, url = start_api(
        tuned_host, backend="asyncssh", pool_mode="pooled", data_dir=data, log=tmp_path / "api.log"
    )
    try:
        yield url, data
    finally:
        stop_api(proc)


@pytest.mark.timeout(90)
def test_headless_sustained_smoke_run_writes_a_complete_report(
    api: tuple[str, Path], tmp_path: Path
) -> None:
    """`locust -f loadtests/sustained.py --headless` ends by itself, exits 0 with no failures,
    and its summary holds exactly the measured arrivals of the schedule, all successful."""
    url, data = api
    reports = tmp_path / "reports"
    env = {**os.environ, "SSHAPI_DATA_DIR": str(data)}
    env.pop("SSHAPI_TOKEN", None)
    env.pop("SSHAPI_CONFIG", None)
    done = subprocess.run(
        [str(LOCUST), "-f", str(REPO / "loadtests" / "sustained.py"), "--headless", "-H", url,
         "--duration-factor", str(FACTOR), "--report-dir", str(reports)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=80,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    (run,) = reports.iterdir()
    assert f"report: {run / 'report.md'}" in output
    summary = json.loads((run / "summary.json").read_text())
    measured = [a for a in arrivals(scaled(PROFILES["smoke"], FACTOR)) if a.stage == 1]
    assert summary["requests"] == len(measured)
    assert summary["ok"] == len(measured)
    assert summary["latency_ms"]["p50"] > 0
    assert set(summary["server_timing_ms"]) >= {"auth", "exec"}
    assert (run / "report.md").read_text().startswith("# Load run: sustained smoke")
    assert (
        len((run / "records.jsonl").read_text().splitlines())
        == summary["requests"] + (summary["warmup_requests"])
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_distributed_master_and_two_workers_merge_like_one_process(
    api: tuple[str, Path], tmp_path: Path
) -> None:
    """`--master --expect-workers 2` and two `--worker` processes run sustained.py: both workers
    send, the master's summary holds every measured arrival once, and its percentiles are those
    the single-process method computes from the merged records."""
    url, data = api
    reports = tmp_path / "reports"
    env = {**os.environ, "SSHAPI_DATA_DIR": str(data)}
    env.pop("SSHAPI_TOKEN", None)
    env.pop("SSHAPI_CONFIG", None)
    port = free_port()
    base = [str(LOCUST), "-f", str(REPO / "loadtests" / "sustained.py")]
    master = subprocess.Popen(
        [*base, "--headless", "--master", "--expect-workers", "2", "-H", url,
         "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
         "--duration-factor", str(FACTOR), "--report-dir", str(reports)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    worker = [*base, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port)]
    workers = [
        subprocess.Popen(
            worker, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for _ in range(2)
    ]
    try:
        output, _ = master.communicate(timeout=100)
    finally:
        for w in workers:
            try:
                w.wait(timeout=15)  # a worker quits when its master does
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
    assert master.returncode == 0, output[-3000:]
    (run,) = reports.iterdir()
    summary = json.loads((run / "summary.json").read_text())
    records = list(read_jsonl(run / "records.jsonl"))
    measured = [a for a in arrivals(scaled(PROFILES["smoke"], FACTOR)) if a.stage == 1]
    assert summary["requests"] == summary["ok"] == len(measured)
    assert summary["meta"]["generators"] == 2
    per_worker = Counter(r.worker for r in records if not r.warmup)
    assert sorted(per_worker.values()) == [len(measured) // 2] * 2
    single = summarize(records, summary["meta"], {})
    assert summary["latency_ms"] == single["latency_ms"]
    assert summary["latency_hdr"] == single["latency_hdr"]


@pytest.mark.timeout(120)
def test_each_start_in_the_web_ui_measures_its_own_requests(
    api: tuple[str, Path], tmp_path: Path
) -> None:
    """Drive the Locust web UI's HTTP API as a browser does: Start, wait for the end, Start again
    with burst sizes typed as on the command line, `2 3`. Before: the second Start sent no
    request and wrote a report whose records.jsonl was byte-identical to the first's, `run
    VALID`; and `2 3` was HTTP 500 (Locust split the field on commas only). Also: the UI
    listens on 127.0.0.1 only, its page carries the shape's own parameters and the tab of the
    runs, which lists each run's verdict and report; a value that does not parse is refused
    with a message, not a 500."""
    import hashlib

    import psutil
    import requests

    url, data = api
    reports = tmp_path / "reports"
    env = {**os.environ, "SSHAPI_DATA_DIR": str(data), "SSHAPI_TOKEN": "not-used"}
    env.pop("SSHAPI_CONFIG", None)
    port = free_port()
    proc = subprocess.Popen(
        [str(LOCUST), "-f", str(REPO / "loadtests" / "burst.py"), "-H", url,
         "--web-port", str(port), "--burst-sizes", "3", "--repeats", "1", "--cooldown", "0.1",
         "--report-dir", str(reports)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    ui = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                page = requests.get(ui, timeout=2).text
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "no web UI"
                time.sleep(0.2)
        assert "burst_sizes" in page and "repeats" in page  # the shape's parameters
        listening = {
            c.laddr.ip
            for c in psutil.Process(proc.pid).net_connections()
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        }
        assert listening == {"127.0.0.1"}

        def start_and_wait(form: dict[str, str], runs: int) -> Path:
            answer = requests.post(f"{ui}/swarm", data=form, timeout=5).json()
            assert answer["success"], answer
            deadline = time.monotonic() + 40
            while len(list(reports.glob("*"))) < runs or not list(reports.glob("*/summary.json")):
                assert time.monotonic() < deadline, "no report"
                time.sleep(0.2)
            while requests.get(f"{ui}/stats/requests", timeout=5).json()["state"] != "stopped":
                assert time.monotonic() < deadline, "the run did not stop"
                time.sleep(0.2)
            return sorted(reports.iterdir())[runs - 1]

        assert '"sshapi-runs"' in page  # the tab of the runs
        for bad in ({"burst_sizes": "10 fifty"}, {"repeats": "1 2"}, {"burst_sizes": " "}):
            answer = requests.post(f"{ui}/swarm", data={"host": url, **bad}, timeout=5)
            assert answer.status_code == 200 and answer.json()["success"] is False, answer.text
            assert next(iter(bad)) in answer.json()["message"]
        assert not reports.exists()  # nothing started
        first = start_and_wait({"host": url}, 1)
        second = start_and_wait({"host": url, "burst_sizes": "2 3"}, 2)
        shown = requests.get(f"{ui}/stats/requests", timeout=5).json()["extended_stats"]
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
    runs = [json.loads((run / "summary.json").read_text()) for run in (first, second)]
    assert [s["requests"] for s in runs] == [3, 5], output[-3000:]
    assert [s["ok"] for s in runs] == [3, 5]
    assert runs[0]["meta"]["started"] <= runs[1]["meta"]["started"]
    assert runs[1]["meta"]["burst_sizes"] == [2, 3]
    # The tab: newest first, each with its verdict and where its report went.
    assert shown[0]["key"] == "sshapi-runs"
    rows = shown[0]["data"]
    assert [r["report"] for r in rows] == [str(second / "report.md"), str(first / "report.md")]
    assert [r["verdict"] for r in rows] == ["VALID", "VALID"]
    assert [r["requests"] for r in rows] == [5, 3]
    assert runs[0]["meta"]["subjects"] == 64  # SSHAPI_TOKEN ignored without --use-env-token
    digests = [hashlib.md5((r / "records.jsonl").read_bytes()).hexdigest() for r in (first, second)]
    print(f"web UI runs: requests {[s['requests'] for s in runs]}, records.jsonl md5 {digests}")
    assert digests[0] != digests[1]
    assert output.count("run VALID") == 2
