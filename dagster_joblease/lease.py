"""A PostgreSQL (or SQLite) lease with one live winner per logical run, fenced by a rotating owner token.

State machine of a row: ``RUNNING → SUCCESS | FAIL``; ``FAIL → RUNNING`` (reclaim); a ``RUNNING`` row
whose ``expires_at`` has passed on the *database* clock ``→ RUNNING`` (reclaim by another worker).
``SUCCESS`` is never reclaimed. Every claim rotates ``owner_token`` and increments ``attempt`` (a fencing
number); heartbeat, complete, fail and release only touch the row while the caller's token is current.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import logging
import os
import secrets
import socket
import threading
import traceback
import unicodedata
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, Generic, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from dagster_joblease import errors, identity, options
from dagster_joblease.storage.autocommit import AutocommitConnections, autocommit_connections
from dagster_joblease.storage.clock import db_now, db_now_plus_ms, ms_until
from dagster_joblease.storage.engine import fork_safe, is_psycopg, translate_errors
from dagster_joblease.storage.schema import lease_table

__all__ = [
    "AcquireResult",
    "ExclusiveOutcome",
    "Lease",
    "LeaseService",
    "LeaseStatus",
    "NotAcquiredReason",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_ERROR_CHARS = 4_000
RELEASED_ERROR = "released by its holder before finishing"


class LeaseStatus(enum.StrEnum):
    RUNNING = "RUNNING"  #: held; reclaimable once expires_at passes on the database clock
    SUCCESS = "SUCCESS"  #: done for good; never reclaimed
    FAIL = "FAIL"  #: failed or released; the next acquire reclaims it


class NotAcquiredReason(enum.StrEnum):
    """Why an acquire did not win."""

    HELD = "held by a live lease"
    SUCCEEDED = "already succeeded"
    CONTENDED = "lost a race for the same run"


def bound_error(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Error text as stored: at most ``limit`` characters, so one huge traceback cannot bloat the row."""
    if len(text) <= limit:
        return text
    # The marker's length depends on the number it reports; size it for the largest possible count.
    marker_len = len(f"… [{len(text)} chars cut]")
    kept = max(limit - marker_len, 0)
    return (text[:kept] + f"… [{len(text) - kept} chars cut]")[:limit]


MAX_HOLDER_CHARS = 255  #: the lease table's ``holder`` column


def _holder() -> str:
    return _holder_of(os.getpid())


@functools.cache
def _holder_of(pid: int) -> str:
    return f"{socket.gethostname()}:{pid}"[:MAX_HOLDER_CHARS]


def default_holder() -> str:
    """The holder label of a claim made without one: ``host:pid`` of the claiming process."""
    return _holder()


def validate_holder(value: object) -> str:
    """A holder label as stored: 1-255 characters, no control characters (it shows in CLI tables)."""
    if not isinstance(value, str):
        raise errors.InvalidLeaseOptionsError("holder", value, f"must be a str, got {type(value).__name__}")
    if not 0 < len(value) <= MAX_HOLDER_CHARS or value != value.strip():
        raise errors.InvalidLeaseOptionsError(
            "holder",
            value,
            f"must be 1-{MAX_HOLDER_CHARS} characters without surrounding whitespace; shorten it",
        )
    if any(unicodedata.category(ch) == "Cc" for ch in value):
        raise errors.InvalidLeaseOptionsError(
            "holder", value, "must not contain control characters; use a printable label such as host:pid"
        )
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class Lease:
    """A claim on a logical run. ``owner_token`` fences; ``attempt`` is the fencing number.

    ``lost`` becomes true as soon as this process learns (by a heartbeat or a fenced write) that another
    worker owns the run now.
    """

    id: int
    identity: identity.JobIdentity
    owner_token: str
    attempt: int
    lease_ms: int
    expires_at: datetime
    previous_error: str | None = None
    # A one-way flag the heartbeat thread raises (a list, so the frozen lease can carry it; cheaper to
    # make than a threading.Event on every claim).
    _lost: list[bool] = dataclasses.field(default_factory=list, repr=False)

    @property
    def idempotency_key(self) -> str:
        return self.identity.idempotency_key

    @property
    def reclaimed(self) -> bool:
        """True when an earlier attempt held this run (it failed, was released, or expired)."""
        return self.attempt > 1

    @property
    def lost(self) -> bool:
        return bool(self._lost)

    def ensure_held(self) -> None:
        """Raise :class:`LostLeaseError` if the lease is known to be lost; call it before an effect."""
        if self.lost:
            raise self._lost_error("continue under")

    def _lost_error(self, action: str) -> errors.LostLeaseError:
        return errors.LostLeaseError(
            lease_id=self.id, attempt=self.attempt, idempotency_key=self.idempotency_key, action=action
        )


