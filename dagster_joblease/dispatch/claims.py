"""A claimed row as the dispatcher carries it from its claim to its recorded outcome."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from dagster_joblease.dispatch import policy

__all__ = ["Claimed", "Finished", "from_row"]


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
    #: A rate admission: do not start before this local monotonic time (None: at once).
    not_before: float | None = None
    #: A rate admission: do not start after this local monotonic time (given back instead).
    send_by: float | None = None
    #: The row's first attempt as the claim left it (the claim stamps it when there was none).
    first_attempt_at: dt.datetime | None = None
    #: The database clock's reading when the claim ran (same statement), to age the row at send time.
    claim_now: dt.datetime | None = None
    #: The row's ordering key (None: it has none).
    ordering_key: str | None = None
    #: The row's creation trace context (W3C traceparent / tracestate; None: the row has none).
    traceparent: str | None = None
    tracestate: str | None = None
    #: When the row was inserted, on the database clock.
    created_at: dt.datetime | None = None

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
        if self.created_at is None or self.claim_now is None:
            return None
        return (self.claim_now - self.created_at).total_seconds() + (now - self.claimed_at)


def from_row(r: Any, **extra: Any) -> Claimed:
    """A row returned by a claim (:func:`dagster_joblease.storage.outbox.claim_due`)."""
    return Claimed(
        r[0],
        r[1],
        r[2],
        r[3],
        r[4],
        deferrals=int(r[5] or 0),
        first_attempt_at=r[6],
        claim_now=r[7],
        ordering_key=r[8],
        traceparent=r[9],
        tracestate=r[10],
        created_at=r[11],
        **extra,
    )


#: A finished row: its verdict, or None when the claim is given back undelivered.
Finished = tuple[Claimed, policy.Decision | None]
