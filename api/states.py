"""The job-state vocabulary, in one place: what the HTTP API answers, the store keeps, and the
batch scheduler's states map onto. Pure: imports nothing of the API.

    queued -> running -> succeeded | failed | timed_out | cancelled | lost
    (any state before the command starts) -> error   (nothing ran: the SSH failure says why)
"""

from __future__ import annotations

from typing import Literal, get_args

State = Literal[
    "queued", "running", "succeeded", "failed", "timed_out", "cancelled", "lost", "error"
]

# Not finished yet: the jobs a restart marks `lost` and a list's `active` filter selects.
ACTIVE: tuple[State, ...] = ("queued", "running")
# Finished: the state never changes again.
FINAL: tuple[State, ...] = ("succeeded", "failed", "timed_out", "cancelled", "lost", "error")

assert set(ACTIVE) | set(FINAL) == set(get_args(State)), "every state is active or final"
