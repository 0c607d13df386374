"""How much a dispatcher claims now and when it looks again: pure decisions (no IO, no clock reads).

The dispatcher (:mod:`dagster_joblease.dispatch.dispatcher`) reads the state these functions judge (the
routes, a limit group's row, this dispatcher's own in-flight work, the local monotonic clock) and passes
it in; what the functions return is all it acts on. Each has a table-driven test in
``tests/test_capacity.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from dagster_joblease import limits
from dagster_joblease.dispatch.routes import Route

__all__ = [
    "ANY_ROW_POLL_S",
    "APPLIED_TRUST_S",
    "LIMIT_WAIT_S",
    "SLOT_POLL_S",
    "Layout",
    "NextClaim",
    "claim_size",
    "hands_on",
    "held_back",
    "layout",
    "limit_wait",
    "limited_groups",
    "next_refill",
    "record_now",
    "start_windows",
    "trusted_max_in_flight",
    "wait_hint",
]

#: While a batch runs rows of limited groups, how often idle workers look for due rows of any routed topic
#: (a limited route must not hold an unlimited one's rows back until its own backlog is done).
ANY_ROW_POLL_S = 0.25
#: Longest one batch waits, in total, for a limited group's capacity while its rows are due.
LIMIT_WAIT_S = 1.0
#: Pause between two looks at a full in-flight limit held by other dispatchers.
SLOT_POLL_S = 0.02
#: How long a group's applied limits, read under its lock, are trusted for a lock-free look at its slots.
APPLIED_TRUST_S = 1.0

#: (max_in_flight, rate) of a group; None: no such limit.
Limits = tuple[int | None, int | None]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The routes' limit groups: topic → group, group → its topics (sorted), this dispatcher's own
    limits per group (the smallest of its routes' when two routes of one group disagree), and the
    groups whose routes disagree (group → (their max_in_flight values, their rates))."""

    group_of: dict[str, str]
    group_topics: dict[str, tuple[str, ...]]
    group_limits: dict[str, Limits]
    disagreeing: dict[str, tuple[list[int], list[int]]]
    #: (dedupe_window ms, timeout ms) → the topics whose routes set that window.
    windows: dict[tuple[int, int], list[str]]


def layout(routes: Mapping[str, Route]) -> Layout:
    """The limit groups and dedupe windows of ``routes`` (topic → route)."""
    group_of = {t: str(r.limit_group) for t, r in routes.items()}
    group_topics: dict[str, tuple[str, ...]] = {}
    for topic, group in sorted(group_of.items()):
        group_topics[group] = (*group_topics.get(group, ()), topic)
    group_limits: dict[str, Limits] = {}
    disagreeing: dict[str, tuple[list[int], list[int]]] = {}
    for group, topics in group_topics.items():
        mifs, rates = _configured(routes, topics)
        if len(mifs) > 1 or len(rates) > 1:
            disagreeing[group] = (mifs, rates)
        group_limits[group] = (min(mifs, default=None), min(rates, default=None))
    return Layout(group_of, group_topics, group_limits, disagreeing, _windows(routes))


def _configured(routes: Mapping[str, Route], topics: Collection[str]) -> tuple[list[int], list[int]]:
    """The distinct max_in_flight values and rates the routes of ``topics`` configure, sorted."""
    mifs = {m for t in topics if (m := routes[t].max_in_flight) is not None}
    rates = {r for t in topics if (r := routes[t].rate) is not None}
    return sorted(mifs), sorted(rates)


def _windows(routes: Mapping[str, Route]) -> dict[tuple[int, int], list[str]]:
    """(dedupe_window ms, timeout ms) → the topics whose routes set that window."""
    windows: dict[tuple[int, int], list[str]] = {}
    for topic, route in sorted(routes.items()):
        if route.dedupe_window_s is not None:
            window = (int(route.dedupe_window_s * 1000), int(route.timeout_s * 1000))
            windows.setdefault(window, []).append(topic)
    return windows


def limited_groups(
    groups: Collection[str], paused: Collection[str], mine: Mapping[str, Limits], registered: Collection[str]
) -> set[str]:
    """The groups claimed under their row lock: not paused, and limited by this dispatcher's routes
    (``mine``) or by a limit another dispatcher ``registered``."""
    return {g for g in groups if g not in paused and (mine[g] != (None, None) or g in registered)}


def trusted_max_in_flight(known: tuple[int | None, int | None, float] | None, now: float) -> int | None:
    """The max_in_flight a lock-free look at a group's slots may judge by: ``known`` (max_in_flight,
    rate, trusted until) was read under the group's lock a moment ago, says max_in_flight alone applies,
    and is still trusted at local time ``now``. None: take the lock."""
    if known is None or known[0] is None or known[1] is not None or known[2] <= now:
        return None
    return known[0]


