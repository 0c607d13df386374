"""Recording delivery outcomes: each finished row's outcome written fenced by its claim (a write that
matches nothing is a lost claim), a database error retried a few times on a fresh connection, the limit
groups' pauses and failure streaks the outcomes call for, and the tallies of a :class:`DispatchReport`.

The limit groups (:mod:`dagster_joblease.dispatch.groups`) hand finished rows to :meth:`Recorder.record`
(a transaction of its own, retried), or write them with :meth:`Recorder.write` in a transaction of theirs
that also claims the refill (one commit for both: a freed ``max_in_flight`` slot never waits for another
dispatcher's poll) and count them with :meth:`Recorder.tally` once it committed. The statements are
:mod:`dagster_joblease.storage.outbox`'s and :mod:`dagster_joblease.storage.route_groups`'.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping

import sqlalchemy as sa

from dagster_joblease import errors
from dagster_joblease.dispatch import policy
from dagster_joblease.dispatch.capacity import Layout
from dagster_joblease.dispatch.claims import Claimed, Finished
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.storage import outbox as store
from dagster_joblease.storage import route_groups
from dagster_joblease.storage.engine import translate_errors

__all__ = [
    "MAX_REPORT_ROWS",
    "DispatchReport",
    "Recorder",
    "RowOutcome",
    "count",
    "pause_reason",
]

logger = logging.getLogger(__name__)

#: Rows kept in the report returned by :meth:`Dispatcher.run` (the counters cover everything).
MAX_REPORT_ROWS = 1_000
#: Pauses before re-trying to record outcomes after a database error (then the claims are left to expire).
RECORD_RETRY_PAUSES_S = (0.05, 0.25, 1.0)
_OutcomeLabel = str


@dataclasses.dataclass(frozen=True)
class RowOutcome:
    """What happened to one claimed row in this batch."""

    id: int
    idempotency_key: str
    topic: str
    outcome: _OutcomeLabel  #: "sent" | "retry" | "dead"
    status_code: int | None
    reason: str


@dataclasses.dataclass
class DispatchReport:
    """Counters for one batch (or, from :meth:`Dispatcher.run`, for all of them).

    ``lost_claims`` counts deliveries whose fenced write matched nothing (the claim expired and another
    dispatcher owns the row now); ``released`` counts claims given back undelivered (stopping, or too
    little claim time left); ``unrecorded`` counts outcomes the database refused to store (the claim
    expires and the row is delivered again, which the receiver deduplicates).
    """

    claimed: int = 0
    sent: int = 0
    retried: int = 0
    dead: int = 0
    rows: list[RowOutcome] = dataclasses.field(default_factory=list)
    lost_claims: int = 0
    released: int = 0
    unrecorded: int = 0
    #: Of ``dead``: rows past their route's ``dedupe_window``, dead-lettered without being sent.
    expired: int = 0
    #: Of ``retried``: attempts deferred by a ``Retry-After`` pause (not counted against max_attempts).
    deferred: int = 0
    #: Limit groups paused when this batch claimed: group → (paused until, ISO 8601 UTC; reason).
    paused: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    #: Limit groups whose due rows waited for capacity (max_in_flight or rate) in this batch.
    limited: set[str] = dataclasses.field(default_factory=set)

    def merge(self, other: DispatchReport) -> DispatchReport:
        """A new report with both reports' counters summed and rows concatenated."""
        return DispatchReport(
            claimed=self.claimed + other.claimed,
            sent=self.sent + other.sent,
            retried=self.retried + other.retried,
            dead=self.dead + other.dead,
            rows=[*self.rows, *other.rows],
            lost_claims=self.lost_claims + other.lost_claims,
            released=self.released + other.released,
            unrecorded=self.unrecorded + other.unrecorded,
            expired=self.expired + other.expired,
            deferred=self.deferred + other.deferred,
            paused={**self.paused, **other.paused},
            limited=self.limited | other.limited,
        )


