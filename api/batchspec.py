"""What a batch job request may say: the script and the sbatch options the API accepts, each
validated here so that the HTTP schemas (api/schemas.py) take them without importing the Slurm
client (api/jobs/scheduler.py), which turns them into sbatch arguments."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.output import Stream

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
ENV_NAME_RE = r"[A-Za-z_][A-Za-z0-9_]{0,127}"  # fullmatch: `$` would let a trailing \n in
# Variables that would change sbatch itself (its input environment variables, the program
# looked up, the loader), not the job: set them in the script instead.
ENV_RESERVED = re.compile(r"^(SLURM_|SBATCH_|SALLOC_|SRUN_|LD_)|^PATH$")
MAX_SCRIPT = 1 << 20


class BatchOptions(BaseModel):
    """sbatch options the API accepts, each validated and passed as one argument."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(default=None, pattern=NAME_RE, description="Job name (--job-name).")
    partition: str | None = Field(
        default=None, pattern=NAME_RE, description="Partition; the cluster's default if unset."
    )
    time_limit: int | None = Field(
        default=None,
        ge=1,
        le=365 * 86400,
        description="Seconds (--time); Slurm rounds up to whole minutes.",
    )
    nodes: int | None = Field(default=None, ge=1, le=100_000, description="--nodes")
    ntasks: int | None = Field(default=None, ge=1, le=10_000_000, description="--ntasks")
    workdir: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="Absolute working directory (--chdir); output files go there.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        max_length=256,
        description="Added to the job's environment (which is the login environment).",
    )

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None:
            if not value.startswith("/"):
                raise ValueError("workdir must be an absolute path")
            if any(ord(c) < 32 or c == "\x7f" for c in value):
                raise ValueError("workdir cannot contain control characters")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not re.fullmatch(ENV_NAME_RE, key):
                raise ValueError(f"env name {key!r}: use letters, digits and '_'")
            if ENV_RESERVED.match(key):
                raise ValueError(f"env name {key!r} is reserved (it would change sbatch itself)")
            if "\0" in item or len(item) > 65536:
                raise ValueError(f"env {key}: no NUL bytes, at most 64 KiB")
        return value

    def sbatch_args(self) -> list[str]:
        """The options as sbatch arguments, one element each."""
        args: list[str] = []
        if self.name is not None:
            args.append(f"--job-name={self.name}")
        if self.partition is not None:
            args.append(f"--partition={self.partition}")
        if self.time_limit is not None:
            minutes, seconds = divmod(self.time_limit, 60)
            hours, minutes = divmod(minutes, 60)
            args.append(f"--time={hours}:{minutes:02d}:{seconds:02d}")
        if self.nodes is not None:
            args.append(f"--nodes={self.nodes}")
        if self.ntasks is not None:
            args.append(f"--ntasks={self.ntasks}")
        if self.workdir is not None:
            args.append(f"--chdir={self.workdir}")
        if self.env:
            # Values travel in sbatch's environment (set by `env`), so commas and quotes in them
            # are safe; --export names them on top of the login environment.
            args.append("--export=ALL," + ",".join(sorted(self.env)))
        return args

    def output_path(self, job_id: str, key: str, stream: Stream) -> str:
        """Where the job's stdout or stderr goes (relative paths: from the account's home).

        The name holds the key's digest as well as the job id: job ids repeat across clusters
        and after a controller loses its state, and a new job must never append to (or be read
        as) an old job's file. A job adopted by key gets the same paths back."""
        tag = key_digest(key)[:12]
        name = f"sshapi-{job_id}-{tag}.{'out' if stream == 'stdout' else 'err'}"
        return name if self.workdir is None else f"{self.workdir.rstrip('/')}/{name}"


class BatchRequest(BatchOptions):
    """A batch job as POST /v1/jobs takes it: the script (sent on sbatch's stdin) and options."""

    script: str = Field(
        min_length=2,
        max_length=MAX_SCRIPT,
        description="The batch script, starting with an interpreter line such as #!/bin/bash.",
    )

    @field_validator("script")
    @classmethod
    def _script(cls, value: str) -> str:
        validate_script(value)
        return value

    def options(self) -> BatchOptions:
        return batch_options(self.model_dump())


def batch_options(data: Mapping[str, Any]) -> BatchOptions:
    """The options of a batch request's dump (as a job stores it), the script left out."""
    return BatchOptions.model_validate({k: v for k, v in data.items() if k != "script"})


def validate_script(script: str) -> None:
    """sbatch needs an interpreter line; the size cap keeps stdin bounded."""
    if not script.startswith("#!"):
        raise ValueError("the script must start with '#!' and an interpreter, e.g. #!/bin/bash")
    if "\0" in script:
        raise ValueError("the script cannot contain NUL bytes")
    if len(script.encode()) > MAX_SCRIPT:
        raise ValueError(f"the script is larger than {MAX_SCRIPT} bytes")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
