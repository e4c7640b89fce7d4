"""The handshake ceiling: how many fresh SSH connections per second the rig's stock sshd
completes with k handshakes in flight, and the CPU each costs on either side.

    .venv/bin/python -m loadtests.handshakes --inflight 4 6 8 9 --duration 10
    .venv/bin/python -m loadtests.handshakes --inflight 2 --phase tcp kex auth exec

Per cell, k loops each: connect a researcher account (a fresh connection, key auth, through the
pool's backend), run `true` on it, close it; the accounts taken in turn. --phase stops earlier,
to tell sshd's costs apart: `tcp` reads sshd's banner and closes (the listener's fork and the
child's re-exec), `kex` makes the key exchange and is refused a login without a key, `auth` logs
in and closes, `exec` (the default) runs `true` too. --kex names the key exchange asyncssh
offers (default: its own list). --client openssh runs OpenSSH's `ssh ... true` instead (its
default key exchange unless --kex; its CPU is that of the reaped `ssh` processes). --credentials
compares logins with the accounts' keys, certificates of the rig's ECDSA P-256 user CA (as the
API's certificate hosts), or of an Ed25519 CA: sshd checks an Ed25519 CA's signature with its
own slower code. Reports the handshakes completed per second, connects sshd dropped
(MaxStartups) and its "drop connection" lines, p50/p99 of one connection (connect to close), and
CPU per handshake: this process (the client), sshd (the listener's reaped children: every
connection's processes and what they ran), the whole box (/proc/stat, other work included) and
the load average. Run as root (the accounts are real). This is the rate the per-sshd budget can
reach at most (docs/pool.md, "One sshd, many accounts").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import asyncssh

from loadtests import hdr
from loadtests.cpu import machine_seconds, own_seconds, reaped_children_seconds
from sshpool import ConnectError, SSHPoolError, Target
from sshpool.backends import load_backend
from sshpool.backends.asyncssh import ENCRYPTION_ALGS
from sshpool.certificates import UserCA
from sshpool.command import Capture
from sshpool.devhost import LocalHost, Rig, RigSpec
from sshpool.devhost.accounts import Account, ensure_accounts

TICK = os.sysconf("SC_CLK_TCK")
PHASES = ("tcp", "kex", "auth", "exec")
CREDENTIALS = ("keys", "certificate", "certificate-ed25519")
BACKEND = load_backend("asyncssh")


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its reaped children (sshd's listener reaps every connection's
    processes once they end)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / TICK


def drop_lines(host: LocalHost, offset: int) -> int:
    """sshd's "drop connection" lines (MaxStartups) in its log since `offset`."""
    with open(host.log_path, "rb") as f:
        f.seek(offset)
        return f.read().count(b"drop connection")


def _options(target: Target, kex: str | None, **extra: Any) -> dict[str, Any]:
    """asyncssh's options for `target` as the pool's backend sets them, and `kex`."""
    options: dict[str, Any] = {
        "port": target.port,
        "username": target.username,
        "client_keys": list(target.client_keys),
        "known_hosts": target.known_hosts,
        "agent_path": None,
        "config": None,
        "preferred_auth": "publickey",
        "password": None,
        "encryption_algs": list(ENCRYPTION_ALGS),
        **extra,
    }
    if kex:
        options["kex_algs"] = [kex]
    return options


