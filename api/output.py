"""What reading a job's output deals in, for plain commands (kept in the store) and batch jobs
(files on the login host) alike. Pure: imports nothing of the API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Stream = Literal["stdout", "stderr"]

# The most one output read returns, whatever `limit` the caller asks for.
MAX_READ = 16 << 20


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """A byte range of an output: ``data`` starts at ``offset``; ``size`` is the whole output's
    size when read (None: a batch job's file does not exist yet)."""

    data: bytes
    offset: int
    size: int | None

    @property
    def next_offset(self) -> int:
        return self.offset + len(self.data)