def _claimed_lease(
    id: int,
    job: identity.JobIdentity,
    owner_token: str,
    attempt: int,
    lease_ms: int,
    expires_at: datetime,
    previous_error: str | None,
) -> Lease:
    """The lease of a claim just won, its fields as the database returned them, set without the frozen
    dataclass's per-field ``__init__`` (a fifth of the Python around a claim)."""
    lease = object.__new__(Lease)
    lease.__dict__.update(
        id=id,
        identity=job,
        owner_token=owner_token,
        attempt=attempt,
        lease_ms=lease_ms,
        expires_at=expires_at,
        previous_error=previous_error,
        _lost=[],
    )
    return lease


@dataclasses.dataclass(frozen=True)
class AcquireResult:
    """The outcome of an acquire: a lease, or the reason there is none."""

    lease: Lease | None
    reason: NotAcquiredReason | None = None

    @property
    def acquired(self) -> bool:
        return self.lease is not None

    @classmethod
    def _won(cls, lease: Lease) -> AcquireResult:
        result = object.__new__(cls)
        result.__dict__.update(lease=lease, reason=None)
        return result


#: The result of a refusal, one per reason (immutable, so every refusal for a reason can share it).
_REFUSED = {reason: AcquireResult(lease=None, reason=reason) for reason in NotAcquiredReason}


_REASONS = {
    LeaseStatus.SUCCESS.value: NotAcquiredReason.SUCCEEDED,
    LeaseStatus.RUNNING.value: NotAcquiredReason.HELD,
}

_RECLAIM_NOTE = " expired without finishing (worker died or stalled)"


def _text(value: str) -> Any:
    """A constant written into the SQL rather than bound: the claim sends only what varies per call."""
    assert "'" not in value
    return sa.literal_column(f"'{value}'", sa.String())


_RUNNING, _FAIL, _SUCCESS = (
    _text(s.value) for s in (LeaseStatus.RUNNING, LeaseStatus.FAIL, LeaseStatus.SUCCESS)
)
_ONE = sa.literal_column("1", sa.Integer())


def _claim_values(lease_ms: Any, heartbeat_ms: Any) -> dict[str, Any]:
    """Column → value of a fresh claim (attempt 1), all times from the database clock.

    The holder's own timing goes on the row (``lease_ms``, ``heartbeat_ms``): whoever judges the holder
    later measures it against these, not its own settings (see :mod:`dagster_joblease.staleness`).
    """
    return {
        "lock_key": sa.bindparam("p_lock_key", type_=sa.String()),
        "job_type": sa.bindparam("p_job_type", type_=sa.String()),
        "code": sa.bindparam("p_code", type_=sa.String()),
        "run_key": sa.bindparam("p_run_key", type_=sa.String()),
        "status": _RUNNING,
        "owner_token": sa.bindparam("p_owner_token", type_=sa.String()),
        "attempt": _ONE,
        "lease_ms": lease_ms,
        "heartbeat_ms": heartbeat_ms,
        "holder": sa.bindparam("p_holder", type_=sa.String()),
        "created_at": db_now(),
        "acquired_at": db_now(),
        "heartbeat_at": db_now(),
        "expires_at": db_now_plus_ms(lease_ms),
    }


def _reclaim_values(owner_token: Any, holder: Any, lease_ms: Any, heartbeat_ms: Any) -> dict[str, Any]:
    """Column → value of a reclaim: a new token, the next attempt, fresh times from the database clock."""
    t = lease_table
    return {
        "status": _RUNNING,
        "owner_token": owner_token,
        "attempt": t.c.attempt + _ONE,
        "lease_ms": lease_ms,
        "heartbeat_ms": heartbeat_ms,
        "holder": holder,
        "acquired_at": db_now(),
        "heartbeat_at": db_now(),
        "expires_at": db_now_plus_ms(lease_ms),
        "finished_at": sa.null(),
        "result": sa.null(),  # SQL NULL, not the JSON literal null that None would become
        # Keep the previous attempt's error; say so when it simply stopped heartbeating.
        "last_error": sa.case(
            (
                t.c.status == _RUNNING,
                _text("attempt ") + sa.cast(t.c.attempt, sa.String) + _text(_RECLAIM_NOTE),
            ),
            else_=t.c.last_error,
        ),
    }


def _reclaimable() -> Any:
    """A FAIL row, or a RUNNING row whose lease has expired on the database clock."""
    t = lease_table
    return sa.or_(t.c.status == _FAIL, sa.and_(t.c.status == _RUNNING, t.c.expires_at < db_now()))


