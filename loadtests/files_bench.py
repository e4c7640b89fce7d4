"""File transfer throughput through the API beside `scp`, with the API's memory watched.

    python -m loadtests.files_bench --size-mib 1024

It starts a local sshd (`tuned`) and the API (`loadtests.server.start_api`, pooled), writes a
file of random bytes, then uploads it with `PUT .../files/content` and downloads it with `GET`
(streamed both ways, the download hashed on arrival and checked; with `--chunk-mib N`, also as
a resumable upload in N-MiB chunks, each with its Content-Digest, right after the PUT), sampling
the API process's RSS
every 50 ms (psutil) during each. Then the same backend moves it through SFTP alone, in this
process, with the API's chunk size (what the SSH library costs without HTTP), and `scp` moves
it both ways over the same sshd with the same key and known_hosts (OpenSSH 9's scp speaks SFTP
too). It prints MB/s for each,
the API/scp ratio, the RSS growth per transfer and the load average (this box is shared: the
figures move with it), and where the CPU went during each transfer: seconds of CPU of the API
process, of this client, of the sshd side (the listener and every session process under it,
internal-sftp included) and of scp with its ssh child. On a box with few cores a path that needs
more CPU per byte is slower however it is written, so the CPU split says which process to make
cheaper.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from loadtests.cpu import CpuMeter
from loadtests.server import start_api, stop_api, tuned_host

MIB = 1 << 20
PIECE = MIB  # what the client sends and reads at a time
SAMPLE = 0.05  # seconds between RSS samples


@dataclass
class Transfer:
    """One transfer: its rate, and the API's RSS before it and at its highest during it."""

    name: str
    seconds: float
    mb_per_s: float
    rss_before_mib: float | None = None
    rss_peak_mib: float | None = None
    cpu: dict[str, float] | None = None  # CpuMeter.spent: CPU seconds by where they went
    round: int = 1

    @property
    def rss_growth_mib(self) -> float | None:
        if self.rss_before_mib is None or self.rss_peak_mib is None:
            return None
        return self.rss_peak_mib - self.rss_before_mib


class RssSampler:
    """The highest RSS of a process while the `with` body runs, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.before = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        rss: int = self.proc.memory_info().rss
        return rss

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> RssSampler:
        self.before = self.peak = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def make_file(path: Path, size: int) -> str:
    """Write `size` random bytes to `path`; returns their sha256."""
    digest = hashlib.sha256()
    block = os.urandom(PIECE)  # one random MiB, varied per piece: cheap and incompressible
    with path.open("wb") as f:
        for n in range(0, size, PIECE):
            piece = (n.to_bytes(8, "little") + block[8:])[: min(PIECE, size - n)]
            digest.update(piece)
            f.write(piece)
    return digest.hexdigest()


def _pieces(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while data := f.read(PIECE):
            yield data


def _rate(size: int, seconds: float) -> float:
    return size / seconds / 1e6


def api_upload(
    client: httpx.Client,
    url: str,
    token: str,
    pids: tuple[int, int | None],
    source: Path,
    remote: str,
    sha256: str,
) -> Transfer:
    """PUT `source` to `remote` through the API, streamed; the answer's sha256 checked."""
    size = source.stat().st_size
    headers = {"Authorization": f"Bearer {token}", "Content-Length": str(size)}
    with RssSampler(pids[0]) as rss, CpuMeter(*pids, sample=SAMPLE) as cpu:
        t0 = time.perf_counter()
        r = client.put(
            f"{url}/v1/hosts/local/files/content",
            params={"path": remote},
            content=_pieces(source),
            headers=headers,
        )
        seconds = time.perf_counter() - t0
    if r.status_code not in (200, 201) or r.json()["sha256"] != sha256:
        raise RuntimeError(f"upload failed: {r.status_code} {r.text[:300]}")
    return _transfer("API upload", size, seconds, rss, cpu)


