"""Live output of jobs (moved here from api/live.py and api/relay.py; split into modules next)."""

from api.live.feeds import (
    STREAMS,
    Cutoff,
    Feed,
    Gap,
    KeepAlive,
    LiveHub,
    Output,
    OutputGone,
    Relay,
    Spend,
    StateChange,
    event_id,
    follow,
    parse_event_id,
    text_boundary,
)
from api.live.relay import RedisRelay, make_relay

__all__ = [
    "STREAMS",
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
    "event_id",
    "follow",
    "make_relay",
    "parse_event_id",
    "text_boundary",
]