class Recorder:
    """Writes finished rows' outcomes (see the module's docstring) for one dispatcher: its ``engine``,
    its ``routes`` and their limit groups (``layout``); ``stopping`` says whether the dispatcher is
    stopping (a failed write is then not retried)."""

    def __init__(
        self, engine: sa.Engine, routes: Mapping[str, Route], layout: Layout, stopping: Callable[[], bool]
    ) -> None:
        self.engine = engine
        self.routes = routes
        self._group_of = layout.group_of
        self._group_topics = layout.group_topics
        self._stopping = stopping

    def record(self, token: str, finished: list[Finished], report: DispatchReport) -> None:
        """Store the outcomes of ``finished`` rows in one transaction of their own and count them into
        ``report``; a database error is retried on a fresh connection (:data:`RECORD_RETRY_PAUSES_S`),
        then the outcomes are counted ``unrecorded`` (their claims expire, the rows go again)."""
        try:
            matched = self._write_with_retry(token, finished)
        except errors.StorageError as exc:
            for row, decision in finished:
                if decision is None:
                    report.released += 1
                    continue
                report.unrecorded += 1
                logger.warning(
                    "could not record %s for outbox row %d (key %s): %s; it will be delivered again after "
                    "its claim expires",
                    decision.outcome.value,
                    row.id,
                    row.idempotency_key,
                    exc,
                    extra={"action": "outbox_unrecorded"},
                )
            return
        self.tally(finished, matched, report)

    def write(self, conn: sa.Connection, token: str, finished: list[Finished]) -> set[int]:
        """Write ``finished`` rows' outcomes (fenced by claim) and the group rows' writes they call for in
        ``conn``'s transaction; returns the ids the fenced writes matched (count them with :meth:`tally`
        once the transaction committed)."""
        matched = self._write_outcomes(conn, token, finished)
        for write in self._group_writes(finished):
            write(conn)
        return matched

    def tally(self, finished: list[Finished], matched: set[int], report: DispatchReport) -> None:
        """Count recorded outcomes into ``report`` (a fenced write that matched nothing: a lost claim)."""
        for row, decision in finished:
            if decision is None:
                report.released += 1
            elif row.id not in matched:
                report.lost_claims += 1
                logger.warning(
                    "lost the claim on outbox row %d (key %s) before recording %s: it expired and another "
                    "dispatcher owns the row now",
                    row.id,
                    row.idempotency_key,
                    decision.outcome.value,
                    extra={"action": "outbox_claim_lost"},
                )
            else:
                count(row, decision, report)

    def _write_outcomes(self, conn: sa.Connection, token: str, finished: list[Finished]) -> set[int]:
        """The fenced writes of ``finished``; returns the ids they matched. Sent rows with one status code
        share one statement (the usual case: the whole group in one); retries and dead rows are one
        statement each; claims given back undelivered, one per kind (first attempt stamped or not)."""
        sent: dict[int | None, list[int]] = {}
        matched: set[int] = set()
        released: list[Claimed] = []
        for row, decision in finished:
            if decision is None:
                released.append(row)
            elif decision.outcome is policy.Outcome.SENT:
                sent.setdefault(decision.status_code, []).append(row.id)
            elif self._write_failed(conn, token, row, decision):
                matched.add(row.id)
        for status_code, ids in sent.items():
            matched.update(store.mark_sent(conn, ids, token, status_code))
        for stamped in (False, True):
            # Given back undelivered: the claim's attempt (and a first-attempt time it stamped) is undone.
            back = [r.id for r in released if r.stamped is stamped]
            if back:
                store.give_back(conn, back, token, stamped=stamped)
        return matched

    def _write_failed(self, conn: sa.Connection, token: str, row: Claimed, decision: policy.Decision) -> bool:
        """The fenced write of a row that was not sent: a retry (a timed-out request stays in flight for
        its grace: the downstream may still be working on it) or a dead row; whether it matched."""
        if decision.outcome is policy.Outcome.RETRY:
            hold_ms = self.hold_ms(row, decision)
            return store.record_retry(
                conn,
                row.id,
                token,
                status_code=decision.status_code,
                reason=decision.reason,
                delay_ms=decision.delay_ms,
                deferred=decision.deferred,
                hold=(row.group, hold_ms) if hold_ms else None,
            )
        return store.record_dead(
            conn,
            row.id,
            token,
            status_code=decision.status_code,
            reason=decision.reason,
            unsent=decision.unsent,
        )

    def hold_ms(self, row: Claimed, decision: policy.Decision) -> int:
        """How long a finished row stays in flight after its outcome (a timeout's grace, on every route),
        in ms: the downstream may still be working on the request, so neither the row's retry nor its
        ordering key's next row may start, and a limited group's slot stays taken."""
        if not decision.timed_out:
            return 0
        return int(self.routes[row.topic].slot_grace_s * 1000)

    def _group_writes(self, finished: list[Finished]) -> list[Callable[[sa.Connection], object]]:
        """Writes to the limit groups' rows that ``finished`` calls for: pauses a downstream asked for,
        and consecutive connection failures where a route counts them. Group by group, in the groups'
        order: the order every claim locks them in (writes in finishing order deadlocked two dispatchers
        whose outcomes touched the same groups)."""
        pauses, streaks = self._group_tallies(finished)
        writes: list[Callable[[sa.Connection], object]] = []
        for group in sorted(pauses.keys() | streaks.keys()):
            if group in pauses:
                pause_ms, reason = pauses[group]
                writes.append(
                    functools.partial(
                        route_groups.record_pause, group=group, pause_ms=pause_ms, reason=reason
                    )
                )
            answered, failures, last = streaks.get(group, (False, 0, ""))
            if answered:
                writes.append(functools.partial(route_groups.record_answers, group=group))
            if failures:
                writes.append(self._failures_write(group, failures, last))
        return writes

    def _group_tallies(
        self, finished: list[Finished]
    ) -> tuple[dict[str, tuple[int, str]], dict[str, tuple[bool, int, str]]]:
        """Per group, the longest pause ``finished`` asks for (ms, reason), and its streak: (answered at
        all, connection failures since, the last one's reason), for groups whose routes count them."""
        pauses: dict[str, tuple[int, str]] = {}
        streaks: dict[str, tuple[bool, int, str]] = {}
        for row, decision in finished:
            if decision is None or decision.unsent:
                continue
            group = self._group_of[row.topic]
            if decision.pause_ms and decision.pause_ms > pauses.get(group, (0, ""))[0]:
                pauses[group] = (decision.pause_ms, pause_reason(row, decision))
            if self.routes[row.topic].pause_after_failures is not None:
                answered, failures, last = streaks.get(group, (False, 0, ""))
                if decision.status_code is None and decision.outcome is not policy.Outcome.SENT:
                    streaks[group] = (answered, failures + 1, decision.reason)
                else:
                    streaks[group] = (True, 0, last)
        return pauses, streaks

    def _failures_write(self, group: str, failures: int, last: str) -> Callable[[sa.Connection], object]:
        """The write adding ``failures`` connection failures to ``group``'s streak (the smallest threshold
        of its routes; the failure pause of its first)."""
        route = self.routes[self._group_topics[group][0]]
        threshold = min(
            r.pause_after_failures
            for t in self._group_topics[group]
            if (r := self.routes[t]).pause_after_failures is not None
        )
        return functools.partial(
            route_groups.record_connection_failures,
            group=group,
            count=failures,
            threshold=threshold,
            pause_ms=int(route.failure_pause_s * 1000),
            reason=last,
        )

    def _write_once(self, token: str, finished: list[Finished]) -> set[int]:
        """One transaction of :meth:`write`."""
        with translate_errors("record delivery outcomes"), self.engine.begin() as conn:
            return self.write(conn, token, finished)

    def _write_with_retry(self, token: str, finished: list[Finished]) -> set[int]:
        """Run the fenced UPDATEs in one transaction; returns the ids they matched. A dropped connection
        gets a few quick retries on a fresh one.

        The outcomes are already known (the downstream answered), so losing them to a brief database
        hiccup would mean needless re-deliveries once the claims expire. Retrying is safe: every write is
        fenced by the claim token.
        """
        retries = 0
        while True:
            try:
                return self._write_once(token, finished)
            except errors.StorageError as exc:
                if retries == len(RECORD_RETRY_PAUSES_S) or self._stopping():
                    raise
                logger.info(
                    "retrying an outcome write after a database error: %s",
                    exc,
                    extra={"action": "outbox_record_retry"},
                )
                time.sleep(RECORD_RETRY_PAUSES_S[retries])
                retries += 1


