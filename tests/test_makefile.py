"""Every install recipe of the Makefile works as root (no sudo) and through sudo.

Each recipe is run for real by make, with its tool checks pointed at absent paths (the make
variables *_BIN, SLURM_SEARCH_PATH) and `apt-get` and `sudo` replaced by recording programs first
on PATH. The fake sudo resets the environment as the real one does (env_reset), so a variable set
before `sudo` is lost, and a recipe that expands to `-E apt-get` (empty $(SUDO)) exits 127. The
fake apt-get records its argv and environment and "installs" each package by creating the
programs the recipes check, so a second run must install nothing: the checked paths and the
installed packages agree. `sh -n` alone accepts all of those bugs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sshpool.devhost.slurm import BINARIES as SLURM_BINARIES

ROOT = Path(__file__).resolve().parents[1]

# recipe -> {package: [programs it installs that the recipe checks, by make variable]}
RECIPES: dict[str, dict[str, dict[str, str]]] = {
    "python-venv": {"python3-venv": {"ENSUREPIP_MAIN": "ensurepip-main"}},
    "sshd": {"openssh-server": {"SSHD_BIN": "sshd"}},
    "deploy-tools": {
        "nginx": {"NGINX_BIN": "nginx"},
        "systemd": {"SYSTEMD_ANALYZE_BIN": "systemd-analyze"},
    },
    "shells": {"zsh": {"ZSH_BIN": "zsh"}, "tcsh": {"TCSH_BIN": "tcsh"}},
    "browser": {
        "chromium": {"CHROMIUM_BIN": "chromium"},
        "chromium-driver": {"CHROMEDRIVER_BIN": "chromedriver"},
    },
    "slurm": {
        package: {
            f"SLURM_{program}": program for program, p in SLURM_BINARIES.items() if p == package
        }
        for package in sorted(set(SLURM_BINARIES.values()))
    },
}
# Variables the recipe must pass to apt-get install beyond DEBIAN_FRONTEND.
EXTRA_ENV = {"deploy-tools": {"RUNLEVEL": "1"}}

FAKE_APT = """\
#!{python}
import json, os, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": args, "env": {{k: os.environ.get(k) for k in
        ("DEBIAN_FRONTEND", "RUNLEVEL", "SUDO_COMMAND")}}}}) + "\\n")
if "install" in args:
    programs = json.load(open({programs!r}))
    for package in args:
        for program in programs.get(package, []):
            path = os.path.join({installed!r}, program)
            with open(path, "w") as out:
                out.write("#!/bin/sh\\n")
            os.chmod(path, 0o755)
"""

# Like sudo's env_reset: the command gets PATH (secure_path) and sudo's own variables only.
FAKE_SUDO = """\
#!{python}
import os, sys
argv = sys.argv[1:]
os.execvpe(argv[0], argv, {{"PATH": os.environ["PATH"], "SUDO_COMMAND": " ".join(argv)}})
"""


def install_recipes() -> set[str]:
    """Targets whose recipe installs OS packages (apt-get directly or through a script)."""
    found: set[str] = set()
    target = ""
    for line in (ROOT / "Makefile").read_text().splitlines():
        if m := re.match(r"^([A-Za-z][\w-]*):", line):
            target = m.group(1)
        elif line.startswith("\t") and re.search(r"APT_GET|apt-get|slurm install", line):
            found.add(target)
    return found


def make(target: str, tmp: Path, sudo: str) -> subprocess.CompletedProcess[str]:
    installed = tmp / "installed"
    variables = {"SUDO": sudo, "SLURM_SEARCH_PATH": str(installed)}
    for packages in RECIPES.values():
        for programs in packages.values():
            variables |= {var: str(installed / prog) for var, prog in programs.items()}
    # The venv that runs this test, and a stamp newer than pyproject.toml: no venv rebuild.
    stamp = tmp / "stamp"
    stamp.touch()
    variables |= {"VENV": str(Path(sys.executable).parent.parent), "STAMP": str(stamp)}
    if target == "python-venv":  # what it installs is only needed to create a missing venv
        variables["VENV"] = str(tmp / "no-venv")
    env = {**os.environ, "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}"}
    env.pop("DEBIAN_FRONTEND", None)
    env.pop("RUNLEVEL", None)
    argv = ["make", "--no-print-directory", "-C", str(ROOT), target]
    argv += [f"{k}={v}" for k, v in variables.items()]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def calls(tmp: Path) -> list[dict[str, object]]:
    log = tmp / "apt.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def fakes(tmp_path: Path) -> Path:
    (tmp_path / "bin").mkdir()
    (tmp_path / "installed").mkdir()
    programs = {
        package: list(progs.values())
        for packages in RECIPES.values()
        for package, progs in packages.items()
    }
    (tmp_path / "programs.json").write_text(json.dumps(programs))
    fill = {
        "python": sys.executable,
        "log": str(tmp_path / "apt.log"),
        "programs": str(tmp_path / "programs.json"),
        "installed": str(tmp_path / "installed"),
    }
    for name, text in (("apt-get", FAKE_APT), ("sudo", FAKE_SUDO)):
        path = tmp_path / "bin" / name
        path.write_text(textwrap.dedent(text).format(**fill))
        path.chmod(0o755)
    return tmp_path


def test_every_install_recipe_is_covered() -> None:
    """A new install recipe in the Makefile must be added here, so it is run both ways."""
    assert install_recipes() == set(RECIPES)


@pytest.mark.parametrize("sudo", ["", "sudo"], ids=["as-root", "through-sudo"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_install_recipe_installs_missing_packages(recipe: str, sudo: str, fakes: Path) -> None:
    """With its tools missing, the recipe runs apt-get update then a non-interactive install
    of its packages (through sudo when SUDO=sudo), exits 0, and a second run installs nothing."""
    done = make(recipe, fakes, sudo)
    assert done.returncode == 0, done.stdout + done.stderr
    recorded = calls(fakes)
    assert [c["argv"][0] for c in recorded] == ["update", "install"], recorded  # type: ignore[index]
    install = recorded[1]["argv"]
    assert set(RECIPES[recipe]) <= set(install), install  # type: ignore[arg-type]
    assert "-y" in install  # type: ignore[operator]
    for call in recorded:
        env = call["env"]
        assert env["DEBIAN_FRONTEND"] == "noninteractive", call  # type: ignore[index]
        assert (env["SUDO_COMMAND"] is not None) == bool(sudo), call  # type: ignore[index]
    for name, value in EXTRA_ENV.get(recipe, {}).items():
        assert recorded[1]["env"][name] == value, recorded[1]  # type: ignore[index]

    again = make(recipe, fakes, sudo)
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(calls(fakes)) == len(recorded), "the second run installed again"
