"""Delivery limits of a limit group, as pure decisions (no IO): which configured limit applies, how many
requests the rate admits now and when each may start, and how a pause merges with the one in force.

The state these functions judge lives in ``joblease_route_group`` (one row per group, read and written by
:mod:`dagster_joblease.storage.route_groups`); every time comes from the database clock.

* **Smallest configured value applies.** Each dispatcher registers its ``max_in_flight`` and ``rate`` for a
  group; a registration lasts :data:`REGISTRATION_MS` and is refreshed by every claim of the dispatcher
  whose value is in force. A smaller value replaces a larger one at once; a larger one applies only once
  the smaller registration lapsed (its dispatchers stopped). A dispatcher with no limit of its own obeys a
  limit another registered.
* **Rate: no burst.** Admissions are spaced ``(1 + RATE_SLACK) / rate`` seconds apart on the database
  clock, so any 1-second window holds at most ``rate`` of them. A request may start at most
  :data:`RATE_LATE_S` after its admission (a later one is given back, not sent), which leaves
  ``RATE_SLACK - RATE_LATE_S`` seconds (40 ms) for the network's own jitter before a downstream could count
  more than ``rate`` in one second. Admissions are handed out at most :data:`RATE_HORIZON_MS` ahead, so a
  dispatcher never reserves much of the future.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

__all__ = [
    "RATE_HORIZON_MS",
    "RATE_LATE_S",
    "RATE_SLACK",
    "REGISTRATION_MS",
    "Applied",
    "RateAdmission",
    "admit_rate",
    "applied_limit",
    "merged_pause",
    "rate_spacing_ms",
]

#: How long a dispatcher's registered limit stays in force without a claim refreshing it (5 minutes).
REGISTRATION_MS = 5 * 60_000
#: Admissions are spaced (1 + RATE_SLACK) / rate seconds apart: 6% below the rate, room for late starts.
RATE_SLACK = 0.06
#: Longest a rate-admitted request may start after its admission (seconds); a later one is given back.
RATE_LATE_S = 0.02
#: How far ahead of the database's now rate admissions are handed out.
RATE_HORIZON_MS = 200


@dataclasses.dataclass(frozen=True)
class Applied:
    """The limit in force for one group after a dispatcher's claim.

    ``value``: the limit to obey (None: no limit). ``register``: write ``value`` and refresh its lapse
    (this dispatcher's value is the one in force). ``mismatch``: another dispatcher registered a smaller
    value than ours, which applies.
    """

    value: int | None
    register: bool
    mismatch: bool = False


def applied_limit(mine: int | None, stored: int | None, stored_live: bool) -> Applied:
    """Which value applies when this dispatcher configured ``mine`` and the group row holds ``stored``
    (in force while ``stored_live``)."""
    live = stored if stored_live else None
    if mine is None:
        return Applied(live, register=False)
    if live is None or mine <= live:
        return Applied(mine, register=True)
    return Applied(live, register=False, mismatch=True)


def rate_spacing_ms(rate: int) -> float:
    """Milliseconds between two admissions of a group limited to ``rate`` requests per second."""
    return 1000.0 * (1.0 + RATE_SLACK) / rate


@dataclasses.dataclass(frozen=True)
class RateAdmission:
    """``count`` requests admitted; the i-th may start ``offsets_ms[i]`` after the database's now (not
    before); ``next_at_ms``: the group's next free admission, in ms after now, once ``used`` of them are
    taken (see :meth:`next_after`). ``wait_ms``: with nothing admitted, how long until one could be."""

    count: int
    offsets_ms: tuple[float, ...]
    start_ms: float
    spacing_ms: float
    wait_ms: float = 0.0

    def next_after(self, used: int) -> float:
        """The group's next free admission (ms after now) when ``used`` admissions were taken."""
        return self.start_ms + used * self.spacing_ms


def admit_rate(
    rate: int, next_at: dt.datetime | None, now: dt.datetime, want: int, lead_ms: float = 0.0
) -> RateAdmission:
    """Admit up to ``want`` requests of a group limited to ``rate``/s whose next free admission is
    ``next_at`` (None: never used), at database time ``now``. The first admission is at least ``lead_ms``
    ahead: the time the claim still needs to commit and start the request, so it does not start late."""
    spacing = rate_spacing_ms(rate)
    ahead = 0.0 if next_at is None else (next_at - now).total_seconds() * 1000.0
    start = max(ahead, min(lead_ms, RATE_HORIZON_MS / 2))
    if want <= 0 or start > RATE_HORIZON_MS:
        return RateAdmission(0, (), start, spacing, wait_ms=max(0.0, start - RATE_HORIZON_MS))
    count = min(want, int((RATE_HORIZON_MS - start) // spacing) + 1)
    return RateAdmission(count, tuple(start + i * spacing for i in range(count)), start, spacing)


def merged_pause(current: dt.datetime | None, now: dt.datetime, pause_ms: int) -> tuple[dt.datetime, bool]:
    """The pause end after asking for ``pause_ms`` more at ``now``: the later of the two. Returns the end
    and whether it moved (a shorter request never shortens a pause in force)."""
    wanted = now + dt.timedelta(milliseconds=pause_ms)
    if current is not None and current >= wanted:
        return current, False
    return wanted, True
