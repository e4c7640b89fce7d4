"""One builder for the rig: a local login host (or several login nodes), with a single-node Slurm,
the researcher accounts' logins and a WAN relay when asked, started and stopped as one.
`sshapi dev`, the load suite's scenarios and its measurement programs build their hosts here.

```python
with Rig(RigSpec("bench", "stock", researchers=True), data_dir=Path(".data")) as rig:
    target = rig.host.target()          # the (first) login node
    reached = rig.reached               # what a client connects to: the relay when rtt_ms > 0
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from sshpool.devhost.cluster import LocalCluster
from sshpool.devhost.host import LocalHost, Profile
from sshpool.devhost.relay import LatencyRelay, RelayedHost
from sshpool.devhost.slurm import LocalSlurm


@dataclass(frozen=True, slots=True)
class RigSpec:
    """What a rig holds. ``nodes`` > 1: a `LocalCluster` of that many login nodes (the first
    stands for them as ``Rig.host``). ``researchers``: sshd runs as root and logs in the
    researcher accounts (`sshpool.devhost.accounts`). ``slurm``: a `LocalSlurm` started first,
    the hosts' sshd pointed at it. ``rtt_ms`` > 0: a `LatencyRelay` in front of the host.
    ``shell``, ``sshd`` and ``overrides``: the login shell, the sshd binary and sshd_config
    lines (`LocalHost`'s; ``overrides`` over Slurm's)."""

    name: str = "local"
    profile: Profile = "tuned"
    nodes: int = 1
    researchers: bool = False
    slurm: bool = False
    rtt_ms: float = 0.0
    shell: str | None = None
    sshd: str | None = None
    overrides: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nodes > 1 and self.rtt_ms > 0:
            raise ValueError("several login nodes and a relay do not go together yet")


class Rig:
    """The started rig of a `RigSpec`; `stop` (or leaving its ``with``) stops all of it, the
    hosts' sessions killed. Its files live under ``data_dir`` (`LocalHost`'s layout)."""

    def __init__(self, spec: RigSpec, *, data_dir: Path | str) -> None:
        self.spec = spec
        self.data_dir = Path(data_dir)
        self.slurm: LocalSlurm | None = None
        self.cluster: LocalCluster | None = None
        self.relay: LatencyRelay | None = None
        self._host: LocalHost | None = None
        self._stack = contextlib.ExitStack()

    @property
    def host(self) -> LocalHost:
        """The login host (with several nodes: the first node)."""
        if self._host is None:
            raise RuntimeError("the rig is not started")
        return self._host

    @property
    def reached(self) -> LocalHost | RelayedHost:
        """What a client connects to: the host, or the relay in front of it."""
        return self.host if self.relay is None else RelayedHost(self.host, self.relay)

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every login node's address, or () for a single host."""
        return () if self.cluster is None else self.cluster.addresses

    def start(self) -> Self:
        spec, stack = self.spec, self._stack
        try:
            overrides: dict[str, str] = {}
            if spec.slurm:
                self.slurm = stack.enter_context(LocalSlurm(spec.name, data_dir=self.data_dir))
                overrides = self.slurm.sshd_overrides()
            overrides |= spec.overrides
            options: dict[str, Any] = {
                "overrides": overrides,
                "researchers": spec.researchers,
                "shell": spec.shell,
                "sshd": spec.sshd,
            }
            if spec.nodes > 1:
                cluster = LocalCluster(
                    spec.name, spec.nodes, spec.profile, data_dir=self.data_dir, **options
                )
                self.cluster = cluster.start()
                stack.callback(cluster.stop, kill_sessions=True)
                self._host = cluster.nodes[0]
            else:
                host = LocalHost(
                    spec.name,
                    spec.profile,
                    data_dir=self.data_dir,
                    overrides=overrides,
                    researchers=spec.researchers,
                    shell=spec.shell,
                    sshd=spec.sshd,
                )
                self._host = host.start()
                stack.callback(host.stop, kill_sessions=True)
            if spec.rtt_ms > 0:
                relay = LatencyRelay((self.host.address, self.host.port), spec.rtt_ms)
                self.relay = stack.enter_context(relay)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self._stack.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
