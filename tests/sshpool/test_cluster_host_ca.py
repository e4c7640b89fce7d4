"""Login nodes vouched for by a host CA (`@cert-authority` in known_hosts, each node's host key
certified for its address) on the three backends: asyncssh verifies the certificates and
refuses a node certified by another CA; paramiko and ssh2 cannot check host certificates and
fail closed (HostKeyMismatch: nothing sent), so those backends need a key line per node."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from sshpool import HostKeyMismatch, Pool
from sshpool.devhost import LocalCluster


def read(path: str) -> str:
    return Path(path).read_text()


def write(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    return path


@pytest.fixture(scope="module")
def ca_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    data = tmp_path_factory.mktemp("ca-cluster")
    with LocalCluster("ca", 2, "stock", data_dir=data, host_ca=True) as cluster:
        yield cluster


def test_known_hosts_holds_only_the_ca(ca_cluster: LocalCluster) -> None:
    lines = Path(ca_cluster.known_hosts).read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("@cert-authority ")


async def test_asyncssh_verifies_every_node_by_its_certificate(ca_cluster: LocalCluster) -> None:
    target = replace(ca_cluster.target(), backend="asyncssh")
    async with Pool() as pool:
        for node in target.nodes:
            result = await pool.run(target.node_target(node), ["true"], acquire_timeout=10)
            assert result.ok


async def test_asyncssh_refuses_a_node_certified_by_another_ca(
    ca_cluster: LocalCluster, tmp_path: Path
) -> None:
    other = LocalCluster("other", 1, "stock", data_dir=tmp_path, host_ca=True)
    with other:
        # The first cluster's CA line, this node's address and port: its certificate is the
        # other CA's.
        ca = " ".join(read(ca_cluster.known_hosts).split()[2:])
        known = write(
            tmp_path / "known_hosts", f"@cert-authority {other.nodes[0].host_pattern} {ca}"
        )
        target = replace(other.target(), known_hosts=str(known), backend="asyncssh")
        async with Pool() as pool:
            with pytest.raises(HostKeyMismatch):
                await pool.run(target.node_target(target.nodes[0]), ["true"], acquire_timeout=10)


@pytest.mark.parametrize("backend", ["paramiko", "ssh2"])
async def test_paramiko_and_ssh2_fail_closed_on_a_ca_line(
    ca_cluster: LocalCluster, backend: str
) -> None:
    target = replace(ca_cluster.target(), backend=backend)
    async with Pool() as pool:
        with pytest.raises(HostKeyMismatch):
            await pool.run(target.node_target(target.nodes[0]), ["true"], acquire_timeout=10)


@pytest.mark.parametrize("backend", ["asyncssh", "paramiko", "ssh2"])
async def test_a_ca_line_beside_key_lines_breaks_no_backend(
    ca_cluster: LocalCluster, backend: str, tmp_path: Path
) -> None:
    """The CA line and a key line per node in one file: every backend reaches every node."""
    lines = [read(ca_cluster.known_hosts).strip()]
    lines += [node.known_hosts_line() for node in ca_cluster.nodes]
    known = write(tmp_path / "known_hosts", "\n".join(lines))
    target = replace(ca_cluster.target(), backend=backend, known_hosts=str(known))
    async with Pool() as pool:
        for node in target.nodes:
            assert (await pool.run(target.node_target(node), ["true"], acquire_timeout=10)).ok
