"""The development rig: a local HPC host (a real OpenSSH sshd on loopback) and a single-node
Slurm beside it, for `sshapi dev`, the tests and the benchmarks.

Nothing in the core of `sshpool` imports this package.
"""
