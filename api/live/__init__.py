"""Live output: many followers per job, none of which can slow the job down.

One `Feed` per followed job in this process holds, per stream, the head (the first `max_output`
bytes, what the job keeps) and a window of the latest bytes; followers are cursors (byte
offsets) into it, never copies:

    pool drain --on_output--> Feed.append --wake--> follower 1 ... follower N --> HTTP body

- Appending never waits: it copies the chunk into the window, trims the window (amortised, at
  twice its size) and sets one event. A follower whose client reads slowly only blocks its own
  HTTP send (uvicorn's flow control); once its cursor falls out of the window and past the head
  it is cut off with a `cutoff` event naming its offset, and resumes by offset (from the window
  or the head, else a `gap` event says which bytes were not kept).
- A follower that disconnects is just a cursor that goes away: the job never sees it.

Where the bytes come from:
- a command run by this replica: its channel, through `Pool.run(on_output=)`; the Feed exists
  from the submit on, so a follower arriving late still reads from byte 0 (the head), and a
  follower past the cap still sees the live stream (the job keeps only the head; `*_bytes`
  counts everything, so `stdout_bytes - len(stdout)` bytes were not kept).
- a batch job: its output files, read over SSH by one watcher task per job in this process
  however many clients follow it, in ranges, until the scheduler reports the job final and the
  files are read to their end; a follower behind the window reads its range from the file
  itself. The watcher reads ahead only while the leading follower of a stream is within
  READ_AHEAD of what was read: a follower whose client stops reading stops the reads (its
  cursor stays where its client's flow control holds it), so a finished output of any size
  costs SSH reads in step with what its followers' clients take, not with its size. Every such
  read takes a token of the follower's identity ("reads" bucket: the rule's rate and burst, as
  output reads do): the leading follower's for the watcher's reads, its own for a read from
  behind the window. A follower beyond its rate waits for its next token: a slower stream, not
  an error (it is an answer already under way, and a researcher watching output expects it to
  go on).
- a command run by another replica (several replicas share PostgreSQL): its bytes live in that
  replica's memory. With Redis (SSHAPI_REDIS_URL) one watcher per job here reads them from the
  owner's capped Redis streams into a Feed of this process (relay), so followers here see
  them live, with the same cursors, cut-offs and gaps. Without Redis (or while it is down) the
  watcher polls the shared store: state changes within `POLL` seconds and the kept output (the
  head) once the job is final.

The face: `LiveHub` (the feeds of this process; the job service opens and closes a command's
feed, the live routes get one per follower, admitted under the identity's follower cap),
`follow` and the items it yields, the `/events` offsets, `Relay` (what the hub needs of a relay)
and `make_relay`. The modules:

    feeds      the bytes (StreamBuffer, Feed) and the cursors into them  api.output, api.store
    followers  follow() and its items; the /events offsets             feeds, api.numbers
    hub        LiveHub: the feeds of this process, their watchers,     feeds, api.problems,
               the followers' cap; Relay (what it needs of a relay)    api.quota, api.states,
                                                                       api.store, api.tasks
    relay      RedisRelay: a command's feed copied between replicas    feeds, hub, api.pubsub,
                                                                       api.quota
    changes    ChangeFeeds: the per-identity change feed's waking      api.pubsub, api.quota,
               (GET /v1/jobs/events), nudged between replicas          api.store

It may import api.numbers, api.output, api.problems, api.pubsub, api.quota, api.states,
api.store's JobRow and new_id (and its event log, api.store.portals), and api.tasks (its
listener is a task of the supervisor's). It imports no HTTP framework itself (fastapi,
starlette: api/routes/live.py makes the responses), no route and no other feature (api.jobs,
api.files).
"""

from api.live.changes import ChangeFeeds
from api.live.feeds import STREAMS, Feed, OutputGone, Spend
from api.live.followers import (
    Cutoff,
    Gap,
    KeepAlive,
    Output,
    StateChange,
    Stopped,
    event_id,
    follow,
    parse_event_id,
    text_boundary,
)
from api.live.hub import LiveHub, Relay
from api.live.relay import RedisRelay, make_relay

__all__ = [
    "STREAMS",
    "ChangeFeeds",
    "Cutoff",
    "Feed",
    "Gap",
    "KeepAlive",
    "LiveHub",
    "Output",
    "OutputGone",
    "RedisRelay",
    "Relay",
    "Spend",
    "StateChange",
    "Stopped",
    "event_id",
    "follow",
    "make_relay",
    "parse_event_id",
    "text_boundary",
]
