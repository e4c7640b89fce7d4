"""Files on a host over SFTP (moved here from api/files.py; split into modules next)."""

from api.files.service import (
    CHUNK,
    MAX_PATH,
    NEW_FILE_MODE,
    SNAPSHOTS_PER_IDENTITY,
    Files,
    FileService,
    Listings,
    Place,
    Preconditions,
    Snapshot,
    Upload,
    describe,
    etag_of,
    file_problem,
    http_date,
    temp_name,
)

__all__ = [
    "CHUNK",
    "MAX_PATH",
    "NEW_FILE_MODE",
    "SNAPSHOTS_PER_IDENTITY",
    "FileService",
    "Files",
    "Listings",
    "Place",
    "Preconditions",
    "Snapshot",
    "Upload",
    "describe",
    "etag_of",
    "file_problem",
    "http_date",
    "temp_name",
]
