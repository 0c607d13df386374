"""The dispatcher's decisions about one row that are not about an answer: pure functions, no IO, no clock
of their own (every time is an argument). :mod:`dagster_joblease.dispatch.policy` judges answers.

* :func:`may_start`: may a claimed row's request start now, be given back unsent, or go DEAD unsent?
* :func:`within_dedupe_window`: may a retried row start now, or would its request outlive the time its
  downstream remembers the key (a second effect)?
"""

from __future__ import annotations

import enum

__all__ = ["Start", "dedupe_window_reason", "may_start", "within_dedupe_window"]


class Start(enum.Enum):
    """What to do with a claimed row at the moment its request would start."""

    GO = "go"
    #: Give the claim back undelivered (attempt and first-attempt time undone): it is sent later.
    GIVE_BACK = "give back"
    #: Dead-letter it unsent: its dedupe_window would pass before its request could end.
    EXPIRED = "expired"


def may_start(
    *,
    now: float,
    stopping: bool,
    claim_ends_at: float,
    timeout_s: float,
    paused_until: float,
    age_at_claim_ms: float | None,
    claimed_at: float,
    window_s: float | None,
) -> Start:
    """Whether a claimed row's request may start at local monotonic time ``now``.

    Given back when the dispatcher is stopping, when the request's whole ``timeout_s`` would not end
    before ``claim_ends_at`` (the claim's end less its safety margin: another dispatcher could send the
    key meanwhile), or while its group is paused (``paused_until``, local time); expired when
    :func:`within_dedupe_window` says no (``claimed_at``: local time just before the claim).
    """
    if stopping or now + timeout_s > claim_ends_at or paused_until > now:
        return Start.GIVE_BACK
    if not within_dedupe_window(
        age_at_claim_ms=age_at_claim_ms,
        since_claim_s=now - claimed_at,
        window_s=window_s,
        timeout_s=timeout_s,
    ):
        return Start.EXPIRED
    return Start.GO


def within_dedupe_window(
    *, age_at_claim_ms: float | None, since_claim_s: float, window_s: float | None, timeout_s: float
) -> bool:
    """Whether a request may start now: its whole timeout must end inside the route's ``dedupe_window``,
    counted from the row's first attempt.

    ``age_at_claim_ms`` is the first attempt's age when the row was claimed, on the database clock (None:
    this claim's attempt is the first one, so no earlier request can be repeated); ``since_claim_s`` the
    local monotonic time since just before the claim (so the age is never under-estimated). The same rule
    dead-letters due rows at claim (:func:`dagster_joblease.storage.outbox.expire_past_window`): age +
    timeout must stay below the window.
    """
    if window_s is None or age_at_claim_ms is None:
        return True
    return age_at_claim_ms + since_claim_s * 1000 + timeout_s * 1000 < window_s * 1000


def dedupe_window_reason(window_s: float) -> str:
    """The ``last_error`` of a row dead-lettered, unsent, because its dedupe_window passed."""
    return (
        f"not sent again: its first delivery attempt is older than the route's dedupe_window "
        f"({window_s:g} s, less one timeout), so the downstream may have forgotten the key and a "
        "resend could be a second effect. Reconcile the effect by hand (did the downstream apply it?); "
        "`joblease outbox requeue` sends it again with a fresh window, if you decide it must be sent"
    )
