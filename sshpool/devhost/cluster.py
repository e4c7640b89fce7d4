"""A local login-node cluster: several sshd on 127.0.0.2, .3, ... sharing one port, one account
(so one home, and one Slurm when the rig runs one) and one client key, as a site's login nodes
behind one name share their home file systems and their scheduler.

```python
with LocalCluster("hpc", 3, data_dir=Path(".data")) as cluster:
    target = cluster.target()        # Target(nodes=("127.0.0.2", "127.0.0.3", "127.0.0.4"))
    cluster.nodes[1].stop(kill_sessions=True)   # one login node goes down, sessions and all
```
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from sshpool.devhost.host import LocalHost, LocalHostError, Profile
from sshpool.target import Limits, Target

# The first node's address; the next ones count up from it (any of 127.0.0.0/8 needs no setup).
FIRST_ADDRESS = 2


def node_address(index: int) -> str:
    return f"127.0.0.{FIRST_ADDRESS + index}"


class LocalCluster:
    """`count` login nodes, each a `LocalHost` named ``<name>-n<i>`` on its own address and the
    same port; the first node's client key logs in on all of them, and its known_hosts lists
    every node's host key."""

    def __init__(
        self,
        name: str,
        count: int,
        profile: Profile = "tuned",
        *,
        data_dir: Path | str,
        host_ca: bool = False,
        **host_options: Any,
    ) -> None:
        """``host_ca``: the nodes' host keys are certified by one host CA (made once, under
        ``<data_dir>/hosts/<name>-ca/``) and known_hosts holds only its ``@cert-authority``
        line, as a site with many login nodes does instead of a key per node."""
        if not 1 <= count <= 250:
            raise ValueError("a local cluster has 1 to 250 nodes")
        self.name = name
        data = Path(data_dir).absolute()
        self.ca_key = data / "hosts" / f"{name}-ca" / "ca" if host_ca else None
        first = LocalHost(
            f"{name}-n0", profile, address=node_address(0), data_dir=data, **host_options
        )
        client_dir = Path(first.client_key).parent
        self.nodes = [first] + [
            LocalHost(
                f"{name}-n{i}",
                profile,
                address=node_address(i),
                port=first.port,
                data_dir=data,
                client_dir=client_dir,
                **host_options,
            )
            for i in range(1, count)
        ]

    @property
    def port(self) -> int:
        return self.nodes[0].port

    @property
    def address(self) -> str:
        """The first node's address."""
        return self.nodes[0].address

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(node.address for node in self.nodes)

    @property
    def username(self) -> str:
        return self.nodes[0].username

    @property
    def client_key(self) -> str:
        return self.nodes[0].client_key

    @property
    def known_hosts(self) -> str:
        return self.nodes[0].known_hosts

    def target(self, **limits: object) -> Target:
        """The cluster's Target (its nodes); keyword arguments go to ``Limits``."""
        return Target(
            host=self.name,
            username=self.username,
            client_keys=(self.client_key,),
            known_hosts=self.known_hosts,
            port=self.port,
            limits=Limits(**limits),  # type: ignore[arg-type]
            nodes=self.addresses,
        )

    def start(self) -> Self:
        # Sharing the first node's client directory, each node authorizes its key and adds
        # its own host key to its known_hosts.
        if self.ca_key is not None:
            self._certify()
        for node in self.nodes:
            node.start()
        if self.ca_key is not None:
            self._trust_ca_only()
        return self

    def _certify(self) -> None:
        """Make the host CA once, and certify each node's host key for its address."""
        assert self.ca_key is not None
        if not self.ca_key.exists():
            self.ca_key.parent.mkdir(parents=True, exist_ok=True)
            _ssh_keygen(
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                f"{self.name}-host-ca",
                "-f",
                str(self.ca_key),
            )
        for node in self.nodes:
            if not node.host_key_path.exists():
                node.replace_host_key()
            pub = f"{node.host_key_path}.pub"
            _ssh_keygen(
                "-q", "-s", str(self.ca_key), "-h", "-I", node.name, "-n", node.address, pub
            )
            node.overrides["HostCertificate"] = f"{node.host_key_path}-cert.pub"

    def _trust_ca_only(self) -> None:
        patterns = ",".join(node.host_pattern for node in self.nodes)
        ca = Path(f"{self.ca_key}.pub").read_text().split()[:2]
        Path(self.known_hosts).write_text(f"@cert-authority {patterns} {' '.join(ca)}\n")

    def stop(self, *, kill_sessions: bool = False) -> None:
        for node in self.nodes:
            node.stop(kill_sessions=kill_sessions)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _ssh_keygen(*args: str) -> None:
    done = subprocess.run(["ssh-keygen", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LocalHostError(f"ssh-keygen {' '.join(args)} failed: {done.stderr.strip()}")