def api_chunked_upload(
    client: httpx.Client,
    url: str,
    token: str,
    pids: tuple[int, int | None],
    source: Path,
    remote: str,
    sha256: str,
    chunk: int,
) -> Transfer:
    """`source` to `remote` as a resumable upload (docs/files.md): POST, then PATCH chunks of
    `chunk` bytes, each with its Content-Digest; the last one's sha256 (hashed on the host)
    checked."""
    size = source.stat().st_size
    auth = {"Authorization": f"Bearer {token}"}
    with RssSampler(pids[0]) as rss, CpuMeter(*pids, sample=SAMPLE) as cpu:
        t0 = time.perf_counter()
        made = client.post(
            f"{url}/v1/hosts/local/files/uploads",
            params={"path": remote},
            headers={**auth, "Upload-Length": str(size)},
        )
        if made.status_code != 201:
            raise RuntimeError(f"upload not created: {made.status_code} {made.text[:300]}")
        location = f"{url}{made.headers['location']}"
        with source.open("rb") as f:
            offset = 0
            while True:
                data = f.read(chunk)
                last = offset + len(data) >= size
                digest = base64.b64encode(hashlib.sha256(data).digest()).decode()
                headers = {
                    **auth,
                    "Upload-Offset": str(offset),
                    "Upload-Complete": "?1" if last else "?0",
                    "Content-Digest": f"sha-256=:{digest}:",
                    "Content-Type": "application/partial-upload",
                }
                pieces = [data[n : n + PIECE] for n in range(0, len(data), PIECE)]
                headers["Content-Length"] = str(len(data))
                r = client.patch(location, content=pieces, headers=headers)
                if r.status_code not in ((200, 201) if last else (204,)):
                    raise RuntimeError(f"chunk at {offset}: {r.status_code} {r.text[:300]}")
                offset += len(data)
                if last:
                    break
        seconds = time.perf_counter() - t0
    if r.json()["sha256"] != sha256:
        raise RuntimeError("the chunked upload's sha256 differs from the file's")
    return _transfer(f"API chunks {chunk // MIB} MiB", size, seconds, rss, cpu)


def api_download(
    client: httpx.Client,
    url: str,
    token: str,
    pids: tuple[int, int | None],
    size: int,
    remote: str,
    sha256: str,
) -> Transfer:
    """GET `remote` through the API, streamed, hashed on arrival and checked."""
    digest = hashlib.sha256()
    headers = {"Authorization": f"Bearer {token}"}
    with RssSampler(pids[0]) as rss, CpuMeter(*pids, sample=SAMPLE) as cpu:
        t0 = time.perf_counter()
        endpoint = f"{url}/v1/hosts/local/files/content"
        with client.stream("GET", endpoint, params={"path": remote}, headers=headers) as r:
            r.raise_for_status()
            for data in r.iter_raw(PIECE):
                digest.update(data)
        seconds = time.perf_counter() - t0
    if digest.hexdigest() != sha256:
        raise RuntimeError("the download's sha256 differs from the file's")
    return _transfer("API download", size, seconds, rss, cpu)


def _transfer(name: str, size: int, seconds: float, rss: RssSampler, cpu: CpuMeter) -> Transfer:
    rate = _rate(size, seconds)
    return Transfer(name, seconds, rate, rss.before / MIB, rss.peak / MIB, cpu.spent)


def sftp_transfer(
    host: Any, backend: str, upload: bool, source: Path, remote: str, sha256: str
) -> Transfer:
    """The file through the backend's SFTP alone, in this process: a pooled session (opened
    before the clock starts), the API's CHUNK-sized sequential writes or reads, no HTTP and no
    hashing but the check after a download. What the API adds on top of its SSH library is the
    difference."""
    from api.files import CHUNK
    from sshpool import Pool
    from sshpool.backends import load_backend

    size = source.stat().st_size
    digest = hashlib.sha256()

    async def run() -> float:
        async with (
            Pool(load_backend(backend)) as pool,
            pool.sftp(host.target(), acquire_timeout=30) as fs,
        ):
            t0 = time.perf_counter()
            if upload:
                f = await fs.open_write(remote, exclusive=False)
                with source.open("rb") as local:
                    while data := local.read(CHUNK):
                        await f.write(data)
            else:
                f = await fs.open_read(remote)
                while data := await f.read(CHUNK):
                    digest.update(data)
            await f.close()
            return time.perf_counter() - t0

    with CpuMeter(None, host.pid, sample=SAMPLE) as cpu:
        seconds = asyncio.run(run())
    if not upload and digest.hexdigest() != sha256:
        raise RuntimeError("the SFTP download's sha256 differs from the file's")
    name = "SFTP upload" if upload else "SFTP download"
    return Transfer(name, seconds, _rate(size, seconds), cpu=cpu.spent)


