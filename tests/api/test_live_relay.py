"""The Redis relay of live output between replicas (api/live/relay.py) against the real Redis: the
owner's feed copied into another replica's feed, and what its followers see when bytes were
missed."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

from api.live import Cutoff, Feed, Gap, Output, RedisRelay, follow
from api.store import JobRow
from tests.api.api_helpers import REDIS_URL

SIZE = 2 << 20  # well past the 256-512 KiB window
HEAD = 1024  # the owner's max_output
DATA = bytes(i % 251 for i in range(SIZE))  # every byte tells its offset


def row(job_id: str, state: str, total: int = 0) -> JobRow:
    return JobRow(
        id=job_id,
        owner_iss="iss",
        owner_sub="sub",
        replica="owner",
        host="local",
        target="t",
        timeout=60.0,
        state=state,
        kind="command",
        stdout=DATA[:HEAD] if total else b"",
        stderr=b"",
        stdout_bytes=total,
        stderr_bytes=0,
        created_at=datetime.now(UTC),
    )


async def test_a_relayed_follower_that_missed_bytes_gets_a_gap_and_every_other_byte_once() -> None:
    """2 MiB written before anyone followed remotely: a follower on the other replica reads the
    kept head, a gap (or a cut-off, then the gap on resume) for the bytes out of the window,
    then the rest, each byte at its offset and none twice."""
    job_id = str(uuid.uuid4())
    owner, other = RedisRelay(REDIS_URL, "owner"), RedisRelay(REDIS_URL, "other")
    mine = Feed(row(job_id, "running"), HEAD)
    for at in range(0, SIZE, 32 << 10):
        mine.append("stdout", DATA[at : at + (32 << 10)])
    final = row(job_id, "succeeded", SIZE)
    stored: dict[str, JobRow] = {}

    async def load(_: str) -> JobRow | None:
        return stored.get("row", row(job_id, "running"))

    tasks: list[asyncio.Task[None]] = []
    tasks.append(
        asyncio.create_task(
            owner.listen(lambda wanted: tasks.append(asyncio.create_task(owner.publish(mine))))
        )
    )
    await asyncio.sleep(0.3)  # subscribed (else the watcher's next announce, 5 s later, counts)
    theirs = Feed(row(job_id, "running"), 0)
    tasks.append(asyncio.create_task(other.watch(theirs, load)))
    try:
        offset, seen, gaps = 0, bytearray(), []
        finished = False
        while True:
            async with asyncio.timeout(20):
                async for item in follow(theirs, {"stdout": offset}, states=False):
                    if isinstance(item, Output):
                        assert item.offset == offset
                        assert item.data == DATA[offset : offset + len(item.data)]
                        offset += len(item.data)
                        seen += item.data
                        if offset >= SIZE - 1000 and not finished:
                            finished = True  # the owner's command ends; its row is final
                            stored["row"] = final
                            mine.finish(final)
                    elif isinstance(item, Gap):
                        gaps.append((item.offset, item.next_offset))
                        offset = item.next_offset
                    elif isinstance(item, Cutoff):
                        break  # a new request from the offset reached
                else:
                    break
        assert offset == SIZE
        assert seen[:HEAD] == DATA[:HEAD]
        assert gaps and gaps[0][0] == HEAD
        assert len(seen) + sum(b - a for a, b in gaps) == SIZE
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await owner.close()
        await other.close()
