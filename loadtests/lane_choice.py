"""Where should a download's SSH work run so that another identity's jobs do not pay for it?
The measurement behind the transfer lane (issue 41, docs/files.md "The transfer lane").

    python -m loadtests.lane_choice --size-mib 1024 --downloads 4 --modes shared,own,thread,process

No HTTP: one process (this one, "the API") runs `true` one after the other on the tuned
local host through its pool, 50 ms apart, alone and then while `--downloads` SFTP downloads of
a sparse file run at once, with the bytes delivered to this process's event loop and dropped
(as an API would hand them to its HTTP side). The downloads run:

- `shared`: on this event loop, on the same pool and connections as the jobs (the API before
  the lane);
- `own`: on this event loop, on a pool of their own (other SSH connections, same loop);
- `thread`: in a thread with its own event loop and pool, each chunk passed to this loop;
- `process`: in a child process with its own event loop and pool, the bytes sent to this
  process over a Unix socket per download, read on this loop.

`thread-1ms` is `thread` with the interpreter's switch interval at 1 ms (5 ms by default: how
long a thread that wants the GIL waits before it asks the holder to let go). It prints, per
mode, the jobs' p50/p90 alone and during, the downloads' rate, and the CPU seconds of this
process (with the child's). Bounded: N downloads of one file per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from loadtests.cpu import tree_seconds
from sshpool import Pool, Target
from sshpool.target import Limits

MIB = 1 << 20
CHUNK = 4 * MIB


async def _download(pool: Pool, target: Target, path: str, size: int, deliver: Any) -> int:
    got = 0
    async with pool.sftp(target, acquire_timeout=60) as fs:
        f = await fs.open_read(path)
        try:
            while got < size:
                data = await f.read(min(CHUNK, size - got))
                if not data:
                    break
                got += len(data)
                await deliver(data)
        finally:
            await f.close()
    return got


async def _drop(data: bytes) -> None:
    return None


async def _pings(pool: Pool, target: Target, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await pool.run(target, ["true"], timeout=30, acquire_timeout=30, tenant="bob")
        out.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(0.05)


def _target_spec(target: Target) -> dict[str, Any]:
    return {
        "host": target.host,
        "port": target.port,
        "username": target.username,
        "client_keys": list(target.client_keys),
        "known_hosts": target.known_hosts,
    }


def _target(spec: dict[str, Any]) -> Target:
    return Target(
        host=spec["host"],
        port=spec["port"],
        username=spec["username"],
        client_keys=tuple(spec["client_keys"]),
        known_hosts=spec["known_hosts"],
        limits=Limits(max_sessions=8),
    )


async def _child(spec: dict[str, Any]) -> None:
    """The `process` mode's child: each download's bytes to its own Unix socket connection."""
    target = _target(spec["target"])
    async with Pool() as pool:

        async def one() -> None:
            _reader, writer = await asyncio.open_unix_connection(spec["socket"])

            async def send(data: bytes) -> None:
                writer.write(data)
                await writer.drain()

            await _download(pool, target, spec["path"], spec["size"], send)
            writer.close()
            await writer.wait_closed()

        await asyncio.gather(*(one() for _ in range(spec["downloads"])))


def _thread_downloads(
    target: Target, path: str, size: int, n: int, main: asyncio.AbstractEventLoop, q: Any
) -> None:
    async def run() -> None:
        async with Pool() as pool:

            async def deliver(data: bytes) -> None:
                # Handed to the main loop, waited for there (one chunk in flight each).
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(q.put(data), main))

            await asyncio.gather(*(_download(pool, target, path, size, deliver) for _ in range(n)))

    asyncio.run(run())


async def _mode(
    mode: str, pool: Pool, target: Target, path: str, size: int, n: int
) -> dict[str, Any]:
    stop = asyncio.Event()
    during: list[float] = []
    me = os.getpid()
    child_cpu = 0.0
    cpu0, t0 = tree_seconds(me), time.perf_counter()
    pinger = asyncio.ensure_future(_pings(pool, target, stop, during))
    got = 0
    if mode in ("shared", "own"):
        if mode == "shared":
            got = sum(
                await asyncio.gather(
                    *(_download(pool, target, path, size, _drop) for _ in range(n))
                )
            )
        else:
            async with Pool() as own:
                got = sum(
                    await asyncio.gather(
                        *(_download(own, target, path, size, _drop) for _ in range(n))
                    )
                )
    elif mode.startswith("thread"):
        q: asyncio.Queue[bytes] = asyncio.Queue(1)
        loop = asyncio.get_running_loop()
        th = threading.Thread(target=_thread_downloads, args=(target, path, size, n, loop, q))
        interval = sys.getswitchinterval()
        if mode == "thread-1ms":
            # The main thread waits at most this long for the GIL after each system call.
            sys.setswitchinterval(0.001)
        th.start()
        try:
            while got < n * size:
                got += len(await q.get())
            await asyncio.to_thread(th.join)
        finally:
            sys.setswitchinterval(interval)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            where = os.path.join(tmp, "lane.sock")
            done = asyncio.Event()
            counts: list[int] = []

            async def take(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                total = 0
                while data := await r.read(1 << 20):
                    total += len(data)
                counts.append(total)
                w.close()
                if len(counts) == n:
                    done.set()

            server = await asyncio.start_unix_server(take, where)
            spec = {
                "target": _target_spec(target),
                "socket": where,
                "path": path,
                "size": size,
                "downloads": n,
            }
            argv = [sys.executable, "-m", "loadtests.lane_choice", "--child", json.dumps(spec)]
            proc = await asyncio.create_subprocess_exec(*argv)
            await done.wait()
            await proc.wait()
            server.close()
            got = sum(counts)
        # The child was waited for: its CPU is in this process's reaped children's times.
        child_cpu = 0.0
    seconds = time.perf_counter() - t0
    stop.set()
    await pinger
    cpu = tree_seconds(me) - cpu0
    return {
        "mode": mode,
        "during_ms": during,
        "mb_per_s": got / seconds / 1e6,
        "seconds": seconds,
        "cpu_this_and_children_s": cpu + child_cpu,
        "load": os.getloadavg()[0],
    }


async def _run(host: Any, path: str, size: int, n: int, modes: list[str]) -> list[dict[str, Any]]:
    target = host.target(max_sessions=8)
    results = []
    async with Pool() as pool:
        await pool.run(target, ["true"], timeout=30)
        for mode in modes:
            stop = asyncio.Event()
            alone: list[float] = []
            pinger = asyncio.ensure_future(_pings(pool, target, stop, alone))
            await asyncio.sleep(4)
            stop.set()
            await pinger
            result = await _mode(mode, pool, target, path, size, n)
            result["alone_ms"] = alone
            results.append(result)
    return results


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        alone, during = r["alone_ms"], r["during_ms"]
        ratio = statistics.median(during) / statistics.median(alone)
        lines.append(
            f"{r['mode']:>8}: jobs alone p50 {_pct(alone, 0.5):.1f} ms p90 {_pct(alone, 0.9):.1f};"
            f" during p50 {_pct(during, 0.5):.1f} ms p90 {_pct(during, 0.9):.1f} (x{ratio:.1f},"
            f" {len(during)} jobs); downloads {r['mb_per_s']:.0f} MB/s; CPU this process (+child)"
            f" {r['cpu_this_and_children_s']:.1f} s in "
            f"{r['seconds']:.1f} s; load {r['load']:.1f}"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.lane_choice")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--downloads", type=int, default=4)
    p.add_argument("--modes", default="shared,own,thread,process")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        asyncio.run(_child(json.loads(args.child)))
        return 0
    from loadtests.server import tuned_host

    size = args.size_mib * MIB
    with tuned_host("lane-choice") as (host, _tmp):
        path = str(Path(host.account.home) / f"lane-choice-{os.getpid()}.bin")
        host.run_local(["truncate", "-s", str(size), path])
        try:
            modes = args.modes.split(",") * args.rounds
            results = asyncio.run(_run(host, path, size, args.downloads, modes))
        finally:
            host.run_local(["rm", "-f", path])
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