_HEARTBEAT_MS = sa.bindparam("p_heartbeat_ms", type_=sa.BigInteger())
_RETURNED = (lease_table.c.id, lease_table.c.attempt, lease_table.c.expires_at, lease_table.c.last_error)
#: What a fresh insert returns: its attempt is 1 and it has no previous error, so only these vary.
_INSERTED = (lease_table.c.id, lease_table.c.expires_at)


@functools.cache
def acquire_statement(dialect_name: str) -> Any:
    """The one-statement claim, built once per dialect (SQLAlchemy then reuses its compiled form).

    ``INSERT … ON CONFLICT (lock_key) DO UPDATE … WHERE status = 'FAIL' OR (status = 'RUNNING' AND
    expires_at < db now) RETURNING …``, with bound parameters ``p_lock_key``, ``p_job_type``, ``p_code``,
    ``p_run_key``, ``p_owner_token``, ``p_lease_ms``, ``p_heartbeat_ms`` and ``p_holder``. SQLite (and
    PostgreSQL without psycopg) claims with it; PostgreSQL with psycopg uses :func:`insert_claim_statement`
    first.
    """
    t = lease_table
    insert = (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(t)
    lease_ms = sa.bindparam("p_lease_ms", type_=sa.BigInteger())
    stmt = insert.values(**_claim_values(lease_ms, _HEARTBEAT_MS))
    update = stmt.on_conflict_do_update(
        index_elements=[t.c.lock_key],
        set_=_reclaim_values(stmt.excluded.owner_token, stmt.excluded.holder, lease_ms, _HEARTBEAT_MS),
        where=_reclaimable(),
    )
    return update.returning(*_RETURNED)


@functools.cache
def insert_claim_statement() -> Any:
    """PostgreSQL, first step of a claim: ``INSERT … ON CONFLICT (lock_key) DO NOTHING RETURNING id,
    expires_at`` (a row it returns is a new one: attempt 1, no previous error).

    A run claimed for the first time (the common case: every partition, every tick) costs what a bare
    insert costs: no read before it and no row lock, and a conflict is found through the unique index
    without taking a transaction id. Measured against one statement that also reclaims or reports on a
    conflict (a data-modifying CTE, or a PL/pgSQL function), this is 5-15% faster on a first claim;
    a conflict then costs a second round trip (:func:`reclaim_or_status_statement`), and stays cheaper
    than the bare ``ON CONFLICT DO UPDATE`` that locks the row even to refuse it.
    """
    t = lease_table
    lease_ms = sa.bindparam("p_lease_ms", type_=sa.BigInteger())
    insert = postgresql.insert(t).values(**_claim_values(lease_ms, _HEARTBEAT_MS))
    return insert.on_conflict_do_nothing(index_elements=[t.c.lock_key]).returning(*_INSERTED)


@functools.cache
def reclaim_or_status_statement() -> Any:
    """PostgreSQL, second step of a claim whose insert met an existing row: reclaim it if it is
    reclaimable, else report its status, in one statement.

    ``UPDATE … WHERE lock_key = … AND <reclaimable>`` re-checks the row under its lock (READ COMMITTED
    re-evaluates the condition on the newest version), so two reclaimers still get exactly one winner.
    A refusal is a plain read: no row lock, no transaction id, no commit flush. Rows: a win returns
    ``(id, attempt, expires_at, last_error, NULL)``; a refusal returns ``(NULL, …, status)``, only for a
    row that is not reclaimable (a live holder, a success). No row means the row changed between the
    statements: it was deleted (purged) after the insert saw it, or the reclaim found it gone or taken
    while the statement's snapshot still shows it reclaimable (a purge's DELETE held its lock, then
    committed): the caller claims again (see :data:`CLAIM_ROUNDS`) rather than report a refusal that
    names nobody.
    """
    t = lease_table
    lease_ms = sa.bindparam("p_lease_ms", type_=sa.BigInteger())
    key = sa.bindparam("p_lock_key", type_=sa.String())
    values = _reclaim_values(
        sa.bindparam("p_owner_token", type_=sa.String()),
        sa.bindparam("p_holder", type_=sa.String()),
        lease_ms,
        _HEARTBEAT_MS,
    )
    reclaimed = (
        sa.update(t).where(t.c.lock_key == key, _reclaimable()).values(**values).returning(*_RETURNED)
    ).cte("reclaimed")
    won = sa.select(
        reclaimed.c.id,
        reclaimed.c.attempt,
        reclaimed.c.expires_at,
        reclaimed.c.last_error,
        sa.cast(sa.null(), sa.String()).label("status"),
    )
    refused = sa.select(
        sa.cast(sa.null(), sa.BigInteger()),
        sa.cast(sa.null(), sa.Integer()),
        sa.cast(sa.null(), sa.DateTime(timezone=True)),
        sa.cast(sa.null(), sa.Text()),
        t.c.status,
    ).where(t.c.lock_key == key, ~_reclaimable(), ~sa.exists(sa.select(reclaimed.c.id)))
    return sa.union_all(won, refused)


#: The status of a row that refuses a claim (a live holder or a success); nothing for a reclaimable row.
_STATUS_OF = sa.select(lease_table.c.status).where(
    lease_table.c.lock_key == sa.bindparam("p_lock_key"), ~_reclaimable()
)

#: How many lock keys a service remembers having met an existing row for (then it forgets them all and
#: starts again): its next claim of such a key sends the reclaim-or-status statement first, so a repeated
#: refusal, or the reclaim of a run that failed, is one round trip instead of two (and burns no id of the
#: sequence). Only keys whose claim met a row go in: new keys, the common case, never evict them.
KNOWN_KEYS = 4096

#: How many times a claim starts again when the row changed between its statements (a purge deleted
#: it; the reclaim waited on a purge's lock and then found it gone). Each round is a new statement with a
#: new snapshot; only churn on one key that outlasts every round ends in ``CONTENDED``.
CLAIM_ROUNDS = 5


#: The positional parameters of the two claim statements as SQLAlchemy compiles them for psycopg:
#: :meth:`LeaseService._claim_psycopg` builds its argument tuples in this order.
_INSERT_ORDER = (
    "p_lock_key",
    "p_job_type",
    "p_code",
    "p_run_key",
    "p_owner_token",
    "p_lease_ms",
    "p_heartbeat_ms",
    "p_holder",
    "p_lease_ms",
)
_RECLAIM_ORDER = (
    "p_owner_token",
    "p_lease_ms",
    "p_heartbeat_ms",
    "p_holder",
    "p_lease_ms",
    "p_lock_key",
    "p_lock_key",
)


@dataclasses.dataclass(frozen=True)
class _CompiledClaim:
    """A claim statement compiled for psycopg with positional ``%s`` parameters, and their order."""

    sql: str
    order: tuple[str, ...]

    def args(self, params: dict[str, Any]) -> tuple[Any, ...]:
        return tuple([params[name] for name in self.order])


@functools.cache
def psycopg_claim_sql() -> tuple[_CompiledClaim, _CompiledClaim]:
    """:func:`insert_claim_statement` and :func:`reclaim_or_status_statement`, compiled once for psycopg.

    Compiled for a fresh psycopg dialect rather than each engine's, so engines built per run or per
    sensor tick do not each add a cache entry; positional parameters spare psycopg a mapping per call.
    """
    dialect = psycopg_dialect.dialect(paramstyle="format")  # type: ignore[no-untyped-call]
    compiled = []
    for statement, order in (
        (insert_claim_statement(), _INSERT_ORDER),
        (reclaim_or_status_statement(), _RECLAIM_ORDER),
    ):
        form = statement.compile(dialect=dialect)
        if tuple(form.positiontup or ()) != order:
            raise RuntimeError(f"claim SQL parameters {form.positiontup} are not in the order {order}")
        compiled.append(_CompiledClaim(str(form), order))
    return compiled[0], compiled[1]


# -- run_exclusive: the outcome and the heartbeat thread ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExclusiveOutcome(Generic[T]):
    """What :meth:`LeaseService.run_exclusive` did: ran ``fn`` (``acquired``) and its ``result``, or why
    it did not."""

    acquired: bool
    result: T | None = None
    reason: NotAcquiredReason | None = None
    lease: Lease | None = None

    @property
    def outcome(self) -> str:
        """``won``, ``reclaimed`` or ``skipped: <reason>``: the label shown in logs and the Dagster UI."""
        if self.lease is not None:
            return "reclaimed" if self.lease.reclaimed else "won"
        return f"skipped: {self.reason.value if self.reason else 'not acquired'}"


class _Heartbeat(threading.Thread):
    """Renews the lease every ``interval_ms`` until stopped or until the lease turns out to be lost."""

    def __init__(self, service: LeaseService, lease: Lease, interval_ms: int) -> None:
        super().__init__(name=f"joblease-heartbeat-{lease.id}", daemon=True)
        self._service = service
        self._lease = lease
        self._interval_s = interval_ms / 1000
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self._interval_s):
            try:
                self._service.heartbeat(self._lease)
            except errors.LostLeaseError:
                return  # heartbeat() has already marked the lease lost; the callback sees it at once
            except errors.StorageError as exc:
                # A transient database failure: keep trying; the lease only dies if renewals stay
                # impossible for the rest of its length, and then the next fenced write says so.
                logger.warning("heartbeat for lease %d failed: %s", self._lease.id, exc)
            except Exception:
                # Anything else (a bug, a misconfigured engine): a thread that died here would let the
                # lease expire silently while the work goes on. Say so loudly and keep renewing; if
                # renewals never succeed, the lease expires and the next fenced write raises.
                logger.exception("heartbeat for lease %d failed unexpectedly; still renewing", self._lease.id)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()