def scp_argv(ssh_argv: list[str]) -> list[str]:
    """The LocalHost's ssh argv (key, known_hosts, strict checking) as scp's: `-P` for the
    port, and without the trailing user@host."""
    argv = ["scp", "-q", *ssh_argv[1:-1]]
    return ["-P" if a == "-p" else a for a in argv]


def scp_transfer(host: Any, upload: bool, source: Path, remote: str, back: Path) -> Transfer:
    ssh_argv = host.ssh_argv()
    where = f"{ssh_argv[-1]}:{remote}"  # user@host:path
    args = [str(source), where] if upload else [where, str(back)]
    with CpuMeter(None, host.pid, sample=SAMPLE) as cpu:
        t0 = time.perf_counter()
        subprocess.run([*scp_argv(ssh_argv), *args], check=True)
        seconds = time.perf_counter() - t0
    name = "scp upload" if upload else "scp download"
    return Transfer(name, seconds, _rate(source.stat().st_size, seconds), cpu=cpu.spent)


def measure(
    host: Any,
    size: int,
    workdir: Path,
    backend: str = "asyncssh",
    rounds: int = 1,
    rtt_ms: float = 0.0,
    chunk: int = 0,
) -> dict[str, Any]:
    """`_measure` on `host`, or through the rig's relay at `rtt_ms` (the API, SFTP alone and
    scp alike: all three reach sshd through it)."""
    if rtt_ms <= 0:
        return _measure(host, size, workdir, backend, rounds, chunk)
    from sshpool.devhost import LatencyRelay, RelayedHost

    with LatencyRelay((host.address, host.port), rtt_ms) as relay:
        result = _measure(RelayedHost(host, relay), size, workdir, backend, rounds, chunk)
    return {**result, "rtt_ms": rtt_ms}


