"""`systemctl` for tests/deploy/test_deploy_doc.py, on a machine whose PID 1 is not systemd: what
docs/deploy.md asks of it, done from the unit file it installed, as systemd would do it.

- `daemon-reload`: nothing to do.
- `enable --now NAME@INSTANCE... | NAME`: the unit's [Service] with `%i` and `%H` expanded; its
  `Environment=` lines, then its `EnvironmentFile=` (which wins, as in systemd); `ExecStart` as
  `User=`/`Group=`, in a session of its own; the pid goes to SHIM_STATE/NAME@INSTANCE.pid.
- `reload nginx`: nginx with NGINX_CONF, started when its pid file is absent, else reloaded.

SHIM_UNITS is the directory the page installs units into; SHIM_STATE where pids and logs go."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def service(unit: Path, instance: str) -> tuple[dict[str, str], dict[str, str]]:
    """(settings, environment) of the unit's [Service] section for `instance`."""
    settings: dict[str, str] = {}
    env: dict[str, str] = {}
    files: list[str] = []
    section = ""
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            value = value.replace("%i", instance).replace("%H", socket.gethostname())
            if key == "Environment":
                name, _, setting = value.partition("=")
                env[name] = setting
            elif key == "EnvironmentFile":
                files.append(value)
            else:
                settings[key] = value
    for file in files:
        for raw in Path(file).read_text().splitlines():
            line = raw.strip()
            if line and not line.startswith("#") and "=" in line:
                name, _, value = line.partition("=")
                env[name] = value
    return settings, env


def start(name: str, units: Path, state: Path) -> None:
    base, at, instance = name.partition("@")
    unit = units / (f"{base}@.service" if at else f"{name}.service")
    settings, env = service(unit, instance)
    with (state / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(
            settings["ExecStart"].split(),
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **env},
            # No User=: root, as systemd runs it (the login host's sshd).
            user=settings.get("User"), group=settings.get("Group"),
            extra_groups=[] if "User" in settings else None, cwd="/",
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
    (state / f"{name}.pid").write_text(str(proc.pid))


def main(argv: list[str]) -> int:
    units, state = Path(os.environ["SHIM_UNITS"]), Path(os.environ["SHIM_STATE"])
    state.mkdir(parents=True, exist_ok=True)
    match argv:
        case ["daemon-reload"]:
            return 0
        case ["enable", "--now", *names] if names:
            for name in names:
                start(name, units, state)
            return 0
        case ["reload", "nginx"]:
            conf = os.environ["NGINX_CONF"]
            pid = state / "nginx.pid"  # `nginx -t` may leave it empty
            running = pid.exists() and pid.read_text().strip() != ""
            command = ["nginx", "-c", conf, *(["-s", "reload"] if running else [])]
            return subprocess.run(command, check=False).returncode
    print(f"systemctl (test stand-in): {' '.join(argv)} is not something docs/deploy.md does")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
