"""How long the `sshapi` command takes to start and finish: `sshapi --help`, and `sshapi jobs
list` against a running server (`sshapi dev` in a scratch data dir), each run N times in a row
as a researcher's shell would; prints the median, p90 and min of the wall time beside the bare
interpreter's (`python -c pass`), the floor no command can go under.

    python -m loadtests.cli_startup --runs 21
    python -m loadtests.cli_startup --runs 21 --client-only   # as `pip install sshapi` has it
    python -m loadtests.cli_startup --runs 21 --sshapi /other/.venv/bin/sshapi   # another build

`--client-only` times the `sshapi` of a venv holding only what `pip install sshapi` brings (no
`server` extra), built offline from this environment's packages (`client_only_venv`, which
tests/api/test_client_install.py uses too): the development venv also has packages that httpx's
imports pick up when present (trio, through httpcore), a researcher's install does not.
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
from pathlib import Path

from packaging.requirements import Requirement

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
    script.write_text(f"#!{python}\nimport sys\nfrom api.cli import app\nsys.exit(app())\n")
    script.chmod(0o755)
    return venv / "bin"


def timed(argv: list[str], env: dict[str, str], runs: int) -> list[float]:
    """Wall seconds of each of `runs` runs of `argv` (each must exit 0)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def line(name: str, times: list[float]) -> str:
    ms = sorted(t * 1000 for t in times)
    p90 = ms[min(len(ms) - 1, int(len(ms) * 0.9))]
    return f"{name:22} median {statistics.median(ms):6.0f} ms  p90 {p90:6.0f}  min {ms[0]:6.0f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21, help="Runs of each command.")
    parser.add_argument("--sshapi", default=str(HERE / "sshapi"), help="The sshapi to time.")
    parser.add_argument(
        "--client-only", action="store_true", help="Time the sshapi of a client-only install."
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        if args.client_only:
            args.sshapi = str(client_only_venv(Path(scratch)) / "sshapi")
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
            print(f"{args.runs} runs each, {args.sshapi}")
            print(line("python -c pass", timed([sys.executable, "-c", "pass"], env, args.runs)))
            print(line("sshapi --help", timed([args.sshapi, "--help"], client, args.runs)))
            print(line("sshapi jobs list", timed([args.sshapi, "jobs", "list"], client, args.runs)))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
