"""Shared fixtures. Tests run against real OpenSSH sshd instances on loopback (sshpool.devhost).

* ``stock_host`` / ``tuned_host``: one started LocalHost per profile for the whole session. Do not
  restart them or change their keys: use ``make_host`` for that.
* ``slurm`` / ``slurm_host`` / ``workdir``: one single-node Slurm (``SLURM_CPUS`` CPUs), a login
  host whose sessions use it, and a directory the job account owns for output files.
* ``openssh10_sshd``: the path of OpenSSH 10.0's sshd (``make openssh10``; fetched here when
  missing), for ``make_host(sshd=...)``; skips, saying why, only when it cannot be had.
* ``make_host(profile="stock", **kwargs)``: a fresh, started LocalHost of its own (own name, data
  dir, port and keys), stopped after the test. kwargs go to LocalHost (address, overrides...).
"""

from __future__ import annotations

import gc
import itertools
import os

# Parallel workers (pytest-xdist, `make test`) each get their own rig account before sshpool.devhost
# reads it: tests plant files in that account's home, which two workers must not share.
if (_worker := os.environ.get("PYTEST_XDIST_WORKER", "gw0")) != "gw0":
    os.environ.setdefault("SSHPOOL_DEVHOST_ACCOUNT", f"sshapi-hpc-{_worker}")
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sshpool.devhost import (
    LocalHost,
    LocalHostError,
    LocalSlurm,
    LocalSlurmError,
    Profile,
    Rig,
    RigSpec,
    install_packages,
    openssh,
    sshd_binary,
)

MakeHost = Callable[..., LocalHost]

# The tiers. `make test-fast` runs the tests marked with none of these (the pool, the API and
# the client against the rig's sshd); `make test`, what CI runs, runs every test. Each marker is
# set here by rule, so a new test lands in its tier without a word: `slurm` (it uses the
# single-node Slurm), `browser` (Chromium), `deploy` (nginx, systemd units, the deploy guide),
# `docs` (every documented command, most a subprocess), `load` (the load suite's programs and
# benchmarks), `install` (the Makefile's install recipes), and `slow`, set by hand on long
# fault and load tests. `full` is added to each of them: `-m "not full"` is the fast tier.
TIERS = {
    "slurm": "uses the single-node Slurm (batch jobs)",
    "browser": "renders a page in headless Chromium",
    "deploy": "nginx, systemd units or the deploy guide",
    "docs": "checks the commands and links of the docs",
    "load": "runs the load suite's programs or benchmarks",
    "install": "runs the Makefile's install recipes",
    "slow": "a long fault or load test",
}
TIER_PATHS = {
    "tests/deploy/": "deploy",
    "tests/docs/": "docs",
    "tests/loadtests/": "load",
    "tests/test_makefile.py": "install",
    "tests/api/test_api_docs_browser.py": "browser",
}
SLURM_FIXTURES = {"slurm", "slurm_host", "workdir"}


