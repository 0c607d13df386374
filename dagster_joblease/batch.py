"""Batch leases: claim, renew, finish and fence a *set* of logical runs with a fixed number of statements.

A range run (a year of daily partitions in one Dagster run) needs one lease per key, and one statement
per key makes 365 keys cost 365 round trips, each with its own commit. The functions here give every key
exactly what :class:`~dagster_joblease.LeaseService` gives one key, with statements over the whole
set:

* :func:`claim_many` claims a set of identities: one multi-row ``INSERT … ON CONFLICT DO NOTHING
  RETURNING`` for the keys never claimed; for the keys that met a row, one ``UPDATE`` that reclaims the
  ``FAIL`` and expired ``RUNNING`` ones under row locks taken in key order, then one read that reports
  the rest (held by a live lease, or already succeeded, with the holder). Every won key gets its own new
  owner token and the next attempt number, so each :class:`~dagster_joblease.Lease` in the result
  is exactly what one ``try_acquire`` returns and works with every ``LeaseService`` method.
* :func:`heartbeat_many`, :func:`complete_many`, :func:`fail_many` and :func:`release_many` write the
  whole set with one statement each, fenced per key by its owner token, and report which keys were lost.
* :func:`fenced_transaction_many` opens one transaction that commits only while every lease of the set
  is still held (the set's rows locked in key order when it opens); a lost lease aborts it, and then
  every lease of the set is failed for a retry and reported lost (:class:`LostBatchLeaseError`).
* :class:`BatchHeartbeat` renews a set from a background thread.

The rules are the single lease's: times from the database clock, the same validation and error types.
Keys are always handled in the order of their lock key (the idempotency key), so two workers claiming
overlapping sets at once queue behind each other instead of deadlocking. PostgreSQL runs each claim or
write statement in autocommit (a claim of N new keys is one round trip, whatever N); SQLite runs the
whole call in one ``BEGIN IMMEDIATE`` transaction, which serializes writers (SQLite has no row locks).

The guarantee is the single lease's: one live holder per key at a time, fenced writes, and
at-least-once delivery with end-to-end deduplication by the idempotency key, never exactly-once.

Example: a year of daily partitions, claimed with one statement::

    year = [JobIdentity.schedule("daily-billing", f"2026-{d:%m-%d}") for d in days_of_2026]
    claim = claim_many(service, year)
    if claim.leases:
        with BatchHeartbeat(service, claim.leases):
            with fenced_transaction_many(service, claim.leases) as conn:
                conn.execute(...)  # one SQL statement over the won days
                enqueue_many(conn, [OutboxItem(x.idempotency_key, "billing", {"day": x.identity.run_key})
                                    for x in claim.leases])
        complete_many(service, claim.leases).raise_if_lost()
    for refused in claim.refused:
        print(refused.identity, refused.reason, refused.holder)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import threading
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from dagster_joblease import checks, errors, identity
from dagster_joblease import lease as _lease
from dagster_joblease.lease import Lease, LeaseService, LeaseStatus, NotAcquiredReason
from dagster_joblease.storage import driver, rowset
from dagster_joblease.storage import leases as store
from dagster_joblease.storage.engine import translate_errors

__all__ = [
    "MAX_BATCH_KEYS",
    "STATEMENT_KEYS",
    "BatchClaim",
    "BatchHeartbeat",
    "BatchWrite",
    "KeyClaim",
    "assert_held_many",
    "claim_many",
    "complete_many",
    "fail_many",
    "fenced_transaction_many",
    "heartbeat_many",
    "release_many",
]

logger = logging.getLogger(__name__)

#: The most identities (or leases) one call takes; split larger sets into several calls.
MAX_BATCH_KEYS = rowset.MAX_ROWS
#: Keys per statement: a larger call runs several statements, in key order (so still deadlock-free).
STATEMENT_KEYS = rowset.ROWS_PER_STATEMENT


# -- results -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KeyClaim:
    """The claim of one key of a batch: a lease, or why there is none and who has it.

    ``lease`` is set when this call won the key (``lease.reclaimed``: it took over a ``FAIL`` or expired
    attempt). Otherwise ``reason`` says why not (``HELD``: a live lease; ``SUCCEEDED``: done for good;
    ``CONTENDED``: lost a race to a concurrent claimer), and ``status``, ``holder``, ``attempt``,
    ``expires_at`` and ``heartbeat_age_ms`` describe the row as read (for ``SUCCEEDED``, ``holder`` is
    the winner). For a won key they describe the new lease (``holder`` is this claim's label).
    """

    identity: identity.JobIdentity
    lease: Lease | None
    reason: NotAcquiredReason | None = None
    status: LeaseStatus | None = None
    holder: str | None = None
    attempt: int | None = None
    expires_at: datetime | None = None
    heartbeat_age_ms: int | None = None

    @property
    def acquired(self) -> bool:
        return self.lease is not None

    @property
    def idempotency_key(self) -> str:
        return self.identity.idempotency_key


@dataclasses.dataclass(frozen=True)
class BatchClaim:
    """What :func:`claim_many` did, per key, in the order the identities were given."""

    claims: tuple[KeyClaim, ...]

    @property
    def leases(self) -> tuple[Lease, ...]:
        """The leases this call won (first claims and reclaims), in the given order."""
        return tuple(c.lease for c in self.claims if c.lease is not None)

    @property
    def refused(self) -> tuple[KeyClaim, ...]:
        """The keys not won (held, succeeded or contended), in the given order."""
        return tuple(c for c in self.claims if c.lease is None)

    def with_reason(self, reason: NotAcquiredReason) -> tuple[KeyClaim, ...]:
        return tuple(c for c in self.claims if c.reason is reason)

    def __getitem__(self, job: identity.JobIdentity | str) -> KeyClaim:
        """The claim of ``job`` (an identity or its idempotency key)."""
        key = job.idempotency_key if isinstance(job, identity.JobIdentity) else job
        for claim in self.claims:
            if claim.identity.idempotency_key == key:
                return claim
        raise KeyError(key)

    def __iter__(self) -> Iterator[KeyClaim]:
        return iter(self.claims)

    def __len__(self) -> int:
        return len(self.claims)


@dataclasses.dataclass(frozen=True)
class BatchWrite:
    """What a fenced set write did: the leases it wrote (``held``) and those no longer this worker's
    (``lost``: reclaimed by another worker, or already finished). Lost leases are marked lost
    (``lease.lost``, ``lease.ensure_held()`` raises). ``expires_at``: a heartbeat's new expiry per
    idempotency key of the renewed leases. A write over an empty set sends no statement."""

    action: str
    held: tuple[Lease, ...]
    lost: tuple[Lease, ...]
    expires_at: dict[str, datetime] = dataclasses.field(default_factory=dict)

    def raise_if_lost(self) -> None:
        """Raise :class:`LostBatchLeaseError` naming the first lost key, if any lease was lost."""
        if self.lost:
            first = self.lost[0]
            raise errors.LostBatchLeaseError(
                lease_id=first.id,
                attempt=first.attempt,
                idempotency_key=first.idempotency_key,
                action=self.action,
                lost_keys=tuple(x.idempotency_key for x in self.lost),
                keys=tuple(x.idempotency_key for x in (*self.held, *self.lost)),
            )


# -- validation ----------------------------------------------------------------------------------------


def _check_count(
    field: str, count: int, error: type[errors.JobLeaseError], value: object, *, empty: str | None
) -> None:
    if count == 0 and empty is not None:
        raise _invalid(error, field, value, empty)
    if count > MAX_BATCH_KEYS:
        raise _invalid(
            error,
            field,
            f"<{count} items>",
            f"holds {count} items; at most {MAX_BATCH_KEYS} are allowed per call, split the set",
        )


def _invalid(error: type[errors.JobLeaseError], field: str, value: object, rule: str) -> errors.JobLeaseError:
    if error is errors.InvalidJobIdentityError:
        return errors.InvalidJobIdentityError(field, value, rule)
    return errors.InvalidLeaseOptionsError(field, value, rule)


def _as_list(field: str, value: object, error: type[errors.JobLeaseError]) -> list[Any]:
    if isinstance(value, str | bytes | dict) or not isinstance(value, Iterable):
        raise _invalid(error, field, value, "must be a list (or another iterable) of items, not one item")
    return list(value)


def _check_identities(identities: object) -> list[identity.JobIdentity]:
    jobs = _as_list("identities", identities, errors.InvalidJobIdentityError)
    _check_count(
        "identities",
        len(jobs),
        errors.InvalidJobIdentityError,
        identities,
        empty="is empty; pass at least one identity",
    )
    seen: set[str] = set()
    for job in jobs:
        if not isinstance(job, identity.JobIdentity):
            raise errors.InvalidJobIdentityError(
                "identities", job, f"every item must be a JobIdentity, got {type(job).__name__}"
            )
        if job.idempotency_key in seen:
            raise errors.InvalidJobIdentityError(
                "identities", str(job), "appears twice in the set; pass each identity once"
            )
        seen.add(job.idempotency_key)
    return jobs


def _check_leases(leases: object, *, empty: str | None = None) -> list[Lease]:
    """The leases as a list: distinct :class:`Lease` objects, at most MAX_BATCH_KEYS; an empty set is
    refused with ``empty`` as the rule when given (else allowed: a write over nothing does nothing)."""
    items = _as_list("leases", leases, errors.InvalidLeaseOptionsError)
    _check_count("leases", len(items), errors.InvalidLeaseOptionsError, leases, empty=empty)
    seen: set[str] = set()
    for item in items:
        if not isinstance(item, Lease):
            raise errors.InvalidLeaseOptionsError(
                "leases",
                item,
                f"every item must be a Lease (from claim_many or acquire), got {type(item).__name__}",
            )
        if item.idempotency_key in seen:
            raise errors.InvalidLeaseOptionsError(
                "leases", str(item.identity), "appears twice in the set; pass each lease once"
            )
        seen.add(item.idempotency_key)
    return items


def _chunks(items: Sequence[Any]) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), STATEMENT_KEYS):
        yield items[start : start + STATEMENT_KEYS]


# -- claim ---------------------------------------------------------------------------------------------


def claim_many(
    service: LeaseService,
    identities: Iterable[identity.JobIdentity],
    *,
    lease_ms: int | None = None,
    heartbeat_ms: int | None = None,
    holder: str | None = None,
) -> BatchClaim:
    """Claim or reclaim every identity of the set; for each key, a lease or the reason there is none.

    Each key is claimed exactly as :meth:`LeaseService.try_acquire` claims it (new rows ``RUNNING`` at
    attempt 1; ``FAIL`` and expired ``RUNNING`` rows reclaimed at the next attempt with the previous
    error kept; ``SUCCESS`` never), with its own new owner token, all times from the database clock.
    Statements: one multi-row ``INSERT … ON CONFLICT DO NOTHING RETURNING`` for the set; when some keys
    met a row, one ``UPDATE`` reclaiming those that are reclaimable (row locks in key order), and one
    read reporting the rest. A row purged in between (or a key lost in a race to a concurrent claimer)
    is tried again, in as many rounds as a single claim (``storage.leases.CLAIM_ROUNDS``); a key still
    undecided is reported ``CONTENDED``. At most :data:`STATEMENT_KEYS` keys go in one statement; keys
    are processed in lock-key order, so overlapping sets claimed at once cannot deadlock.

    Args:
        service: the lease service (its engine, default ``lease_ms`` and holder label).
        identities: 1 to :data:`MAX_BATCH_KEYS` distinct :class:`JobIdentity` (any mix of types and
            codes); an empty set, a duplicate or a non-identity raises :class:`InvalidJobIdentityError`.
        lease_ms: the lease length for this claim (default: the service's).
        heartbeat_ms: the heartbeat interval recorded on the won rows, by which others judge the
            holder stale (default: the service's; with only ``lease_ms`` given, that length's default;
            0: judged by expiry only). Renew at least that often (:class:`BatchHeartbeat`).
        holder: the holder label recorded on the won rows (default: the service's, else ``host:pid``).

    Returns:
        a :class:`BatchClaim` with one :class:`KeyClaim` per identity, in the given order.
    """
    jobs = _check_identities(identities)
    timing, label = _lease.claim_terms(
        service.timing, service.holder, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms, holder_override=holder
    )
    tokens = {job.idempotency_key: secrets.token_hex(16) for job in jobs}
    found: dict[str, KeyClaim] = {}
    call = {"p_lease_ms": timing.lease_ms, "p_heartbeat_ms": timing.heartbeat_ms, "p_holder": label}
    with driver.statements(service.engine, "claim a batch of leases") as db:
        for chunk in _chunks(sorted(jobs, key=lambda job: job.idempotency_key)):
            _claim_chunk(db, list(chunk), tokens, call, timing.lease_ms, label, found)
    claims = tuple(found[job.idempotency_key] for job in jobs)
    logger.info(
        "batch claim of %d keys: %d won (%d reclaimed), %d held, %d succeeded, %d contended",
        len(claims),
        *claim_tally(claims),
        extra={"action": "lease_batch_claimed"},
    )
    return BatchClaim(claims=claims)


def claim_tally(claims: Iterable[KeyClaim]) -> tuple[int, int, int, int, int]:
    """How a claim went, as logged: keys won, of those reclaimed, then refused as held, succeeded and
    contended."""
    won = reclaimed = 0
    refused = dict.fromkeys(NotAcquiredReason, 0)
    for claim in claims:
        if claim.lease is not None:
            won += 1
            reclaimed += claim.lease.reclaimed
        elif claim.reason is not None:
            refused[claim.reason] += 1
    return (
        won,
        reclaimed,
        refused[NotAcquiredReason.HELD],
        refused[NotAcquiredReason.SUCCEEDED],
        refused[NotAcquiredReason.CONTENDED],
    )


def _claim_chunk(
    db: driver.Statements,
    chunk: list[identity.JobIdentity],
    tokens: dict[str, str],
    call: dict[str, Any],
    length: int,
    label: str,
    found: dict[str, KeyClaim],
) -> None:
    """Claim one statement's worth of keys (in key order) in up to ``store.CLAIM_ROUNDS`` rounds; a key still
    undecided after the last round is reported ``CONTENDED``."""
    pending = chunk
    for _ in range(store.CLAIM_ROUNDS):
        pending = _claim_round(db, pending, tokens, call, length, label, found)
        if not pending:
            return
    for job in pending:
        found[job.idempotency_key] = KeyClaim(identity=job, lease=None, reason=NotAcquiredReason.CONTENDED)


def _claim_round(
    db: driver.Statements,
    jobs: list[identity.JobIdentity],
    tokens: dict[str, str],
    call: dict[str, Any],
    length: int,
    label: str,
    found: dict[str, KeyClaim],
) -> list[identity.JobIdentity]:
    """One round over ``jobs`` (in key order): insert, reclaim, report. Fills ``found``; returns the
    keys to try again (their row vanished between two statements, or was taken in a race)."""
    by_key = {job.idempotency_key: job for job in jobs}
    rows = [(j.idempotency_key, j.type.value, j.code, j.run_key, tokens[j.idempotency_key]) for j in jobs]
    _record_won(found, by_key, store.claim_new_many(db, rows, call), tokens, length, label)
    met = _undecided(by_key, found)
    if met:
        _record_won(found, by_key, store.reclaim_many(db, met, tokens, call), tokens, length, label)
    rest = _undecided(met, found)
    if rest:
        for row in store.report_many(db, rest):
            refused = refused_claim(by_key[row[0]], row)
            if refused is not None:
                found[row[0]] = refused
    return [by_key[key] for key in _undecided(rest, found)]


def _undecided(keys: Iterable[str], found: dict[str, KeyClaim]) -> list[str]:
    return [key for key in keys if key not in found]


def _record_won(
    found: dict[str, KeyClaim],
    by_key: dict[str, identity.JobIdentity],
    rows: Iterable[Sequence[Any]],
    tokens: dict[str, str],
    length: int,
    label: str,
) -> None:
    for row in rows:
        found[row[0]] = won_claim(by_key[row[0]], row, tokens, length, label)


def won_claim(
    job: identity.JobIdentity, row: Sequence[Any], tokens: dict[str, str], length: int, label: str
) -> KeyClaim:
    """The claim of a key the insert or the reclaim won, from its returned row ``(lock_key, id, attempt,
    expires_at, last_error[, owner_token])``. A PostgreSQL reclaim returns the token the database made:
    it replaces the one in ``tokens``. The previous error is kept on a reclaim (attempt > 1) only."""
    key, lease_id, attempt, expires_at, last_error = row[:5]
    if len(row) > 5:
        tokens[key] = row[5]
    lease = Lease(
        id=lease_id,
        identity=job,
        owner_token=tokens[key],
        attempt=attempt,
        lease_ms=length,
        expires_at=expires_at,
        previous_error=last_error if attempt > 1 else None,
    )
    return KeyClaim(
        identity=job,
        lease=lease,
        status=LeaseStatus.RUNNING,
        holder=label,
        attempt=attempt,
        expires_at=expires_at,
        heartbeat_age_ms=0,
    )


def refused_claim(job: identity.JobIdentity, row: Sequence[Any]) -> KeyClaim | None:
    """The claim of a key neither statement won, from its report row ``(lock_key, status, holder,
    attempt, expires_at, heartbeat_age_ms, reclaimable)``; ``None`` when the row is reclaimable again
    (its winner failed it in between): another round claims it."""
    _key, status, holder, attempt, expires_at, age, reclaimable = row
    if reclaimable:
        return None
    return KeyClaim(
        identity=job,
        lease=None,
        reason=_lease._REASONS.get(status, NotAcquiredReason.CONTENDED),
        status=LeaseStatus(status),
        holder=holder,
        attempt=attempt,
        expires_at=expires_at,
        heartbeat_age_ms=None if age is None else int(age),
    )


# -- fenced set writes ---------------------------------------------------------------------------------


def _write(service: LeaseService, leases: Iterable[Lease], action: str, params: dict[str, Any]) -> BatchWrite:
    items = _check_leases(leases)
    if not items:
        return BatchWrite(action=action, held=(), lost=())
    ordered = sorted(items, key=lambda x: x.idempotency_key)
    written: dict[str, datetime] = {}
    statement = "fail" if action == "release" else action
    with driver.statements(service.engine, f"{action} a batch of leases") as db:
        for chunk in _chunks(ordered):
            rows = [(x.id, x.owner_token) for x in chunk]
            written.update(dict(store.write_many(db, statement, rows, params)))
    held = tuple(x for x in items if x.idempotency_key in written)
    lost = tuple(x for x in items if x.idempotency_key not in written)
    for x in lost:
        x._lost.append(True)
    if lost:
        logger.warning(
            "%d of %d leases lost on %s (first: lease %d, key %s)",
            len(lost),
            len(items),
            action,
            lost[0].id,
            lost[0].idempotency_key,
            extra={"action": "lease_lost"},
        )
    return BatchWrite(
        action=action,
        held=held,
        lost=lost,
        expires_at=written if action == "heartbeat" else {},
    )


def heartbeat_many(service: LeaseService, leases: Iterable[Lease]) -> BatchWrite:
    """Extend every lease of the set by its own length from the database's now, in one statement.

    Fenced per key (id, owner token, ``RUNNING``), like :meth:`LeaseService.heartbeat`; a lease no
    longer this worker's is reported in ``lost`` and marked lost instead of raising, so the rest of the
    set is still renewed. ``expires_at`` gives each renewed lease's new expiry.
    """
    return _write(service, leases, "heartbeat", {})


def complete_many(service: LeaseService, leases: Iterable[Lease], data: Any = None) -> BatchWrite:
    """Mark every lease of the set ``SUCCESS`` in one statement; ``data`` (JSON) is stored on each row.

    Fenced per key like :meth:`LeaseService.complete`. Leases that were lost are *not* completed: they
    are reported in ``lost`` (call :meth:`BatchWrite.raise_if_lost` to turn that into an error).
    """
    if data is not None:
        try:
            json.dumps(data, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise errors.InvalidPayloadError("result data", f"must be JSON-serializable ({exc})") from None
    return _write(service, leases, "complete", {"w_result": data})


def fail_many(service: LeaseService, leases: Iterable[Lease], error: str | BaseException) -> BatchWrite:
    """Mark every lease of the set ``FAIL`` with the bounded error text, in one statement; the next
    claim retries each with the same key. Fenced per key like :meth:`LeaseService.fail`."""
    return _write(service, leases, "fail", {"w_error": _lease.bound_error(_lease.error_text(error))})


def release_many(
    service: LeaseService, leases: Iterable[Lease], reason: str = _lease.RELEASED_ERROR
) -> BatchWrite:
    """Give every lease of the set back unfinished (``FAIL``, reason: released), in one statement."""
    return _write(service, leases, "release", {"w_error": _lease.bound_error(reason)})


# -- fenced transaction over a set ---------------------------------------------------------------------


_NOTHING_TO_FENCE = (
    "is empty: a transaction fenced by no lease is not fenced at all; skip the work when the claim won "
    "nothing"
)


def assert_held_many(connection: sa.Connection, leases: Sequence[Lease]) -> None:
    """Inside ``connection``'s transaction, make sure every lease of the set is still this worker's.

    The set's rows are locked in lock-key order (``FOR UPDATE`` on PostgreSQL, held until the
    transaction ends; SQLite's ``BEGIN IMMEDIATE`` already holds the write lock), so no reclaim can slip
    in before the commit. A lease reclaimed, finished or expired raises :class:`LostBatchLeaseError`
    naming the first such key (in key order) and listing all of them; nothing is marked or failed here.
    """
    items = _check_leases(leases, empty=_NOTHING_TO_FENCE)
    ordered = sorted(items, key=lambda x: x.idempotency_key)
    held: set[str] = set()
    db = driver.sqlalchemy_statements(connection)
    with translate_errors("check a batch of leases"):
        for chunk in _chunks(ordered):
            held.update(store.held_many(db, [(x.id, x.owner_token) for x in chunk]))
    lost = [x for x in ordered if x.idempotency_key not in held]
    if lost:
        raise errors.LostBatchLeaseError(
            lease_id=lost[0].id,
            attempt=lost[0].attempt,
            idempotency_key=lost[0].idempotency_key,
            action="commit a fenced transaction under",
            lost_keys=tuple(x.idempotency_key for x in lost),
            keys=tuple(x.idempotency_key for x in items),
        )


@contextlib.contextmanager
def fenced_transaction_many(service: LeaseService, leases: Iterable[Lease]) -> Iterator[sa.Connection]:
    """One transaction that commits only while *every* lease of the set is still held.

    The set's rows are locked in lock-key order when it opens (see :func:`assert_held_many`): the same
    semantics as :meth:`LeaseService.fenced_transaction` for one lease. Write the set's domain change and
    its outbox rows (:func:`~dagster_joblease.outbox.enqueue_many`) here: all commit under live leases,
    or nothing does. If any lease of the set is lost (already known, or found when the transaction
    opens), nothing of the block runs or commits, every lease of the set is marked lost and the ones
    still held are failed (``FAIL``, so a retry can reclaim them at once), and
    :class:`LostBatchLeaseError` names the first lost key and lists them all. An exception raised by
    the block rolls the transaction back and leaves the leases as they are (the caller fails them).
    """
    items = _check_leases(leases, empty=_NOTHING_TO_FENCE)
    lost: errors.LostBatchLeaseError | None = None
    known = [x for x in items if x.lost]
    if known:
        lost = errors.LostBatchLeaseError(
            lease_id=known[0].id,
            attempt=known[0].attempt,
            idempotency_key=known[0].idempotency_key,
            action="open a fenced transaction under",
            lost_keys=tuple(x.idempotency_key for x in known),
            keys=tuple(x.idempotency_key for x in items),
        )
    else:
        with service.engine.begin() as connection:
            try:
                assert_held_many(connection, items)
            except errors.LostBatchLeaseError as exc:
                lost = exc  # the transaction ends (releasing its locks) before the set is failed
            else:
                yield connection
                return
    assert lost is not None
    _abort_set(service, items, lost)
    raise lost


def _abort_set(service: LeaseService, items: list[Lease], cause: errors.LostBatchLeaseError) -> None:
    """After a lost lease aborted a set's transaction: fail the set's leases still held, mark all lost."""
    try:
        fail_many(
            service,
            items,
            f"aborted: the set's fenced transaction could not commit because lease of key "
            f"{cause.idempotency_key} was lost",
        )
    except errors.JobLeaseError as failure:
        logger.warning("could not fail the leases of an aborted batch: %s", failure)
    for x in items:
        if not x.lost:
            x._lost.append(True)


# -- heartbeat thread ----------------------------------------------------------------------------------


class BatchHeartbeat:
    """Renew a set of leases every ``heartbeat_ms`` from a background thread, one statement per renewal.

    Use it as a context manager around the work on the set. A lease found lost is marked lost (the
    worker sees ``lease.lost``) and dropped from the renewals; a transient database failure is logged
    and retried at the next interval (the leases only die if renewals stay impossible for their length).
    ``heartbeat_ms=0`` renews nothing.
    """

    def __init__(
        self, service: LeaseService, leases: Iterable[Lease], heartbeat_ms: int | None = None
    ) -> None:
        self._service = service
        self._leases = _check_leases(leases)
        interval = service.timing.heartbeat_ms if heartbeat_ms is None else heartbeat_ms
        interval = checks.milliseconds(
            "heartbeat_ms", interval, why="0: no heartbeat", error=checks.lease_option
        )
        self._interval_s = interval / 1000
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BatchHeartbeat:
        if self._interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="joblease-batch-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            live = [x for x in self._leases if not x.lost]
            if not live:
                return
            try:
                heartbeat_many(self._service, live)
            except errors.StorageError as exc:
                logger.warning("batch heartbeat of %d leases failed: %s", len(live), exc)

    def stop(self) -> None:
        self._stop.set()
        if (
            self._thread is not None
            and self._thread.is_alive()
            and threading.current_thread() is not self._thread
        ):
            self._thread.join()
