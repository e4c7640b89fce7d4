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
import threading
import time
from typing import Self

import psutil


def tree_times(pid: int | None) -> dict[tuple[int, float], float]:
    """CPU seconds (user + system, reaped children included) of `pid` and of each descendant
    alive now, by (pid, start time); {} when the process is gone."""
    out: dict[tuple[int, float], float] = {}
    if pid is None:
        return out
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            out[(p.pid, p.create_time())] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:  # exited between the listing and the read: a few ms lost at most
            continue
    return out


def tree_seconds(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by `pid` and every descendant, alive or reaped;
    0.0 when the process is gone."""
    return sum(tree_times(pid).values())


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


class CpuMeter:
    """CPU seconds spent between `start()` and `finish()` (or over a `with` body) by the API's
    process tree (`api`), sshd's (`sshd`: the listener, its per-connection processes and the
    shells they ran), the machine (`machine`), this process (`client`) and its waited-for
    children (`children`: an scp and its ssh, exact from getrusage); in `spent` after `finish`.

    ``sample`` 0: each tree is read at both ends (a reaped child is in its parent's children
    times). ``sample`` > 0: the trees are also read every ``sample`` seconds in a thread and
    each process's last reading counts, for trees whose ended processes nobody reaps into them
    (sshd's session processes during a transfer: one that ends loses at most ``sample`` s)."""

    def __init__(self, api_pid: int | None, sshd_pid: int | None, sample: float = 0.0) -> None:
        self.trees = {"api": api_pid, "sshd": sshd_pid}
        self.sample = sample
        self.spent: dict[str, float] = {}
        self._base: dict[str, dict[tuple[int, float], float]] = {}
        self._last: dict[str, dict[tuple[int, float], float]] = {k: {} for k in self.trees}
        self._own = (0.0, 0.0, 0.0)
        self._sampling = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _own_now() -> tuple[float, float, float]:
        return own_seconds(), reaped_children_seconds(), machine_seconds()

    def _read(self) -> None:
        for name, pid in self.trees.items():
            self._last[name].update(tree_times(pid))

    def _run(self) -> None:
        while not self._stop.wait(self.sample):
            self._read()
        self._sampling = time.thread_time()  # the meter's own cost, not the client's

    def start(self) -> Self:
        self._own = self._own_now()
        self._base = {name: tree_times(pid) for name, pid in self.trees.items()}
        if self.sample > 0:
            self._thread.start()
        return self

    def finish(self) -> dict[str, float]:
        own, children, machine = self._own_now()
        if self.sample > 0:
            self._stop.set()
            self._thread.join()
        self.spent = {
            "client": own - self._own[0] - self._sampling,
            "children": children - self._own[1],
            "machine": machine - self._own[2],
        }
        ended = {name: tree_times(pid) for name, pid in self.trees.items()}
        for name, base in self._base.items():
            if self.sample > 0:
                last = self._last[name] | ended[name]
                self.spent[name] = sum(v - base.get(key, 0.0) for key, v in last.items())
            else:
                self.spent[name] = sum(ended[name].values()) - sum(base.values())
        return self.spent

    def stop(self, jobs: int, generator_seconds: float | None) -> dict[str, float | int | None]:
        """`finish`, as CPU per job in ms by where it went. `jobs`: requests the generator sent
        (warm-up included); `generator_seconds`: the generator's own CPU over its sending. The
        rest is the machine's busy time minus the three: the generator's start-up, the store's
        disk work in the kernel, other tenants of the box."""
        spent = self.finish()
        api, sshd, machine = spent["api"], spent["sshd"], spent["machine"]
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

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.finish()
