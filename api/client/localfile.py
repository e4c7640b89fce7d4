"""A local file as each client reads and writes it: besides waiting, the one place where the two
clients differ. `AsyncFile` (the async client's, in _async.py) runs each blocking call in a
thread so that the event loop goes on; unasync's rule turns the name into `SyncFile` in the
generated _sync.py, where the calls are the plain ones."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar

T = TypeVar("T")
PIECE = 1 << 20  # bytes per part of a body sent from memory (`pieces`)


async def _in_thread(call: Callable[..., T], *args: object) -> T:
    """`call(*args)` in a thread. asyncio is imported here, on first use: the sync client's
    process (every `sshapi` command) needs none of it (about 7 ms of its start-up)."""
    from asyncio import to_thread

    return await to_thread(call, *args)


def _sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while data := f.read(1 << 20):
            digest.update(data)
    return digest.hexdigest()


def _identity(path: str | os.PathLike[str]) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


class AsyncFile:
    """A local file whose blocking calls run in a thread."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw

    @classmethod
    async def open(cls, path: str | os.PathLike[str]) -> AsyncFile:
        """`path`, opened for reading."""
        return cls(await _in_thread(Path(path).open, "rb"))

    @staticmethod
    async def size(path: str | os.PathLike[str]) -> int:
        return (await _in_thread(os.stat, path)).st_size

    @staticmethod
    async def sha256(path: str | os.PathLike[str]) -> str:
        return await _in_thread(_sha256, path)

    @staticmethod
    async def identity(path: str | os.PathLike[str]) -> list[int]:
        """The file's size, mtime, inode and device: a change of any is a new file."""
        return await _in_thread(_identity, path)

    @staticmethod
    async def pieces(data: bytes) -> AsyncIterator[bytes]:
        """`data` in PIECE-sized parts, for a request's body: httpx sent one 64 MiB `bytes`
        body at a third of the rate of the same bytes in parts (loopback, 2026-11-28)."""
        for n in range(0, len(data), PIECE):
            yield data[n : n + PIECE]

    async def read(self, size: int) -> bytes:
        return await _in_thread(self.raw.read, size)

    async def write(self, data: bytes) -> None:
        await _in_thread(self.raw.write, data)

    async def seek(self, offset: int) -> None:
        await _in_thread(self.raw.seek, offset)

    def close(self) -> None:
        self.raw.close()


class SyncFile:
    """A local file, called directly."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SyncFile:
        """`path`, opened for reading."""
        return cls(Path(path).open("rb"))

    @staticmethod
    def size(path: str | os.PathLike[str]) -> int:
        return os.path.getsize(path)

    @staticmethod
    def sha256(path: str | os.PathLike[str]) -> str:
        return _sha256(path)

    @staticmethod
    def identity(path: str | os.PathLike[str]) -> list[int]:
        """The file's size, mtime, inode and device: a change of any is a new file."""
        return _identity(path)

    @staticmethod
    def pieces(data: bytes) -> Iterator[bytes]:
        """`data` in PIECE-sized parts, for a request's body."""
        for n in range(0, len(data), PIECE):
            yield data[n : n + PIECE]

    def read(self, size: int) -> bytes:
        return self.raw.read(size)

    def write(self, data: bytes) -> None:
        self.raw.write(data)

    def seek(self, offset: int) -> None:
        self.raw.seek(offset)

    def close(self) -> None:
        self.raw.close()
