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
   the database, so a dispatcher needs one pooled connection whatever its concurrency.

A dispatcher that dies leaves claims that expire and are claimed again; the receiver deduplicates the
re-delivery by its ``Idempotency-Key``. That is at-least-once delivery with end-to-end deduplication.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import secrets
import signal
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from types import FrameType, TracebackType
from typing import Any

import httpcore
import httpx
import sqlalchemy as sa

from dagster_joblease import errors, outbox
from dagster_joblease.dispatch import policy
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.storage.clock import db_now, db_now_plus_ms
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import outbox_table

__all__ = ["DispatchReport", "Dispatcher", "RowOutcome", "claim_statement"]

logger = logging.getLogger(__name__)

#: Response bytes read for the stored error snippet; the rest of a huge body is not downloaded.
MAX_BODY_READ = 8 * 1024
#: Rows kept in the report returned by :meth:`Dispatcher.run` (the counters cover everything).
MAX_REPORT_ROWS = 1_000
#: Pauses before re-trying to record outcomes after a database error (then the claims are left to expire).
RECORD_RETRY_PAUSES_S = (0.05, 0.25, 1.0)
#: Longest a finished delivery waits to be recorded while the rest of its batch is still in flight.
MAX_RECORD_DELAY_S = 0.25
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
        )


@dataclasses.dataclass(frozen=True)
class _Claimed:
    id: int
    idempotency_key: str
    topic: str
    attempts: int
    payload: str


#: A finished row: its verdict, or None when the claim is given back undelivered.
_Finished = tuple[_Claimed, policy.Decision | None]


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise errors.ConfigurationError(f"dispatcher option {name}={value!r} must be an int >= {minimum}")
    return value


