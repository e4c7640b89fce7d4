"""The load suite's scenarios: each measurement as a named unit that `python -m loadtests` lists,
runs and compares (as pyperformance and asv name their benchmarks).

A scenario is a module here, `loadtests/scenarios/<name>.py`, with:

* `TAGS`: words to find it by (`quick`, `raw`, `http`, `files`, `root`, ...);
* `parse(argv) -> Namespace`: its arguments (the wrapped program's own parser, so the options
  and defaults are the ones `python -m loadtests.<module> --help` lists);
* `rig(args) -> RigSpec | None`: the rig the runner builds for it (`sshpool.devhost.rig`), or
  None when the program starts its own;
* `run(rig, args) -> figures`: calls the program's existing function and returns what it
  measured as a dict.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sshpool.devhost.rig import Rig, RigSpec


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    tags: tuple[str, ...]
    summary: str  # the first line of its docstring
    parse: Callable[[list[str] | None], argparse.Namespace]
    rig: Callable[[argparse.Namespace], RigSpec | None]
    run: Callable[[Rig | None, argparse.Namespace], dict[str, Any]]


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load(name: str) -> Scenario:
    if name not in names():
        raise KeyError(name)
    module = importlib.import_module(f"{__name__}.{name}")
    return Scenario(
        name,
        tuple(module.TAGS),
        (module.__doc__ or "").strip().splitlines()[0],
        module.parse,
        module.rig,
        module.run,
    )