def count(row: Claimed, decision: policy.Decision, report: DispatchReport) -> None:
    """Count one recorded outcome into ``report`` (and log a retry or a dead row)."""
    report.rows.append(
        RowOutcome(
            id=row.id,
            idempotency_key=row.idempotency_key,
            topic=row.topic,
            outcome=decision.outcome.value,
            status_code=decision.status_code,
            reason=decision.reason,
        )
    )
    if decision.outcome is policy.Outcome.SENT:
        report.sent += 1
    elif decision.outcome is policy.Outcome.RETRY:
        report.retried += 1
        report.deferred += int(decision.deferred)
        logger.info(
            "outbox row %d (key %s) will be retried in %d ms: %s",
            row.id,
            row.idempotency_key,
            decision.delay_ms,
            decision.reason,
            extra={"action": "outbox_retry"},
        )
    else:
        report.dead += 1
        report.expired += int(decision.unsent)
        logger.warning(
            "outbox row %d (key %s, topic %s) is DEAD: %s",
            row.id,
            row.idempotency_key,
            row.topic,
            decision.reason,
            extra={"action": "outbox_dead"},
        )


def pause_reason(row: Claimed, decision: policy.Decision) -> str:
    """The reason stored with a pause a downstream asked for."""
    return (
        f"HTTP {decision.status_code} with Retry-After from topic {row.topic} "
        f"(outbox row {row.id}): {decision.reason}"
    )
