"""The dispatcher: claim due outbox rows of its routed topics, POST them with their idempotency key, record
the outcomes.

One batch is three phases, and no transaction is open while HTTP is in flight:

1. **Claim** (one short transaction, one statement): due rows *of the topics this dispatcher routes* are
   locked with ``FOR UPDATE SKIP LOCKED`` (PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` serializes claims
   instead), stamped with a fresh claim token and a claim expiry on the database clock, and their
   ``attempts`` incremented, so an attempt that crashes the process still counts. Rows of other topics stay
   ``PENDING``, untouched, for the dispatcher that routes them (several code locations can share one
   database).
2. **Deliver** inline (concurrency 1) or on a thread pool sharing one keep-alive ``httpx.Client``; a
   request starts only while the claim has time left for its whole timeout, and each request has a *total*
   deadline (connect, send, headers and body together) that ends before the claim does, so a downstream
   that dribbles its answer cannot keep a key in flight while another dispatcher sends it again.
3. **Record** the finished rows' outcomes from the dispatching thread, a group at a time (at the end of
   the batch, or sooner when deliveries are slow): one transaction, one UPDATE per kind of outcome, each
   fenced by ``id`` *and* claim token. A dispatcher whose claim expired and was re-claimed updates nothing
   (a *lost claim*), and the row's fate is decided by its new owner. Only the dispatching thread touches
   the database (save a delivery thread writing a downstream's pause the moment it arrives), so a
   dispatcher needs one pooled connection whatever its concurrency, and briefly a second during a pause.

A dispatcher that dies leaves claims that expire and are claimed again; the receiver deduplicates the
re-delivery by its ``Idempotency-Key``. That is at-least-once delivery with end-to-end deduplication.

**Limits and pauses** (see :class:`Route`): each claim first reads the state of its routes' limit groups
(one indexed read of a small table; nothing else when no group has a limit or a pause: the unlimited path).
Rows of a paused group are not claimed. Rows of a limited group are claimed, under that group's row lock,
only as far as its global ``max_in_flight`` (unexpired claims holding the group's capacity, whichever
dispatcher made them) and ``rate`` (evenly spaced admissions) allow, and no further than this dispatcher has
idle workers, so a claimed row starts at once; its outcome is recorded as soon as it is known, which frees
the slot, and the batch claims again while it has budget. A freed slot of a group limited by
``max_in_flight`` alone is handed on by a *swap* (PostgreSQL): the statement or transaction that records
the finished rows claims no more due rows than those still held slots, so the count never grows and needs
no exclusive lock of the group's row (only a ``FOR SHARE`` read, which a pause being written waits for);
growth of the count is claimed under the lock. A ``429``/``503`` with ``Retry-After`` pauses the
group in the database for every dispatcher (and at once for this one's other threads).
A row whose route has a ``dedupe_window`` and whose first attempt is older is not sent but dead-lettered.

**Where things are.** This module: :class:`Dispatcher` (options, ``run()``) and the batch loop
(``_BatchLoop``, one method per phase). Its parts, in ``dispatch/``: ``groups`` (the limit groups, one
implementation per kind picked when the dispatcher is built: ``UnlimitedGroups``, ``locked.LockedGroup``,
``swapping.SwappingGroup``, behind ``kinds.GroupKind``'s ``claim`` and ``complete``), ``delivery`` (one
row's send and its verdict, the workers), ``pauses`` (the local pauses, the claims' timer), ``capacity``
(pure: how much to claim, rate windows, wait hints, the loop's choices), ``decisions`` (pure: may this row
start now?), ``policy`` (pure: what does this answer mean?), ``transports`` (one message per row, and how
each kind of route sends it: HTTP's deadline-bounded POST) and ``recorder`` (outcome writes fenced by
claim, their retry, the tallies). Every statement is a store module's:
:mod:`dagster_joblease.storage.outbox` (its delivery section) and
:mod:`dagster_joblease.storage.route_groups`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue as queue_mod
import secrets
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from types import FrameType, TracebackType
from typing import Any

import httpx
import sqlalchemy as sa

from dagster_joblease import checks, errors
from dagster_joblease.dispatch import capacity, policy
from dagster_joblease.dispatch.capacity import ANY_ROW_POLL_S
from dagster_joblease.dispatch.claims import Claimed, Finished
from dagster_joblease.dispatch.delivery import Retrying, Sender
from dagster_joblease.dispatch.groups import LimitGroups
from dagster_joblease.dispatch.groups.kinds import Refill, Room, Shared
from dagster_joblease.dispatch.pauses import ClaimTimer, Pauses
from dagster_joblease.dispatch.recorder import MAX_REPORT_ROWS, DispatchReport, Recorder, RowOutcome
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.storage.engine import translate_errors

__all__ = ["DispatchReport", "Dispatcher", "RowOutcome"]

logger = logging.getLogger(__name__)

#: Longest a finished delivery waits to be recorded while the rest of its batch is still in flight.
MAX_RECORD_DELAY_S = 0.25
#: How often a batch with undelivered rows re-reads its groups' pauses (another dispatcher may open one).
PAUSE_REFRESH_S = 0.05
DEFAULT_MAX_DEFERRALS = 100


def _safety_ms(claim_ms: int) -> int:
    """Margin kept between a request's deadline and the claim's expiry (clock skew, recording time)."""
    return min(1_000, claim_ms // 10)


def _checked_routes(routes: object) -> dict[str, Route]:
    """``routes`` (topic → :class:`Route`) as a dict, or a :class:`ConfigurationError` saying what is
    not a route."""
    if not isinstance(routes, Mapping):
        raise errors.ConfigurationError("routes must be a mapping of topic → Route")
    for topic, route in routes.items():
        if not isinstance(route, Route):
            raise errors.ConfigurationError(
                f"route for topic {topic!r} must be a Route, got {type(route).__name__}"
            )
    return dict(routes)


def _warn_disagreements(layout: capacity.Layout) -> None:
    for group, (mifs, rates) in layout.disagreeing.items():
        logger.warning(
            "routes of limit group %s configure different limits (max_in_flight %s, rate %s); the "
            "smallest applies",
            group,
            mifs,
            rates,
            extra={"action": "limit_mismatch"},
        )


def _check_claim_ms(claim_ms: int, routes: Mapping[str, Route]) -> None:
    """A claim must outlast every route's whole timeout plus the safety margin."""
    longest_ms = max((int(r.timeout_s * 1000) for r in routes.values()), default=0)
    if longest_ms + _safety_ms(claim_ms) >= claim_ms:
        raise errors.ConfigurationError(
            f"claim_ms={claim_ms} must exceed the longest route timeout ({longest_ms} ms) plus a "
            f"{_safety_ms(claim_ms)} ms margin, or a slow delivery could outlive its claim and "
            "overlap with another dispatcher's; raise claim_ms or lower timeout_s"
        )


