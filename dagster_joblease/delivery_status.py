"""Delivery status per topic and per limit group: what is due, in flight, retrying, dead, paused, and how
much of each limit is in use, on the database clock. What ``joblease outbox status`` prints."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from dagster_joblease.storage import outbox, route_groups
from dagster_joblease.storage.engine import translate_errors

__all__ = ["BlockedKey", "DeliveryStatus", "GroupStatus", "TopicStatus", "blocked_keys", "delivery_status"]

#: How many blocked ordering keys a status names (all of them are counted).
BLOCKED_KEYS_SHOWN = 20


@dataclasses.dataclass(frozen=True)
class TopicStatus:
    topic: str
    limit_group: str | None  #: from the routes given, else None
    due: int  #: pending, due now, not in flight (a paused group's rows included: see the group)
    in_flight: int  #: pending with an unexpired claim
    waiting: int  #: pending, waiting out a backoff or a pause
    retrying: int  #: pending rows that already failed at least once (not in flight)
    dead: int
    skipped: int = 0  #: SKIPPED: a person decided they are never sent (not dead, hold no key)


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
class BlockedKey:
    """An ordering key a DEAD row blocks: ``blocking_id`` (its first DEAD row, of ``topic``) and ``held``,
    the key's PENDING rows after it, which no dispatcher claims until that row is requeued or skipped."""

    ordering_key: str
    blocking_id: int
    topic: str
    held: int

    def describe(self) -> str:
        held = f"{self.held} later row(s) held"
        return f"ordering key {self.ordering_key!r} is blocked by DEAD row {self.blocking_id} ({held})"


def blocked_keys(
    conn: sa.Connection, *, topics: Sequence[str] | None = None, limit: int = BLOCKED_KEYS_SHOWN
) -> tuple[int, tuple[BlockedKey, ...]]:
    """Ordering keys a DEAD row (of ``topics``; None: every topic) blocks: how many, and the first
    ``limit`` of them by the blocking row's id."""
    count, rows = outbox.blocked_keys(conn, None if topics is None else list(topics), limit)
    return count, tuple(BlockedKey(str(r.ordering_key), int(r.id), str(r.topic), int(r.held)) for r in rows)


@dataclasses.dataclass(frozen=True)
class DeliveryStatus:
    now: str
    topics: tuple[TopicStatus, ...]
    groups: tuple[GroupStatus, ...]
    #: Ordering keys a DEAD row blocks: how many, and the first BLOCKED_KEYS_SHOWN of them.
    blocked_key_count: int = 0
    blocked_keys: tuple[BlockedKey, ...] = ()

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
        blocked_count, blocked = blocked_keys(conn)
    names = sorted(set(states) | set(groups_of.values()) | set(in_flight))
    topics = topic_statuses(counts, groups_of)
    groups = [group_status(name, states.get(name), groups_of, in_flight.get(name, 0), now) for name in names]
    return DeliveryStatus(
        now=now.isoformat(),
        topics=tuple(topics),
        groups=tuple(groups),
        blocked_key_count=blocked_count,
        blocked_keys=blocked,
    )


def topic_statuses(counts: Mapping[str, Sequence[int]], topic_groups: Mapping[str, str]) -> list[TopicStatus]:
    """One status per topic that has rows (``counts``) or a route (``topic_groups``), sorted by topic;
    a routed topic without rows counts zeros."""
    return [
        TopicStatus(t, topic_groups.get(t), *counts.get(t, [0, 0, 0, 0, 0, 0]))
        for t in sorted(set(counts) | set(topic_groups))
    ]


def group_status(
    name: str,
    state: route_groups.GroupState | None,
    topic_groups: Mapping[str, str],
    in_flight: int,
    now: dt.datetime,
) -> GroupStatus:
    """A limit group as the status shows it: its routed topics, its claims in flight, and from its row
    (``state``, None when it has none) the limits in force (a lapsed registration shows none), how far
    ahead the rate's admissions are taken as of ``now``, and a pause in force with its reason."""
    topics = tuple(sorted(t for t, g in topic_groups.items() if g == name))
    if state is None:
        return GroupStatus(name, topics, in_flight, None, None, 0, None, 0, None, 0)
    pause_until = state.paused_until if state.paused else None
    return GroupStatus(
        limit_group=name,
        topics=topics,
        in_flight=in_flight,
        max_in_flight=state.max_in_flight if state.max_in_flight_live else None,
        rate=state.rate if state.rate_live else None,
        rate_busy_ms=_ms_ahead(state.rate_next_at, now),
        paused_until=None if pause_until is None else pause_until.isoformat(),
        pause_remaining_ms=state.pause_remaining_ms,
        pause_reason=None if pause_until is None else state.pause_reason,
        consecutive_failures=state.failures,
    )


def _ms_ahead(at: dt.datetime | None, now: dt.datetime) -> int:
    """How many whole ms ``at`` is after ``now`` (0 when it is not, or there is none)."""
    return 0 if at is None else max(0, int((at - now).total_seconds() * 1000))
