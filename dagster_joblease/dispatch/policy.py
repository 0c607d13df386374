"""How a delivery attempt is judged, and when the next one happens: pure functions, no IO.

* 2xx → ``sent``.
* Transient trouble (network errors, timeouts, 408, 409, 425, 429, 5xx) → ``retry`` after an exponential
  backoff with full jitter, or after the downstream's ``Retry-After`` when it gives one; once
  ``max_attempts`` is reached → ``dead``.
* 3xx → ``dead``: redirects are never followed, because httpx would carry custom credential headers to the
  new origin.
* ``422`` → ``dead`` with the downstream's reason: the IETF Idempotency-Key draft answers 422 when a key is
  reused with another payload, so resending cannot help and a person must look.
* Any other 4xx → ``dead`` at once: the request itself is wrong and repeating it cannot help.
* ``409`` (the draft's "the first request with this key is still in flight") is retried with the same key
  and backoff. A stored ``5xx`` replayed for a key is retried like any 5xx, so ``max_attempts`` (and the
  route's ``dedupe_window``) bound it.
* A ``429``/``503`` *with* ``Retry-After`` is the downstream's instruction to the whole client: the row's
  limit group is paused (see :func:`decide`'s ``max_pause_ms``) and the attempt is *deferred*, not counted
  against ``max_attempts``; ``max_deferrals`` bounds how often that can happen to one row.
"""

from __future__ import annotations

import dataclasses
import email.utils
import enum
import random
import re
from datetime import UTC, datetime

import httpx

__all__ = [
    "MAX_REASON_CHARS",
    "MAX_RETRY_AFTER_S",
    "PAUSING_STATUSES",
    "RETRYABLE_STATUSES",
    "Classification",
    "Decision",
    "Outcome",
    "backoff_ms",
    "bound",
    "classify_exception",
    "classify_response",
    "decide",
    "parse_retry_after_ms",
]

#: Bound on the stored ``last_error``: enough to diagnose, too little to bloat a row.
MAX_REASON_CHARS = 500
#: Client errors that mean "not now" rather than "never".
RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})
#: Answers whose Retry-After pauses the whole limit group.
PAUSING_STATUSES = frozenset({429, 503})
#: Longest Retry-After taken as given (a year); a route's max_pause_s caps a pause much sooner.
MAX_RETRY_AFTER_S = 366 * 86_400
_DELTA_SECONDS = re.compile(r"[0-9]+")


class Outcome(enum.StrEnum):
    SENT = "sent"
    RETRY = "retry"
    DEAD = "dead"


@dataclasses.dataclass(frozen=True)
class Classification:
    """What one attempt's result means, before attempts and backoff are taken into account."""

    outcome: Outcome
    status_code: int | None
    reason: str
    retry_after_ms: int | None = None
    #: The request timed out after it may have reached the downstream, which may still be working on it.
    timed_out: bool = False

    @property
    def connection_failure(self) -> bool:
        """No HTTP answer at all (refused, reset, timed out): what ``pause_after_failures`` counts."""
        return self.status_code is None and self.outcome is Outcome.RETRY

    @property
    def asks_pause(self) -> bool:
        """A 429/503 with a Retry-After: the downstream asks every client to hold off until then."""
        return self.status_code in PAUSING_STATUSES and self.retry_after_ms is not None


@dataclasses.dataclass(frozen=True)
class Decision:
    """The final verdict for a row: its outcome, and for a retry the delay until the next attempt."""

    outcome: Outcome
    status_code: int | None
    reason: str
    delay_ms: int = 0
    #: The limit group should pause this long (a Retry-After pause), or None.
    pause_ms: int | None = None
    #: The attempt does not count against max_attempts (it was deferred by a pause).
    deferred: bool = False
    #: Nothing was sent (a check before sending decided the outcome: a passed dedupe_window).
    unsent: bool = False
    #: The request timed out while the downstream may still be working on it (it keeps its slot a while).
    timed_out: bool = False


