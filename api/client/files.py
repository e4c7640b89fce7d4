"""What the files methods of both clients share: paths, upload headers (a resumable upload's
chunks' too), and the part file that lets a download resume."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import posixpath
import time
from collections.abc import Callable, Mapping
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import BinaryIO

import httpx

from api.client.errors import SshapiError

# A transfer's progress: (bytes done, bytes in all).
Progress = Callable[[int, int], None]
CHUNK = 1 << 20  # bytes per upload read (the server writes to the host in 1 MiB writes too)


def _upload_headers(size: int, create_only: bool) -> dict[str, str]:
    # A declared length lets the server refuse a file over its cap before any byte is sent.
    headers = {"Content-Length": str(size), "Content-Type": "application/octet-stream"}
    if create_only:
        headers["If-None-Match"] = "*"
    return headers


# Bytes per chunk of a resumable upload (`upload_resumable`): what one lost connection costs
# again at most. The server's cap is in its answers' `Upload-Limit` (max-append-size).
UPLOAD_CHUNK = 16 << 20
CHUNK_TIMEOUT = httpx.Timeout(60, write=300)  # a chunk's send may wait on a slow host


def _chunk_headers(offset: int, data: bytes, last: bool) -> dict[str, str]:
    """One chunk of a resumable upload: where it starts, whether it ends the file, and its
    RFC 9530 digest (the server refuses it, and counts nothing of it, if a byte differs)."""
    digest = base64.b64encode(hashlib.sha256(data).digest()).decode()
    return {
        "Content-Length": str(len(data)),  # sent in pieces (`AsyncFile.pieces`), not chunked
        "Upload-Offset": str(offset),
        "Upload-Complete": "?1" if last else "?0",
        "Content-Digest": f"sha-256=:{digest}:",
        "Content-Type": "application/partial-upload",
    }


def _creation(size: int, create_only: bool) -> dict[str, str]:
    """A resumable upload's creation: the file's size, and `If-None-Match: *` to create only."""
    return {"Upload-Length": str(size), **({"If-None-Match": "*"} if create_only else {})}


def upload_records() -> Path:
    """Where the client keeps its resumable uploads in progress (`UploadRecord`):
    $XDG_STATE_HOME/sshapi/uploads, by default ~/.local/state/sshapi/uploads."""
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "sshapi" / "uploads"


# A problem answer to a chunk after which the upload cannot go on (gone, refused for good):
# its record is dropped. Others (401, 403, 429, 5xx) may pass: the next call resumes.
FINAL_REFUSALS = frozenset({400, 404, 409, 412, 413, 416, 422})


# A local file's size, mtime, inode and device: a change of any is a new file.
Identity = list[int]


class UploadRecord:
    """A resumable upload in progress, on disk (one small JSON file, mode 0600, in `directory`):
    its `Location` and the local file as it was when the upload began (size, mtime, inode). A
    later call for the same server, host, path and local file, from another process after this
    one was stopped, goes on where the server stands; a local file changed since is sent anew
    (the old upload cancelled, freeing its place). Dropped once the upload is complete or
    refused for good."""

    def __init__(
        self,
        directory: Path,
        server: str,
        host: str,
        path: str,
        source: str | os.PathLike[str],
        create_only: bool,
    ) -> None:
        # Small local files, read and written in place even by the async client: microseconds.
        key = [server, host, path, os.path.abspath(source), create_only]
        name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
        self.path = directory / f"{name}.json"

    def load(self, prefix: str) -> tuple[str, Identity] | None:
        """The recorded upload's Location and the local file's identity then, if any. Only a
        Location under `prefix` (the host's uploads, on this client's server): an edited record
        must not send the file, and the token with it, anywhere else."""
        try:
            kept = json.loads(self.path.read_text())
            location, identity = str(kept["location"]), [int(x) for x in kept["identity"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None  # none, or unreadable: the upload starts again
        return (location, identity) if location.startswith(prefix) else None

    def save(self, location: str, identity: Identity) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = self.path.with_suffix(".tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"location": location, "identity": identity}, f)
        temp.replace(self.path)

    def drop(self) -> None:
        self.path.unlink(missing_ok=True)


def _chunk_refused(response: httpx.Response) -> tuple[int | None, bool]:
    """A chunk's refusal the client acts on: the offset a 409 says the upload stands at (send
    from there), and whether the chunk arrived damaged (400 `digest-mismatch`: send it again)."""
    if response.status_code == 409:
        return _upload_offset(response), False
    problem = response.headers.get("content-type", "").startswith("application/problem")
    kind = response.json().get("type", "") if problem and response.status_code == 400 else ""
    return None, str(kind).endswith(":digest-mismatch")


class Sent:
    """The local file's sha256 over the chunks a resumable upload sent, in order: the whole
    file's once they cover it without a gap (a resume past bytes never hashed here leaves a
    gap: then the file is hashed again at the end)."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._hashed = 0

    def confirmed(self, offset: int, data: bytes) -> None:
        if offset == self._hashed:
            self._sha.update(data)
            self._hashed += len(data)

    def hexdigest(self, size: int) -> str | None:
        return self._sha.hexdigest() if self._hashed == size else None


def _check_sha256(answer: Mapping[str, object], local: str, host: str, path: str) -> None:
    """The server's sha256 of the file it renamed into place is the local file's."""
    if answer.get("sha256") != local:
        raise SshapiError(
            f"{path} on {host}: the host's sha256 {answer.get('sha256')} is not the local file's "
            f"{local} (did the local file change during the upload?)"
        )