def claim_size(want: int, max_in_flight: int | None, rate: int | None, in_flight: int | None) -> int | None:
    """How many rows a locked claim of a group may take before its rate admits them: ``want`` (idle
    workers) within ``max_in_flight`` minus the group's ``in_flight`` requests. None: max_in_flight alone
    applies, and the claim statement counts the slots left itself (its snapshot is taken under the lock;
    ``in_flight`` is not read). With both limits ``in_flight`` must be given."""
    if max_in_flight is None:
        return want
    if rate is None:
        return None
    assert in_flight is not None, "max_in_flight with a rate needs the group's in-flight count"
    return min(want, max_in_flight - in_flight)


def start_windows(
    offsets_ms: tuple[float, ...], count: int, asked: float, answered: float
) -> list[tuple[float | None, float | None]]:
    """Per claimed row (``count``), when it may start and by when it must (local monotonic times; None:
    at once, no limit): a rate admission's offset after the database clock was read, bracketed by the
    local times just before (``asked``) and after (``answered``) the read. A request starts no earlier
    than the latest moment the admission can be and no later than the earliest + RATE_LATE_S."""
    windows: list[tuple[float | None, float | None]] = []
    for i in range(count):
        if i < len(offsets_ms):
            offset_s = offsets_ms[i] / 1000
            windows.append((answered + offset_s, asked + offset_s + limits.RATE_LATE_S))
        else:
            windows.append((None, None))
    return windows


def held_back(want: int, got: int, size: int | None, admission: limits.RateAdmission | None) -> bool:
    """Whether a locked claim took fewer rows than ``want`` because of the group's limit (not its
    backlog): its ``size`` (after the rate's admission; None: the statement counted the slots) was the
    bound."""
    limit_bound = size is None or size <= 0 or admission is not None
    return got < want and limit_bound


def wait_hint(admission: limits.RateAdmission | None) -> float:
    """Seconds worth waiting before a held-back group is claimed again: until the rate admits the next
    request, or a short poll for a slot."""
    if admission is not None and admission.count == 0:
        return max(admission.wait_ms / 1000, 0.001)
    return SLOT_POLL_S


def hands_on(mine: Limits, registered_rate: int | None, dedupe_window: bool) -> bool:
    """Whether a finished row's slot may be handed on by a swap: its group is limited by max_in_flight
    alone (``mine``, this dispatcher's; no ``registered_rate`` another dispatcher applies: the locked
    claim admits those) and no route of it has a dedupe window (the swap skips the refill's
    dead-lettering of rows past their window)."""
    mine_mif, mine_rate = mine
    return mine_mif is not None and mine_rate is None and registered_rate is None and not dedupe_window


def record_now(*, finished: bool, urgent: bool, busy: bool, since_flush_s: float, delay_s: float) -> bool:
    """Whether finished deliveries are recorded now: some are waiting, and a slot or a pause calls for it
    (``urgent``), nothing else is in flight, or the oldest waited ``delay_s``."""
    return finished and (urgent or not busy or since_flush_s >= delay_s)


class NextClaim:
    """Which claim a running batch makes after a turn (see :func:`next_refill`)."""

    NONE = "none"
    #: Rows of the limited groups (a freed slot, or a group waited for while nothing is in flight).
    LIMITED = "limited"
    #: Any due row of the routed topics, for idle workers (a limited route must not hold others back).
    ANY = "any"


def next_refill(
    *, can_refill: bool, freed: bool, blocked: bool, busy: bool, mixed: bool, any_due: bool
) -> str:
    """The claim after a turn of the batch loop: ``can_refill`` (budget, idle workers, not stopping);
    ``freed``: finished rows of limited groups were recorded; ``blocked``: groups waited for capacity;
    ``busy``: deliveries in flight; ``mixed``: the routes have limited and unlimited groups; ``any_due``:
    the poll for any due row is due."""
    if not can_refill:
        return NextClaim.NONE
    if freed or (blocked and not busy):
        return NextClaim.LIMITED
    if mixed and any_due:
        return NextClaim.ANY
    return NextClaim.NONE


def limit_wait(blocked: Mapping[str, float], budget: int, waited: float, stopping: bool) -> float | None:
    """How long an idle batch waits for a held-back group before claiming again (None: the batch ends):
    the shortest hint, at least 1 ms, within :data:`LIMIT_WAIT_S` in all."""
    if not blocked or budget <= 0 or waited >= LIMIT_WAIT_S or stopping:
        return None
    return min(max(min(blocked.values()), 0.001), LIMIT_WAIT_S - waited)
