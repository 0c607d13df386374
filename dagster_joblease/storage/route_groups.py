"""Every statement on ``joblease_route_group``, the limit groups' shared state: read it, lock a group for a
claim, record a pause or a connection failure, end a pause early (:func:`resume`). The rules a group's row
is judged by (a pause in force, a registered limit in force, a registration fresh) are written once here as
SQL (:func:`paused`, :func:`in_force`, :func:`fresh_for`) and used by the row's read (the locked claim's
too) and by the swap (:func:`dagster_joblease.storage.outbox.swap`). The decisions themselves are in
:mod:`dagster_joblease.limits`; the count of a group's claims in flight is a statement on the outbox, so
it is :func:`dagster_joblease.storage.outbox.count_in_flight`.

Only row locks inside short transactions (``SELECT … FOR UPDATE`` on PostgreSQL; SQLite's ``BEGIN
IMMEDIATE`` serializes writers anyway): no advisory locks, no LISTEN/NOTIFY, no SQL-level PREPARE, so it
works behind PgBouncer in transaction mode. Every time is the database's.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from collections.abc import Collection, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from dagster_joblease import limits
from dagster_joblease.storage import driver
from dagster_joblease.storage.clock import db_now, db_now_plus_ms
from dagster_joblease.storage.engine import is_psycopg, translate_errors
from dagster_joblease.storage.schema import route_group_table

__all__ = [
    "FRESH_MS",
    "GroupState",
    "as_utc",
    "database_now",
    "delete_all",
    "fresh_for",
    "in_force",
    "lock_group",
    "paused",
    "paused_now",
    "paused_remaining",
    "read_states",
    "record_answers",
    "record_connection_failures",
    "record_pause",
    "resume",
    "update_group",
]

g = route_group_table
MAX_REASON_CHARS = 500


def as_utc(value: object) -> dt.datetime | None:
    """A timestamp read from either backend as an aware UTC datetime (SQLite hands back text or naive)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    assert isinstance(value, dt.datetime), value
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


@dataclasses.dataclass(frozen=True)
class GroupState:
    """One group's row as of ``now`` (the database clock)."""

    limit_group: str
    now: dt.datetime
    max_in_flight: int | None = None
    max_in_flight_live: bool = False
    rate: int | None = None
    rate_live: bool = False
    rate_next_at: dt.datetime | None = None
    paused_until: dt.datetime | None = None
    pause_reason: str | None = None
    failures: int = 0
    max_in_flight_until: dt.datetime | None = None
    rate_until: dt.datetime | None = None
    #: A pause is in force (:func:`paused`, judged by the database in the read).
    paused: bool = False
    #: Each registration holds for more than half a registration's life (:func:`fresh_for`).
    max_in_flight_fresh: bool = False
    rate_fresh: bool = False

    def registration_fresh(self, name: str, value: int | None) -> bool:
        """Whether ``name`` (max_in_flight or rate) already holds ``value`` for more than half a
        registration's life: refreshing it now would be a write for nothing."""
        if name == "max_in_flight":
            return self.max_in_flight == value and self.max_in_flight_fresh
        return self.rate == value and self.rate_fresh

    @property
    def pause_remaining_ms(self) -> int:
        if not self.paused:
            return 0
        assert self.paused_until is not None
        return max(0, int((self.paused_until - self.now).total_seconds() * 1000))

    @property
    def limited(self) -> bool:
        """A limit registered by some dispatcher is in force."""
        return (self.max_in_flight is not None and self.max_in_flight_live) or (
            self.rate is not None and self.rate_live
        )


def paused(now: sa.ColumnElement[Any] | None = None) -> sa.ColumnElement[bool]:
    """A pause is in force: it ends later than ``now`` (the database clock unless given); false
    without one. The one spelling of the rule, for the row's read and the swap."""
    return sa.func.coalesce(g.c.paused_until > (db_now() if now is None else now), sa.false())


