"""Where the CPU of a run went: the API's processes, sshd with the shells it started, the load
generator (which measures itself, see loadtests/harness.py) and the rest of the machine.

CPU time per job is the steady figure on a shared box: latency there measures the neighbours
too, while the CPU seconds a process spends on N jobs barely change with what else runs (cache
and frequency effects aside). A process tree's CPU is the sum over its live processes of their
own time and of their reaped children's: a shell that ran and exited is in its parent's
`children_*` times, so nothing that ran under the tree is lost, and nothing counts twice.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import psutil


def tree_seconds(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by `pid` and every descendant, alive or reaped;
    0.0 when the process is gone."""
    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:  # exited between the listing and the read: a few ms lost at most
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def machine_seconds() -> float:
    """Busy CPU seconds of the whole machine, all cores (everything but idle and iowait)."""
    t = psutil.cpu_times()
    busy: float = sum(t) - t.idle - getattr(t, "iowait", 0.0)
    return busy


def reaped_children_seconds() -> float:
    """CPU seconds (user + system) of this process's children waited for so far."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def own_seconds() -> float:
    """CPU seconds (user + system) of this process so far, its children aside."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


@dataclass(slots=True)
class CpuMeter:
    """Snapshots before and after a run of the API's process tree and sshd's (the listener, its
    per-connection processes and the shells they ran) and of the machine.

    Call `start()` once the API is up and before the generator starts, `stop()` after the
    generator ended and before the API stops."""

    api_pid: int | None
    sshd_pid: int | None
    _api: float = 0.0
    _sshd: float = 0.0
    _machine: float = 0.0

    def start(self) -> CpuMeter:
        self._api = tree_seconds(self.api_pid)
        self._sshd = tree_seconds(self.sshd_pid)
        self._machine = machine_seconds()
        return self

    def stop(self, jobs: int, generator_seconds: float | None) -> dict[str, float | int | None]:
        """CPU per job in ms, by where it went. `jobs`: requests the generator sent (warm-up
        included); `generator_seconds`: the generator's own CPU over its sending. The rest is
        the machine's busy time minus the three: the generator's start-up, the store's disk
        work in the kernel, other tenants of the box."""
        api = tree_seconds(self.api_pid) - self._api
        sshd = tree_seconds(self.sshd_pid) - self._sshd
        machine = machine_seconds() - self._machine
        gen = generator_seconds or 0.0
        per = 1000.0 / jobs if jobs else 0.0
        return {
            "jobs": jobs,
            "api_ms_per_job": round(api * per, 3) if jobs else None,
            "sshd_ms_per_job": round(sshd * per, 3) if jobs else None,
            "generator_ms_per_job": round(gen * per, 3) if jobs and generator_seconds else None,
            "rest_ms_per_job": round((machine - api - sshd - gen) * per, 3) if jobs else None,
            "machine_ms_per_job": round(machine * per, 3) if jobs else None,
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
