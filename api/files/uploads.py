"""Resumable uploads' pieces (api/files/resumable.py has the protocol): their record and table
as the uploads need them from the store (Protocols: api/store/uploads.py implements them), what
they need of the file service, where an upload stands (`UploadState`), RFC 9530 digests and
the draft's problems."""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from api.auth import Principal
from api.config import Config
from api.files.confine import Files
from api.files.transfers import Uploaded
from api.metrics import Metrics
from api.policy import Grant
from api.problems import Problem
from sshpool import Pool

# RFC 9530's algorithm name for sha256, and what a refusal of the others asks for instead.
SHA256 = "sha-256"
WANT_DIGEST = {"Want-Content-Digest": f"{SHA256}=10"}


class FileOps(Protocol):
    """What uploads use of the file service (api/files/service.py `FileService`): its
    confinement, limits and commit lock."""

    config: Config
    pool: Pool
    metrics: Metrics

    def grant(self, who: Principal, host: str) -> tuple[Grant, list[str]]: ...
    def open(
        self, who: Principal, host: str, bulk: bool = False
    ) -> AbstractAsyncContextManager[Files]: ...
    def transfer(
        self, who: Principal, grant: Grant, direction: str
    ) -> AbstractAsyncContextManager[None]: ...
    def commit_lock(self, host: str, path: str) -> AbstractAsyncContextManager[None]: ...


class UploadRecord(Protocol):
    """An upload as the store keeps it (api/store/uploads.py `UploadRow`)."""

    @property
    def id(self) -> str: ...
    @property
    def owner_account(self) -> str | None: ...
    @property
    def owner_iss(self) -> str: ...
    @property
    def owner_sub(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def resolved(self) -> str: ...
    @property
    def temp(self) -> str: ...
    @property
    def length(self) -> int: ...
    @property
    def received(self) -> int: ...
    @property
    def if_match(self) -> str | None: ...
    @property
    def create_only(self) -> bool: ...
    @property
    def state(self) -> str: ...
    @property
    def expires_at(self) -> float: ...
    @property
    def sha256(self) -> str | None: ...
    @property
    def etag(self) -> str | None: ...
    @property
    def replaced(self) -> bool | None: ...


class UploadTable(Protocol):
    """The store's face for uploads (api/store/uploads.py `UploadStore`)."""

    async def create(self, values: Mapping[str, object], cap: int, now: float) -> bool: ...
    async def get(
        self, upload_id: str, owner: tuple[str, str], now: float
    ) -> UploadRecord | None: ...
    async def claim(self, upload_id: str, token: str, until: float, now: float) -> bool: ...
    async def renew(self, upload_id: str, token: str, until: float) -> bool: ...
    async def record(self, upload_id: str, token: str, received: int) -> None: ...
    async def release(
        self,
        upload_id: str,
        token: str,
        *,
        received: int | None = None,
        expires_at: float | None = None,
    ) -> None: ...
    async def complete(
        self,
        upload_id: str,
        token: str,
        *,
        sha256: str,
        etag: str,
        replaced: bool,
        expires_at: float,
    ) -> None: ...
    async def delete(self, upload_id: str, token: str | None = None) -> None: ...
    async def expired(
        self, now: float, token: str, until: float, limit: int
    ) -> Sequence[UploadRecord]: ...


@dataclass(frozen=True, slots=True)
class UploadState:
    """What HEAD, GET and a chunk answer: where the upload stands, and once complete, the
    file's answer (as PUT's)."""

    id: str
    host: str
    path: str
    length: int
    offset: int
    expires_at: float
    result: Uploaded | None = None

    @property
    def complete(self) -> bool:
        return self.result is not None

    def describe(self) -> dict[str, object]:
        found: dict[str, object] = {
            "id": self.id,
            "path": self.path,
            "length": self.length,
            "offset": self.offset,
            "complete": self.complete,
            "expires_at": self.expires_at,
        }
        if self.result is not None:
            found |= {"size": self.result.size, "sha256": self.result.sha256}
        return found


def parse_digest(header: str | None) -> bytes | None:
    """The sha-256 of an RFC 9530 `Content-Digest` (a dictionary of `algorithm=:base64:`), or
    None without the header. 400 `digest-unsupported-algorithms` when it names no sha-256 (with
    `Want-Content-Digest`), 400 `digest-invalid-value` when its sha-256 is not 32 bytes of
    base64 (the problem types of the IETF's digest-fields-problem-types draft)."""
    if header is None:
        return None
    for member in header.split(","):
        key, _, value = member.strip().partition("=")
        if key.strip().lower() != SHA256:
            continue
        value = value.split(";")[0].strip()  # parameters are allowed and mean nothing here
        if len(value) < 2 or value[0] != ":" or value[-1] != ":":
            break
        try:
            digest = base64.b64decode(value[1:-1], validate=True)
        except (binascii.Error, ValueError):
            break
        if len(digest) == hashlib.sha256().digest_size:
            return digest
        break
    else:
        raise Problem(
            400,
            "digest-unsupported-algorithms",
            "Unsupported digest algorithm",
            f"Content-Digest: only {SHA256} is supported",
            headers=WANT_DIGEST,
        )
    raise Problem(
        400,
        "digest-invalid-value",
        "Invalid digest",
        f"Content-Digest: {SHA256} must be 32 bytes in base64 between colons",
    )


def digest_header(digest: bytes) -> str:
    return f"{SHA256}=:{base64.b64encode(digest).decode()}:"


def mismatch(expected: int, provided: int) -> Problem:
    return Problem(
        409,
        "mismatching-upload-offset",
        "Upload-Offset does not match",
        f"the upload holds {expected} bytes; the chunk claimed to start at {provided}",
        headers={"Upload-Offset": str(expected)},
        **{"expected-offset": expected, "provided-offset": provided},
    )


def inconsistent(detail: str) -> Problem:
    return Problem(400, "inconsistent-upload-length", "Inconsistent upload length", detail)


def not_found(upload_id: str) -> Problem:
    return Problem(404, "upload-not-found", "No such upload", f"no open upload {upload_id!r}")


class Both:
    """A chunk's sha256 and the whole file's running one, fed the same bytes at once (an
    `Upload`'s hasher, in its thread): `digest` is the chunk's."""

    def __init__(self, whole: Any) -> None:
        self.chunk = hashlib.sha256()
        self.whole = whole

    def update(self, data: bytes, /) -> None:
        self.chunk.update(data)
        self.whole.update(data)

    def digest(self) -> bytes:
        return self.chunk.digest()

    def hexdigest(self) -> str:
        return self.chunk.hexdigest()
