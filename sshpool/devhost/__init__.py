"""The development rig: a local HPC host (a real OpenSSH sshd on loopback), a single-node Slurm
beside it, the tests' PostgreSQL and Redis, and a fake backend, for `sshapi dev`, the tests and
the benchmarks.

* `host.py`: `LocalHost`, one sshd with its keys, account and profile (`stock` or `tuned`).
* `slurm.py`: `LocalSlurm`, munged + slurmctld + slurmd on loopback
  (`python -m sshpool.devhost.slurm install` installs the OS packages).
* `services.py`: PostgreSQL and Redis for the test suite, installed and started when absent
  (`python -m sshpool.devhost.services install`, what `make services` runs).
* `accounts.py`: researcher accounts (``sshapi-r0001``...), real Unix accounts with their keys,
  for one sshd with many accounts (a ``LocalHost(..., researchers=True)``).
* `relay.py`: `LatencyRelay`, a TCP relay adding a fixed delay per direction (a WAN for the
  rig: `sshapi dev --rtt-ms`, `loadtests.bench --rtt-ms`), and `RelayedHost`, a LocalHost
  reached through one.
* `rig.py`: `Rig` and `RigSpec`, the one builder of a rig (a host or several login nodes, with
  Slurm, researcher logins and a relay as asked) that `sshapi dev`, the load suite and the tests
  start.
* `procs.py`: the processes, ports and at-exit clean-up both share.
* `fake.py`: `FakeBackend`, a backend without SSH for pool-logic tests.

Everything here takes its data dir, sshd binary and tuned config from the caller and reads no
environment variable of the API. It may import the sshpool core (`target`, `errors`, `command`,
`backends.base`); nothing in the core imports it, so `import sshpool` loads none of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sshpool.devhost.accounts import AccountError, ensure_accounts, remove_accounts
    from sshpool.devhost.cluster import LocalCluster
    from sshpool.devhost.fake import FakeBackend, FakeConnection
    from sshpool.devhost.host import (
        TUNED_CONFIG,
        LocalHost,
        LocalHostError,
        Profile,
        sshd_binary,
        sshd_version,
        tuned_settings,
    )
    from sshpool.devhost.relay import LatencyRelay, RelayedHost
    from sshpool.devhost.rig import Rig, RigSpec
    from sshpool.devhost.slurm import LocalSlurm, LocalSlurmError, install_packages

# Public name -> its module, imported on first use: `python -m sshpool.devhost.slurm` must not
# find its own module imported already by this package (runpy would run a second copy).
_MODULES = {
    "AccountError": "sshpool.devhost.accounts",
    "ensure_accounts": "sshpool.devhost.accounts",
    "remove_accounts": "sshpool.devhost.accounts",
    "LocalCluster": "sshpool.devhost.cluster",
    "FakeBackend": "sshpool.devhost.fake",
    "FakeConnection": "sshpool.devhost.fake",
    "TUNED_CONFIG": "sshpool.devhost.host",
    "LocalHost": "sshpool.devhost.host",
    "LocalHostError": "sshpool.devhost.host",
    "Profile": "sshpool.devhost.host",
    "sshd_binary": "sshpool.devhost.host",
    "sshd_version": "sshpool.devhost.host",
    "tuned_settings": "sshpool.devhost.host",
    "LatencyRelay": "sshpool.devhost.relay",
    "RelayedHost": "sshpool.devhost.relay",
    "Rig": "sshpool.devhost.rig",
    "RigSpec": "sshpool.devhost.rig",
    "LocalSlurm": "sshpool.devhost.slurm",
    "LocalSlurmError": "sshpool.devhost.slurm",
    "install_packages": "sshpool.devhost.slurm",
}


def __getattr__(name: str) -> object:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "TUNED_CONFIG",
    "AccountError",
    "FakeBackend",
    "FakeConnection",
    "LatencyRelay",
    "LocalCluster",
    "LocalHost",
    "LocalHostError",
    "LocalSlurm",
    "LocalSlurmError",
    "Profile",
    "RelayedHost",
    "Rig",
    "RigSpec",
    "ensure_accounts",
    "install_packages",
    "remove_accounts",
    "sshd_binary",
    "sshd_version",
    "tuned_settings",
]
