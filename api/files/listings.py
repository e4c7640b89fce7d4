"""Listings: a directory read once, its entries kept as a snapshot for the next pages, and the
cursors that name a page (a snapshot id and the last name of the previous page)."""

from __future__ import annotations

import base64
import binascii
import bisect
import json
import re
import secrets
import sys
import time
from array import array
from collections import OrderedDict
from datetime import UTC, datetime

from api.problems import Problem
from sshpool import FileAttrs, FileType

# Snapshots of listings kept per identity (its least recently used go first beyond).
SNAPSHOTS_PER_IDENTITY = 4
TYPES: tuple[FileType, ...] = ("file", "dir", "symlink", "other")


def iso(ts: int) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def describe(name: str, attrs: FileAttrs, target: str | None = None) -> dict[str, object]:
    entry: dict[str, object] = {
        "name": name,
        "type": attrs.type,
        "size": attrs.size,
        "mode": f"{attrs.mode:04o}",
        "mtime": iso(attrs.mtime),
    }
    if target is not None:
        entry["target"] = target
    return entry


Owner = tuple[str, str]


class Snapshot:
    """A directory's entries read once, sorted by name, for the listing's next pages: names in a
    list, the attributes in flat arrays (about 80 bytes an entry with a 20-character name,
    where a DirEntry with its FileAttrs takes about 250)."""

    __slots__ = (
        "given",
        "host",
        "kinds",
        "modes",
        "mtimes",
        "names",
        "nbytes",
        "owner",
        "path",
        "sizes",
        "used",
    )

    def __init__(self, owner: Owner, host: str, given: str, path: str) -> None:
        self.owner = owner
        self.host = host
        self.given = given
        self.path = path
        self.names: list[str] = []
        self.kinds = bytearray()
        self.sizes = array("q")
        self.modes = array("H")
        self.mtimes = array("q")
        self.nbytes = 0
        self.used = time.monotonic()

    def add(self, name: str, attrs: FileAttrs) -> None:
        self.names.append(name)
        self.kinds.append(TYPES.index(attrs.type))
        self.sizes.append(min(attrs.size, (1 << 63) - 1))
        self.modes.append(attrs.mode & 0o7777)
        self.mtimes.append(attrs.mtime)

    def sort(self) -> None:
        """Sort by name (code point order), the order the pages promise."""
        order = sorted(range(len(self.names)), key=self.names.__getitem__)
        self.names = [self.names[i] for i in order]
        self.kinds = bytearray(self.kinds[i] for i in order)
        self.sizes = array("q", (self.sizes[i] for i in order))
        self.modes = array("H", (self.modes[i] for i in order))
        self.mtimes = array("q", (self.mtimes[i] for i in order))
        self.nbytes = sum(map(sys.getsizeof, self.names)) + 27 * len(self.names) + 512

    def __len__(self) -> int:
        return len(self.names)

    def after(self, name: str | None) -> int:
        """The index of the first entry after `name` (0 for None)."""
        return 0 if name is None else bisect.bisect_right(self.names, name)

    def attrs(self, i: int) -> FileAttrs:
        return FileAttrs(TYPES[self.kinds[i]], self.sizes[i], self.modes[i], self.mtimes[i])


def encode_cursor(sid: str, name: str) -> str:
    raw = json.dumps([sid, name], ensure_ascii=False).encode("utf-8", "surrogatepass")
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[str, str]:
    """(snapshot id, the last name of the previous page); 422 for anything else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        sid, name = json.loads(raw.decode("utf-8", "surrogatepass"))
    except (ValueError, TypeError, binascii.Error):
        sid = name = None
    if not (isinstance(sid, str) and isinstance(name, str) and re.fullmatch(r"[0-9a-f]{32}", sid)):
        raise Problem(422, "invalid-cursor", "Invalid cursor", "pass `next_cursor` as it was given")
    return sid, name


class Listings:
    """The snapshots of this process's listings, for their next pages: a snapshot answers only
    its owner, for the host and path it was read from, until `ttl` seconds after its last page;
    all together stay within `budget` bytes (the least recently used dropped first), each
    identity keeps SNAPSHOTS_PER_IDENTITY. A cursor whose snapshot is gone (expired, dropped,
    or another replica's) reads the directory again and goes on after its name."""

    def __init__(self, ttl: float, budget: int) -> None:
        self.ttl = ttl
        self.budget = budget
        self.nbytes = 0
        self._snapshots: OrderedDict[str, Snapshot] = OrderedDict()

    def get(self, sid: str, owner: Owner, host: str, given: str) -> Snapshot | None:
        self._expire()
        snap = self._snapshots.get(sid)
        if snap is None or (snap.owner, snap.host, snap.given) != (owner, host, given):
            return None
        snap.used = time.monotonic()
        self._snapshots.move_to_end(sid)
        return snap

    def put(self, snap: Snapshot) -> str:
        self._expire()
        sid = secrets.token_hex(16)
        self._snapshots[sid] = snap
        self.nbytes += snap.nbytes
        mine = [k for k, v in self._snapshots.items() if v.owner == snap.owner]
        for key in mine[:-SNAPSHOTS_PER_IDENTITY]:
            self._drop(key)
        while self.nbytes > self.budget and self._snapshots:
            self._drop(next(iter(self._snapshots)))
        return sid

    def _drop(self, sid: str) -> None:
        self.nbytes -= self._snapshots.pop(sid).nbytes

    def _expire(self) -> None:
        # Least recently used first: stop at the first one still fresh.
        limit = time.monotonic() - self.ttl
        while self._snapshots:
            sid, snap = next(iter(self._snapshots.items()))
            if snap.used >= limit:
                break
            self._drop(sid)