def pytest_configure(config: pytest.Config) -> None:
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: full tier: {what}")
    config.addinivalue_line("markers", "full: in `make test` only, not in `make test-fast`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    for item in items:
        where = item.path.relative_to(root).as_posix()
        tiers = {tier for path, tier in TIER_PATHS.items() if where.startswith(path)}
        if SLURM_FIXTURES & set(getattr(item, "fixturenames", ())):
            tiers.add("slurm")
        tiers.update(m.name for m in item.iter_markers() if m.name in TIERS)
        for tier in sorted(tiers):
            item.add_marker(getattr(pytest.mark, tier))
        if tiers:
            item.add_marker(pytest.mark.full)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = longest_first(items)


# The order pytest-xdist hands the files out (`--dist loadfile`: a whole file to whichever worker
# is free). By default xdist sorts them by test count, most first, which left the few-test, long
# files (the deploy guide, the benchmarks' runs) to the end: one worker spent the run's last
# minute on them while the other had nothing left. `make test` turns that sort off
# (--no-loadscope-reorder) and the workers collect these files first, longest first, then the
# rest as xdist would have them: the run ends on short files. Seconds of one file on one of two
# workers (setup + call + teardown: the "longest files" that `--durations` prints below), rounded,
# 2026-11-28: the load tier (`pytest -n 2 tests/loadtests`, load 3-6), the deploy guide, docs,
# login and Makefile files alone (load 4-5), the rest from `make test-fast TEST_WORKERS=4` at
# load 6-8 scaled by 0.55 (test_login.py: 66.5 s there, 36.6 s alone). Only the order counts;
# files under ~20 s are left to xdist's order. Refresh from a `make test` run's summary.
LONGEST_FILES = {
    "tests/loadtests/test_accounts_bench.py": 76,
    "tests/loadtests/test_bench.py": 74,
    "tests/deploy/test_deploy_doc.py": 68,
    "tests/api/test_client.py": 54,
    "tests/api/test_sshd_budget.py": 45,
    "tests/loadtests/test_runner.py": 45,
    "tests/sshpool/test_backend_conformance.py": 41,
    "tests/api/test_api_webhooks.py": 40,
    "tests/api/test_api_revocations.py": 37,
    "tests/api/test_login.py": 37,
    "tests/loadtests/test_loadtests_smoke.py": 33,
    "tests/api/test_api_agent.py": 33,
    "tests/api/test_api_hostile.py": 31,
    "tests/loadtests/test_portals_bench.py": 27,
    "tests/docs/test_docs.py": 26,
    "tests/test_makefile.py": 25,
    "tests/api/test_api_workers.py": 25,
    "tests/api/test_api_files.py": 23,
    "tests/api/test_api_jobs.py": 23,
    "tests/api/test_api_dev.py": 22,
    "tests/api/test_api_files_limits.py": 21,
    "tests/loadtests/test_panels.py": 21,
    "tests/loadtests/test_soak.py": 21,
    "tests/loadtests/test_files_bench.py": 20,
    "tests/api/test_api_portals.py": 20,
}


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` grouped by file, LONGEST_FILES first, longest first, then the other files by
    test count, most first (a stable sort: equal counts keep their collection order)."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(by_file, key=lambda f: (-LONGEST_FILES.get(f, 0), -len(by_file[f])))
    return [item for file in order for item in by_file[file]]


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """With `--durations`: the longest files and each worker's busy seconds, which say whether
    LONGEST_FILES still puts the long files first and how evenly the workers ended."""
    if config.option.durations is None:
        return
    files: dict[str, float] = {}
    workers: dict[str, float] = {}
    ran_on: dict[str, str] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if not isinstance(report, pytest.TestReport):
                continue
            file = report.nodeid.split("::", 1)[0]
            files[file] = files.get(file, 0.0) + report.duration
            if node := getattr(report, "node", None):
                ran_on[file] = node.gateway.id
                workers[ran_on[file]] = workers.get(ran_on[file], 0.0) + report.duration
    write = terminalreporter.write_line
    terminalreporter.section("longest files (setup + call + teardown; LONGEST_FILES in conftest)")
    for file, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:15]:
        listed = "" if file in LONGEST_FILES else "  (not in LONGEST_FILES)" * (seconds >= 20)
        write(f"{seconds:7.1f} s  {ran_on.get(file, ''):4}  {file}{listed}")
    if workers:
        write("busy per worker: " + ", ".join(f"{w} {s:.0f} s" for w, s in sorted(workers.items())))


@pytest.fixture(scope="module", autouse=True)
def _leaks_reported_in_their_file() -> Iterator[None]:
    """A garbage collection after each test file: a socket or transport a file's tests left
    open is reported (ResourceWarning, an error under filterwarnings) at that file's last
    teardown, not in whichever later test the collector happens to run (CI once failed
    `test_api_agent.py` for a socket another file had left)."""
    yield
    gc.collect()


SLURM_CPUS = 16
# The Makefile's OPENSSH10_DIR.
OPENSSH10_DIR = Path(os.environ.get("OPENSSH10_DIR", f"/tmp/sshapi-openssh10-{os.getuid()}"))


def _require_sshd() -> None:
    """Fail (never skip) when the OpenSSH server is missing: the suite is meaningless without it."""
    try:
        binary = sshd_binary()
    except LocalHostError:
        binary = ""
    if not binary or not os.access(binary, os.X_OK):
        pytest.fail(
            "OpenSSH's sshd (/usr/sbin/sshd) is missing: run `make test`, which installs "
            "openssh-server, or install it yourself (Debian: apt-get install openssh-server)",
            pytrace=False,
        )


def _session_host(
    tmp_path_factory: pytest.TempPathFactory, profile: Profile, name: str = "", **kwargs: Any
) -> Iterator[LocalHost]:
    _require_sshd()
    data_dir = tmp_path_factory.mktemp("data")
    with Rig(RigSpec(name or f"{profile}-session", profile, **kwargs), data_dir=data_dir) as rig:
        yield rig.host


@pytest.fixture(scope="session")
def stock_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    """A running sshd with OpenSSH's default limits (MaxStartups 10:30:100, MaxSessions 10)."""
    yield from _session_host(tmp_path_factory, "stock")


@pytest.fixture(scope="session")
def tuned_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    """A running sshd with sshd_config.tuned applied."""
    yield from _session_host(tmp_path_factory, "tuned")


@pytest.fixture(scope="session")
def openssh10_sshd() -> str:
    """OpenSSH 10.0's sshd, unpacked beside the system's (PerSourcePenalties on by default)."""
    try:
        return str(openssh.fetch(OPENSSH10_DIR))
    except openssh.OpenSSHUnavailable as exc:
        pytest.skip(f"OpenSSH 10.0 cannot be fetched here ({exc}); `make openssh10` says more")


_host_numbers = itertools.count(1)


@pytest.fixture
def make_host(tmp_path: Path) -> Iterator[MakeHost]:
    """Factory of started LocalHosts private to the test, all stopped (sessions killed) after it."""
    _require_sshd()
    hosts: list[LocalHost] = []

    def make(profile: Profile = "stock", **kwargs: Any) -> LocalHost:
        # Not the API's data dir (tmp_path / "data", kept 0700): the host's account must
        # traverse its own files, as `sshapi dev` keeps its host beside the data dir.
        kwargs.setdefault("data_dir", tmp_path / "hosts")
        name = kwargs.pop("name", f"host{next(_host_numbers)}")
        host = LocalHost(name, profile, **kwargs)
        hosts.append(host)
        return host.start()

    yield make
    for host in hosts:
        host.stop(kill_sessions=True)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    try:
        install_packages()
    except LocalSlurmError as exc:
        pytest.fail(
            f"Slurm is not installed and could not be installed: {exc}\n"
            "install it with `python -m sshpool.devhost.slurm install` "
            "(apt-get install slurmctld slurmd slurm-client munge)",
            pytrace=False,
        )
    cluster = LocalSlurm("test", data_dir=tmp_path_factory.mktemp("slurm"), cpus=SLURM_CPUS)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_host(slurm: LocalSlurm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    yield from _session_host(
        tmp_path_factory, "tuned", "slurm-login", overrides=slurm.sshd_overrides()
    )


@pytest.fixture(scope="session")
def workdir(slurm_host: LocalHost, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory the job account owns, for the jobs' output files."""
    path = tmp_path_factory.mktemp("jobs")
    os.chown(path, slurm_host.account.uid, slurm_host.account.gid)
    for directory in (path, path.parent):
        directory.chmod(directory.stat().st_mode | 0o111)
    return str(path)
