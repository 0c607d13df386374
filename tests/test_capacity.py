"""The dispatcher's capacity decisions (dagster_joblease.dispatch.capacity), table-driven."""

from __future__ import annotations

import pytest

from dagster_joblease import limits
from dagster_joblease.dispatch import Route, capacity

ADMITTED = limits.RateAdmission(2, (10.0, 60.0), 10.0, 50.0)
NONE_ADMITTED = limits.RateAdmission(0, (), 300.0, 50.0, wait_ms=100.0)
NONE_ADMITTED_NOW = limits.RateAdmission(0, (), 200.0, 50.0, wait_ms=0.0)


@pytest.mark.parametrize(
    ("routes", "group_of", "group_limits", "disagreeing", "windows"),
    [
        ({}, {}, {}, {}, {}),
        (
            {"a": Route("http://x/a", limit_group="u")},
            {"a": "u"},
            {"u": (None, None)},
            {},
            {},
        ),
        (
            {
                "a": Route("http://x/a", limit_group="g", max_in_flight=3),
                "b": Route("http://x/b", limit_group="g", max_in_flight=2, rate=5),
            },
            {"a": "g", "b": "g"},
            {"g": (2, 5)},
            {"g": ([2, 3], [5])},
            {},
        ),
        (
            {
                "a": Route("http://x/a", limit_group="u", dedupe_window=60, timeout_s=2),
                "b": Route("http://x/b", limit_group="u", timeout_s=2),
            },
            {"a": "u", "b": "u"},
            {"u": (None, None)},
            {},
            {(60_000, 2_000): ["a"]},
        ),
    ],
    ids=["none", "one-unlimited", "two-routes-disagree", "a-dedupe-window"],
)
def test_layout(
    routes: dict[str, Route],
    group_of: dict[str, str],
    group_limits: dict[str, tuple[int | None, int | None]],
    disagreeing: dict[str, tuple[list[int], list[int]]],
    windows: dict[tuple[int, int], list[str]],
) -> None:
    found = capacity.layout(routes)
    assert found.group_of == group_of
    assert found.group_limits == group_limits
    assert found.disagreeing == disagreeing
    assert found.windows == windows
    assert {g: sorted(ts) for g, ts in found.group_topics.items()} == {
        g: sorted(t for t, og in group_of.items() if og == g) for g in set(group_of.values())
    }


@pytest.mark.parametrize(
    ("paused", "mine", "registered", "expected"),
    [
        (set(), {"a": (None, None), "b": (2, None)}, set(), {"b"}),
        (set(), {"a": (None, None), "b": (None, None)}, {"a"}, {"a"}),  # another dispatcher's limit
        ({"b"}, {"a": (None, None), "b": (2, None)}, set(), set()),  # paused: not claimed at all
        (set(), {"a": (None, 5), "b": (None, None)}, set(), {"a"}),
    ],
)
def test_limited_groups(
    paused: set[str], mine: dict[str, tuple[int | None, int | None]], registered: set[str], expected: set[str]
) -> None:
    assert capacity.limited_groups(sorted(mine), paused, mine, registered) == expected


@pytest.mark.parametrize(
    ("known", "now", "expected"),
    [
        (None, 0.0, None),
        ((3, None, 10.0), 5.0, 3),
        ((3, None, 10.0), 10.0, None),  # no longer trusted
        ((3, 5, 10.0), 5.0, None),  # a rate applies too: only the locked claim admits
        ((None, 5, 10.0), 5.0, None),
        ((None, None, 10.0), 5.0, None),
    ],
)
def test_trusted_max_in_flight(
    known: tuple[int | None, int | None, float] | None, now: float, expected: int | None
) -> None:
    assert capacity.trusted_max_in_flight(known, now) == expected


@pytest.mark.parametrize(
    ("want", "mif", "rate", "in_flight", "expected"),
    [
        (8, None, None, None, 8),
        (8, None, 5, None, 8),  # rate alone: the admission bounds it next
        (8, 3, None, None, None),  # max_in_flight alone: the statement counts the slots
        (8, 3, 5, 1, 2),
        (1, 3, 5, 0, 1),
        (8, 3, 5, 3, 0),
        (8, 3, 5, 5, -2),  # a lowered limit: nothing to claim
    ],
)
def test_claim_size(
    want: int, mif: int | None, rate: int | None, in_flight: int | None, expected: int | None
) -> None:
    assert capacity.claim_size(want, mif, rate, in_flight) == expected


