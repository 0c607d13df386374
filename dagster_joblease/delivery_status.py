"""Delivery status per topic and per limit group: what is due, in flight, retrying, dead, paused, and how
much of each limit is in use, on the database clock. What ``joblease outbox status`` prints."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from dagster_joblease.storage import outbox, route_groups
from dagster_joblease.storage.engine import translate_errors

__all__ = ["DeliveryStatus", "GroupStatus", "TopicStatus", "delivery_status"]


@dataclasses.dataclass(frozen=True)
class TopicStatus:
    topic: str
    limit_group: str | None  #: from the routes given, else None
    due: int  #: pending, due now, not in flight (a paused group's rows included: see the group)
    in_flight: int  #: pending with an unexpired claim
    waiting: int  #: pending, waiting out a backoff or a pause
    retrying: int  #: pending rows that already failed at least once (not in flight)
    dead: int


@dataclasses.dataclass(frozen=True)
class GroupStatus:
    limit_group: str
    topics: tuple[str, ...]
    in_flight: int  #: unexpired claims holding the group's capacity (every dispatcher)
    max_in_flight: int | None  #: the registered limit in force, None when none is
    rate: int | None
    rate_busy_ms: int  #: how far ahead the rate's admissions are taken (0: idle)
    paused_until: str | None  #: ISO 8601 UTC while paused
    pause_remaining_ms: int
    pause_reason: str | None
    consecutive_failures: int


@dataclasses.dataclass(frozen=True)
class DeliveryStatus:
    now: str
    topics: tuple[TopicStatus, ...]
    groups: tuple[GroupStatus, ...]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def delivery_status(engine: sa.Engine, *, topic_groups: Mapping[str, str] | None = None) -> DeliveryStatus:
    """Per-topic counts of pending and dead rows (one grouped read of those rows) and every limit group's
    state. ``topic_groups`` (topic → limit group, from the routes) names each topic's group and lists
    routed topics that have no rows yet."""
    groups_of = dict(topic_groups or {})
    with translate_errors("read the delivery status"), engine.connect() as conn:
        now = route_groups.database_now(conn)
        counts = outbox.delivery_counts_by_topic(conn)
        in_flight = outbox.in_flight_by_group(conn)
        states = route_groups.read_states(conn, None)
    topics = [
        TopicStatus(t, groups_of.get(t), *counts.get(t, [0, 0, 0, 0, 0]))
        for t in sorted(set(counts) | set(groups_of))
    ]
    names = sorted(set(states) | set(groups_of.values()) | set(in_flight))
    groups = []
    for name in names:
        state = states.get(name)
        next_at = state.rate_next_at if state is not None else None
        groups.append(
            GroupStatus(
                limit_group=name,
                topics=tuple(sorted(t for t, g in groups_of.items() if g == name)),
                in_flight=in_flight.get(name, 0),
                max_in_flight=state.max_in_flight if state and state.max_in_flight_live else None,
                rate=state.rate if state and state.rate_live else None,
                rate_busy_ms=max(0, int((next_at - now).total_seconds() * 1000)) if next_at else 0,
                paused_until=state.paused_until.isoformat()
                if state and state.paused and state.paused_until
                else None,
                pause_remaining_ms=state.pause_remaining_ms if state else 0,
                pause_reason=state.pause_reason if state and state.paused else None,
                consecutive_failures=state.failures if state else 0,
            )
        )
    return DeliveryStatus(now=now.isoformat(), topics=tuple(topics), groups=tuple(groups))
