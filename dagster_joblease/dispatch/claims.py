"""A claimed row as the dispatcher carries it from its claim to its recorded outcome."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from dagster_joblease import tracing
from dagster_joblease.dispatch import policy

__all__ = ["AT_ONCE", "NO_TIMES", "ClaimTimes", "Claimed", "Finished", "StartWindow", "from_row"]


@dataclasses.dataclass(frozen=True)
class StartWindow:
    """When a rate-admitted row may start: not before ``not_before``, not after ``send_by`` (local
    monotonic times; None: at once, no limit)."""

    not_before: float | None = None
    send_by: float | None = None


@dataclasses.dataclass(frozen=True)
class ClaimTimes:
    """A claimed row's database times: its first attempt as the claim left it (the claim stamps it when
    there was none), the database clock's reading when the claim ran (same statement), and its INSERT."""

    first_attempt_at: dt.datetime | None = None
    claim_now: dt.datetime | None = None
    created_at: dt.datetime | None = None


AT_ONCE = StartWindow()
NO_TIMES = ClaimTimes()


@dataclasses.dataclass(frozen=True)
class Claimed:
    """One claimed row: what the claim returned, and when and how it may be sent."""

    id: int
    idempotency_key: str
    topic: str
    attempts: int
    payload: str
    deferrals: int = 0
    #: The limit group whose capacity the claim holds (None: unlimited path).
    group: str | None = None
    #: Local monotonic time just before the claim statement ran: the claim lasts claim_ms from then.
    claimed_at: float = 0.0
    #: A rate admission's window (:data:`AT_ONCE`: none).
    window: StartWindow = AT_ONCE
    #: The row's database times (first attempt, the claim's clock, its INSERT).
    times: ClaimTimes = NO_TIMES
    #: The row's ordering key (None: it has none).
    ordering_key: str | None = None
    #: The row's creation trace context (W3C traceparent / tracestate; fields None: the row has none).
    trace: tracing.TraceContext = tracing.NO_TRACE

    @property
    def not_before(self) -> float | None:
        """A rate admission: do not start before this local monotonic time (None: at once)."""
        return self.window.not_before

    @property
    def send_by(self) -> float | None:
        """A rate admission: do not start after this local monotonic time (given back instead)."""
        return self.window.send_by

    @property
    def first_attempt_at(self) -> dt.datetime | None:
        return self.times.first_attempt_at

    @property
    def claim_now(self) -> dt.datetime | None:
        return self.times.claim_now

    @property
    def traceparent(self) -> str | None:
        return self.trace.traceparent

    @property
    def tracestate(self) -> str | None:
        return self.trace.tracestate

    @property
    def stamped(self) -> bool:
        """Whether this claim stamped ``first_attempt_at``: no earlier attempt was sent."""
        return self.first_attempt_at is not None and self.first_attempt_at == self.claim_now

    @property
    def age_at_claim_ms(self) -> float | None:
        """Milliseconds from the first attempt to the claim, on the database clock (None: this claim's
        attempt is the first, or the statement did not say)."""
        if self.stamped or self.first_attempt_at is None or self.claim_now is None:
            return None
        return (self.claim_now - self.first_attempt_at).total_seconds() * 1000

    def time_in_outbox_s(self, now: float) -> float | None:
        """Seconds from the row's INSERT to local monotonic time ``now``: its age at the claim on the
        database clock plus the time since the claim on this process's clock (None: unknown)."""
        created_at, claim_now = self.times.created_at, self.times.claim_now
        if created_at is None or claim_now is None:
            return None
        return (claim_now - created_at).total_seconds() + (now - self.claimed_at)


def from_row(r: Any, **extra: Any) -> Claimed:
    """A row returned by a claim (:func:`dagster_joblease.storage.outbox.claim_due`)."""
    return Claimed(
        r[0],
        r[1],
        r[2],
        r[3],
        r[4],
        deferrals=int(r[5] or 0),
        times=ClaimTimes(first_attempt_at=r[6], claim_now=r[7], created_at=r[11]),
        ordering_key=r[8],
        trace=tracing.TraceContext(r[9], r[10]),
        **extra,
    )


#: A finished row: its verdict, or None when the claim is given back undelivered.
Finished = tuple[Claimed, policy.Decision | None]
