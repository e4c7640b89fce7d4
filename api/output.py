"""What reading a job's output deals in, for plain commands (kept in the store) and batch jobs
(files on the login host) alike. Pure: imports nothing of the API."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

Stream = Literal["stdout", "stderr"]

# The most one output read returns, whatever `limit` the caller asks for.
MAX_READ = 16 << 20
# A batch job's output is read over SSH this many bytes at a time and sent on as it comes:
# a 16 MiB read holds about one piece in memory, not 16 MiB.
PIECE = 512 << 10


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


@dataclass(frozen=True, slots=True)
class OutputRange:
    """A byte range of an output as an answer: ``length`` bytes from ``offset``, produced by
    ``body`` while they are sent; ``size`` as in OutputChunk (None: nothing to read yet)."""

    offset: int
    size: int | None
    length: int
    body: AsyncIterator[bytes]

    @property
    def next_offset(self) -> int:
        return self.offset + self.length


def stored_range(kept: bytes, final: bool, offset: int, limit: int) -> OutputRange:
    """A byte range of a command's kept output (the store's): nothing until the job is final."""
    if not final:
        return OutputRange(offset, None, 0, pieces())
    data = kept[offset : offset + limit]
    return OutputRange(offset, len(kept), len(data), pieces(data))


async def pieces(*items: bytes) -> AsyncIterator[bytes]:
    """An output body from bytes already in memory."""
    for item in items:
        yield item
