"""loadtests.cpu: a process tree's CPU includes what its children spent, alive or exited."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from loadtests.cpu import CpuMeter, machine_seconds, tree_seconds

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_a_tree_counts_the_cpu_of_children_that_already_exited() -> None:
    """A parent whose child burned 0.3 s of CPU and exited shows that 0.3 s in its tree."""
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         f"subprocess.run([sys.executable, '-c', {BURN.format(s=0.3)!r}])\n"
         "print('done', flush=True)\ntime.sleep(30)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "done"
        assert tree_seconds(parent.pid) >= 0.28  # a clock tick of accounting
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def test_meter_splits_cpu_per_job_and_a_gone_process_counts_nothing() -> None:
    """CPU per job is the tree's CPU over the run divided by the jobs; no pid, no figure."""
    meter = CpuMeter(os.getpid(), None).start()
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    cpu = meter.stop(jobs=100, generator_seconds=None)
    # 0.2 s / 100 jobs, less the clock tick of the kernel's accounting
    assert cpu["api_ms_per_job"] is not None and cpu["api_ms_per_job"] >= 1.8
    assert cpu["sshd_ms_per_job"] == 0.0 and cpu["generator_ms_per_job"] is None
    assert tree_seconds(None) == 0.0 and machine_seconds() > 0
