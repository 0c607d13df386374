"""The delivery status' pure parts (dagster_joblease.delivery_status), table-driven: a topic per row or
route, and a limit group as shown from its row (limits in force, the rate's lead, a pause in force)."""

from __future__ import annotations

import datetime as dt

import pytest

from dagster_joblease.delivery_status import GroupStatus, TopicStatus, group_status, topic_statuses
from dagster_joblease.storage.route_groups import GroupState

NOW = dt.datetime(2026, 12, 4, 22, 0, tzinfo=dt.UTC)
LATER = NOW + dt.timedelta(seconds=2.5)
EARLIER = NOW - dt.timedelta(seconds=1)
ROUTES = {"mail": "smtp", "sms": "smtp", "billing": "billing"}


def state(**fields: object) -> GroupState:
    """A group's row as read at NOW: a pause in force when it ends later (the database judges it in the
    read, storage.route_groups.paused)."""
    until = fields.get("paused_until")
    paused = isinstance(until, dt.datetime) and until > NOW
    return GroupState(limit_group="smtp", now=NOW, paused=paused, **fields)  # type: ignore[arg-type]


def test_every_topic_with_rows_or_a_route_is_shown_sorted() -> None:
    counts = {"zeta": [1, 2, 3, 4, 5], "mail": [0, 1, 0, 0, 0]}
    assert topic_statuses(counts, ROUTES) == [
        TopicStatus("billing", "billing", 0, 0, 0, 0, 0),  # routed, no rows yet
        TopicStatus("mail", "smtp", 0, 1, 0, 0, 0),
        TopicStatus("sms", "smtp", 0, 0, 0, 0, 0),
        TopicStatus("zeta", None, 1, 2, 3, 4, 5),  # rows, no route here
    ]
    assert topic_statuses({}, {}) == []


@pytest.mark.parametrize(
    ("row", "shown"),
    [
        (None, GroupStatus("smtp", ("mail", "sms"), 3, None, None, 0, None, 0, None, 0)),  # no row yet
        (state(), GroupStatus("smtp", ("mail", "sms"), 3, None, None, 0, None, 0, None, 0)),
        (  # registered limits in force, the rate's admissions taken 2.5 s ahead
            state(max_in_flight=4, max_in_flight_live=True, rate=10, rate_live=True, rate_next_at=LATER),
            GroupStatus("smtp", ("mail", "sms"), 3, 4, 10, 2_500, None, 0, None, 0),
        ),
        (  # lapsed registrations show no limit; a rate slot in the past is idle
            state(max_in_flight=4, rate=10, rate_next_at=EARLIER),
            GroupStatus("smtp", ("mail", "sms"), 3, None, None, 0, None, 0, None, 0),
        ),
        (  # a pause in force, with its reason and the failures behind it
            state(paused_until=LATER, pause_reason="429 Retry-After", failures=2),
            GroupStatus(
                "smtp", ("mail", "sms"), 3, None, None, 0, LATER.isoformat(), 2_500, "429 Retry-After", 2
            ),
        ),
        (  # a pause that ended: neither its time nor its reason
            state(paused_until=EARLIER, pause_reason="429 Retry-After", failures=1),
            GroupStatus("smtp", ("mail", "sms"), 3, None, None, 0, None, 0, None, 1),
        ),
    ],
)
def test_a_group_shows_its_limits_in_force_its_rate_lead_and_a_pause_in_force(
    row: GroupState | None, shown: GroupStatus
) -> None:
    assert group_status("smtp", row, ROUTES, 3, NOW) == shown


def test_a_group_no_route_names_has_no_topics() -> None:
    assert group_status("other", None, ROUTES, 0, NOW).topics == ()