async def one(target: Target, phase: str, client: str, kex: str | None) -> None:
    """One connection to `target`, as far as `phase`; ConnectError when sshd dropped it."""
    if client == "openssh":
        argv = ["ssh", "-F", "none", "-i", target.client_keys[0], "-p", str(target.port)]
        for setting in (
            "IdentitiesOnly=yes",
            f"UserKnownHostsFile={target.known_hosts}",
            "StrictHostKeyChecking=yes",
            "BatchMode=yes",
            *([f"KexAlgorithms={kex}"] if kex else []),
        ):
            argv += ["-o", setting]
        proc = await asyncio.create_subprocess_exec(
            *argv, f"{target.username}@{target.host}", "true", stderr=asyncio.subprocess.PIPE
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise ConnectError(f"ssh exited {proc.returncode}: {err.decode().strip()}")
        return
    if phase == "tcp":
        try:
            reader, writer = await asyncio.open_connection(target.host, target.port)
            if not await reader.readline():
                raise ConnectError("closed before its banner")
        except OSError as exc:
            raise ConnectError(str(exc)) from exc
        writer.close()
        await writer.wait_closed()
        return
    if phase == "exec" and not kex:
        conn = await BACKEND.connect(target)
        try:
            await conn.exec("true", None, Capture(4096), Capture(4096))
        finally:
            await conn.close()
        return
    try:
        if phase == "kex":
            with contextlib.suppress(asyncssh.PermissionDenied):
                options = _options(target, kex, client_keys=[])
                async with asyncssh.connect(target.host, **options):
                    pass
            return
        async with asyncssh.connect(target.host, **_options(target, kex)) as ssh:
            if phase == "exec":
                await ssh.run("true")
    except (asyncssh.Error, OSError) as exc:
        raise ConnectError(str(exc)) from exc


async def cell(
    host: LocalHost,
    targets: list[Target],
    inflight: int,
    duration: float,
    phase: str = "exec",
    client: str = "asyncssh",
    kex: str | None = None,
) -> Any:
    turn = itertools.cycle(targets)
    statuses: Counter[str] = Counter()
    hist = hdr.histogram()
    offset = host.log_path.stat().st_size
    assert host.pid is not None
    before = (
        own_seconds() + reaped_children_seconds(),
        tree_cpu(host.pid),
        machine_seconds(),
        time.perf_counter(),
    )
    stop = before[3] + duration

    async def loop() -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            try:
                await one(next(turn), phase, client, kex)
            except ConnectError as exc:
                statuses["dropped" if exc.retryable else type(exc).__name__] += 1
                continue
            except SSHPoolError as exc:
                statuses[type(exc).__name__] += 1
                continue
            hist.record_value(max(1, int((time.perf_counter() - t0) * 1e6)))
            statuses["ok"] += 1

    await asyncio.gather(*(loop() for _ in range(inflight)))
    elapsed = time.perf_counter() - before[3]
    await asyncio.sleep(1.0)  # let sshd reap the last connections' processes
    after = (own_seconds() + reaped_children_seconds(), tree_cpu(host.pid), machine_seconds())
    ok = statuses["ok"] or 1
    p = hdr.percentiles(hist)
    return {
        "inflight": inflight,
        "phase": phase,
        "client": client,
        "kex": kex or "default",
        "seconds": round(elapsed, 1),
        "statuses": dict(statuses),
        "handshakes_per_s": round(statuses["ok"] / elapsed, 1),
        "p50_ms": p["p50"],
        "p99_ms": p["p99"],
        "drop_lines": drop_lines(host, offset),
        "client_cpu_ms": round((after[0] - before[0]) / ok * 1000, 2),
        "sshd_cpu_ms": round((after[1] - before[1]) / ok * 1000, 2),
        "box_cpu_ms": round((after[2] - before[2]) / ok * 1000, 2),
        "load": round(os.getloadavg()[0], 1),
    }


async def run(
    host: LocalHost, targets: dict[str, list[Target]], args: argparse.Namespace
) -> list[Any]:
    """Every cell, for each kind of `targets` in turn (interleaved within a round)."""
    rows = []
    for _ in range(args.rounds):
        for k in args.inflight:
            for phase in args.phase:
                for kex in args.kex or [None]:
                    for credentials, kind in targets.items():
                        row = await cell(host, kind, k, args.duration, phase, args.client, kex)
                        row = {"credentials": credentials, **row}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    return rows


def credential_targets(host: LocalHost, accounts: list[Account], kind: str) -> list[Target]:
    """The accounts' targets logging in with `kind` of CREDENTIALS: their keys, or a fresh
    certificate per connection of the rig's user CA (ECDSA P-256), or of an Ed25519 CA made now
    and trusted by the rig's sshd beside its own (the rig writes its CA file again at its next
    start)."""
    if kind == "keys":
        return [a.target(host) for a in accounts]
    targets = [host.certificate_target(a.name, username=a.name) for a in accounts]
    if kind == "certificate":
        return targets
    ca = UserCA(asyncssh.generate_private_key("ssh-ed25519").export_private_key())
    with host.ca_keys_path.open("a") as trusted:  # sshd reads it at each login
        trusted.write(ca.public_key + "\n")
    return [dataclasses.replace(t, ca=ca) for t in targets]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.handshakes", description=__doc__)
    parser.add_argument("--inflight", type=int, nargs="+", default=[4, 6, 8, 9])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per cell")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--accounts", type=int, default=100)
    parser.add_argument(
        "--phase", nargs="+", choices=PHASES, default=["exec"], help="how far each connection goes"
    )
    parser.add_argument("--kex", nargs="+", help="key exchange algorithms to compare, in turn")
    parser.add_argument("--client", choices=("asyncssh", "openssh"), default="asyncssh")
    parser.add_argument(
        "--credentials",
        nargs="+",
        choices=CREDENTIALS,
        default=["keys"],
        help="how the accounts log in, compared in turn: their keys, certificates of the rig's "
        "ECDSA CA, or of an Ed25519 CA (asyncssh client only)",
    )
    parser.add_argument("--data-dir", default=".data-accounts")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every cell of `args` against the rig's stock sshd logging in `--accounts` researcher
    accounts (made when missing, as root): one row per cell."""
    data_dir = Path(args.data_dir).absolute()
    accounts = ensure_accounts(args.accounts, data_dir=data_dir)
    if args.client == "openssh" and args.credentials != ["keys"]:
        raise SystemExit("--client openssh logs in with the accounts' keys only")
    with Rig(RigSpec("accounts", "stock", researchers=True), data_dir=data_dir) as rig:
        targets = {c: credential_targets(rig.host, accounts, c) for c in args.credentials}
        return asyncio.run(run(rig.host, targets, args))


def main(argv: list[str] | None = None) -> int:
    rows = measure(parse(argv))
    head = (
        "credentials         inflight phase client   kex                   hs/s  p50ms  p99ms "
        "drops client_ms sshd_ms box_ms load"
    )
    print(head)
    for r in rows:
        print(
            f"{r['credentials']:19} {r['inflight']:8} {r['phase']:5} {r['client']:8} "
            f"{r['kex'][:20]:20} "
            f"{r['handshakes_per_s']:5} {r['p50_ms'] or 0:6.1f} "
            f"{r['p99_ms'] or 0:6.1f} {r['drop_lines']:5} {r['client_cpu_ms']:9} "
            f"{r['sshd_cpu_ms']:7} {r['box_cpu_ms']:6} {r['load']:4}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