def _error_text(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()


class LeaseService:
    """Acquire, renew and finish leases on a SQLAlchemy engine (PostgreSQL or SQLite).

    Args:
        engine: an engine over a database migrated with :func:`dagster_joblease.migrate`.
        lease_ms: default lease length (15 minutes).
        heartbeat_ms: default renewal interval for :meth:`run_exclusive` (``min(60 s, lease_ms // 3)``).
        holder: the label recorded as the holder of leases this service takes (default ``host:pid`` of
            the claiming process); the Dagster layer records its run here.

    Example::

        service = LeaseService(create_engine("postgresql+psycopg://app@db/app"))
        outcome = service.run_exclusive(JobIdentity.schedule("daily-billing", "2026-11-29"), bill)
        if not outcome.acquired:
            print("skipped:", outcome.reason)
    """

    def __init__(
        self,
        engine: sa.Engine,
        *,
        lease_ms: int | None = None,
        heartbeat_ms: int | None = None,
        holder: str | None = None,
    ) -> None:
        self.engine = fork_safe(engine)  # a forked child never uses a connection of its parent
        self.timing = options.resolve_timing(lease_ms, heartbeat_ms)
        self.holder = None if holder is None else validate_holder(holder)
        #: Lock keys whose row this service has met (see :data:`KNOWN_KEYS`).
        self._known: set[str] = set()
        #: The engine claims last went to and its autocommit connections (None: not psycopg), looked up
        #: once per engine rather than per claim (the same object for the engine's lifetime: a dispose or
        #: a fork empties it in place).
        self._claim_path: tuple[sa.Engine, AutocommitConnections | None] | None = None

    @contextlib.contextmanager
    def _one_statement(self, action: str) -> Iterator[sa.Connection]:
        """A connection for self-contained statements (each one atomic on its own).

        On PostgreSQL they run in autocommit, so a claim or a heartbeat is one round trip instead of three
        (BEGIN, statement, COMMIT). SQLite keeps its ``BEGIN IMMEDIATE`` transaction (see storage.engine).
        """
        with translate_errors(action):
            if self.engine.dialect.name == "postgresql":
                with self.engine.connect() as conn:
                    yield conn.execution_options(isolation_level="AUTOCOMMIT")
            else:
                with self.engine.begin() as conn:
                    yield conn

    # -- acquire -----------------------------------------------------------------------------------

    def try_acquire(
        self,
        job: identity.JobIdentity,
        *,
        lease_ms: int | None = None,
        heartbeat_ms: int | None = None,
        holder: str | None = None,
    ) -> AcquireResult:
        """Claim or reclaim ``job``; on a loss, say why.

        ``holder`` overrides the service's holder label for this claim. The claim records the holder's
        lease length and heartbeat interval on the row (default: the service's; with only ``lease_ms``
        given, that length's default interval): others judge this holder stale by them. A caller that
        will not heartbeat records ``heartbeat_ms=0`` (judged by expiry only).
        """
        if not isinstance(job, identity.JobIdentity):
            raise errors.InvalidJobIdentityError("identity", job, "must be a JobIdentity")
        if lease_ms is None and heartbeat_ms is None:
            timing = self.timing
        else:
            timing = options.resolve_timing(lease_ms, heartbeat_ms, defaults=self.timing)
        length = timing.lease_ms
        label = validate_holder(holder) if holder is not None else self.holder or _holder()
        token = secrets.token_hex(16)
        engine = self.engine
        path = self._claim_path
        if path is None or path[0] is not engine:
            fast = is_psycopg(engine.dialect)
            path = self._claim_path = (engine, autocommit_connections(engine) if fast else None)
        connections = path[1]
        if connections is not None:
            row, current = self._claim_psycopg(connections, job, token, length, timing.heartbeat_ms, label)
        else:
            row, current = self._claim_generic(job, token, length, timing.heartbeat_ms, label)
        if row is None:
            reason = _REASONS.get(current or "", NotAcquiredReason.CONTENDED)
            if logger.isEnabledFor(logging.INFO):
                logger.info(
                    "lease not acquired for %s: %s", job, reason.value, extra={"action": "lease_skipped"}
                )
            return _REFUSED[reason]
        lease_id, attempt, expires_at, last_error = row
        lease = _claimed_lease(
            lease_id, job, token, attempt, length, expires_at, last_error if attempt > 1 else None
        )
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "lease %s for %s (attempt %d)",
                "reclaimed" if attempt > 1 else "acquired",
                job,
                attempt,
                extra={"action": "lease_reclaimed" if attempt > 1 else "lease_acquired"},
            )
        return AcquireResult._won(lease)

    def _claim_generic(
        self, job: identity.JobIdentity, token: str, lease_ms: int, heartbeat_ms: int, holder: str
    ) -> tuple[Any, str | None]:
        """The claim through SQLAlchemy (SQLite; PostgreSQL on another driver): :func:`acquire_statement`,
        then the status of a row it could not claim."""
        params = {
            "p_lock_key": job.idempotency_key,
            "p_job_type": job.type.value,
            "p_code": job.code,
            "p_run_key": job.run_key,
            "p_owner_token": token,
            "p_lease_ms": lease_ms,
            "p_heartbeat_ms": heartbeat_ms,
            "p_holder": holder,
        }
        current: str | None = None
        with self._one_statement("acquire a lease") as conn:
            for _ in range(CLAIM_ROUNDS):
                row = conn.execute(acquire_statement(conn.dialect.name), params).first()
                if row is not None:
                    return row, None
                current = conn.execute(_STATUS_OF, {"p_lock_key": job.idempotency_key}).scalar_one_or_none()
                if current is not None:
                    break  # a live holder or a success: the refusal names it
        return None, current

    def _claim_psycopg(
        self,
        connections: AutocommitConnections,
        job: identity.JobIdentity,
        token: str,
        lease_ms: int,
        heartbeat_ms: int,
        holder: str,
    ) -> tuple[Any, str | None]:
        """The claim on PostgreSQL with psycopg: prepared statements on an autocommit driver connection.

        Claims are the hot path (every worker, every tick, every partition), so they skip SQLAlchemy's
        per-execution and pool work (see :mod:`dagster_joblease.storage.autocommit`); the SQL is what
        SQLAlchemy compiles from :func:`insert_claim_statement` and :func:`reclaim_or_status_statement`.
        A first claim is one round trip; a claim that meets an existing row is two, or one when this
        service has met the key's row before (see :data:`KNOWN_KEYS`): then the reclaim-or-status
        statement goes first and the insert follows only if the row has gone. Either order is the same
        protocol (each statement is atomic and one winner per key holds for both), so a stale hint only
        costs the round trip it tried to save. Returns the claimed row (or None) and, when refused, the
        row's status (None: the row kept changing for :data:`CLAIM_ROUNDS` rounds).

        The per-call work around the two statements is spelled out (no context managers, positional
        argument tuples built in place): it was a third of the claim's client CPU.
        """
        insert, reclaim = psycopg_claim_sql()
        engine = self.engine
        try:
            handle = connections.acquire(engine)
        except BaseException:
            with translate_errors("acquire a lease"):
                raise
        key = job._key
        known = self._known
        won: Any = None
        status: str | None = None
        met = False
        try:
            cursor = handle.cursor
            exists = hinted = key in known
            for _ in range(CLAIM_ROUNDS):  # again only if the row changed between the two statements
                if not exists:
                    # The order of _INSERT_ORDER, then of _RECLAIM_ORDER (checked when compiled).
                    cursor.execute(
                        insert.sql,
                        (
                            key,
                            job.type.value,
                            job.code,
                            job.run_key,
                            token,
                            lease_ms,
                            heartbeat_ms,
                            holder,
                            lease_ms,
                        ),
                        prepare=True,
                    )
                    inserted = cursor.fetchone()
                    if inserted is not None:
                        won = (inserted[0], 1, inserted[1], None)
                        break  # a first claim: the common case, one round trip
                second = handle.second_cursor
                second.execute(
                    reclaim.sql, (token, lease_ms, heartbeat_ms, holder, lease_ms, key, key), prepare=True
                )
                found = second.fetchone()
                if found is not None:
                    met = True
                    if found[4] is None:
                        won = found[:4]
                    else:
                        status = str(found[4])
                    break
                exists = False  # no row under the key (purged, or gone under a purge's lock): insert
        except BaseException:
            connections.release(handle, discard=True)
            with translate_errors("acquire a lease"):
                raise
        connections.release(handle)
        if met != hinted:
            if hinted:
                known.discard(key)  # the row had gone
            else:
                if len(known) >= KNOWN_KEYS:
                    known.clear()
                known.add(key)  # the next claim of this key will likely meet this row again
        return won, status

    def acquire(
        self,
        job: identity.JobIdentity,
        *,
        lease_ms: int | None = None,
        heartbeat_ms: int | None = None,
        holder: str | None = None,
    ) -> Lease | None:
        """Claim or reclaim ``job``; ``None`` when another worker holds it or it already succeeded.

        The row records the service's heartbeat setting (or ``heartbeat_ms``): heartbeat at least that
        often, or pass ``heartbeat_ms=0`` to be judged by the lease's expiry only.
        """
        return self.try_acquire(job, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms, holder=holder).lease

    def fail_dead_holder(
        self,
        job: identity.JobIdentity,
        *,
        attempt: int,
        owner_token: str | None = None,
        stale_ms: int,
        reason: str,
    ) -> bool:
        """Take a dead holder's ``RUNNING`` lease away at once (``FAIL``), so the next acquire reclaims it.

        One statement, fenced on what the caller observed: the row must still be ``RUNNING`` at
        ``attempt`` (and ``owner_token``, when given) with a heartbeat older than ``stale_ms`` on the
        database clock. A holder that heartbeated in between, or a claim that moved on, keeps its lease;
        a surviving holder that stopped heartbeating is fenced out (its writes raise
        :class:`LostLeaseError`). The caller decides that the holder is dead (e.g. its Dagster run is
        finished); returns True when this call failed the lease.
        """
        if not isinstance(job, identity.JobIdentity):
            raise errors.InvalidJobIdentityError("identity", job, "must be a JobIdentity")
        for name, value in (("attempt", attempt), ("stale_ms", stale_ms)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise errors.InvalidLeaseOptionsError(
                    name, value, "must be a positive int (the attempt read from the row; milliseconds)"
                )
        t = lease_table
        conditions = [
            t.c.lock_key == job.idempotency_key,
            t.c.status == LeaseStatus.RUNNING.value,
            t.c.attempt == attempt,
            t.c.heartbeat_at < db_now_plus_ms(sa.literal(-stale_ms, sa.BigInteger())),
        ]
        if owner_token is not None:
            conditions.append(t.c.owner_token == owner_token)
        stmt = (
            sa.update(t)
            .where(*conditions)
            .values(status=LeaseStatus.FAIL.value, finished_at=db_now(), last_error=bound_error(reason))
            .returning(t.c.id)
        )
        with self._one_statement("fail a dead holder's lease") as conn:
            row = conn.execute(stmt).first()
        if row is not None:
            logger.warning(
                "lease %d for %s (attempt %d) taken from a dead holder: %s",
                row.id,
                job,
                attempt,
                reason,
                extra={"action": "lease_dead_holder"},
            )
        return row is not None

    # -- fenced writes -----------------------------------------------------------------------------

    def _fenced_update(self, lease: Lease, action: str, values: dict[str, Any]) -> sa.Row[Any]:
        t = lease_table
        stmt = (
            sa.update(t)
            .where(
                t.c.id == lease.id,
                t.c.owner_token == lease.owner_token,
                t.c.status == LeaseStatus.RUNNING.value,
            )
            .values(**values)
            .returning(t.c.expires_at)
        )
        with self._one_statement(f"{action} a lease") as conn:
            row = conn.execute(stmt).first()
        if row is None:
            lease._lost.append(True)
            logger.warning("lease %d lost on %s", lease.id, action, extra={"action": "lease_lost"})
            raise lease._lost_error(action)
        return row

    def assert_held(self, connection: sa.Connection, lease: Lease) -> None:
        """Inside ``connection``'s transaction, make sure ``lease`` is still this worker's live lease.

        This fences the caller's own writes (domain rows, the outbox row), not just ours: on PostgreSQL the
        lease row stays locked (``FOR UPDATE``) until the transaction ends, so no reclaim can slip in
        between this check and the commit; SQLite's ``BEGIN IMMEDIATE`` already holds the write lock. A
        lease that was reclaimed, finished or expired raises :class:`LostLeaseError`, and the caller's
        transaction rolls back with it.
        """
        t = lease_table
        stmt = sa.select(t.c.id).where(
            t.c.id == lease.id,
            t.c.owner_token == lease.owner_token,
            t.c.status == LeaseStatus.RUNNING.value,
            t.c.expires_at > db_now(),
        )
        if connection.dialect.name == "postgresql":
            stmt = stmt.with_for_update()
        with translate_errors("check a lease"):
            row = connection.execute(stmt).first()
        if row is None:
            lease._lost.append(True)
            raise lease._lost_error("commit a fenced transaction under")

    @contextlib.contextmanager
    def fenced_transaction(self, lease: Lease) -> Iterator[sa.Connection]:
        """One transaction that commits only while ``lease`` is still ours (see :meth:`assert_held`).

        Write the domain change and its outbox row here: either both commit under a live lease, or
        neither does.
        """
        lease.ensure_held()
        with self.engine.begin() as connection:
            self.assert_held(connection, lease)
            yield connection

    def heartbeat(self, lease: Lease) -> datetime:
        """Extend the lease by its own length from the database's now; returns the new expiry."""
        row = self._fenced_update(
            lease,
            "heartbeat",
            {"heartbeat_at": db_now(), "expires_at": db_now_plus_ms(lease_table.c.lease_ms)},
        )
        expires_at: datetime = row.expires_at
        return expires_at

    def complete(self, lease: Lease, data: Any = None) -> None:
        """Mark the run ``SUCCESS`` (never reclaimed again); ``data`` is stored as JSON."""
        if data is not None:
            try:
                json.dumps(data, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise errors.InvalidPayloadError(
                    "result data", f"must be JSON-serializable ({exc})"
                ) from None
        self._fenced_update(
            lease,
            "complete",
            {
                "status": LeaseStatus.SUCCESS.value,
                "finished_at": db_now(),
                "result": sa.null() if data is None else data,
                "last_error": None,
            },
        )

    def fail(self, lease: Lease, error: str | BaseException) -> None:
        """Mark the run ``FAIL`` with bounded error text; the next acquire retries it with the same key."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._fenced_update(
            lease,
            "fail",
            {"status": LeaseStatus.FAIL.value, "finished_at": db_now(), "last_error": bound_error(text)},
        )

    def release(self, lease: Lease, reason: str = RELEASED_ERROR) -> None:
        """Give the run back unfinished (``FAIL``, reason: released) so a later acquire may retry it."""
        self._fenced_update(
            lease,
            "release",
            {"status": LeaseStatus.FAIL.value, "finished_at": db_now(), "last_error": bound_error(reason)},
        )

    def remaining_ms(self, lease: Lease) -> int | None:
        """Milliseconds left on the database clock, or ``None`` if this lease is no longer current."""
        t = lease_table
        with translate_errors("read a lease"), self.engine.connect() as conn:
            value: int | None = conn.execute(
                sa.select(ms_until(t.c.expires_at)).where(
                    t.c.id == lease.id, t.c.owner_token == lease.owner_token, t.c.status == "RUNNING"
                )
            ).scalar_one_or_none()
        return value

    # -- run_exclusive -----------------------------------------------------------------------------

    def run_exclusive(
        self,
        job: identity.JobIdentity,
        fn: Callable[[Lease], T],
        *,
        lease_ms: int | None = None,
        heartbeat_ms: int | None = None,
    ) -> ExclusiveOutcome[T]:
        """Run ``fn(lease)`` only if this worker wins the lease for ``job`` (the same as
        :func:`dagster_joblease.exclusive.run_exclusive`).

        A loser returns ``acquired=False`` with the reason and never calls ``fn``. The winner heartbeats from
        a background thread, so ``lease.lost`` turns true as soon as the lease is gone; then records
        ``SUCCESS`` (or ``FAIL`` with the error text, re-raising ``fn``'s exception). ``KeyboardInterrupt``,
        ``SystemExit`` and other interrupts (Dagster's run termination) release the lease instead of leaving
        it to expire. If the lease was lost, finalization raises :class:`LostLeaseError`: the effect may run
        again under the next owner, which the idempotency key lets the downstream deduplicate.
        """
        timing = options.resolve_timing(lease_ms, heartbeat_ms, defaults=self.timing)
        acquired = self.try_acquire(job, lease_ms=timing.lease_ms, heartbeat_ms=timing.heartbeat_ms)
        lease = acquired.lease
        if lease is None:
            return ExclusiveOutcome(acquired=False, reason=acquired.reason)

        heartbeat = _Heartbeat(self, lease, timing.heartbeat_ms) if timing.heartbeat_ms else None
        if heartbeat is not None:
            heartbeat.start()
        try:
            result = fn(lease)
        except Exception as exc:
            if heartbeat is not None:
                heartbeat.stop()
            try:
                self.fail(lease, _error_text(exc))
            except errors.LostLeaseError as lost:
                raise lost from exc
            except errors.StorageError as storage:
                # fn's own exception is the one the caller must see; the lease simply expires later.
                logger.warning("could not record the failure of lease %d: %s", lease.id, storage)
            raise
        except BaseException as exc:
            if heartbeat is not None:
                heartbeat.stop()
            try:
                self.release(lease, f"released: interrupted by {type(exc).__name__}")
            except errors.JobLeaseError as release_error:
                logger.warning("could not release lease %d on interrupt: %s", lease.id, release_error)
            raise
        if heartbeat is not None:
            heartbeat.stop()
        if lease.lost:
            raise lease._lost_error("complete")
        self.complete(lease)
        return ExclusiveOutcome(acquired=True, result=result, lease=lease)