class Dispatcher:
    """Deliver due outbox rows of the routed topics over HTTP, fenced by claim tokens; safe to run in
    several processes, and beside dispatchers that route other topics on the same database.

    Args:
        engine: an engine over a migrated joblease database. The dispatcher uses one connection of its
            pool at a time, whatever ``concurrency`` is.
        routes: topic → :class:`Route`. Only rows of these topics are claimed; rows of other topics stay
            ``PENDING``, untouched (see :func:`dagster_joblease.outbox.due_summary` with ``topics``).
        max_attempts: attempts before a retryable failure becomes ``DEAD``.
        claim_ms: how long a claim lasts; it must exceed every route's timeout. A crashed dispatcher's rows
            are delivered again after this long.
        concurrency: deliveries in flight at once (1: inline; more: threads sharing one keep-alive client).
        backoff_base_ms, backoff_max_ms: full-jitter exponential backoff between attempts.
        client: an ``httpx.Client`` to use instead of the dispatcher's own (redirects are never followed,
            whatever the client's default). The dispatcher's own client bounds each request by a total
            deadline at the socket level and keeps no cookies (a downstream's ``Set-Cookie`` is never
            sent back with another row); with a client of yours the deadline is checked between body
            chunks and caps each phase's timeout, but a downstream that dribbles its headers is bounded
            only by your client's own timeouts.
        async_swap_commit: PostgreSQL, off by default. A swap (finished rows recorded SENT and their
            ``max_in_flight`` slots handed on, one statement) then commits without waiting for the WAL
            flush (``synchronous_commit = off`` for that statement's own transaction only), which
            shortens the time a slot idles between two requests. The cost is durability: a PostgreSQL
            crash can lose the last swaps (up to about three ``wal_writer_delay``, 0.6 s by default).
            A lost SENT record means the row is sent again once its claim expires (deduplicated by its
            key); a lost claim means a request on the wire that the database no longer counts, so until
            it finishes the group can see more than ``max_in_flight`` and another dispatcher may send
            the same key at once (deduplicated too). Nothing changes while PostgreSQL stays up.

    Secret headers are read from the environment here, once; a missing variable raises
    :class:`ConfigurationError` naming it.

    Example::

        with Dispatcher(engine, {"billing": Route("https://billing.internal/hook")}) as dispatcher:
            totals = dispatcher.run(poll_interval_s=1.0)
    """

    def __init__(
        self,
        engine: sa.Engine,
        routes: Mapping[str, Route],
        *,
        max_attempts: int = 10,
        claim_ms: int = 60_000,
        concurrency: int = 8,
        backoff_base_ms: int = 1_000,
        backoff_max_ms: int = 300_000,
        client: httpx.Client | None = None,
        max_deferrals: int = DEFAULT_MAX_DEFERRALS,
        async_swap_commit: bool = False,
    ) -> None:
        self.engine = engine
        max_attempts = checks.integer("max_attempts", max_attempts, minimum=1)
        self.claim_ms = checks.milliseconds("claim_ms", claim_ms, minimum=100)
        self.concurrency = checks.integer("concurrency", concurrency, minimum=1)
        backoff_base_ms = checks.milliseconds("backoff_base_ms", backoff_base_ms, minimum=1)
        retrying = Retrying(
            max_attempts=max_attempts,
            backoff_base_ms=backoff_base_ms,
            backoff_max_ms=checks.milliseconds("backoff_max_ms", backoff_max_ms, minimum=backoff_base_ms),
            max_deferrals=checks.integer("max_deferrals", max_deferrals, minimum=1),
        )
        if not isinstance(async_swap_commit, bool):
            raise errors.ConfigurationError(
                f"dispatcher option async_swap_commit={async_swap_commit!r} must be a bool"
            )
        self.routes: dict[str, Route] = _checked_routes(routes)
        _check_claim_ms(self.claim_ms, self.routes)
        # Limit groups: topic → group, group → its topics, and this dispatcher's own limits per group
        # (the smallest of its routes' when two routes of one group disagree).
        layout = capacity.layout(self.routes)
        _warn_disagreements(layout)
        pauses = Pauses()
        self._sender = Sender(
            engine,
            self.routes,
            retrying,
            (self.claim_ms - _safety_ms(self.claim_ms)) / 1000,
            self.concurrency,
            client,
            pauses,
        )
        recorder = Recorder(engine, self.routes, layout, lambda: self._sender.stop.is_set())
        self._shared = Shared(
            engine, self.routes, layout, self.claim_ms, recorder, pauses, ClaimTimer(), async_swap_commit
        )
        self._groups = LimitGroups(self._shared)
        self._record_delay_s = min(MAX_RECORD_DELAY_S, _safety_ms(self.claim_ms) / 2000)
        self._warm = False
        self._closed = False

    @property
    def topics(self) -> frozenset[str]:
        """The routed topics."""
        return frozenset(self.routes)

    @property
    def groups(self) -> frozenset[str]:
        """The routes' limit groups."""
        return frozenset(self._shared.layout.group_topics)

    @property
    def max_attempts(self) -> int:
        return self._sender.retrying.max_attempts

    @property
    def backoff_base_ms(self) -> int:
        return self._sender.retrying.backoff_base_ms

    @property
    def backoff_max_ms(self) -> int:
        return self._sender.retrying.backoff_max_ms

    @property
    def max_deferrals(self) -> int:
        return self._sender.retrying.max_deferrals

    @property
    def async_swap_commit(self) -> bool:
        return self._shared.async_swap_commit

    @property
    def _client(self) -> httpx.Client | None:
        """The HTTP transport's client (None: no HTTP route)."""
        return self._sender.client

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for in-flight deliveries, then release the thread pool and (if ours) the HTTP client."""
        if self._closed:
            return
        self._closed = True
        self._sender.close()

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- one batch ---------------------------------------------------------------------------------

    def dispatch(self, limit: int = 100) -> DispatchReport:
        """Claim up to ``limit`` due rows of the routed topics, deliver them, record every outcome.

        Rows of limited groups are claimed as capacity frees up, within this same call (the batch keeps
        claiming them while it has budget; it waits at most :data:`LIMIT_WAIT_S` in all for capacity
        other dispatchers hold). Rows of paused groups are not claimed (``report.paused`` names them).
        """
        limit = checks.integer("limit", limit, minimum=1)
        if self._closed:
            raise errors.DispatchError("this dispatcher is closed; create a new one")
        report = DispatchReport()
        if not self.routes:
            return report
        token = secrets.token_hex(16)
        if self._sender.pool is not None and self._groups.limited_seen and not self._warm:
            self._warm_pause_connection()
        room = Room(limit, self.concurrency)
        claimed = self._groups.claim(token, room, report, limited_only=False)
        report.claimed += len(claimed.rows)
        if not claimed.rows and not claimed.waits:
            return report
        batch = _BatchLoop(self, token, limit - len(claimed.rows), claimed.waits, report)
        try:
            # Rows of limited groups first: they were claimed for idle workers and hold capacity.
            batch.run(sorted(claimed.rows, key=lambda r: (r.group is None, r.id)))
        except BaseException:
            batch.settle()  # whatever failed, the answers already given are recorded
            raise
        report.limited |= set(batch.blocked)
        logger.info(
            "dispatched %d rows: %d sent, %d retry, %d dead, %d lost claims, %d released",
            report.claimed,
            report.sent,
            report.retried,
            report.dead,
            report.lost_claims,
            report.released,
            extra={"action": "dispatch_batch"},
        )
        return report

    def _warm_pause_connection(self) -> None:
        """Keep a second connection in the pool, once: a delivery thread writing a downstream's pause need
        not open one then (tens of ms on a busy machine, while other dispatchers keep claiming)."""
        self._warm = True
        pool = self.engine.pool
        if not isinstance(pool, sa.pool.QueuePool) or pool.size() < 2:
            return  # a pool this small would make the second checkout wait
        try:
            with translate_errors("open a connection"), self.engine.connect(), self.engine.connect():
                pass
        except errors.StorageError:
            pass  # the pause write opens its own when it needs one

    # -- the loop ----------------------------------------------------------------------------------

    def run(
        self,
        *,
        poll_interval_s: float = 1.0,
        stop: threading.Event | None = None,
        max_batches: int | None = None,
        on_report: Callable[[DispatchReport], None] | None = None,
        limit: int = 100,
    ) -> DispatchReport:
        """Dispatch batches until ``stop`` is set, ``max_batches`` ran, or SIGTERM/SIGINT arrives.

        A full batch is followed at once by the next; otherwise the loop waits ``poll_interval_s``. A
        database failure is logged and retried after the same pause. On a signal (handled only when called
        from the main thread) in-flight deliveries finish and are recorded, unstarted ones are given back,
        and the totals are returned.
        """
        checks.number("poll_interval_s", poll_interval_s, minimum=0)
        if max_batches is not None:
            checks.integer("max_batches", max_batches, minimum=1, none="no bound")
        limit = checks.integer("limit", limit, minimum=1)
        self._sender.stop = stop if stop is not None else threading.Event()
        previous = self._install_signal_handlers()
        totals = DispatchReport()
        batches = 0
        try:
            while not self._sender.stop.is_set() and (max_batches is None or batches < max_batches):
                batches += 1
                try:
                    report = self.dispatch(limit)
                except errors.StorageError as exc:
                    logger.warning(
                        "dispatch batch failed, retrying in %.2f s: %s",
                        poll_interval_s,
                        exc,
                        extra={"action": "dispatch_storage_error"},
                    )
                    self._sender.stop.wait(max(poll_interval_s, 0.05))
                    continue
                totals = totals.merge(report)
                del totals.rows[:-MAX_REPORT_ROWS]
                if on_report is not None and report.claimed:
                    on_report(report)
                if report.claimed < limit:
                    self._sender.stop.wait(poll_interval_s)
        finally:
            self._restore_signal_handlers(previous)
            # A later dispatch() must not inherit this run's stop request.
            self._sender.stop = threading.Event()
        logger.info(
            "dispatcher stopped after %d batches: %d claimed, %d sent, %d retry, %d dead, %d lost claims",
            batches,
            totals.claimed,
            totals.sent,
            totals.retried,
            totals.dead,
            totals.lost_claims,
            extra={"action": "dispatch_stopped"},
        )
        return totals

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        stop = self._sender.stop

        def _on_signal(signum: int, _frame: FrameType | None) -> None:
            logger.info(
                "received %s: finishing in-flight deliveries, then stopping",
                signal.Signals(signum).name,
                extra={"action": "dispatch_stopping"},
            )
            stop.set()

        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, _on_signal)
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclasses.dataclass
class _Pace:
    """When a batch's loop does its periodic things (local monotonic times): its last record of outcomes,
    its next re-read of pauses, its next look for any due row (``mixed``: the routes have limited and
    unlimited groups), and how long it waited for capacity in all."""

    record_delay_s: float
    mixed: bool
    flushed_at: float = dataclasses.field(default_factory=time.monotonic)
    refresh_at: float = 0.0
    any_at: float = 0.0
    waited: float = 0.0

    def __post_init__(self) -> None:
        self.refresh_at = self.flushed_at + PAUSE_REFRESH_S
        self.any_at = self.flushed_at + ANY_ROW_POLL_S


def _take_done(
    inflight: dict[Future[policy.Decision | None], Claimed],
    done_q: queue_mod.SimpleQueue[Future[policy.Decision | None]],
    wake_at: float | None,
) -> list[Finished]:
    """The deliveries done by now: waits for the first until ``wake_at`` (local monotonic time; None:
    until one is done), then takes every other one already done."""
    timeout = None if wake_at is None else max(0.0, wake_at - time.monotonic())
    done: list[Future[policy.Decision | None]] = []
    try:
        done.append(done_q.get(timeout=timeout))
        while True:
            done.append(done_q.get_nowait())
    except queue_mod.Empty:
        pass  # the timeout passed with nothing done, or every done delivery is taken
    return [(inflight.pop(f), f.result()) for f in done]  # each future comes once


def _unstarted(inflight: Mapping[Future[Any], Claimed], concurrency: int) -> bool:
    """Whether some submitted row has not started yet (queued behind busy workers, or waiting for its
    rate admission): only those can still be stopped by a pause read from the database."""
    if len(inflight) > concurrency:
        return True
    now = time.monotonic()
    return any(r.not_before is not None and r.not_before > now for r in inflight.values())


class _Done:
    """A batch's finished rows not recorded yet, and what each turn asks of them, kept as rows come (not
    recounted every turn: an inline batch of 100 rows would scan them 5,050 times): the limit groups whose
    capacity they free, and whether a downstream asked for a pause (both call for recording at once)."""

    def __init__(self) -> None:
        self.rows: list[Finished] = []
        self.freed: set[str] = set()
        self.pause_asked = False

    def __bool__(self) -> bool:
        return bool(self.rows)

    def add(self, finished: list[Finished]) -> None:
        for row, decision in finished:
            self.rows.append((row, decision))
            if row.group is not None:
                self.freed.add(row.group)
            if decision is not None and decision.pause_ms:
                self.pause_asked = True

    def take(self) -> list[Finished]:
        """The rows, handed over for recording; none left."""
        rows, self.rows, self.freed, self.pause_asked = self.rows, [], set(), False
        return rows


class _BatchLoop:
    """One batch's loop (:meth:`Dispatcher.dispatch`): rows are submitted to the workers (or queued,
    inline), finished deliveries collected and completed by their limit groups (which refill what they
    freed), and the batch claims again while it has ``budget`` and idle workers: now and then for any
    due row, or after a wait for capacity other dispatchers hold. It talks to the groups only through
    :class:`LimitGroups`' ``claim`` and ``complete``. Each turn's choices are :mod:`capacity`'s pure
    decisions; this class holds the state they are taken on."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        token: str,
        budget: int,
        blocked: dict[str, float],
        report: DispatchReport,
    ) -> None:
        self.sender = dispatcher._sender
        self.groups = dispatcher._groups
        self.token = token
        self.budget = budget
        #: Limit groups whose due rows wait for capacity → seconds worth waiting before looking again.
        self.blocked = blocked
        self.report = report
        self.inflight: dict[Future[policy.Decision | None], Claimed] = {}
        # Each delivery's future puts itself here when done: the loop reads one queue instead of
        # installing a waiter on every in-flight future each turn (concurrent.futures.wait's cost).
        self.done_q: queue_mod.SimpleQueue[Future[policy.Decision | None]] = queue_mod.SimpleQueue()
        self.queue: list[Claimed] = []  # inline (concurrency 1): rows not delivered yet
        self.finished = _Done()
        # Refills claim only limited groups; with topics outside them too, idle workers also look for any
        # due row now and then (see ANY_ROW_POLL_S).
        self.pace = _Pace(dispatcher._record_delay_s, self.groups.mixed)

    @property
    def concurrency(self) -> int:
        return self.sender.concurrency

    def run(self, pending: list[Claimed]) -> None:
        """Deliver ``pending`` and whatever the batch claims meanwhile; returns when nothing is in flight,
        everything is recorded, and no group is worth waiting for."""
        stop = self.sender.stop
        while True:
            self._submit(pending)
            self._collect()
            busy = bool(self.inflight or self.queue)
            pending = self._take(self._turn(busy))
            if pending or busy or self.finished:
                continue
            pause = capacity.limit_wait(self.blocked, self.budget, self.pace.waited, stop.is_set())
            if pause is None:
                return
            stop.wait(pause)
            self.pace.waited += pause

    def settle(self) -> None:
        """After the loop failed: every delivery in flight ends and every known outcome is recorded (the
        recorder retries on a fresh connection); rows not started yet are given back."""
        for future, row in list(self.inflight.items()):
            try:
                self.finished.add([(row, future.result())])
            except Exception:  # not judged: its claim expires, the row goes again
                logger.exception("outbox row %d: its delivery failed unjudged", row.id)
        self.inflight.clear()
        self.finished.add([(row, None) for row in self.queue])
        self.queue.clear()
        if self.finished:
            self.groups.complete(self.token, self.finished.take(), Room(0, 0), self.report, ())

    def _submit(self, pending: list[Claimed]) -> None:
        pool = self.sender.pool
        for row in pending:
            if pool is None:
                self.queue.append(row)
                continue
            future = pool.submit(self.sender.deliver, row)
            self.inflight[future] = row
            future.add_done_callback(self.done_q.put)

    def _collect(self) -> None:
        """Deliver queued rows (inline), or take the deliveries done (workers), until the next moment the
        loop has something else to do: a record delay, a pause refresh, the poll for any due row."""
        if self.sender.pool is None:
            self._deliver_queued()
        elif self.inflight:
            self._take_finished()

    def _deliver_queued(self) -> None:
        """Inline: deliver queued rows one after another until a row frees a limit group's slot or asks
        for a pause, or the record delay or pause refresh is due (a turn between two inline rows would do
        nothing else: no worker is idle while rows are queued)."""
        pace, finished = self.pace, self.finished
        turn_at = min(pace.flushed_at + pace.record_delay_s, pace.refresh_at)
        while self.queue:
            row = self.queue.pop(0)
            finished.add([(row, self.sender.deliver(row))])
            if finished.freed or finished.pause_asked or time.monotonic() >= turn_at:
                return

    def _take_finished(self) -> None:
        """Workers: take the deliveries done by the next moment the loop has something else to do."""
        pace = self.pace
        wake_at = [pace.flushed_at + pace.record_delay_s] if self.finished else []
        if _unstarted(self.inflight, self.concurrency):
            wake_at.append(time.monotonic() + PAUSE_REFRESH_S)
        if pace.mixed and len(self.inflight) < self.concurrency and self.budget > 0:
            wake_at.append(pace.any_at)
        self.finished.add(_take_done(self.inflight, self.done_q, min(wake_at, default=None)))

    def _turn(self, busy: bool) -> tuple[Refill, frozenset[str]] | None:
        """Complete what finished (with the refill it calls for), re-read pauses, claim again: the claim's
        rows and waits, and the groups it covered (empty: all of them), or None when nothing was claimed."""
        freed = frozenset(self.finished.freed)
        urgent = bool(freed) or self.finished.pause_asked
        free = self._idle_workers()
        can_refill = self.budget > 0 and free > 0 and not self.sender.stop.is_set()
        refill = self._flush(busy, urgent, Room(self.budget, free) if can_refill and freed else Room(0, 0))
        self._refresh(busy)
        if refill is not None:
            return refill, freed
        more = self._claim_more(can_refill, bool(freed), busy, free)
        return None if more is None else (more, frozenset())

    def _idle_workers(self) -> int:
        """Workers free for another row now (inline: one, once the queue is empty)."""
        if self.sender.pool is not None:
            return self.concurrency - len(self.inflight)
        return 0 if self.queue else 1

    def _busy_groups(self) -> set[str]:
        return {r.group for r in self.inflight.values() if r.group is not None}

    def _flush(self, busy: bool, urgent: bool, room: Room) -> Refill | None:
        """Complete the finished rows when :func:`capacity.record_now` says so, refilling within ``room``
        (the refill is returned when there was room, else None: the loop decides its next claim)."""
        pace = self.pace
        if not capacity.record_now(
            finished=bool(self.finished),
            urgent=urgent,
            busy=busy,
            since_flush_s=time.monotonic() - pace.flushed_at,
            delay_s=pace.record_delay_s,
        ):
            return None
        refill = self.groups.complete(self.token, self.finished.rows, room, self.report, self._busy_groups())
        self.finished.take()  # after: were complete to raise, settle() records them again (fenced)
        pace.flushed_at = time.monotonic()
        return refill if room.want > 0 else None

    def _refresh(self, busy: bool) -> None:
        """Rows still waiting to start: learn of pauses other dispatchers opened meanwhile."""
        if not busy or time.monotonic() < self.pace.refresh_at:
            return
        if _unstarted(self.inflight, self.concurrency) or self.queue:
            self.groups.refresh_pauses()
        self.pace.refresh_at = time.monotonic() + PAUSE_REFRESH_S

    def _claim_more(self, can_refill: bool, freed: bool, busy: bool, free: int) -> Refill | None:
        kind = capacity.next_refill(
            can_refill=can_refill,
            freed=freed,
            blocked=bool(self.blocked),
            busy=busy,
            mixed=self.pace.mixed,
            any_due=time.monotonic() >= self.pace.any_at,
        )
        if kind == capacity.NextClaim.NONE:
            return None
        limited_only = kind == capacity.NextClaim.LIMITED
        # Idle workers take any due row, not only the limited groups' (no more than are idle).
        room = Room(self.budget, free) if limited_only else Room(min(self.budget, free), free)
        more = self.groups.claim_during_batch(
            self.token, room, self.report, limited_only=limited_only, busy=self._busy_groups()
        )
        if not limited_only:
            self.pace.any_at = time.monotonic() + ANY_ROW_POLL_S
        return more

    def _take(self, claimed: tuple[Refill, frozenset[str]] | None) -> list[Claimed]:
        """Count a claim's rows into the batch (they are submitted next) and its waits: a claim of every
        limited group replaces them, a refill of some groups (``covered``) replaces theirs."""
        if claimed is None:
            return []
        refill, covered = claimed
        if covered:
            self.blocked = {g: w for g, w in self.blocked.items() if g not in covered}
            self.blocked.update(refill.waits)
        else:
            self.blocked = dict(refill.waits)
        self.report.claimed += len(refill.rows)
        self.budget -= len(refill.rows)
        return sorted(refill.rows, key=lambda r: r.id)
