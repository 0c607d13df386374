"""The limit groups' shared state: its statements live in :mod:`dagster_joblease.storage.route_groups`
(and the count of a group's claims in flight, a statement on the outbox, in
:mod:`dagster_joblease.storage.outbox`). This module keeps the names the dispatcher and tests import from
``dagster_joblease.route_groups``; it holds no SQL.
"""

from __future__ import annotations

from dagster_joblease.storage.outbox import count_in_flight, in_flight_query
from dagster_joblease.storage.route_groups import (
    MAX_REASON_CHARS,
    PAUSED_SQL,
    GroupState,
    as_utc,
    database_now,
    g,
    lock_group,
    paused_remaining,
    read_states,
    record_answers,
    record_connection_failures,
    record_pause,
    registration_until,
    resume,
    slots_left,
    update_group,
)

__all__ = [
    "MAX_REASON_CHARS",
    "PAUSED_SQL",
    "GroupState",
    "as_utc",
    "count_in_flight",
    "database_now",
    "g",
    "in_flight_query",
    "lock_group",
    "paused_remaining",
    "read_states",
    "record_answers",
    "record_connection_failures",
    "record_pause",
    "registration_until",
    "resume",
    "slots_left",
    "update_group",
]