def _measure(
    host: Any,
    size: int,
    workdir: Path,
    backend: str = "asyncssh",
    rounds: int = 1,
    chunk: int = 0,
) -> dict[str, Any]:
    """Start the API against the started LocalHost `host` and move a `size`-byte file `rounds`
    times: each round uploads it through the API, through SFTP alone and with scp back to back,
    then downloads it the same three ways, so that each API / scp pair ran under the same load.
    Returns the transfers, the ratios (the median of the rounds') and load averages."""
    from api.local import local_token, resolve_config
    from api.settings import Settings

    workdir.mkdir(parents=True, exist_ok=True)
    api_dir = workdir / "api"
    source = workdir / "source.bin"
    back = workdir / "back.bin"
    sha256 = make_file(source, size)
    tag = uuid.uuid4().hex[:8]
    remotes = {
        way: os.path.join(host.account.home, f"files-bench-{tag}-{way}.bin")
        for way in ("api", "sftp", "scp")
    }
    load_before = os.getloadavg()
    # The edge's default body deadline, as an operator runs it: an upload earns time as its
    # bytes arrive (SSHAPI_BODY_MIN_RATE), so a slow 1 GiB upload on a loaded box passes.
    proc, url = start_api(
        host, backend=backend, pool_mode="pooled", data_dir=api_dir, log=workdir / "api.log"
    )
    transfers: list[Transfer] = []
    ratios: dict[str, list[float]] = {"upload": [], "download": []}
    try:
        settings = Settings(data_dir=api_dir)
        scopes = ["files:read", "files:write"]
        token = local_token(settings, resolve_config(settings), "files-bench", scopes)
        pids = (proc.pid, host.pid)
        with httpx.Client(timeout=httpx.Timeout(600.0)) as client:
            for n in range(rounds):
                up = api_upload(client, url, token, pids, source, remotes["api"], sha256)
                chunked = (
                    [
                        api_chunked_upload(
                            client, url, token, pids, source, remotes["api"], sha256, chunk
                        )
                    ]
                    if chunk
                    else []
                )
                sftp_up = sftp_transfer(host, backend, True, source, remotes["sftp"], sha256)
                scp_up = scp_transfer(host, True, source, remotes["scp"], back)
                down = api_download(client, url, token, pids, size, remotes["api"], sha256)
                sftp_down = sftp_transfer(host, backend, False, source, remotes["sftp"], sha256)
                scp_down = scp_transfer(host, False, source, remotes["scp"], back)
                for t in (up, *chunked, sftp_up, scp_up, down, sftp_down, scp_down):
                    t.round = n + 1
                    transfers.append(t)
                ratios["upload"].append(up.mb_per_s / scp_up.mb_per_s)
                ratios["download"].append(down.mb_per_s / scp_down.mb_per_s)
                for remote in remotes.values():
                    os.remove(remote)
    finally:
        stop_api(proc)
        for leftover in [*remotes.values(), str(source), str(back)]:
            if os.path.exists(leftover):
                os.remove(leftover)
    return {
        "size_mib": size / MIB,
        "backend": backend,
        "rounds": rounds,
        "transfers": [{**asdict(t), "rss_growth_mib": t.rss_growth_mib} for t in transfers],
        "ratios_upload": ratios["upload"],
        "ratios_download": ratios["download"],
        "ratio_upload": statistics.median(ratios["upload"]),
        "ratio_download": statistics.median(ratios["download"]),
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['size_mib']:.0f} MiB, backend {result['backend']}, relay RTT "
        f"{result.get('rtt_ms', 0):g} ms, load average "
        f"{'/'.join(f'{x:.2f}' for x in result['load_before'])} before, "
        f"{'/'.join(f'{x:.2f}' for x in result['load_after'])} after",
        f"{'transfer':<17} {'seconds':>8} {'MB/s':>8} {'RSS before':>11} {'RSS peak':>9} "
        f"{'growth':>7}",
    ]
    many = result["rounds"] > 1
    for t in result["transfers"]:
        rss = (
            f"{t['rss_before_mib']:>9.1f}MiB {t['rss_peak_mib']:>6.1f}MiB "
            f"{t['rss_growth_mib']:>+6.1f}"
            if t["rss_before_mib"] is not None
            else ""
        )
        name = f"{t['round']}: {t['name']}" if many else t["name"]
        lines.append(f"{name:<17} {t['seconds']:>8.2f} {t['mb_per_s']:>8.1f} {rss}")
    lines.append("CPU seconds during each transfer (cores busy = total CPU / wall seconds):")
    for t in result["transfers"]:
        # The machine's busy time holds the rest: shown apart, not summed with its parts.
        cpu = {k: v for k, v in (t["cpu"] or {}).items() if v >= 0.05 and k != "machine"}
        total = sum(cpu.values())
        split = "  ".join(f"{k} {v:.1f}" for k, v in cpu.items())
        name = f"{t['round']}: {t['name']}" if many else t["name"]
        lines.append(f"{name:<17} {split}  total {total:.1f} ({total / t['seconds']:.2f} cores)")
    for way in ("upload", "download"):
        rounds = ", ".join(f"{r:.0%}" for r in result[f"ratios_{way}"])
        sftp = [t["mb_per_s"] for t in result["transfers"] if t["name"] == f"SFTP {way}"]
        scp = [t["mb_per_s"] for t in result["transfers"] if t["name"] == f"scp {way}"]
        alone = statistics.median(a / b for a, b in zip(sftp, scp, strict=True))
        target = "90%" if not result.get("rtt_ms") else "80%"
        lines.append(
            f"API / scp {way}: {result[f'ratio_{way}']:.0%} (target >= {target}; rounds: "
            f"{rounds}); SFTP alone / scp: {alone:.0%}"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.files_bench", description=__doc__.split("\n")[0]
    )
    p.add_argument("--size-mib", type=int, default=1024, help="File size in MiB.")
    p.add_argument("--backend", default="asyncssh", choices=["asyncssh", "paramiko", "ssh2"])
    p.add_argument("--out", type=Path, default=None, help="Work directory (default: a temp dir).")
    p.add_argument(
        "--rounds", type=int, default=1, help="Rounds of the six transfers (ratios: the median)."
    )
    p.add_argument(
        "--rtt-ms", type=float, default=0.0, help="Through the rig's relay at this round trip."
    )
    p.add_argument(
        "--chunk-mib",
        type=int,
        default=0,
        help="Also upload through the API as a resumable upload in chunks of this many MiB.",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tuned_host("files-bench") as (host, tmp):
        out = args.out or tmp
        result = measure(
            host,
            args.size_mib * MIB,
            out / "run",
            args.backend,
            args.rounds,
            args.rtt_ms,
            args.chunk_mib * MIB,
        )
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
