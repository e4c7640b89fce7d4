"""How long the `sshapi` command takes to start and finish: `sshapi --help`, and `sshapi jobs
list` against a running server (`sshapi dev` in a scratch data dir), as a researcher's shell
runs them, beside the bare interpreter (`python -c pass`), the floor no command can go under.
The commands take turns, run after run (floor, then each command once, N times over), so that
the load of a shared machine falls on all of them alike; it prints the median, p90 and min of
the wall time of each, its median over the floor's (x floor) and above it (+ms), and the median
CPU time of the process. A row for the server's part of `jobs list`: its request, timed here.

    python -m loadtests.cli_startup --runs 21
    python -m loadtests.cli_startup --runs 21 --client-only   # also as `pip install sshapi` has it
    python -m loadtests.cli_startup --runs 21 --sshapi OTHER/sshapi --sshapi .venv/bin/sshapi  # A/B

`--client-only` also times the `sshapi` of a venv holding only what `pip install sshapi` brings
(no `server` extra), built offline from this environment's packages (`client_only_venv`, which
tests/api/test_client_install.py uses too): the development venv also has packages that httpx's
and httpcore's imports pick up when present (click and rich for httpx's own CLI, trio through
httpcore), which `sshapi` marks absent (`api.cli.main`) and a researcher's install may not have.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from packaging.requirements import Requirement

from loadtests.cpu import reaped_children_seconds
from loadtests.server import free_port, wait_ready

HERE = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


def client_distributions() -> set[str]:
    """The distributions `pip install sshapi` brings: the core requirements of this project's
    metadata, followed recursively (markers evaluated, with the extras each was asked with)."""
    found: set[str] = set()
    todo = [(r, "") for r in importlib.metadata.requires("sshapi") or [] if "extra ==" not in r]
    while todo:
        text, extra = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = importlib.metadata.distribution(req.name).metadata["Name"]
        if name in found:
            continue
        found.add(name)
        todo += [(sub, e) for sub in importlib.metadata.requires(name) or []
                 for e in req.extras or {""}]  # fmt: skip
    return found


def client_only_venv(base: Path) -> Path:
    """A venv under `base` whose packages are the client's distributions (linked from this
    environment) and this repository's `api`, with an `sshapi` console script; its bin/."""
    site = base / "site"
    site.mkdir()
    for name in client_distributions():
        dist = importlib.metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if ".." not in str(f)}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    (site / "api").symlink_to(ROOT / "api")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "client.pth").write_text(f"{site}\n")
    script = venv / "bin" / "sshapi"
    script.write_text(f"#!{python}\nimport sys\nfrom api.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return venv / "bin"


def command(argv: list[str], env: dict[str, str]) -> Callable[[], None]:
    """A run of `argv` (it must exit 0), its output dropped."""

    def run() -> None:
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)

    return run


def request(url: str, token: str) -> Callable[[], None]:
    """The server's part of `sshapi jobs list`: its request on a fresh connection, in-process."""

    def get() -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {token}"}) as http:
            http.get(f"{url}/v1/jobs", params={"limit": 50}).raise_for_status()

    return get


def timed(
    commands: dict[str, Callable[[], None]], runs: int
) -> dict[str, list[tuple[float, float]]]:
    """(wall, child CPU) seconds of each of `commands`, `runs` times, the commands taking turns:
    the load of a shared machine falls on all of them alike."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, run in commands.items():
            cpu, start = reaped_children_seconds(), time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start, reaped_children_seconds() - cpu))
    return times


def stats(times: list[tuple[float, float]]) -> dict[str, float]:
    """The wall time's median, p90 and min in ms; the median CPU time of the process (user +
    system; 0 in-process)."""
    ms = sorted(wall * 1000 for wall, _ in times)
    return {
        "median_ms": statistics.median(ms),
        "p90_ms": ms[min(len(ms) - 1, int(len(ms) * 0.9))],
        "min_ms": ms[0],
        "cpu_ms": statistics.median(used * 1000 for _, used in times),
    }


def line(name: str, times: list[tuple[float, float]], floor: float) -> str:
    """One row: `stats`, and the median over `floor`'s (x floor) and above it."""
    s = stats(times)
    median = s["median_ms"]
    return (
        f"{name:30} median {median:5.0f} ms  p90 {s['p90_ms']:5.0f}  min {s['min_ms']:5.0f}"
        f"  {median / floor:4.1f} x floor  +{median - floor:4.0f} ms  cpu {s['cpu_ms']:4.0f} ms"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21, help="Runs of each command.")
    parser.add_argument(
        "--sshapi",
        action="append",
        help="An sshapi to time (again for another build, in the same turns; default: this "
        "venv's).",
    )
    parser.add_argument(
        "--client-only", action="store_true", help="Also time the sshapi of a client-only install."
    )
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Each command's (wall, CPU) seconds over `--runs` turns, with `sshapi dev` serving the
    `jobs list` and the request; prints the table."""
    with tempfile.TemporaryDirectory() as scratch:
        paths = args.sshapi or [str(HERE / "sshapi")]
        if args.client_only:
            paths.append(str(client_only_venv(Path(scratch)) / "sshapi"))
        # Each build's rows are labelled [1], [2]... when there are several.
        builds = {f"[{i}] " if len(paths) > 1 else "": path for i, path in enumerate(paths, 1)}
        port = free_port()
        env = {**os.environ, "SSHAPI_DATA_DIR": f"{scratch}/data", "SSHAPI_LOG_LEVEL": "warning"}
        env.pop("SSHAPI_CONFIG", None)
        printed = Path(scratch) / "dev.out"
        with printed.open("w") as out:
            server = subprocess.Popen([str(HERE / "sshapi"), "dev", "--port", str(port)],
                                      env=env, stdout=out, stdin=subprocess.DEVNULL)  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(server, url, timeout=120)
            token = next(
                line.removeprefix("export TOKEN=")
                for line in printed.read_text().splitlines()
                if line.startswith("export TOKEN=")
            )
            client = {**env, "SSHAPI_URL": url, "SSHAPI_TOKEN": token}
            client["SSHAPI_CLIENT_CONFIG"] = f"{scratch}/none.toml"
            commands = {
                "python -c pass": command([sys.executable, "-c", "pass"], env),
                "server: GET /v1/jobs": request(url, token),
            }
            for label, sshapi in builds.items():
                commands[f"{label}sshapi --help"] = command([sshapi, "--help"], client)
                commands[f"{label}sshapi jobs list"] = command([sshapi, "jobs", "list"], client)
            times = timed(commands, args.runs)
            floor = statistics.median(wall for wall, _ in times["python -c pass"]) * 1000
            print(f"{args.runs} runs each, taking turns")
            for label, path in builds.items():
                print(f"{label or 'sshapi: '}{path}")
            for name, taken in times.items():
                print(line(name, taken, floor))
            return times
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    measure(parse(argv))


if __name__ == "__main__":
    main()
