"""One runner for the load suite's scenarios (`loadtests/scenarios/`):

    python -m loadtests list                         # every scenario with its tags
    python -m loadtests run backend --backends asyncssh -d 1
    python -m loadtests compare reports/A/figures.json reports/B/figures.json

`run NAME [ARGS]` parses ARGS with the scenario's own options (`run NAME --help` lists them),
builds its rig (`sshpool.devhost.rig`), runs it and writes `reports/<time>-<name>/figures.json`
(`loadtests.figures`: versions, machine, load average at start and end, arguments, figures).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtests import figures, scenarios
from loadtests.report import run_dir
from sshpool.devhost.rig import Rig


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="Every scenario with its tags.")
    listing.add_argument("--tag", help="Only the scenarios with this tag.")
    run = sub.add_parser("run", help="Run one scenario; its options follow its name.")
    run.add_argument("--report-dir", type=Path, default=Path("reports"), help="Where runs go.")
    run.add_argument("name", choices=scenarios.names(), metavar="NAME")
    run.add_argument("args", nargs=argparse.REMAINDER, help="The scenario's options.")
    compare = sub.add_parser("compare", help="Two runs' figures side by side, with B / A.")
    compare.add_argument("a", type=Path, metavar="A", help="figures.json, or its run directory")
    compare.add_argument("b", type=Path, metavar="B", help="figures.json, or its run directory")
    return p.parse_args(argv)


def list_scenarios(tag: str | None) -> None:
    loaded = [scenarios.load(n) for n in scenarios.names()]
    for s in loaded:
        if tag is None or tag in s.tags:
            print(f"{s.name:<12} {','.join(s.tags):<24} {s.summary}")


def backends(args: argparse.Namespace) -> list[str]:
    """The SSH libraries a run used: its --backend(s), or the pool's default."""
    given = getattr(args, "backends", None) or [getattr(args, "backend", None) or "asyncssh"]
    return list(given)


def run_scenario(name: str, argv: list[str], report_dir: Path) -> Path:
    """Run scenario `name` with `argv`; returns the figures.json it wrote."""
    scenario = scenarios.load(name)
    args = scenario.parse(argv)
    spec = scenario.rig(args)
    doc: dict[str, Any] = {
        "schema": figures.SCHEMA_VERSION,
        "scenario": name,
        "tags": list(scenario.tags),
        "arguments": figures.plain(vars(args)),
        "started": figures.now(),
        **figures.environment(backends(args)),
        "load_average": {"start": figures.load_average()},
    }
    if spec is None:
        measured = scenario.run(None, args)
    else:
        # A scratch directory, not the report's: hosts' homes hold the transfers' big files.
        with (
            tempfile.TemporaryDirectory(prefix=f"sshapi-{name}-") as tmp,
            Rig(spec, data_dir=tmp) as rig,
        ):
            measured = scenario.run(rig, args)
    doc["load_average"]["end"] = figures.load_average()
    doc["finished"] = figures.now()
    doc["figures"] = figures.plain(measured)
    # Made once the run succeeded: a failed run leaves no empty run directory behind.
    path = run_dir(report_dir, name) / "figures.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def read(path: Path) -> dict[str, Any]:
    path = path / "figures.json" if path.is_dir() else path
    doc = json.loads(path.read_text())
    wrong = figures.problems(doc)
    if wrong:
        raise SystemExit(f"{path}: not a figures.json: {'; '.join(wrong)}")
    return dict(doc)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.command == "list":
        list_scenarios(args.tag)
    elif args.command == "run":
        path = run_scenario(args.name, args.args, args.report_dir)
        print(f"figures: {path}")
    else:
        print(figures.compare(read(args.a), read(args.b)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
