"""Every statement on ``joblease_lease``, each named for the question it answers.

The lease service (:mod:`dagster_joblease.lease`), batch leases (:mod:`dagster_joblease.batch`), admin
and the testing helpers call these and hold no SQL of their own. Hot statements are
:class:`~dagster_joblease.storage.driver.Query` objects built once at import and run through
:mod:`dagster_joblease.storage.driver`; operator reads whose shape depends on their filters are built per
call and run through SQLAlchemy.

Times come from the database clock (:mod:`dagster_joblease.storage.clock`). Constants the partial indexes
are declared with (``status = 'RUNNING'`` ...) are written into the SQL rather than bound, so a prepared
(generic) plan can still prove an index's predicate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql import visitors

from dagster_joblease.storage import driver, purge, rowset
from dagster_joblease.storage.clock import db_now, db_now_plus_ms, ms_until, readable_ts
from dagster_joblease.storage.driver import Query, Statements
from dagster_joblease.storage.schema import any_status, lease_table

__all__ = [
    "CLAIM_ROUNDS",
    "KEYS_PER_STATEMENT",
    "ClaimedRow",
    "LeaseState",
    "ReconcilePage",
    "claim",
    "claim_new_many",
    "complete",
    "count_schedules",
    "delete_all",
    "expire_running",
    "fail",
    "fail_dead_holder",
    "held_many",
    "is_held",
    "lease_rows",
    "lock_for_reset",
    "ms_left",
    "purge_finished_schedules",
    "recent_names",
    "recent_run_keys",
    "reclaim_many",
    "reconcile_page",
    "renew",
    "report_many",
    "reset_to_fail",
    "run_keys_with_rows",
    "running_held_by_runs",
    "states_of",
    "write_many",
]

_t = lease_table

RUNNING, SUCCESS, FAIL = "RUNNING", "SUCCESS", "FAIL"

#: How many times a claim starts again when the row changed between its statements (a purge deleted
#: it; the reclaim waited on a purge's lock and then found it gone). Each round is a new statement with a
#: new snapshot; only churn on one key that outlasts every round ends in a refusal that names nobody.
CLAIM_ROUNDS = 5


def _text(value: str) -> Any:
    """A constant written into the SQL rather than bound: a claim sends only what varies per call."""
    assert "'" not in value
    return sa.literal_column(f"'{value}'", sa.String())


_RUNNING, _FAIL, _SUCCESS = _text(RUNNING), _text(FAIL), _text(SUCCESS)
_ONE = sa.literal_column("1", sa.Integer())
_RECLAIM_NOTE = " expired without finishing (worker died or stalled)"

_LEASE_MS = sa.bindparam("p_lease_ms", type_=sa.BigInteger())
_HEARTBEAT_MS = sa.bindparam("p_heartbeat_ms", type_=sa.BigInteger())
_HOLDER = sa.bindparam("p_holder", type_=sa.String())
_KEY = sa.bindparam("p_lock_key", type_=sa.String())
_TOKEN = sa.bindparam("p_owner_token", type_=sa.String())
_ID = sa.bindparam("p_id", type_=sa.BigInteger())


def _claim_values(lease_ms: Any, heartbeat_ms: Any) -> dict[str, Any]:
    """Column → value of a fresh claim (attempt 1), all times from the database clock.

    The holder's own timing goes on the row (``lease_ms``, ``heartbeat_ms``): whoever judges the holder
    later measures it against these, not its own settings (see :mod:`dagster_joblease.staleness`).
    """
    return {
        "lock_key": _KEY,
        "job_type": sa.bindparam("p_job_type", type_=sa.String()),
        "code": sa.bindparam("p_code", type_=sa.String()),
        "run_key": sa.bindparam("p_run_key", type_=sa.String()),
        "status": _RUNNING,
        "owner_token": _TOKEN,
        "attempt": _ONE,
        "lease_ms": lease_ms,
        "heartbeat_ms": heartbeat_ms,
        "holder": _HOLDER,
        "created_at": db_now(),
        "acquired_at": db_now(),
        "heartbeat_at": db_now(),
        "expires_at": db_now_plus_ms(lease_ms),
    }


def _reclaim_values(owner_token: Any, holder: Any, lease_ms: Any, heartbeat_ms: Any) -> dict[str, Any]:
    """Column → value of a reclaim: a new token, the next attempt, fresh times from the database clock."""
    return {
        "status": _RUNNING,
        "owner_token": owner_token,
        "attempt": _t.c.attempt + _ONE,
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
                _t.c.status == _RUNNING,
                _text("attempt ") + sa.cast(_t.c.attempt, sa.String) + _text(_RECLAIM_NOTE),
            ),
            else_=_t.c.last_error,
        ),
    }


def _reclaimable() -> Any:
    """A FAIL row, or a RUNNING row whose lease has expired on the database clock."""
    return sa.or_(_t.c.status == _FAIL, sa.and_(_t.c.status == _RUNNING, _t.c.expires_at < db_now()))


#: What a won claim returns: (id, attempt, expires_at, last_error).
_RETURNED = (_t.c.id, _t.c.attempt, _t.c.expires_at, _t.c.last_error)


# -- one lease: the claim --------------------------------------------------------------------------


def _claim_or_reclaim(dialect_name: str) -> Any:
    """``INSERT … ON CONFLICT (lock_key) DO UPDATE … WHERE <reclaimable> RETURNING …``: the one-statement
    claim (SQLite, which serializes writers, so it needs no second step)."""
    insert = (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(_t)
    stmt = insert.values(**_claim_values(_LEASE_MS, _HEARTBEAT_MS))
    update = stmt.on_conflict_do_update(
        index_elements=[_t.c.lock_key],
        set_=_reclaim_values(stmt.excluded.owner_token, stmt.excluded.holder, _LEASE_MS, _HEARTBEAT_MS),
        where=_reclaimable(),
    )
    return update.returning(*_RETURNED)


def _insert_claim() -> Any:
    """PostgreSQL, first step of a claim: ``INSERT … ON CONFLICT (lock_key) DO NOTHING RETURNING id,
    expires_at`` (a row it returns is a new one: attempt 1, no previous error).

    A run claimed for the first time (the common case: every partition, every tick) costs what a bare
    insert costs: no read before it and no row lock, and a conflict is found through the unique index
    without taking a transaction id. Measured against one statement that also reclaims or reports on a
    conflict (a data-modifying CTE, or a PL/pgSQL function), this is 5-15% faster on a first claim; a
    conflict then costs a second round trip (:data:`RECLAIM_OR_STATUS`), and stays cheaper than the bare
    ``ON CONFLICT DO UPDATE`` that locks the row even to refuse it.
    """
    insert = postgresql.insert(_t).values(**_claim_values(_LEASE_MS, _HEARTBEAT_MS))
    return insert.on_conflict_do_nothing(index_elements=[_t.c.lock_key]).returning(_t.c.id, _t.c.expires_at)


def _reclaim_or_status() -> Any:
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
    values = _reclaim_values(_TOKEN, _HOLDER, _LEASE_MS, _HEARTBEAT_MS)
    reclaimed = (
        sa.update(_t).where(_t.c.lock_key == _KEY, _reclaimable()).values(**values).returning(*_RETURNED)
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
        _t.c.status,
    ).where(_t.c.lock_key == _KEY, ~_reclaimable(), ~sa.exists(sa.select(reclaimed.c.id)))
    return sa.union_all(won, refused)


CLAIM_OR_RECLAIM = driver.query(_claim_or_reclaim("postgresql"), _claim_or_reclaim("sqlite"))
INSERT_CLAIM = driver.query(_insert_claim())
RECLAIM_OR_STATUS = driver.query(_reclaim_or_status())
#: The status of a row that refuses a claim (a live holder or a success); nothing for a reclaimable row.
REFUSING_STATUS = driver.query(sa.select(_t.c.status).where(_t.c.lock_key == _KEY, ~_reclaimable()))


ClaimedRow = tuple[Any, str | None, bool]
"""What :func:`claim` found: the won row ``(id, attempt, expires_at, last_error)`` or None; when refused,
the status of the row that refused it (None: the row kept changing for :data:`CLAIM_ROUNDS` rounds);
and whether the claim met an existing row."""


def claim(
    db: Statements,
    params: dict[str, Any],
    *,
    hinted: bool = False,
) -> ClaimedRow:
    """Claim or reclaim the run of ``params`` (``p_lock_key``, ``p_job_type``, ``p_code``, ``p_run_key``,
    ``p_owner_token``, ``p_lease_ms``, ``p_heartbeat_ms``, ``p_holder``): who has it now?

    PostgreSQL: a first claim is one round trip (:data:`INSERT_CLAIM`); one that meets an existing row is
    two (then :data:`RECLAIM_OR_STATUS`), or one when ``hinted`` (the caller met this key's row before):
    the reclaim-or-status statement goes first and the insert follows only if the row has gone. Either
    order is the same protocol (each statement is atomic and one winner per key holds for both), so a
    stale hint only costs the round trip it tried to save. SQLite: the one-statement claim, then the
    status of a row it could not claim, in the caller's ``BEGIN IMMEDIATE`` transaction.
    """
    if db.dialect != "postgresql":
        for _ in range(CLAIM_ROUNDS):
            row = db.first(CLAIM_OR_RECLAIM, params)
            if row is not None:
                return row, None, False
            status = db.first(REFUSING_STATUS, params)
            if status is not None:
                return None, str(status[0]), True  # a live holder or a success: the refusal names it
        return None, None, True
    exists = hinted
    for _ in range(CLAIM_ROUNDS):  # again only if the row changed between the two statements
        if not exists:
            inserted = db.first(INSERT_CLAIM, params)
            if inserted is not None:
                return (inserted[0], 1, inserted[1], None), None, False  # a first claim: one round trip
        found = db.first(RECLAIM_OR_STATUS, params)
        if found is not None:
            if found[4] is None:
                return tuple(found[:4]), None, True
            return None, str(found[4]), True
        exists = False  # no row under the key (purged, or gone under a purge's lock): insert
    return None, None, False


# -- one lease: fenced writes ----------------------------------------------------------------------


def _fenced(values: dict[str, Any]) -> Query:
    """``UPDATE … SET <values> WHERE id = … AND owner_token = … AND status = 'RUNNING' RETURNING
    expires_at``: a write only the current holder can make."""
    return driver.query(
        sa.update(_t)
        .where(_t.c.id == _ID, _t.c.owner_token == _TOKEN, _t.c.status == _RUNNING)
        .values(**values)
        .returning(_t.c.expires_at)
    )


#: The result column's type, binding None as SQL NULL (not the JSON literal null).
_RESULT = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
_ERROR = sa.bindparam("p_error", type_=sa.Text())

RENEW = _fenced({"heartbeat_at": db_now(), "expires_at": db_now_plus_ms(_t.c.lease_ms)})
COMPLETE = _fenced(
    {
        "status": _SUCCESS,
        "finished_at": db_now(),
        "result": sa.bindparam("p_result", type_=_RESULT),
        "last_error": sa.null(),
    }
)
FAIL_HELD = _fenced({"status": _FAIL, "finished_at": db_now(), "last_error": _ERROR})


def renew(db: Statements, lease_id: int, owner_token: str) -> Any | None:
    """Extend a held lease by its own length from the database's now: its new expiry, or None when the
    lease is no longer this holder's."""
    row = db.first(RENEW, {"p_id": lease_id, "p_owner_token": owner_token})
    return None if row is None else row[0]


def complete(db: Statements, lease_id: int, owner_token: str, result: Any) -> bool:
    """Mark a held lease ``SUCCESS`` with ``result`` (JSON, None: SQL NULL); False when not held."""
    params = {"p_id": lease_id, "p_owner_token": owner_token, "p_result": result}
    return db.first(COMPLETE, params) is not None


def fail(db: Statements, lease_id: int, owner_token: str, error: str) -> bool:
    """Mark a held lease ``FAIL`` with ``error`` (failed or released); False when not held."""
    params = {"p_id": lease_id, "p_owner_token": owner_token, "p_error": error}
    return db.first(FAIL_HELD, params) is not None


_ANY_TOKEN = sa.bindparam("p_any_token", type_=sa.String())
FAIL_DEAD_HOLDER = driver.query(
    sa.update(_t)
    .where(
        _t.c.lock_key == _KEY,
        _t.c.status == _RUNNING,
        _t.c.attempt == sa.bindparam("p_attempt", type_=sa.Integer()),
        _t.c.heartbeat_at < db_now_plus_ms(sa.bindparam("p_since_ms", type_=sa.BigInteger())),
        sa.or_(sa.cast(_ANY_TOKEN, sa.String()).is_(None), _t.c.owner_token == _ANY_TOKEN),
    )
    .values(status=_FAIL, finished_at=db_now(), last_error=_ERROR)
    .returning(_t.c.id)
)


def fail_dead_holder(
    db: Statements, lock_key: str, *, attempt: int, owner_token: str | None, stale_ms: int, error: str
) -> int | None:
    """Fail the ``RUNNING`` lease of ``lock_key`` at ``attempt`` (and ``owner_token``, when given) whose
    heartbeat is older than ``stale_ms`` on the database clock: the id of the lease failed, or None."""
    params = {
        "p_lock_key": lock_key,
        "p_attempt": attempt,
        "p_since_ms": -stale_ms,
        "p_any_token": owner_token,
        "p_error": error,
    }
    row = db.first(FAIL_DEAD_HOLDER, params)
    return None if row is None else int(row[0])


def _held() -> Any:
    return sa.select(_t.c.id).where(
        _t.c.id == _ID, _t.c.owner_token == _TOKEN, _t.c.status == _RUNNING, _t.c.expires_at > db_now()
    )


#: The lease row while it is still the holder's live lease, locked FOR UPDATE on PostgreSQL until the
#: transaction ends (SQLite's BEGIN IMMEDIATE already holds the write lock).
HELD = driver.query(_held().with_for_update(), _held())


def is_held(db: Statements, lease_id: int, owner_token: str) -> bool:
    """Is the lease still this holder's live lease? On PostgreSQL its row stays locked until the
    transaction of ``db`` ends, so no reclaim slips in before that transaction commits."""
    return db.first(HELD, {"p_id": lease_id, "p_owner_token": owner_token}) is not None


MS_LEFT = driver.query(
    sa.select(ms_until(_t.c.expires_at)).where(
        _t.c.id == _ID, _t.c.owner_token == _TOKEN, _t.c.status == _RUNNING
    )
)


def ms_left(db: Statements, lease_id: int, owner_token: str) -> int | None:
    """Milliseconds left on the database clock, or None when the lease is no longer this holder's."""
    row = db.first(MS_LEFT, {"p_id": lease_id, "p_owner_token": owner_token})
    return None if row is None else int(row[0])


EXPIRE = driver.query(
    sa.update(_t)
    .where(
        _t.c.lock_key == _KEY,
        _t.c.status == _RUNNING,
        sa.or_(sa.cast(_ANY_TOKEN, sa.String()).is_(None), _t.c.owner_token == _ANY_TOKEN),
    )
    .values(expires_at=db_now_plus_ms(sa.bindparam("p_by_ms", type_=sa.BigInteger())))
    .returning(_t.c.id)
)


def expire_running(db: Statements, lock_key: str, owner_token: str | None, *, ago_ms: int) -> int:
    """Let the ``RUNNING`` lease of ``lock_key`` (of ``owner_token``, when given) have expired ``ago_ms``
    ago on the database clock (testing helpers); how many leases changed."""
    return len(db.rows(EXPIRE, {"p_lock_key": lock_key, "p_any_token": owner_token, "p_by_ms": -ago_ms}))


# -- sets of leases -----------------------------------------------------------------------------------

_CLAIM_COLUMNS = (
    ("lock_key", sa.String()),
    ("job_type", sa.String()),
    ("code", sa.String()),
    ("run_key", sa.String()),
    ("owner_token", sa.String()),
)
CLAIM_NAMES = tuple(name for name, _ in _CLAIM_COLUMNS)
_LEASE_COLUMNS = (("id", sa.BigInteger()), ("owner_token", sa.String()))


def _per_key(expression: Any, source: Any) -> Any:
    """``expression`` with the single claim's per-key parameters (``p_lock_key`` …) replaced by the
    columns of ``source``: the batch claim writes exactly the values :func:`_claim_values` writes."""

    def replace(element: Any) -> Any:
        if isinstance(element, sa.BindParameter) and element.key.startswith("p_"):
            name = element.key[2:]
            if name in CLAIM_NAMES:
                return source.c[name]
        return None

    return visitors.replacement_traverse(expression, {}, replace)  # type: ignore[call-overload]


def _insert_many(dialect_name: str) -> Any:
    """``INSERT … SELECT <the single claim's values> FROM <keys> ORDER BY lock_key ON CONFLICT (lock_key)
    DO NOTHING RETURNING lock_key, id, attempt, expires_at, last_error``: the keys never claimed."""
    source = rowset.rows_source(dialect_name, _CLAIM_COLUMNS, joined=False)
    values = _claim_values(_LEASE_MS, _HEARTBEAT_MS)
    rows = (
        sa.select(*(_per_key(expr, source).label(name) for name, expr in values.items()))
        .select_from(source)
        .where(sa.true())  # SQLite: INSERT … SELECT … ON CONFLICT needs a WHERE to parse
        .order_by(source.c.lock_key)
    )
    insert = (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(_t)
    return (
        insert.from_select(list(values), rows)
        .on_conflict_do_nothing(index_elements=[_t.c.lock_key])
        .returning(_t.c.lock_key, *_RETURNED)
    )


# PostgreSQL statements over a set find rows with plans that stay linear whatever the planner's row
# estimates say (a range claimed into a fresh table has stale statistics, and a nested loop over a
# misestimated join, or a sequential scan testing `= ANY(array)` on every row, is quadratic): each key is
# looked up by a LATERAL index lookup driven by the key rows (which Python sends sorted by lock key, so
# rows are locked in that order), and the update then reaches the locked rows by their ctid (a TID scan;
# a row this statement has locked cannot move).


def _filter_only(condition: Any) -> Any:
    """``(condition) IS TRUE``: the same test, but one the planner cannot answer from an index. With
    stale statistics it would otherwise pick the status index (guessed one row) over the key lookup and
    scan every row of that status once per key."""
    return sa.cast(condition, sa.Boolean()).is_(sa.true())


class _Tid(sa.types.UserDefinedType[Any]):
    """PostgreSQL's ``tid`` (a row version's physical address, the ``ctid`` system column)."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "TID"


_CTID_COLUMN: Any = sa.literal_column("joblease_lease.ctid", _Tid())
_CTID: Any = _CTID_COLUMN.label("row_ctid")


def _looked_up(source: Any, match: Any, columns: Sequence[Any], *conditions: Any, lock: bool) -> Any:
    """PostgreSQL: ``columns`` of the lease row of each row of ``source`` (``match``: the index lookup,
    e.g. ``lock_key = k.lock_key``) that meets ``conditions``, found by a LATERAL lookup per key, in the
    order of ``source``; locked ``FOR UPDATE`` when ``lock``."""
    found = sa.select(*columns).where(match, *(_filter_only(c) for c in conditions))
    if lock:
        found = found.with_for_update()
    row = found.lateral("l")
    return sa.select(*(row.c[c.name] for c in columns)).select_from(source.join(row, sa.true()))


def _locked_rows(locked: Any) -> Any:
    """``ctid = ANY((SELECT array_agg(row_ctid) FROM locked))``: the rows the CTE ``locked`` locked."""
    ctids = sa.select(sa.func.array_agg(locked.c.row_ctid)).scalar_subquery()
    return _CTID_COLUMN == sa.any_(sa.cast(ctids, postgresql.ARRAY(_Tid())))


#: A new owner token made by the database (PostgreSQL reclaims): 32 hex digits like secrets.token_hex(16).
_SERVER_TOKEN = sa.literal_column("replace(CAST(gen_random_uuid() AS TEXT), '-', '')", sa.String())


def _reclaim_many(dialect_name: str) -> Any:
    """Reclaim the ``FAIL`` and expired ``RUNNING`` rows of the keys, ``RETURNING lock_key, id, attempt,
    expires_at, last_error, owner_token``. On PostgreSQL the rows are locked first in lock-key order, and
    READ COMMITTED re-checks the reclaim condition on the newest version of each locked row, so two
    reclaimers get one winner per key and never deadlock; the new owner tokens are made by the database
    (``gen_random_uuid``), so the update needs no join back to the keys. SQLite (one writer at a time)
    takes the caller's tokens."""
    returning = (_t.c.lock_key, *_RETURNED, _t.c.owner_token)
    if dialect_name == "postgresql":
        keys = rowset.rows_source(dialect_name, (("lock_key", sa.String()),))
        locked = (
            _looked_up(keys, _t.c.lock_key == keys.c.lock_key, [_CTID], _reclaimable(), lock=True)
            .cte("locked")
            .prefix_with("MATERIALIZED")
        )
        return (
            sa.update(_t)
            .where(_locked_rows(locked), _filter_only(_reclaimable()))
            .values(**_reclaim_values(_SERVER_TOKEN, _HOLDER, _LEASE_MS, _HEARTBEAT_MS))
            .returning(*returning)
        )
    source = rowset.rows_source(dialect_name, (("lock_key", sa.String()), ("owner_token", sa.String())))
    return (
        sa.update(_t)
        .where(_t.c.lock_key == source.c.lock_key, _reclaimable())
        .values(**_reclaim_values(source.c.owner_token, _HOLDER, _LEASE_MS, _HEARTBEAT_MS))
        .returning(*returning)
    )


def waiter_view(conn: sa.Connection, lock_key: str) -> tuple[Any, ...] | None:
    """One row as a waiter sees it: status, attempt, owner_token, holder, heartbeat_age_ms, remaining_ms
    (both on the database clock) and the holder's heartbeat_ms; None when the key has no row."""
    stmt = sa.select(
        _t.c.status,
        _t.c.attempt,
        _t.c.owner_token,
        _t.c.holder,
        (-ms_until(_t.c.heartbeat_at)).label("heartbeat_age_ms"),
        ms_until(_t.c.expires_at).label("remaining_ms"),
        _t.c.heartbeat_ms,
    ).where(_t.c.lock_key == lock_key)
    row = conn.execute(stmt).first()
    return None if row is None else tuple(row)


def _report_many(dialect_name: str) -> Any:
    """The rows of keys neither inserted nor reclaimed: status, holder, attempt, expiry, heartbeat age,
    and whether the row is reclaimable now (then the claim lost a race and tries it again)."""
    columns = [
        _t.c.lock_key,
        _t.c.status,
        _t.c.holder,
        _t.c.attempt,
        _t.c.expires_at,
        (-ms_until(_t.c.heartbeat_at)).label("heartbeat_age_ms"),
        sa.case((_reclaimable(), sa.true()), else_=sa.false()).label("reclaimable"),
    ]
    source = rowset.rows_source(dialect_name, (("lock_key", sa.String()),))
    if dialect_name == "postgresql":
        return _looked_up(source, _t.c.lock_key == source.c.lock_key, columns, lock=False)
    return sa.select(*columns).select_from(_t.join(source, _t.c.lock_key == source.c.lock_key))


def _held_rows(columns: Sequence[Any], *conditions: Any) -> Any:
    """PostgreSQL: ``columns`` of the set's rows whose id and owner token match and that meet
    ``conditions``, each found by its primary key and locked ``FOR UPDATE``, in lock-key order."""
    source = rowset.rows_source("postgresql", _LEASE_COLUMNS)
    match = sa.and_(_t.c.id == source.c.id, _t.c.owner_token == source.c.owner_token)
    return _looked_up(source, match, columns, *conditions, lock=True)


def _renewed() -> dict[str, Any]:
    return {"heartbeat_at": db_now(), "expires_at": db_now_plus_ms(_t.c.lease_ms)}


def _completed() -> dict[str, Any]:
    return {
        "status": _SUCCESS,
        "finished_at": db_now(),
        "result": sa.bindparam("w_result", type_=_RESULT),
        "last_error": sa.null(),
    }


def _failed() -> dict[str, Any]:
    return {"status": _FAIL, "finished_at": db_now(), "last_error": sa.bindparam("w_error", type_=sa.Text())}


_SET_VALUES = {"heartbeat": _renewed, "complete": _completed, "fail": _failed}


def _write_many(dialect_name: str, action: str) -> Any:
    """One fenced write over a set: the rows whose id and owner token match and that are still
    ``RUNNING`` get ``action``'s values, ``RETURNING lock_key, expires_at``. On PostgreSQL they are
    locked in lock-key order first, as a claim locks them, so a set write and a claim cannot deadlock."""
    running = _t.c.status == _RUNNING
    update = sa.update(_t).values(**_SET_VALUES[action]()).returning(_t.c.lock_key, _t.c.expires_at)
    if dialect_name == "postgresql":
        locked = _held_rows([_CTID], running).cte("locked").prefix_with("MATERIALIZED")
        return update.where(_locked_rows(locked))  # locked there, and checked RUNNING under the lock
    source = rowset.rows_source(dialect_name, _LEASE_COLUMNS)
    return update.where(_t.c.id == source.c.id, _t.c.owner_token == source.c.owner_token, running)


def _held_many(dialect_name: str) -> Any:
    """The lock keys of the set's rows still held (id, owner token, ``RUNNING``, not expired on the
    database clock), locked ``FOR UPDATE`` in lock-key order on PostgreSQL until the transaction ends."""
    held = (_t.c.status == _RUNNING, _t.c.expires_at > db_now())
    if dialect_name == "postgresql":
        return _held_rows([_t.c.lock_key], *held)
    source = rowset.rows_source(dialect_name, _LEASE_COLUMNS)
    return (
        sa.select(_t.c.lock_key)
        .select_from(
            _t.join(source, sa.and_(_t.c.id == source.c.id, _t.c.owner_token == source.c.owner_token))
        )
        .where(*held)
    )


def _both(build: Any, *args: Any) -> Query:
    return driver.query(build("postgresql", *args), build("sqlite", *args))


CLAIM_NEW_MANY = _both(_insert_many)
RECLAIM_MANY = _both(_reclaim_many)
REPORT_MANY = _both(_report_many)
WRITE_MANY = {action: _both(_write_many, action) for action in _SET_VALUES}
HELD_MANY = _both(_held_many)


def claim_new_many(db: Statements, rows: Sequence[tuple[Any, ...]], call: dict[str, Any]) -> list[Any]:
    """Insert the keys of ``rows`` (lock_key, job_type, code, run_key, owner_token; in key order) never
    claimed before; ``call``: ``p_lease_ms``, ``p_heartbeat_ms``, ``p_holder``. The rows won:
    ``(lock_key, id, attempt, expires_at, last_error)``."""
    return db.rows(CLAIM_NEW_MANY, {**call, **rowset.bind_rows(db.dialect, CLAIM_NAMES, rows)})


def reclaim_many(
    db: Statements, keys: Sequence[str], tokens: dict[str, str], call: dict[str, Any]
) -> list[Any]:
    """Reclaim those of ``keys`` (in key order) whose row is reclaimable: ``(lock_key, id, attempt,
    expires_at, last_error, owner_token)`` per key won. PostgreSQL makes the new tokens; SQLite takes
    ``tokens``."""
    if db.dialect == "postgresql":
        keyed = rowset.bind_rows(db.dialect, ("lock_key",), [(k,) for k in keys])
    else:
        keyed = rowset.bind_rows(db.dialect, ("lock_key", "owner_token"), [(k, tokens[k]) for k in keys])
    return db.rows(RECLAIM_MANY, {**call, **keyed})


def report_many(db: Statements, keys: Sequence[str]) -> list[Any]:
    """Who holds each of ``keys``: ``(lock_key, status, holder, attempt, expires_at, heartbeat_age_ms,
    reclaimable)`` per key that has a row."""
    return db.rows(REPORT_MANY, rowset.bind_rows(db.dialect, ("lock_key",), [(k,) for k in keys]))


def write_many(
    db: Statements, action: str, leases: Sequence[tuple[int, str]], params: dict[str, Any]
) -> list[Any]:
    """``action`` (heartbeat, complete, fail) on the held ones of ``leases`` (id, owner token; in key
    order), with ``params`` (``w_result`` / ``w_error``): ``(lock_key, expires_at)`` per lease written."""
    query = WRITE_MANY[action]
    return db.rows(query, {**params, **rowset.bind_rows(db.dialect, ("id", "owner_token"), leases)})


def held_many(db: Statements, leases: Sequence[tuple[int, str]]) -> list[str]:
    """The lock keys of ``leases`` (id, owner token; in key order) still held, locked until the
    transaction of ``db`` ends (PostgreSQL)."""
    rows = db.rows(HELD_MANY, rowset.bind_rows(db.dialect, ("id", "owner_token"), leases))
    return [str(row[0]) for row in rows]


# -- operators' reads and writes (admin) ----------------------------------------------------------------


def _readable_columns() -> list[Any]:
    """The table's columns, timestamps clamped so any stored row can be listed (see readable_ts)."""
    return [readable_ts(c).label(c.name) if isinstance(c.type, sa.DateTime) else c for c in _t.c]


def _rows_select() -> sa.Select[Any]:
    """Every column (timestamps clamped), the ms left and the heartbeat's age (RUNNING rows, database
    clock), and whether the row is expired: one lease row as an operator sees it."""
    running = _t.c.status == RUNNING
    return sa.select(
        *_readable_columns(),
        sa.case((running, ms_until(readable_ts(_t.c.expires_at))), else_=sa.null()).label("remaining_ms"),
        sa.case((running, -ms_until(readable_ts(_t.c.heartbeat_at))), else_=sa.null()).label(
            "heartbeat_age_ms"
        ),
        sa.case((sa.and_(running, _t.c.expires_at < db_now()), sa.true()), else_=sa.false()).label("expired"),
    )


def lease_rows(
    conn: sa.Connection,
    *,
    code: str | None = None,
    status: str | None = None,
    acquired_before_ms: int | None = None,
    expired_only: bool = False,
    limit: int = 100,
) -> list[sa.Row[Any]]:
    """Lease rows as operators see them (see :func:`_rows_select`), newest attempt first, filtered by
    code, status, an attempt started more than ``acquired_before_ms`` ago, or expired RUNNING rows."""
    stmt = _rows_select()
    if code is not None:
        stmt = stmt.where(_t.c.code == code, any_status())
    if status is not None:
        stmt = stmt.where(_t.c.status == status)
    if acquired_before_ms is not None:
        stmt = stmt.where(_t.c.acquired_at < db_now_plus_ms(sa.literal(-acquired_before_ms, sa.BigInteger())))
    if expired_only:
        stmt = stmt.where(_t.c.status == RUNNING, _t.c.expires_at < db_now())
    stmt = stmt.order_by(_t.c.acquired_at.desc(), _t.c.id.desc()).limit(limit)
    return list(conn.execute(stmt))


def _where(lease_id: int | None, lock_key: str | None) -> Any:
    if lease_id is not None:
        return _t.c.id == lease_id
    return _t.c.lock_key == lock_key


def lease_row(conn: sa.Connection, *, lease_id: int | None = None, lock_key: str | None = None) -> Any:
    """One lease row as operators see it, by id or by lock key; None when there is none."""
    return conn.execute(_rows_select().where(_where(lease_id, lock_key))).first()


def lock_for_reset(conn: sa.Connection, *, lease_id: int | None = None, lock_key: str | None = None) -> Any:
    """:func:`lease_row`, its row locked FOR UPDATE until the transaction of ``conn`` ends."""
    return conn.execute(_rows_select().where(_where(lease_id, lock_key)).with_for_update(of=_t)).first()


def reset_to_fail(
    conn: sa.Connection, lease_id: int, owner_token: str, *, expired_only: bool, new_token: str, error: str
) -> int:
    """Fail a ``RUNNING`` lease for an operator: a new token fences out its holder. Only while the row is
    still at ``owner_token`` (and expired, when ``expired_only``); how many rows changed (0 or 1)."""
    still = [_t.c.id == lease_id, _t.c.owner_token == owner_token, _t.c.status == RUNNING]
    if expired_only:
        still.append(_t.c.expires_at < db_now())
    stmt = (
        sa.update(_t)
        .where(*still)
        .values(status=FAIL, owner_token=new_token, finished_at=db_now(), last_error=error)
    )
    return int(conn.execute(stmt).rowcount)


def count_schedules(conn: sa.Connection, code: str) -> int:
    """How many SCHEDULE rows ``code`` has (any status)."""
    stmt = (
        sa.select(sa.func.count())
        .select_from(_t)
        .where(_t.c.code == code, _t.c.job_type == "SCHEDULE", any_status())
    )
    return int(conn.execute(stmt).scalar_one())


def recent_run_keys(conn: sa.Connection, code: str, limit: int) -> list[str]:
    """The run keys of ``code``'s newest ``limit`` SCHEDULE rows, newest first."""
    stmt = (
        sa.select(_t.c.run_key)
        .where(_t.c.code == code, _t.c.job_type == "SCHEDULE", any_status())
        .order_by(_t.c.id.desc())
        .limit(limit)
    )
    return [str(k) for (k,) in conn.execute(stmt) if k is not None]


def recent_names(conn: sa.Connection, limit: int) -> list[tuple[str, str | None]]:
    """(code, run_key) of the newest ``limit`` rows, newest first."""
    stmt = sa.select(_t.c.code, _t.c.run_key).order_by(_t.c.id.desc()).limit(limit)
    return [(str(c), k) for c, k in conn.execute(stmt)]


def purge_finished_schedules(
    conn: sa.Connection, *, finished_before_ms: int, dry_run: bool, limit: int
) -> int:
    """Delete at most ``limit`` (or count all, ``dry_run``) SUCCESS and FAIL rows of SCHEDULE runs that
    finished more than ``finished_before_ms`` ago on the database clock: one batch (see
    :func:`dagster_joblease.storage.purge.batch`)."""
    where = sa.and_(
        _t.c.job_type == "SCHEDULE",
        _t.c.status.in_([SUCCESS, FAIL]),
        _t.c.finished_at < purge.cutoff(finished_before_ms),
    )
    return purge.batch(conn, _t, where, dry_run=dry_run, limit=limit)


# -- reconciliation's reads ---------------------------------------------------------------------------
# What the reconciliation sensor pages through (dagster_joblease.dagster.reconcile.facts): a code's rows in
# the lookback window (the most recently active first, then a sweep by id from a cursor), the rows of given
# run keys (by lock key: the unique index), and which run keys of a code have a row at all. Filter-shaped:
# built per call, on the caller's connection. Ages are on the database clock.

#: Run keys looked up per statement (``IN`` lists of lock keys or run keys).
KEYS_PER_STATEMENT = 1_000


@dataclasses.dataclass(frozen=True)
class LeaseState:
    """A lease row as a judge sees it (never its owner token); ages are on the database clock."""

    id: int
    run_key: str
    status: str
    attempt: int
    holder: str | None
    overdue_ms: int  #: > 0: the lease expired that long ago (by the holder's own length)
    heartbeat_age_ms: int
    idle_ms: int  #: since the last heartbeat or finish
    heartbeat_ms: int | None  #: the holder's recorded interval (None: a row from before migration 0002)


@dataclasses.dataclass(frozen=True)
class ReconcilePage:
    recent: list[LeaseState]  #: the most recently active rows
    sweep: list[LeaseState]  #: the next rows by id after the cursor
    after: int  #: rows after the sweep page (still to look at in this sweep)


def _activity() -> Any:
    return sa.func.coalesce(_t.c.finished_at, _t.c.heartbeat_at)


def _state_columns() -> list[Any]:
    return [
        _t.c.id,
        _t.c.run_key,
        _t.c.status,
        _t.c.attempt,
        _t.c.holder,
        -ms_until(_t.c.expires_at),
        -ms_until(_t.c.heartbeat_at),
        -ms_until(_activity()),
        _t.c.heartbeat_ms,
    ]


def _states(raw: Iterable[Any]) -> list[LeaseState]:
    return [
        LeaseState(
            id=int(r[0]),
            run_key=r[1],
            status=r[2],
            attempt=int(r[3]),
            holder=r[4],
            overdue_ms=int(r[5]),
            heartbeat_age_ms=int(r[6]),
            idle_ms=int(r[7]),
            heartbeat_ms=None if r[8] is None else int(r[8]),
        )
        for r in raw
    ]


def reconcile_page(
    conn: sa.Connection,
    code: str,
    *,
    lookback_ms: int,
    statuses: Sequence[str],
    sweep_after: int,
    recent: int,
    sweep: int,
) -> ReconcilePage:
    """A code's SCHEDULE rows with ``statuses`` active (heartbeat or finish) within ``lookback_ms``: the
    ``recent`` most recently active, and the next ``sweep`` by id after ``sweep_after`` (through the
    live-rows index, or the succeeded one for SUCCESS); and how many rows follow that page."""
    where = [
        _t.c.code == code,
        _t.c.job_type == "SCHEDULE",
        _t.c.status.in_(statuses),
        -ms_until(_activity()) <= lookback_ms,
    ]
    newest = sa.select(*_state_columns()).where(*where).order_by(_activity().desc()).limit(recent)
    page = sa.select(*_state_columns()).where(*where, _t.c.id > sweep_after).order_by(_t.c.id).limit(sweep)
    recent_rows = _states(conn.execute(newest))
    sweep_rows = _states(conn.execute(page))
    last = sweep_rows[-1].id if sweep_rows else sweep_after
    after = conn.execute(sa.select(sa.func.count()).select_from(_t).where(*where, _t.c.id > last))
    return ReconcilePage(recent_rows, sweep_rows, int(after.scalar_one()))


def states_of(conn: sa.Connection, lock_keys: Mapping[str, str]) -> dict[str, LeaseState]:
    """The rows of ``lock_keys`` (lock key -> the name to return it under, e.g. its run key), any status;
    keys without a row are absent. By lock key (the unique index), :data:`KEYS_PER_STATEMENT` per
    statement."""
    found: dict[str, LeaseState] = {}
    ordered = list(lock_keys)
    for offset in range(0, len(ordered), KEYS_PER_STATEMENT):
        chunk = ordered[offset : offset + KEYS_PER_STATEMENT]
        rows = conn.execute(sa.select(_t.c.lock_key, *_state_columns()).where(_t.c.lock_key.in_(chunk))).all()
        for row, state in zip(rows, _states(r[1:] for r in rows), strict=True):
            found[lock_keys[row[0]]] = state
    return found


#: Runs whose leases of any code one statement of ``running_held_by_runs`` reads.
RUNS_PER_STATEMENT = 100


def running_held_by_runs(conn: sa.Connection, run_ids: Sequence[str]) -> list[LeaseState]:
    """The ``RUNNING`` rows, of any code, whose holder names one of ``run_ids`` (``dagster:<deployment>/
    <run id>``): what a run holds anywhere (a run busy in another asset's lease is alive). Only RUNNING
    rows are read (the live-rows index holds them); :data:`RUNS_PER_STATEMENT` runs per statement."""
    found: list[LeaseState] = []
    for offset in range(0, len(run_ids), RUNS_PER_STATEMENT):
        chunk = run_ids[offset : offset + RUNS_PER_STATEMENT]
        names = sa.or_(*(_t.c.holder.endswith("/" + run_id, autoescape=True) for run_id in chunk))
        stmt = sa.select(*_state_columns()).where(_t.c.status == "RUNNING", names)
        found += _states(conn.execute(stmt))
    return found


def run_keys_with_rows(conn: sa.Connection, code: str, run_keys: Sequence[str]) -> set[str]:
    """Which of ``run_keys`` of ``code`` have a SCHEDULE row of any status (through the live and succeeded
    partial indexes: ``any_status``)."""
    found: set[str] = set()
    for offset in range(0, len(run_keys), KEYS_PER_STATEMENT):
        chunk = list(run_keys[offset : offset + KEYS_PER_STATEMENT])
        stmt = sa.select(_t.c.run_key).where(
            _t.c.code == code, _t.c.job_type == "SCHEDULE", _t.c.run_key.in_(chunk), any_status()
        )
        found.update(str(k) for k in conn.execute(stmt).scalars())
    return found


def delete_all(conn: sa.Connection) -> None:
    """Delete every lease's row (the testing kit's reset between tests)."""
    conn.execute(sa.delete(_t))