def _safety_ms(claim_ms: int) -> int:
    """Margin kept between a request's deadline and the claim's expiry (clock skew, recording time)."""
    return min(1_000, claim_ms // 10)


def claim_statement(
    dialect_name: str, *, token: str, limit: int, claim_ms: int, topics: Collection[str] | None = None
) -> sa.Update:
    """The claim as one statement: lock up to ``limit`` due rows (of ``topics`` only, when given), stamp
    ``token`` and an expiry, count the attempt, and return ``(id, idempotency_key, topic, attempts,
    payload as text)``.

    The payload comes back as text (``jsonb::text`` on PostgreSQL) and is sent as-is: decoding it to
    Python only to encode it again would cost time and could change it.
    """
    t = outbox_table
    due = sa.select(t.c.id).where(outbox.due_clause())
    if topics is not None:
        due = due.where(t.c.topic.in_(sorted(topics)))
    due = due.order_by(t.c.next_attempt_at, t.c.id).limit(limit)
    payload: sa.ColumnElement[Any]
    if dialect_name == "postgresql":
        # A locking CTE is evaluated exactly once; rows another dispatcher holds are skipped.
        locked = due.with_for_update(skip_locked=True).cte("due")
        stmt = sa.update(t).where(t.c.id == locked.c.id)
        payload = sa.cast(t.c.payload, sa.Text())
    else:
        # SQLite: the engine's BEGIN IMMEDIATE already serializes claimers.
        stmt = sa.update(t).where(t.c.id.in_(due.scalar_subquery()))
        payload = sa.type_coerce(t.c.payload, sa.Text())
    return stmt.values(
        claim_token=token,
        claim_expires_at=db_now_plus_ms(sa.literal(claim_ms, sa.BigInteger())),
        attempts=t.c.attempts + 1,
        updated_at=db_now(),
    ).returning(t.c.id, t.c.idempotency_key, t.c.topic, t.c.attempts, payload)


# -- a total deadline per request ------------------------------------------------------------------------
#
# httpx's timeouts apply per phase and per socket operation: a downstream answering one byte every 0.1 s
# never trips a 1 s read timeout. The dispatcher's own client therefore runs on a network backend whose
# every connect, read and write is bounded by the time left until the current request's deadline (kept
# per thread, since each delivery runs on one thread).

_deadline = threading.local()


def _bounded(timeout: float | None, timeout_error: type[Exception]) -> float | None:
    deadline: float | None = getattr(_deadline, "at", None)
    if deadline is None:
        return timeout
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise timeout_error("the request's total deadline passed (route timeout_s, bounded by the claim)")
    return remaining if timeout is None else min(timeout, remaining)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, bounded))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_tcp(host, port, bounded, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_unix_socket(path, bounded, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _DeadlineTransport(httpx.HTTPTransport):
    """httpx's own transport (TLS, pooling, keep-alive) on the deadline-bounded network backend."""

    def __init__(self, limits: httpx.Limits) -> None:
        super().__init__(limits=limits)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_DeadlineBackend(),
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
            deadline at the socket level; with a client of yours the deadline is checked between body
            chunks and caps each phase's timeout, but a downstream that dribbles its headers is bounded
            only by your client's own timeouts.

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
    ) -> None:
        self.engine = engine
        self.max_attempts = _positive_int("max_attempts", max_attempts)
        self.claim_ms = _positive_int("claim_ms", claim_ms, 100)
        self.concurrency = _positive_int("concurrency", concurrency)
        self.backoff_base_ms = _positive_int("backoff_base_ms", backoff_base_ms)
        self.backoff_max_ms = _positive_int("backoff_max_ms", backoff_max_ms, backoff_base_ms)
        if not isinstance(routes, Mapping):
            raise errors.ConfigurationError("routes must be a mapping of topic → Route")
        self.routes: dict[str, Route] = {}
        self._headers: dict[str, dict[str, str]] = {}
        self._timeouts: dict[str, httpx.Timeout] = {}
        for topic, route in routes.items():
            if not isinstance(route, Route):
                raise errors.ConfigurationError(
                    f"route for topic {topic!r} must be a Route, got {type(route).__name__}"
                )
            self.routes[topic] = route
            self._headers[topic] = {**route.resolve_headers(), "Content-Type": "application/json"}
            self._timeouts[topic] = route.timeout
        self.topics: frozenset[str] = frozenset(self.routes)
        longest_ms = max((int(r.timeout_s * 1000) for r in self.routes.values()), default=0)
        if longest_ms + _safety_ms(self.claim_ms) >= self.claim_ms:
            raise errors.ConfigurationError(
                f"claim_ms={self.claim_ms} must exceed the longest route timeout ({longest_ms} ms) plus a "
                f"{_safety_ms(self.claim_ms)} ms margin, or a slow delivery could outlive its claim and "
                "overlap with another dispatcher's; raise claim_ms or lower timeout_s"
            )
        self._owns_client = client is None
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        self._client = client or httpx.Client(
            follow_redirects=False,
            limits=limits,
            timeout=httpx.Timeout(10.0),
            transport=_DeadlineTransport(limits),
        )
        self._pool = (
            ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="joblease-dispatch")
            if self.concurrency > 1
            else None
        )
        self._record_delay_s = min(MAX_RECORD_DELAY_S, _safety_ms(self.claim_ms) / 2000)
        self._stop = threading.Event()
        self._rng = random.Random()
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for in-flight deliveries, then release the thread pool and (if ours) the HTTP client."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- one batch ---------------------------------------------------------------------------------

    def dispatch(self, limit: int = 100) -> DispatchReport:
        """Claim up to ``limit`` due rows of the routed topics, deliver them, record every outcome."""
        limit = _positive_int("limit", limit)
        if self._closed:
            raise errors.DispatchError("this dispatcher is closed; create a new one")
        if not self.routes:
            return DispatchReport()
        token = secrets.token_hex(16)
        started = time.monotonic()
        rows = self._claim(token, limit)
        report = DispatchReport(claimed=len(rows))
        if not rows:
            return report
        deadline = started + self.claim_ms / 1000.0
        finished: list[_Finished] = []
        flushed_at = time.monotonic()
        if self._pool is None or len(rows) == 1:
            for row in rows:
                finished.append((row, self._deliver(row, deadline)))
                if time.monotonic() - flushed_at >= self._record_delay_s:
                    self._record(token, finished, report)
                    finished, flushed_at = [], time.monotonic()
        else:
            futures: dict[Future[policy.Decision | None], _Claimed] = {
                self._pool.submit(self._deliver, row, deadline): row for row in rows
            }
            waiting = set(futures)
            while waiting:
                timeout = max(0.0, flushed_at + self._record_delay_s - time.monotonic()) if finished else None
                done, waiting = wait(waiting, timeout=timeout, return_when=FIRST_COMPLETED)
                finished.extend((futures[f], f.result()) for f in done)
                if finished and (not waiting or time.monotonic() - flushed_at >= self._record_delay_s):
                    self._record(token, finished, report)
                    finished, flushed_at = [], time.monotonic()
        if finished:
            self._record(token, finished, report)
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

    def _claim(self, token: str, limit: int) -> list[_Claimed]:
        with translate_errors("claim outbox rows"), self.engine.begin() as conn:
            stmt = claim_statement(
                conn.dialect.name, token=token, limit=limit, claim_ms=self.claim_ms, topics=self.topics
            )
            rows = [_Claimed(*r) for r in conn.execute(stmt)]
        rows.sort(key=lambda r: r.id)
        return rows

    def _deliver(self, row: _Claimed, claim_deadline: float) -> policy.Decision | None:
        """POST one row and judge the answer (no database work here); None: give the claim back."""
        route = self.routes.get(row.topic)
        now = time.monotonic()
        ends = claim_deadline - _safety_ms(self.claim_ms) / 1000
        if route is None or self._stop.is_set() or now + route.timeout_s > ends:
            return None
        _deadline.at = now + route.timeout_s
        try:
            classification = self._post(row, route, _deadline.at)
        except Exception as exc:  # any failure to get a response is judged, never allowed to stop the batch
            classification = policy.classify_exception(exc)
        finally:
            _deadline.at = None
        return policy.decide(
            classification,
            attempts=row.attempts,
            max_attempts=self.max_attempts,
            base_ms=self.backoff_base_ms,
            max_ms=self.backoff_max_ms,
            rng=self._rng,
        )

    def _post(self, row: _Claimed, route: Route, deadline: float) -> policy.Classification:
        headers = {**self._headers[row.topic], "Idempotency-Key": row.idempotency_key}
        request = self._client.build_request(
            "POST",
            route.url,
            content=row.payload.encode("utf-8"),
            headers=headers,
            timeout=self._timeouts[row.topic],
        )
        response = self._client.send(request, stream=True, follow_redirects=False)
        try:
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) >= MAX_BODY_READ:
                    break
                if time.monotonic() >= deadline:
                    raise httpx.ReadTimeout("the request's total deadline passed", request=request)
        finally:
            response.close()
        return policy.classify_response(response, body[:MAX_BODY_READ].decode("utf-8", "replace"))

    # -- recording outcomes ------------------------------------------------------------------------

    def _record(self, token: str, finished: list[_Finished], report: DispatchReport) -> None:
        """Store the outcomes of ``finished`` rows in one transaction and count them into ``report``."""
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
                self._count(row, decision, report)

    @staticmethod
    def _count(row: _Claimed, decision: policy.Decision, report: DispatchReport) -> None:
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
            logger.warning(
                "outbox row %d (key %s, topic %s) is DEAD: %s",
                row.id,
                row.idempotency_key,
                row.topic,
                decision.reason,
                extra={"action": "outbox_dead"},
            )

    def _statements(self, token: str, finished: list[_Finished]) -> list[tuple[sa.Executable, bool]]:
        """The fenced UPDATEs for ``finished``: ``(statement, returns ids)``. Sent rows with one status
        code share one statement (the usual case: the whole group in one); retries, dead rows and
        released claims carry their own values."""
        t = outbox_table
        fence = (t.c.claim_token == token, t.c.status == outbox.OutboxStatus.PENDING.value)
        cleared = {"claim_token": None, "claim_expires_at": None, "updated_at": db_now()}
        sent: dict[int | None, list[int]] = {}
        statements: list[tuple[sa.Executable, bool]] = []
        released: list[int] = []
        for row, decision in finished:
            if decision is None:
                released.append(row.id)
            elif decision.outcome is policy.Outcome.SENT:
                sent.setdefault(decision.status_code, []).append(row.id)
            else:
                values: dict[str, Any] = {**cleared, "last_status": decision.status_code}
                if decision.outcome is policy.Outcome.RETRY:
                    values.update(
                        next_attempt_at=db_now_plus_ms(sa.literal(decision.delay_ms, sa.BigInteger())),
                        last_error=decision.reason,
                    )
                else:
                    values.update(status=outbox.OutboxStatus.DEAD.value, last_error=decision.reason)
                stmt = sa.update(t).where(t.c.id == row.id, *fence).values(**values).returning(t.c.id)
                statements.append((stmt, True))
        for status_code, ids in sent.items():
            stmt = (
                sa.update(t)
                .where(t.c.id.in_(ids), *fence)
                .values(
                    **cleared,
                    last_status=status_code,
                    status=outbox.OutboxStatus.SENT.value,
                    sent_at=db_now(),
                    last_error=None,
                )
                .returning(t.c.id)
            )
            statements.append((stmt, True))
        if released:
            # Given back undelivered: the attempt the claim counted is taken back too.
            give_back = sa.update(t).where(t.c.id.in_(released), *fence)
            statements.append((give_back.values(**cleared, attempts=t.c.attempts - 1), False))
        return statements

    def _write_with_retry(self, token: str, finished: list[_Finished]) -> set[int]:
        """Run the fenced UPDATEs in one transaction; returns the ids they matched. A dropped connection
        gets a few quick retries on a fresh one.

        The outcomes are already known (the downstream answered), so losing them to a brief database
        hiccup would mean needless re-deliveries once the claims expire. Retrying is safe: every write is
        fenced by the claim token.
        """
        statements = self._statements(token, finished)
        retries = 0
        while True:
            try:
                matched: set[int] = set()
                with translate_errors("record delivery outcomes"), self.engine.begin() as conn:
                    for stmt, returns_ids in statements:
                        result = conn.execute(stmt)
                        if returns_ids:
                            matched.update(result.scalars())
                return matched
            except errors.StorageError as exc:
                if retries == len(RECORD_RETRY_PAUSES_S) or self._stop.is_set():
                    raise
                logger.info(
                    "retrying an outcome write after a database error: %s",
                    exc,
                    extra={"action": "outbox_record_retry"},
                )
                time.sleep(RECORD_RETRY_PAUSES_S[retries])
                retries += 1

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
        if (
            isinstance(poll_interval_s, bool)
            or not isinstance(poll_interval_s, int | float)
            or poll_interval_s < 0
        ):
            raise errors.ConfigurationError(f"poll_interval_s={poll_interval_s!r} must be a number >= 0")
        if max_batches is not None:
            _positive_int("max_batches", max_batches)
        limit = _positive_int("limit", limit)
        self._stop = stop if stop is not None else threading.Event()
        previous = self._install_signal_handlers()
        totals = DispatchReport()
        batches = 0
        try:
            while not self._stop.is_set() and (max_batches is None or batches < max_batches):
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
                    self._stop.wait(max(poll_interval_s, 0.05))
                    continue
                totals = totals.merge(report)
                del totals.rows[:-MAX_REPORT_ROWS]
                if on_report is not None and report.claimed:
                    on_report(report)
                if report.claimed < limit:
                    self._stop.wait(poll_interval_s)
        finally:
            self._restore_signal_handlers(previous)
            # A later dispatch() must not inherit this run's stop request.
            self._stop = threading.Event()
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
        stop = self._stop

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