def bound(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` cut to ``limit`` characters (the stored ``last_error``'s bound), an ellipsis marking a cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def parse_retry_after_ms(value: str | None, *, now: datetime) -> int | None:
    """``Retry-After`` as milliseconds from ``now`` (the server's clock: its ``Date`` header, else ours):
    delta-seconds (ASCII digits only, RFC 9110) or an HTTP date; None if absent or invalid. Pure: never
    raises, whatever the header holds (``str.isdigit`` would accept ``²`` and other Unicode digits, which
    ``int`` then refuses)."""
    if value is None:
        return None
    value = value.strip(" \t")
    if not value:
        return None
    if _DELTA_SECONDS.fullmatch(value):
        # Longer than MAX_RETRY_AFTER_S's digits is longer than any pause (and int() refuses 4,300+ digits).
        seconds = int(value) if len(value) <= len(str(MAX_RETRY_AFTER_S)) else MAX_RETRY_AFTER_S
        return min(seconds, MAX_RETRY_AFTER_S) * 1000
    if not value.isascii():
        return None
    when = _http_date(value)
    if when is None:
        return None
    try:
        delta_ms = int((when - now).total_seconds() * 1000)
    except (OverflowError, TypeError):
        return None
    return min(max(0, delta_ms), MAX_RETRY_AFTER_S * 1000)


def _http_date(value: str) -> datetime | None:
    """An HTTP date as an aware datetime (naive: UTC); None when it is not one a datetime can hold (a
    year past 9999 is a ValueError, one past a C long an OverflowError)."""
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _response_now(response: httpx.Response) -> datetime | None:
    # An HTTP-date Retry-After is relative to the server's clock: use its Date header when it sent one
    # (one it cannot hold is no clock: ours is used).
    date = response.headers.get("date")
    return _http_date(date) if date else None


def classify_response(response: httpx.Response, body_snippet: str | None = None) -> Classification:
    """Judge an HTTP response. ``body_snippet`` defaults to the (already read) response text."""
    status = response.status_code
    if 200 <= status < 300:
        return Classification(Outcome.SENT, status, f"HTTP {status}")
    if body_snippet is None:
        try:
            body_snippet = response.text
        except httpx.ResponseNotRead:
            body_snippet = ""
    detail = f"HTTP {status}: {' '.join(body_snippet.split())}".rstrip(": ")
    if 300 <= status < 400:
        location = response.headers.get("location", "")
        return Classification(
            Outcome.DEAD,
            status,
            bound(
                f"HTTP {status}: redirects are not followed (Location: {location[:200]}); point the route "
                "at the final URL"
            ),
        )
    if status in RETRYABLE_STATUSES or status >= 500:
        retry_after = parse_retry_after_ms(
            response.headers.get("retry-after"), now=_response_now(response) or datetime.now(UTC)
        )
        return Classification(Outcome.RETRY, status, bound(detail), retry_after)
    if status == 422:
        return Classification(
            Outcome.DEAD,
            status,
            bound(
                f"{detail} (the downstream refused this key's request; per the Idempotency-Key draft the key "
                "was reused with another payload: not retried, a person must look)"
            ),
        )
    if 400 <= status < 500:
        return Classification(Outcome.DEAD, status, bound(detail))
    return Classification(Outcome.RETRY, status, bound(f"unexpected HTTP status {status}"))


def classify_exception(exc: BaseException) -> Classification:
    """Judge an attempt that produced no response: transient unless we built an invalid request."""
    name = type(exc).__name__
    if isinstance(exc, httpx.LocalProtocolError | httpx.UnsupportedProtocol | httpx.InvalidURL):
        return Classification(Outcome.DEAD, None, bound(f"invalid request ({name}: {exc}); fix the route"))
    if isinstance(exc, httpx.TimeoutException):
        # A connect or pool timeout never reached the downstream; a read or write timeout may have.
        started = isinstance(exc, httpx.ReadTimeout | httpx.WriteTimeout)
        return Classification(Outcome.RETRY, None, bound(f"timeout ({name}: {exc})"), timed_out=started)
    return Classification(Outcome.RETRY, None, bound(f"{name}: {exc}"))


def backoff_ms(attempts: int, *, base_ms: int, max_ms: int, rng: random.Random | None = None) -> int:
    """Full-jitter exponential backoff: uniform in [0, min(max_ms, base_ms * 2 ** (attempts - 1))]."""
    exponent = min(max(attempts, 1) - 1, 62)
    ceiling = min(max_ms, base_ms * (2**exponent))
    return int((rng or random).uniform(0, ceiling))


def decide(
    classification: Classification,
    *,
    attempts: int,
    max_attempts: int,
    base_ms: int,
    max_ms: int,
    rng: random.Random | None = None,
    max_pause_ms: int = 0,
    deferrals: int = 0,
    max_deferrals: int = 100,
) -> Decision:
    """Turn a classification into a verdict. ``attempts`` counts this attempt (1 for the first).

    With ``max_pause_ms > 0`` a 429/503 carrying ``Retry-After`` pauses the group for ``min(Retry-After,
    max_pause_ms)`` and defers the row as long, without counting the attempt; ``deferrals`` (earlier such
    deferrals of this row) having reached ``max_deferrals`` makes it ``DEAD`` instead (``max_deferrals=2``:
    two deferrals, and the third such answer is dead-lettered), so a downstream that keeps
    answering "later" cannot keep a row forever.
    """
    c = classification
    if c.outcome is not Outcome.RETRY:
        return Decision(c.outcome, c.status_code, c.reason)
    if max_pause_ms > 0 and c.asks_pause:
        assert c.retry_after_ms is not None
        if deferrals >= max_deferrals:
            return Decision(
                Outcome.DEAD,
                c.status_code,
                bound(f"gave up after {deferrals} Retry-After deferrals; last: {c.reason}"),
            )
        pause = min(max_pause_ms, max(c.retry_after_ms, 1))
        return Decision(Outcome.RETRY, c.status_code, c.reason, pause, pause_ms=pause, deferred=True)
    if attempts >= max_attempts:
        return Decision(
            Outcome.DEAD, c.status_code, bound(f"gave up after {attempts} attempts; last: {c.reason}")
        )
    if c.retry_after_ms is not None:
        delay = min(max_ms, c.retry_after_ms)
    else:
        delay = backoff_ms(attempts, base_ms=base_ms, max_ms=max_ms, rng=rng)
    return Decision(Outcome.RETRY, c.status_code, c.reason, delay, timed_out=c.timed_out)