def in_force(until: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """A registration (``max_in_flight_until`` or ``rate_until``) lapses later than now; false without
    one."""
    return sa.func.coalesce(until > db_now(), sa.false())


def fresh_for(until: sa.ColumnElement[Any], ms: int) -> sa.ColumnElement[bool]:
    """A registration holds for more than ``ms`` from now: refreshing it now would be a write for
    nothing, and a swap may trust it that long; false without one."""
    return sa.func.coalesce(until > db_now_plus_ms(sa.literal(ms, sa.BigInteger())), sa.false())


#: Half a registration's life: a registration fresher than this is not written again.
FRESH_MS = limits.REGISTRATION_MS // 2

_COLUMNS = (
    g.c.limit_group,
    db_now().label("now"),
    g.c.max_in_flight,
    g.c.max_in_flight_until,
    g.c.rate,
    g.c.rate_until,
    g.c.rate_next_at,
    g.c.paused_until,
    g.c.pause_reason,
    g.c.failures,
    paused().label("paused"),
    in_force(g.c.max_in_flight_until).label("max_in_flight_live"),
    in_force(g.c.rate_until).label("rate_live"),
    fresh_for(g.c.max_in_flight_until, FRESH_MS).label("max_in_flight_fresh"),
    fresh_for(g.c.rate_until, FRESH_MS).label("rate_fresh"),
)


def _state(row: Any) -> GroupState:
    now = as_utc(row.now)
    assert now is not None
    return GroupState(
        limit_group=row.limit_group,
        now=now,
        max_in_flight=row.max_in_flight,
        max_in_flight_live=bool(row.max_in_flight_live),
        rate=row.rate,
        rate_live=bool(row.rate_live),
        rate_next_at=as_utc(row.rate_next_at),
        paused_until=as_utc(row.paused_until),
        pause_reason=row.pause_reason,
        failures=int(row.failures or 0),
        max_in_flight_until=as_utc(row.max_in_flight_until),
        rate_until=as_utc(row.rate_until),
        paused=bool(row.paused),
        max_in_flight_fresh=bool(row.max_in_flight_fresh),
        rate_fresh=bool(row.rate_fresh),
    )


def read_states(conn: sa.Connection, groups: Collection[str] | None = None) -> dict[str, GroupState]:
    """The rows of ``groups`` (None: every group) that exist; a group without a row has no state."""
    if groups is None:
        rows = conn.execute(sa.select(*_COLUMNS).order_by(g.c.limit_group))
    elif not groups:
        return {}
    else:
        rows = conn.execute(_states_of(conn.dialect.name), {"groups": sorted(groups)})
    return {row.limit_group: _state(row) for row in rows}


@functools.cache
def _states_of(dialect_name: str) -> sa.Select[Any]:
    """:func:`read_states`' statement for a list of groups (bound as ``groups``), built once per dialect:
    a dispatcher runs it before every claim, and building it afresh (with an IN list expanded per call)
    cost more client CPU than its round trip. On PostgreSQL the list travels as one array."""
    where: sa.ColumnElement[bool]
    if dialect_name == "postgresql":
        where = g.c.limit_group == sa.any_(sa.bindparam("groups", type_=postgresql.ARRAY(sa.String())))
    else:
        where = g.c.limit_group.in_(sa.bindparam("groups", expanding=True))
    return sa.select(*_COLUMNS).where(where).order_by(g.c.limit_group)


_NOW = sa.select(sa.func.clock_timestamp().label("now")).subquery("n")

#: PostgreSQL: the groups among ``groups`` (a list) paused now on the database clock (one reading), each
#: with the pause's remaining milliseconds. Run by :func:`paused_now` through :func:`driver.statements`:
#: one prepared autocommit statement, for the dispatcher's frequent re-read of pauses other dispatchers
#: opened (a read through SQLAlchemy's pool took a transaction: three round trips and about 2 ms of client
#: CPU).
_PAUSED = driver.query(
    sa.select(
        g.c.limit_group,
        sa.cast(sa.func.ceil(sa.extract("epoch", g.c.paused_until - _NOW.c.now) * 1000), sa.BigInteger),
    )
    .select_from(g, _NOW)
    .where(
        g.c.limit_group == sa.any_(sa.bindparam("groups", type_=postgresql.ARRAY(sa.String()))),
        paused(_NOW.c.now),
    )
)


def paused_now(engine: sa.Engine, groups: Sequence[str]) -> dict[str, int]:
    """The groups among ``groups`` paused now, each with its pause's remaining ms, read outside any
    transaction of the caller's: on PostgreSQL with psycopg one prepared statement on the library's own
    autocommit connections, else a read through the engine."""
    if is_psycopg(engine.dialect):
        with driver.statements(engine, "read limit group pauses") as db:
            return {str(name): int(ms) for name, ms in db.rows(_PAUSED, {"groups": list(groups)})}
    with translate_errors("read limit group pauses"), engine.connect() as conn:
        return paused_remaining(conn, groups)


def paused_remaining(conn: sa.Connection, groups: Collection[str]) -> dict[str, int]:
    """Any backend: the groups among ``groups`` paused now, each with its pause's remaining ms."""
    return {
        name: state.pause_remaining_ms for name, state in read_states(conn, groups).items() if state.paused
    }


def _insert(dialect_name: str) -> Any:
    return (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(g)


def lock_group(conn: sa.Connection, group: str) -> GroupState:
    """Lock the group's row until the transaction ends (creating it if needed) and return its state:
    claims of one limited group are serialized across dispatchers, so a count-then-claim is exact."""
    locked = sa.select(*_COLUMNS).where(g.c.limit_group == group).with_for_update()
    row = conn.execute(locked).first()
    if row is None:
        conn.execute(
            _insert(conn.dialect.name)
            .values(limit_group=group, failures=0, updated_at=db_now())
            .on_conflict_do_nothing(index_elements=[g.c.limit_group])
        )
        row = conn.execute(locked).one()
    return _state(row)


def database_now(conn: sa.Connection) -> dt.datetime:
    """The database clock now (one cheap statement), as an aware UTC datetime."""
    now = as_utc(conn.execute(sa.select(db_now())).scalar_one())
    assert now is not None
    return now


def update_group(conn: sa.Connection, group: str, values: dict[str, Any]) -> None:
    """Write ``values`` to the (locked) group row."""
    if values:
        conn.execute(sa.update(g).where(g.c.limit_group == group).values(**values, updated_at=db_now()))


def registration_until() -> sa.ColumnElement[Any]:
    """When a registration written now lapses."""
    return db_now_plus_ms(sa.literal(limits.REGISTRATION_MS, sa.BigInteger()))


def _bound(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"


def record_pause(conn: sa.Connection, group: str, pause_ms: int, reason: str) -> None:
    """Pause ``group`` for every dispatcher until ``now + pause_ms``, unless a longer pause is in force."""
    until = db_now_plus_ms(sa.literal(pause_ms, sa.BigInteger()))
    insert = _insert(conn.dialect.name)
    stmt = insert.values(
        limit_group=group, paused_until=until, pause_reason=_bound(reason), failures=0, updated_at=db_now()
    )
    longer = sa.and_(g.c.paused_until.is_not(None), g.c.paused_until >= stmt.excluded.paused_until)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[g.c.limit_group],
            set_={
                "paused_until": sa.case((longer, g.c.paused_until), else_=stmt.excluded.paused_until),
                "pause_reason": sa.case((longer, g.c.pause_reason), else_=stmt.excluded.pause_reason),
                "updated_at": db_now(),
            },
        )
    )


def record_connection_failures(
    conn: sa.Connection, group: str, count: int, *, threshold: int, pause_ms: int, reason: str
) -> bool:
    """Add ``count`` consecutive connection failures; at ``threshold`` pause the group for ``pause_ms`` and
    start counting again. Returns whether a pause was opened."""
    insert = _insert(conn.dialect.name)
    stmt = insert.values(limit_group=group, failures=count, updated_at=db_now())
    total = conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[g.c.limit_group],
            set_={"failures": g.c.failures + count, "updated_at": db_now()},
        ).returning(g.c.failures)
    ).scalar_one()
    if int(total) < threshold:
        return False
    record_pause(conn, group, pause_ms, f"{int(total)} consecutive connection failures: {reason}")
    conn.execute(sa.update(g).where(g.c.limit_group == group).values(failures=0))
    return True


def record_answers(conn: sa.Connection, group: str) -> None:
    """The downstream answered: its consecutive connection failures start again from 0."""
    conn.execute(sa.update(g).where(g.c.limit_group == group, g.c.failures > 0).values(failures=0))


def resume(conn: sa.Connection, group: str) -> GroupState | None:
    """End ``group``'s pause now, for every dispatcher (an operator's decision: the downstream is back), and
    start its count of consecutive connection failures again. Returns the group's state as it was (its
    pause and reason), or None when no pause was in force (nothing is written then)."""
    locked = sa.select(*_COLUMNS).where(g.c.limit_group == group).with_for_update()
    row = conn.execute(locked).first()
    if row is None:
        return None
    state = _state(row)
    if not state.paused:
        return None
    conn.execute(
        sa.update(g)
        .where(g.c.limit_group == group)
        .values(paused_until=None, pause_reason=None, failures=0, updated_at=db_now())
    )
    return state


def delete_all(conn: sa.Connection) -> None:
    """Delete every group's row (the testing kit's reset between tests)."""
    conn.execute(sa.delete(g))
