"""A job's output for its readers: byte ranges (GET /v1/jobs/{id}/output) and live followers.

This belongs to live output (api/live/) rather than to running jobs; it sits
here, behind api/jobs' face (`JobService.output`, `JobService.following`), until live output
becomes a package of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from api.auth import Principal
from api.jobs.batch import BatchJobs
from api.live import Feed, LiveHub
from api.output import MAX_READ, OutputRange, Stream, pieces
from api.problems import Problem
from api.quota import Quota
from api.states import FINAL
from api.store import JobRow, new_id

# A live follower counts against its owner's follower cap for at most this long (a replica that
# dies with followers cannot block their owner for longer).
FOLLOWER_TTL = 3600.0


class JobOutput:
    """Reads of the jobs' output, for callers already allowed to see the job."""

    def __init__(self, batch: BatchJobs, quota: Quota, live: LiveHub, max_followers: int) -> None:
        self.batch = batch
        self.quota = quota
        self.live = live
        self.max_followers = max_followers

    async def output(self, row: JobRow, stream: Stream, offset: int, limit: int) -> OutputRange:
        """A byte range of a job's stdout or stderr: a batch job's output file, read over SSH
        and streamed; a command's stored (capped) output."""
        if row.kind == "batch":
            return await self.batch.output(row, stream, offset, min(limit, MAX_READ))
        stored = (row.stdout if stream == "stdout" else row.stderr) or b""
        if row.state not in FINAL:
            return OutputRange(offset, None, 0, pieces())
        data = stored[offset : offset + limit]
        return OutputRange(offset, len(stored), len(data), pieces(data))

    @contextlib.asynccontextmanager
    async def following(self, who: Principal, row: JobRow) -> AsyncIterator[Feed]:
        """The live feed of a job, for one follower: counted against the caller's follower cap
        (like the active-job cap: shared through Redis when configured) for as long as it
        follows."""
        cap = self.max_followers
        follower = new_id()
        try:
            await self.quota.enter(who.key, follower, cap, FOLLOWER_TTL, space="followers")
        except Problem as exc:
            raise Problem(
                429,
                "too-many-followers",
                "Too many followers",
                f"at most {cap} live followers at once per identity",
                headers=exc.headers,
            ) from None
        try:
            async with self.live.feed_for(row) as feed:
                yield feed
        finally:
            await self.quota.leave(who.key, follower, space="followers")


async def read_file(
    batch: BatchJobs, row: JobRow, stream: Stream, offset: int, limit: int
) -> tuple[bytes, int | None]:
    """One read of a batch job's output file: what a live follower of it polls."""
    chunk = await batch.read_chunk(row, stream, offset, limit)
    return chunk.data, chunk.size