def _upload_offset(response: httpx.Response) -> int | None:
    """The `Upload-Offset` of an answer (a HEAD, a 409), or None."""
    value = response.headers.get("upload-offset", "")
    return int(value) if value.isascii() and value.isdigit() else None


def _chunk_limit(response: httpx.Response, wanted: int) -> int:
    """`wanted`, within the server's `Upload-Limit: max-append-size=N`."""
    for member in response.headers.get("upload-limit", "").split(","):
        key, _, value = member.strip().partition("=")
        if key == "max-append-size" and value.isascii() and value.isdigit():
            return max(1, min(wanted, int(value)))
    return wanted


def _parent(path: str) -> str | None:
    """The directory holding `path` on the host, or None when there is none to create (a
    name in the home directory, `/`, `~`)."""
    parent = posixpath.dirname(path.rstrip("/"))
    return parent if parent not in ("", "/", "~", path.rstrip("/")) else None


def files_path(host: str, suffix: str = "") -> str:
    return f"/v1/hosts/{host}/files{suffix}"


# Seconds between a file's last modification and a download for its ETag (size and modification
# second) to name one content: RFC 9110's rule for a strong Last-Modified (a second), plus a second
# for the clocks of the API and the host to disagree.
SETTLED = 2.0


def _http_time(response: httpx.Response, header: str) -> float | None:
    try:
        return parsedate_to_datetime(response.headers[header]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None


def settled(response: httpx.Response) -> bool:
    """Whether the downloaded file was last modified SETTLED seconds or more before the answer
    (the server's Date, else this clock). One modified since may be rewritten within the same
    second at the same size: same ETag, other bytes, so its part must not be resumed."""
    modified = _http_time(response, "last-modified")
    now = _http_time(response, "date") or time.time()
    return modified is not None and now - modified >= SETTLED


def _range_start(response: httpx.Response) -> int | None:
    """The first byte of a 206's `Content-Range: bytes START-END/SIZE`."""
    unit, _, span = response.headers.get("content-range", "").partition(" ")
    first = span.partition("-")[0]
    return int(first) if unit == "bytes" and first.isascii() and first.isdigit() else None


class Partial:
    """A download in progress: `<dest>.part` holds the bytes so far and `<dest>.part.etag` what
    they are part of (server, host, path and the file's ETag), so that a download interrupted (a
    dropped connection, Ctrl-C) resumes by Range from where it stopped, and only then: not
    another file's part, not after the file changed (its ETag), not a file whose ETag could hide
    a change (modified just before the download began: `settled`)."""

    def __init__(self, dest: str | os.PathLike[str], source: Mapping[str, str]) -> None:
        self.dest = Path(dest)
        self.source = dict(source)
        self.part = self.dest.with_name(self.dest.name + ".part")
        self.tag = self.dest.with_name(self.dest.name + ".part.etag")

    def offset(self) -> tuple[int, str | None]:
        """Bytes already here and the ETag they were read under (0, None: start from the
        beginning)."""
        try:
            record = json.loads(self.tag.read_text())
            size = self.part.stat().st_size
        except (OSError, ValueError):  # none, or an older client's plain ETag
            return 0, None
        if not isinstance(record, dict) or not isinstance(record.get("etag"), str):
            return 0, None
        if any(record.get(key) != value for key, value in self.source.items()):
            return 0, None
        return size, record["etag"]

    def headers(self, offset: int, etag: str | None) -> dict[str, str]:
        """`Range` from the bytes here, and `If-Range`: a server that has another version
        answers the whole file (200) instead of the rest of a version these bytes are not of."""
        if not offset or etag is None:
            return {}
        return {"Range": f"bytes={offset}-", "If-Range": etag}

    def start(self, response: httpx.Response, resumed: bool) -> BinaryIO:
        """The part file to write to: appended to when resuming, else from empty, recorded as
        resumable only when the answer's ETag is one to trust (`settled`)."""
        if resumed:
            return self.part.open("ab")
        # The record goes after the truncation: never an old part under a new record.
        self.tag.unlink(missing_ok=True)
        out = self.part.open("wb")
        etag = response.headers.get("etag")
        if etag and settled(response):
            self.tag.write_text(json.dumps({**self.source, "etag": etag}))
        return out

    def verify(self, out: BinaryIO, total: int) -> None:
        """The part file has the file's size, as the server announced it: else something else
        wrote into it too (another download to the same place); it is removed."""
        out.flush()
        size = os.fstat(out.fileno()).st_size
        if size != total:
            self.discard()
            raise SshapiError(
                f"{self.part}: {size} bytes where the file has {total} (written to by something "
                "else too?); removed, run the download again"
            )

    def done(self) -> None:
        self.part.replace(self.dest)
        self.tag.unlink(missing_ok=True)

    def discard(self) -> None:
        self.part.unlink(missing_ok=True)
        self.tag.unlink(missing_ok=True)


def resumable(response: httpx.Response, offset: int, etag: str | None) -> bool | None:
    """Whether an answer to `Range: bytes=<offset>-` continues the part file (True), replaces
    it (False: a whole file, 200), or is not the continuation of the bytes here (None: start
    again): another ETag than theirs, or another first byte."""
    if offset == 0 or response.status_code == 200:
        return False
    if (
        response.status_code == 206
        and etag
        and response.headers.get("etag") == etag
        and _range_start(response) == offset
    ):
        return True
    return None
