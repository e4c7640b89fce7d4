"""Files on a host over SFTP on the pooled connections: confinement, listings, transfers,
checksums, their limits. docs/files.md has the contract.

The face: `FileService` is what the routes call, one method per operation (`list_dir`,
`download`, `upload`, `delete`, `mkdir`, `move`, `checksum`); each takes the caller and the
host, opens its own confined SFTP view and lets go of it, so no route touches the SFTP session.
What this package exports is below (`__all__`); the modules:

    errors     the problems of file operations                  api.problems, sshpool
    confine    roots, protected paths, resolving (`Files`)      errors, api.auth, api.policy
    listings   snapshots of directories, cursors                api.problems
    transfers  the upload protocol, a download's body, ranges   confine, api.numbers
    checksum   sha256sum on the host                            errors, api.config, api.policy
    uploads    resumable uploads' pieces: their store's face    confine, transfers,
               (Protocols), `UploadState`, digests, problems    api.config, api.metrics
    resumable  uploads in chunks (`Resumable`): the protocol,   uploads, confine, transfers,
               the commit, cancel, the expiry sweep             checksum
    service    `FileService`: the operations and the            all of the above, api.quota,
               per-identity limits (transfers, listings,        api.metrics
               the commit lock)

(each also sshpool's SFTP types and errors)

It may import api.auth, api.config, api.metrics, api.numbers, api.policy, api.problems,
api.quota and sshpool by its public names (its SFTP types included). It imports no HTTP
framework itself (fastapi, starlette: the routes turn its answers into responses), no route
and no other feature (api.jobs, api.live, api.store).
"""

from api.files.confine import MAX_PATH
from api.files.errors import file_problem
from api.files.listings import SNAPSHOTS_PER_IDENTITY, Listings, Snapshot
from api.files.resumable import Resumable
from api.files.service import FileService
from api.files.transfers import CHUNK, Download, Uploaded
from api.files.uploads import UploadState, digest_header, parse_digest

__all__ = [
    "CHUNK",
    "MAX_PATH",
    "SNAPSHOTS_PER_IDENTITY",
    "Download",
    "FileService",
    "Listings",
    "Resumable",
    "Snapshot",
    "UploadState",
    "Uploaded",
    "digest_header",
    "file_problem",
    "parse_digest",
]
