"""The delivery of one claimed row (no database work, save a pause a downstream asks for): may it start
now (:mod:`decisions`), its transport's send, the answer judged (:mod:`policy`), and the workers that run
deliveries beside the batch loop."""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import sqlalchemy as sa

from dagster_joblease import errors, tracing
from dagster_joblease.dispatch import decisions, policy
from dagster_joblease.dispatch.claims import Claimed
from dagster_joblease.dispatch.pauses import Pauses
from dagster_joblease.dispatch.recorder import pause_reason
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.dispatch.transports import TooLate, Transport, message_of, open_transports
from dagster_joblease.dispatch.transports.http import HttpTransport
from dagster_joblease.storage import route_groups
from dagster_joblease.storage.engine import translate_errors

__all__ = ["Retrying", "Sender"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Retrying:
    """How failed attempts are retried: ``max_attempts`` before a retryable failure is ``DEAD``, the
    full-jitter backoff between ``backoff_base_ms`` and ``backoff_max_ms``, and ``max_deferrals``
    (``Retry-After`` pauses a row may meet before it counts as an attempt)."""

    max_attempts: int
    backoff_base_ms: int
    backoff_max_ms: int
    max_deferrals: int


class Sender:
    """Sends claimed rows for one dispatcher: its routes' transports, its workers (``pool``; None:
    inline), the retry policy, and the local pauses a downstream's ``Retry-After`` sets at once.
    ``send_s``: how long after its claim a row's request must have ended (the claim less a margin)."""

    def __init__(
        self,
        engine: sa.Engine,
        routes: dict[str, Route],
        retrying: Retrying,
        send_s: float,
        concurrency: int,
        client: httpx.Client | None,
        pauses: Pauses,
    ) -> None:
        self.engine = engine
        self.routes = routes
        self.retrying = retrying
        self.send_s = send_s
        self.pauses = pauses
        self.concurrency = concurrency
        headers = {topic: route.resolve_headers() for topic, route in routes.items()}
        self.transports: dict[str, Transport] = open_transports(routes, headers, concurrency, client)
        #: The HTTP transport's client (None: no HTTP route).
        self.client = next((t.client for t in self.transports.values() if isinstance(t, HttpTransport)), None)
        self.pool = (
            ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="joblease-dispatch")
            if concurrency > 1
            else None
        )
        self.stop = threading.Event()
        self._rng = random.Random()

    def close(self) -> None:
        """Wait for deliveries in flight, then release the workers and the transports."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for transport in set(self.transports.values()):
            transport.close()

    def deliver(self, row: Claimed) -> policy.Decision | None:
        """Send one row and judge the answer (no database work here); None: give the claim back."""
        route = self.routes.get(row.topic)
        if route is None or not self._waited_for_admission(row):
            return None
        now = time.monotonic()
        start = decisions.may_start(
            now=now,
            stopping=self.stop.is_set(),
            claim_ends_at=row.claimed_at + self.send_s,
            timeout_s=route.timeout_s,
            paused_until=self.pauses.until(str(route.limit_group)),
            age_at_claim_ms=row.age_at_claim_ms,
            claimed_at=row.claimed_at,
            window_s=route.dedupe_window_s,
        )
        if start is decisions.Start.GIVE_BACK:
            return None
        if start is decisions.Start.EXPIRED:
            # Checked here, at the moment of sending, not only at claim: a row may wait for a worker.
            reason = decisions.dedupe_window_reason(route.dedupe_window_s or 0.0)
            return policy.Decision(policy.Outcome.DEAD, None, reason, unsent=True)
        decision = self._send(row, route, now)
        if decision is not None and decision.outcome is policy.Outcome.SENT:
            waited = row.time_in_outbox_s(time.monotonic())
            if waited is not None:
                tracing.record_time_in_outbox(waited, row.topic)
        return decision

    def _send(self, row: Claimed, route: Route, now: float) -> policy.Decision | None:
        """The transport's send in a span, judged; None: it started too late for its rate admission."""
        transport = self.transports[row.topic]
        # Named only when a span is recorded (a callable: no per-row work while nothing is traced).
        where = functools.partial(route.span_destination, row.topic, row.ordering_key)
        with tracing.sending(
            row.topic, row.idempotency_key, row.trace, system=route.transport, destination=where
        ) as span:
            try:
                classification = transport.send(message_of(row), route, now + route.timeout_s, row.send_by)
            except TooLate:
                span.outcome("given back", "started too late for its rate admission")
                return None  # sending now could burst
            except Exception as exc:  # any failure to get an acknowledgement is judged, never stops the batch
                classification = transport.classify_exception(exc)
            decision = self._decide(row, route, classification)
            span.outcome(decision.outcome.value, decision.reason)
        return decision

    def _decide(self, row: Claimed, route: Route, classification: policy.Classification) -> policy.Decision:
        """Judge one attempt's classification; a pause it asks for is written at once."""
        r = self.retrying
        decision = policy.decide(
            classification,
            attempts=row.attempts,
            max_attempts=r.max_attempts,
            base_ms=r.backoff_base_ms,
            max_ms=r.backoff_max_ms,
            rng=self._rng,
            max_pause_ms=int(route.max_pause_s * 1000),
            deferrals=row.deferrals,
            max_deferrals=r.max_deferrals,
        )
        if decision.pause_ms:
            # This dispatcher's other threads hold off at once, and the pause is written now (not with the
            # batch's outcomes) so other dispatchers' next claims see it as soon as possible.
            group = str(route.limit_group)
            self.pauses.writing(group, time.monotonic() + decision.pause_ms / 1000)
            self._write_pause_now(group, row, decision)
            self.pauses.written(group)
        return decision

    def _waited_for_admission(self, row: Claimed) -> bool:
        """Wait until a rate-admitted row may start; False: the dispatcher was stopped meanwhile."""
        delay = 0.0 if row.not_before is None else row.not_before - time.monotonic()
        return not (delay > 0 and self.stop.wait(delay))

    def _write_pause_now(self, group: str, row: Claimed, decision: policy.Decision) -> None:
        """The one database write a delivery thread makes: a pause, in its own short transaction (the
        outcome's transaction writes it again; a failure here only delays the pause until then)."""
        assert decision.pause_ms is not None
        try:
            with translate_errors("record a route pause"), self.engine.begin() as conn:
                route_groups.record_pause(conn, group, decision.pause_ms, pause_reason(row, decision))
        except errors.StorageError as exc:
            logger.info("could not record a pause at once: %s", exc, extra={"action": "pause_deferred"})