@pytest.mark.parametrize(
    ("offsets", "count", "asked", "answered", "expected"),
    [
        ((), 2, 1.0, 1.5, [(None, None), (None, None)]),
        ((0.0, 100.0), 2, 1.0, 1.5, [(1.5, 1.0 + limits.RATE_LATE_S), (1.6, 1.1 + limits.RATE_LATE_S)]),
        ((0.0, 100.0), 1, 1.0, 1.0, [(1.0, 1.0 + limits.RATE_LATE_S)]),  # fewer rows than admissions
        ((0.0,), 2, 1.0, 1.0, [(1.0, 1.0 + limits.RATE_LATE_S), (None, None)]),
    ],
)
def test_start_windows(
    offsets: tuple[float, ...],
    count: int,
    asked: float,
    answered: float,
    expected: list[tuple[float | None, float | None]],
) -> None:
    found = capacity.start_windows(offsets, count, asked, answered)
    rounded = [tuple(None if t is None else round(t, 9) for t in pair) for pair in found]
    assert rounded == [tuple(None if t is None else round(t, 9) for t in pair) for pair in expected]


@pytest.mark.parametrize(
    ("want", "got", "size", "admission", "expected"),
    [
        (4, 4, 4, None, False),  # everything wanted was claimed
        (4, 2, 4, None, False),  # the backlog, not the limit, was short
        (4, 2, None, None, True),  # max_in_flight counted by the statement
        (4, 0, 0, None, True),
        (4, 0, -1, None, True),
        (4, 2, 2, ADMITTED, True),  # the rate admitted fewer
        (4, 0, 0, NONE_ADMITTED, True),
    ],
)
def test_held_back(
    want: int, got: int, size: int | None, admission: limits.RateAdmission | None, expected: bool
) -> None:
    assert capacity.held_back(want, got, size, admission) is expected


@pytest.mark.parametrize(
    ("admission", "expected"),
    [
        (None, capacity.SLOT_POLL_S),
        (ADMITTED, capacity.SLOT_POLL_S),
        (NONE_ADMITTED, 0.1),
        (NONE_ADMITTED_NOW, 0.001),
    ],
)
def test_wait_hint(admission: limits.RateAdmission | None, expected: float) -> None:
    assert capacity.wait_hint(admission) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("mine", "registered_rate", "dedupe_window", "expected"),
    [
        ((2, None), None, False, True),
        ((None, None), None, False, False),
        ((2, 5), None, False, False),
        ((2, None), 5, False, False),  # another dispatcher's rate applies
        ((2, None), None, True, False),
    ],
)
def test_hands_on(
    mine: tuple[int | None, int | None], registered_rate: int | None, dedupe_window: bool, expected: bool
) -> None:
    assert capacity.hands_on(mine, registered_rate, dedupe_window) is expected


@pytest.mark.parametrize(
    ("finished", "urgent", "busy", "since_flush_s", "expected"),
    [
        (False, True, False, 9.0, False),
        (True, True, True, 0.0, True),
        (True, False, False, 0.0, True),
        (True, False, True, 0.1, False),
        (True, False, True, 0.25, True),
    ],
)
def test_record_now(finished: bool, urgent: bool, busy: bool, since_flush_s: float, expected: bool) -> None:
    verdict = capacity.record_now(
        finished=finished, urgent=urgent, busy=busy, since_flush_s=since_flush_s, delay_s=0.25
    )
    assert verdict is expected


@pytest.mark.parametrize(
    ("can_refill", "freed", "blocked", "busy", "mixed", "any_due", "expected"),
    [
        (False, True, True, False, True, True, capacity.NextClaim.NONE),
        (True, True, False, True, False, False, capacity.NextClaim.LIMITED),
        (True, False, True, False, False, False, capacity.NextClaim.LIMITED),
        (True, False, True, True, False, False, capacity.NextClaim.NONE),
        (True, False, True, True, True, True, capacity.NextClaim.ANY),
        (True, False, False, True, True, False, capacity.NextClaim.NONE),
        (True, False, False, False, False, True, capacity.NextClaim.NONE),
    ],
)
def test_next_refill(
    can_refill: bool, freed: bool, blocked: bool, busy: bool, mixed: bool, any_due: bool, expected: str
) -> None:
    verdict = capacity.next_refill(
        can_refill=can_refill, freed=freed, blocked=blocked, busy=busy, mixed=mixed, any_due=any_due
    )
    assert verdict == expected


@pytest.mark.parametrize(
    ("blocked", "budget", "waited", "stopping", "expected"),
    [
        ({}, 10, 0.0, False, None),
        ({"g": 0.02}, 10, 0.0, False, 0.02),
        ({"g": 0.02, "h": 0.5}, 10, 0.0, False, 0.02),
        ({"g": 0.0}, 10, 0.0, False, 0.001),
        ({"g": 0.5}, 10, 0.8, False, 0.2),  # within LIMIT_WAIT_S in all
        ({"g": 0.02}, 10, 1.0, False, None),
        ({"g": 0.02}, 0, 0.0, False, None),
        ({"g": 0.02}, 10, 0.0, True, None),
    ],
)
def test_limit_wait(
    blocked: dict[str, float], budget: int, waited: float, stopping: bool, expected: float | None
) -> None:
    assert capacity.limit_wait(blocked, budget, waited, stopping) == pytest.approx(expected)
