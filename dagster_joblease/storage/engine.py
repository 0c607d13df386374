"""Engines for PostgreSQL (psycopg 3) and the embedded SQLite default, and the one place that turns
driver errors into :class:`StorageError` with the URL's password hidden."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import sqlite3
import time
import weakref
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, make_url

from dagster_joblease import errors

__all__ = [
    "DATABASE_URL_ENV",
    "create_engine",
    "default_sqlite_url",
    "describe_database",
    "first_line",
    "fork_safe",
    "is_psycopg",
    "normalize_url",
    "redact_url",
    "scrub_secrets",
    "sqlite_file",
    "translate_errors",
    "upgrade_advice",
    "upgrade_command",
]

#: The environment variable every entry point (CLI, Dagster resource, demo) reads the URL from.
DATABASE_URL_ENV = "JOBLEASE_DATABASE_URL"
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: A pooled PostgreSQL connection idle at least this long is pinged before reuse.
IDLE_PING_AFTER_S = 1.0
#: The ``application_name`` of the library's PostgreSQL sessions (unless the URL or ``$PGAPPNAME`` names
#: one): how ``pg_stat_activity`` (and ``joblease db upgrade``'s warning) tells them apart.
APPLICATION_NAME = "dagster-joblease"
_IDLE_SINCE = "joblease_idle_since"
_PID = "joblease_pid"


def default_sqlite_url(*, create: bool = True) -> str:
    """The embedded default: a file under ``$DAGSTER_HOME``, else under ``./.joblease/``.

    ``./.joblease/`` ignores itself (a ``.gitignore`` of ``*``, as a virtualenv does): it lands in a
    project's folder, and lease state is no source. ``create=False`` only names it: a command that reads
    must not create the folder it would read from.
    """
    home = os.environ.get("DAGSTER_HOME")
    folder = Path(home) if home else Path.cwd() / ".joblease"
    if create:
        folder.mkdir(parents=True, exist_ok=True)
        ignore = folder / ".gitignore"
        if not home and not ignore.exists():
            ignore.write_text("# lease state of dagster-joblease's embedded default; not source\n*\n")
    return f"sqlite:///{folder / 'joblease.sqlite'}"


def sqlite_file(url: str | URL) -> Path | None:
    """The file a SQLite URL opens, or None (PostgreSQL, or a ``?uri=true`` URL that SQLite resolves)."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() != "sqlite" or "uri" in parsed.query:
        return None
    database = parsed.database or ""
    return None if database in ("", ":memory:") else Path(database)


_AMBIGUOUS_URL = (
    "the database URL cannot be split safely into credentials and host: its user name or password seems "
    "to hold an unencoded '@' (with '/', '#' or '?' after it), so part of the password would be taken for "
    "the host or the database. Percent-encode the user name and password, e.g. "
    "urllib.parse.quote(password, safe='') ('@' → %40, '/' → %2F, '#' → %23, '?' → %3F); an '@' in the "
    "database name as %40. Nothing of the URL is shown here."
)


def _ambiguous(raw: str, parsed: URL) -> bool:
    """True when SQLAlchemy's split of ``raw`` into credentials, host and database cannot be trusted.

    An unencoded '@' in a password makes SQLAlchemy end the password at that '@' and take the rest for
    the host, port or database (``p@ss#w/rd`` → password ``p``, host ``ss#w``, database ``rd@…``), or drop
    it as a malformed query part. So: an '@' in the parsed host or database, or fewer '@' in the parsed
    parts than in the raw text, means a piece of a credential went where it does not belong.
    """
    if parsed.get_backend_name() == "sqlite":
        return False  # no credentials; a file path may contain '@'
    if any("@" in part for part in (parsed.host or "", parsed.database or "", *parsed.query.keys())):
        return True  # no host, database or query parameter name holds an '@'
    accounted = (1 if parsed.username or parsed.password else 0) + sum(
        part.count("@")
        for part in (
            parsed.username or "",
            parsed.password or "",
            *(v if isinstance(v, str) else "".join(v) for v in parsed.query.values()),
        )
    )
    return raw.count("@") > accounted


def _parse(url: str | URL) -> URL:
    """make_url, refusing an ambiguous URL; errors never echo the URL."""
    if not isinstance(url, str):
        return url
    try:
        parsed = make_url(url)
    except Exception:  # sqlalchemy.exc.ArgumentError and friends; the URL itself is never echoed
        raise errors.ConfigurationError(
            "the database URL could not be parsed; expected e.g. postgresql+psycopg://user@host:5432/db "
            "or sqlite:///path/to/joblease.sqlite (percent-encode special characters in the password)"
        ) from None
    if _ambiguous(url, parsed):
        raise errors.ConfigurationError(_AMBIGUOUS_URL)
    return parsed


def normalize_url(url: str | URL) -> URL:
    """Parse a URL and pick psycopg 3 for bare ``postgresql://`` / ``postgres://`` URLs.

    A URL whose password holds an unencoded '@' cannot be split reliably and is refused
    (:class:`ConfigurationError`) rather than half-parsed: a half-parsed URL sends a piece of the password
    to DNS as a host name and into error messages.
    """
    parsed = _parse(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    backend = parsed.get_backend_name()
    if backend not in ("postgresql", "sqlite"):
        raise errors.ConfigurationError(
            f"unsupported database backend {backend!r}; use postgresql+psycopg://… or sqlite:///…"
        )
    if backend == "postgresql" and parsed.get_driver_name() != "psycopg":
        raise errors.ConfigurationError(
            f"driver {parsed.get_driver_name()!r} is not supported for the joblease tables; use "
            "postgresql+psycopg:// (psycopg 3). Dagster's own storage is the one that needs +psycopg2."
        )
    return parsed


def redact_url(url: str | URL) -> str:
    """The URL as it may appear in logs: password hidden; if it is ambiguous or unparseable, nothing of
    it but the scheme (an unencoded '@' in a password would put password pieces in the host)."""
    try:
        return _parse(url).render_as_string(hide_password=True)
    except Exception:
        scheme = url.split("://", 1)[0] if isinstance(url, str) and "://" in url else ""
        safe = scheme if scheme.replace("+", "").isalnum() else "database"
        return f"<{safe} URL hidden: ambiguous or unparseable>"


def describe_database(url: str | URL) -> str:
    """The database ``url`` opens, as every message about it names it: the SQLite file's absolute path,
    or PostgreSQL's database, host, port and driver; never a user, a password, a query or the raw URL."""
    try:
        parsed = normalize_url(url)
    except errors.ConfigurationError:
        return "the configured database (its URL cannot be parsed)"
    if parsed.get_backend_name() == "sqlite":
        path = sqlite_file(parsed)
        return f"the SQLite file {path.absolute() if path else parsed.database}"
    server = f"{parsed.host or 'the local socket'}:{parsed.port or 5432}"
    if not parsed.database:
        return f"the PostgreSQL server {server} ({parsed.drivername}; the URL names no database)"
    return f"the PostgreSQL database {parsed.database!r} on {server} ({parsed.drivername})"


def upgrade_command(url: str | URL) -> str:
    """The exact command that installs or upgrades the joblease schema of ``url``'s database, the
    password shown as ``***`` (put it back, or pass ``--database-url "$VARIABLE"``)."""
    try:
        parsed = normalize_url(url)
    except errors.ConfigurationError:
        return "joblease --database-url URL db upgrade"
    if parsed.get_backend_name() == "sqlite":
        path = sqlite_file(parsed)
        if path is not None:
            parsed = parsed.set(database=str(path.absolute()))
    return f"joblease --database-url {shlex.quote(parsed.render_as_string(hide_password=True))} db upgrade"


def upgrade_advice(url: str | URL) -> str:
    """What fixes a schema that is not at head: the command for ``url``'s database, and what ``***``
    means when the URL holds a password."""
    command = f"run `{upgrade_command(url)}`"
    if ":***@" in command:  # render_as_string(hide_password=True) showed a password this way
        command += ' (the password shown as ***: put it back, or pass --database-url "$YOUR_VARIABLE")'
    return command + " or dagster_joblease.migrate(engine) on that database"


def _secret_pieces(url: str) -> set[str]:
    """What in ``url`` is or may be a credential, for :func:`scrub_secrets`: the password as parsed and,
    conservatively, everything from the user name's ':' to the LAST '@'; for an ambiguous URL (an unencoded
    '@'), also what a mis-parse made of it (the host, the database, the user name). Empty when the URL holds
    no password (a bare file name or a password-less URL is no secret)."""
    pieces: set[str] = set()
    try:
        parsed: URL | None = make_url(url)
    except Exception:
        parsed = None
    if parsed is not None and parsed.password:
        pieces.add(str(parsed.password))
    _, sep, rest = url.partition("://")
    if sep and "@" in rest:
        userinfo = rest[: rest.rfind("@")]
        _user, colon, password = userinfo.partition(":")
        if colon:
            pieces.add(password)
            if parsed is not None and _ambiguous(url, parsed):
                for value in (parsed.host, parsed.database, parsed.username):
                    if value:
                        pieces.add(str(value))
                pieces.add(userinfo)
    return {p for p in pieces if p}


def _as_token(piece: str) -> re.Pattern[str]:
    # A piece is replaced only where it stands as a token of its own (not inside a longer word), so a
    # one-letter password fragment such as "p" never turns "split" or "urllib.parse" into "s***lit".
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(piece)}(?![A-Za-z0-9])")


def scrub_secrets(text: str, url: str | URL | None) -> str:
    """``text`` with the URL's password redacted: the whole URL (if it holds a password) shown as
    :func:`redact_url` shows it, and its password, or any piece an ambiguous URL (an unencoded '@', '/',
    '#') could have put in a host name, a database name or a driver error, replaced by ``***`` wherever
    it stands as a token. A URL without a password changes nothing (``joblease.sqlite`` stays readable).

    Use it on every message that might quote a driver error or the configured URL (CLI, receiver).
    """
    if url is None:
        return text
    raw = url if isinstance(url, str) else url.render_as_string(hide_password=False)
    pieces = _secret_pieces(raw)
    if not pieces:
        return text
    text = text.replace(raw, redact_url(raw))
    for piece in sorted(pieces, key=len, reverse=True):
        text = _as_token(piece).sub("***", text)
    return text


def _enable_wal(cursor: Any) -> None:
    """Switch the file to WAL (a persistent, once-per-file setting).

    SQLite answers a journal-mode switch that races another connection with SQLITE_BUSY at once, without
    consulting busy_timeout, so several processes opening a fresh file at the same moment retry here.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    delay = 0.002
    while True:
        try:
            if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


def _install_sqlite_pragmas(engine: sa.Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not pysqlite, decide where transactions begin (see the "begin" hook).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        _enable_wal(cursor)
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        # BEGIN IMMEDIATE takes the write lock up front, so a read-then-write transaction (a claim) cannot
        # fail half-way with SQLITE_BUSY; writers simply queue behind busy_timeout.
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def create_engine(url: str | URL | None = None, **kwargs: Any) -> sa.Engine:
    """Create an engine configured for the joblease tables.

    ``url`` defaults to ``$JOBLEASE_DATABASE_URL``, then to the embedded SQLite file. PostgreSQL URLs use
    psycopg 3 (``postgresql://`` is rewritten to ``postgresql+psycopg://``). SQLite gets WAL, a busy
    timeout and ``BEGIN IMMEDIATE`` transactions, which is what makes it safe for several processes.
    """
    if url is None:
        url = os.environ.get(DATABASE_URL_ENV) or default_sqlite_url()
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:"):
            raise errors.ConfigurationError(
                "an in-memory SQLite database is private to one connection; use a file, e.g. "
                "sqlite:///joblease.sqlite"
            )
        Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(parsed, **kwargs)
        _install_sqlite_pragmas(engine)
        return fork_safe(engine)
    parsed, driver_args = _postgres_connect_args(parsed)
    if driver_args:
        kwargs["connect_args"] = {**driver_args, **kwargs.get("connect_args", {})}
    engine = sa.create_engine(parsed, **kwargs)
    fork_safe(engine)  # first: its checkout guard runs before the idle ping
    if "pool_pre_ping" not in kwargs:
        _install_idle_ping(engine)
    return engine


def _postgres_connect_args(url: URL) -> tuple[URL, dict[str, Any]]:
    """Driver options a URL cannot carry as text: ``?prepare_threshold=none`` (PgBouncer in transaction
    mode) becomes psycopg's ``prepare_threshold=None``; a 10 s connect timeout and
    :data:`APPLICATION_NAME` unless the URL (or ``$PGAPPNAME``) sets them."""
    if url.get_backend_name() != "postgresql":
        return url, {}
    args: dict[str, Any] = {}
    if "connect_timeout" not in url.query:
        args["connect_timeout"] = 10
    if "application_name" not in url.query and not os.environ.get("PGAPPNAME"):
        args["application_name"] = APPLICATION_NAME
    if "prepare_threshold" in url.query:
        raw = url.query["prepare_threshold"]
        text = (raw if isinstance(raw, str) else raw[-1]).strip().lower()
        if text in ("none", "null", ""):
            args["prepare_threshold"] = None
        elif text.isdigit():
            args["prepare_threshold"] = int(text)
        else:
            raise errors.ConfigurationError(
                f"prepare_threshold={text!r} in the database URL must be a non-negative integer or 'none' "
                "(none disables server-side prepared statements, as PgBouncer's transaction mode needs)"
            )
        url = url.difference_update_query(["prepare_threshold"])
    return url, args


def _install_idle_ping(engine: sa.Engine) -> None:
    """Ping a pooled connection on checkout only if it sat idle for a while.

    SQLAlchemy's ``pool_pre_ping`` pings on *every* checkout: one extra round trip per lease call, a
    quarter of a claim's cost. Connections die while idle (server restarts, firewalls and proxies cutting
    idle sockets), so pinging only those keeps the protection. A connection found dead is replaced (the
    pool retries on DisconnectionError); a failure on a busy connection surfaces once as StorageError and
    SQLAlchemy then recycles the pool.

    The listeners hold the dialect, never the engine: a pool copied from this one (``pool.recreate()``,
    as the claim connections do) must not keep the engine alive.
    """
    event.listen(engine, "checkin", _mark_idle)
    event.listen(engine, "checkout", _IdlePing(engine.dialect))


def _mark_idle(_dbapi_connection: Any, record: Any) -> None:
    record.info[_IDLE_SINCE] = time.monotonic()


class _IdlePing:
    """The checkout listener of :func:`_install_idle_ping` (a class, so it holds only the dialect)."""

    __slots__ = ("__weakref__", "dialect")  # SQLAlchemy keeps listeners by weak reference too

    def __init__(self, dialect: sa.Dialect) -> None:
        self.dialect = dialect

    def __call__(self, dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.get(_IDLE_SINCE)
        if idle_since is None or time.monotonic() - idle_since < IDLE_PING_AFTER_S:
            return
        try:
            self.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise sa.exc.DisconnectionError("pooled connection failed its ping") from exc


# -- fork safety -----------------------------------------------------------------------------------

#: The engines made fork-safe, held weakly: a forked child drops their pools (see _after_fork_in_child).
_FORK_SAFE: weakref.WeakSet[sa.Engine] = weakref.WeakSet()


def fork_safe(engine: sa.Engine) -> sa.Engine:
    """Make ``engine`` safe to use in a forked child (idempotent; returns it). :func:`create_engine` and
    every :class:`LeaseService` apply it; call it on an engine of your own that a child may inherit.

    SQLAlchemy's two recipes ("Using Connection Pools with Multiprocessing or os.fork()"): at a fork the
    child replaces the engine's pool by an empty one (``engine.dispose(close=False)``: the parent's
    connections are neither used nor closed by the child), and a connection checked out in another
    process than the one that opened it is discarded unclosed, the pool then opening a new one. A third
    guard covers what the recipes do not: a fork while a thread of the parent is inside the engine's
    one-time dialect initialization (see :class:`_DialectGuard`). The engine is held weakly and the
    listeners hold nothing of it but a weak reference.
    """
    if engine not in _FORK_SAFE:
        if not event.contains(engine, "checkout", _refuse_other_process):
            event.listen(engine, "connect", _record_process)
            event.listen(engine, "checkout", _refuse_other_process)
            event.listen(engine, "connect", _DialectGuard(engine))
            event.listen(engine, "engine_connect", _finish_dialect)
        _FORK_SAFE.add(engine)
    return engine


def _record_process(_dbapi_connection: Any, record: Any) -> None:
    record.info[_PID] = os.getpid()


def _refuse_other_process(_dbapi_connection: Any, record: Any, proxy: Any) -> None:
    pid = os.getpid()
    # A connection opened before the guard was installed is adopted by the process that checks it out
    # first; a fork's child never sees those (its pool was replaced at the fork).
    owner = record.info.setdefault(_PID, pid)
    if owner != pid:
        # Forget the socket without closing it (closing would end the parent's session), then let the
        # pool open a new connection.
        record.dbapi_connection = proxy.dbapi_connection = None
        raise sa.exc.DisconnectionError(f"connection belongs to process {owner}, not {pid}")


#: Dialects whose one-time initialization is known to have finished (in this process, or in the
#: parent before the fork that made it).
_DIALECT_READY: weakref.WeakSet[sa.Dialect] = weakref.WeakSet()
#: In a forked child: dialects the parent may have been initializing at the fork.
_DIALECT_UNSURE: weakref.WeakSet[sa.Dialect] = weakref.WeakSet()


class _DialectGuard:
    """A connect listener, after SQLAlchemy's own: notes that the dialect's initialization finished
    (unless this is a forked child whose parent may have been inside it at the fork: then
    :func:`_finish_dialect` finishes it).

    SQLAlchemy initializes an engine's dialect (server version, default isolation level, ...) once,
    from the pool's first connect, through a once-only wrapper that is used up *before* the
    initialization runs. A child forked while a thread of its parent is inside it inherits a
    half-initialized dialect and a used-up wrapper: nothing would ever finish it, and the child's first
    checkin fails (``'PGDialect_psycopg' object has no attribute 'default_isolation_level'``).
    """

    __slots__ = ("__weakref__", "engine")  # SQLAlchemy keeps listeners by weak reference too

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = weakref.ref(engine)

    def __call__(self, dbapi_connection: Any, record: Any) -> None:
        engine = self.engine()
        if engine is None:  # pragma: no cover - a pool outliving its engine
            return
        if engine.dialect not in _DIALECT_UNSURE:
            _DIALECT_READY.add(engine.dialect)


def _finish_dialect(connection: sa.Connection) -> None:
    """An ``engine_connect`` listener: in a forked child whose dialect may be half-initialized, run
    ``dialect.initialize`` on this connection (what ``sqlalchemy.create_engine``'s first connect does),
    then roll back what its queries began, before the caller uses it. Running it on a dialect that was in
    fact initialized only repeats the same queries and assignments."""
    dialect = connection.dialect
    if dialect in _DIALECT_UNSURE:
        dialect.initialize(connection)
        connection.rollback()
        _DIALECT_UNSURE.discard(dialect)
        _DIALECT_READY.add(dialect)


def ready_dialect(engine: sa.Engine) -> None:
    """Finish a half-initialized dialect now (a forked child's, see :func:`_finish_dialect`), for a caller
    about to use connections that do not come through ``Engine.connect`` (the autocommit pool's)."""
    if engine.dialect in _DIALECT_UNSURE:
        with engine.connect():
            pass


def _after_fork_in_child() -> None:
    for engine in list(_FORK_SAFE):
        try:
            if engine.dialect not in _DIALECT_READY:
                _DIALECT_UNSURE.add(engine.dialect)
            engine.dispose(close=False)
        except Exception:  # pragma: no cover - never break the child's start; the pid guard still holds
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)


def first_line(exc: BaseException) -> str:
    """A driver error's first line (its type's name when it has no text): what a StorageError quotes."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


#: What the server says when a session's prepared statements are not where the client left them.
_PREPARED_STATEMENT_HINT = (
    "the server session lacks a prepared statement this connection made, or already has one of that "
    "name: the connection goes through a pooler in transaction mode (PgBouncer pool_mode = transaction), "
    "which runs each transaction on any server connection. Add prepare_threshold=none to the database "
    "URL (e.g. postgresql+psycopg://user@pgbouncer:6432/db?prepare_threshold=none; your own psycopg "
    "connections take psycopg.connect(..., prepare_threshold=None)); see docs/operations.md section 2"
)


def _is_prepared_statement_error(exc: BaseException | None) -> bool:
    """42P05 / 26000, or a Bind that met another client's statement of the same name (08P01)."""
    if isinstance(exc, psycopg.errors.DuplicatePreparedStatement | psycopg.errors.InvalidSqlStatementName):
        return True
    return isinstance(exc, psycopg.errors.ProtocolViolation) and "prepared statement" in str(exc)


def is_psycopg(dialect: sa.Dialect) -> bool:
    """PostgreSQL through psycopg 3: the one dialect the driver-level fast paths (autocommit claims, the
    pause refresh, a caller's transaction written on its driver connection) run on."""
    return dialect.name == "postgresql" and dialect.driver == "psycopg"


def translate_errors(action: str) -> contextlib.AbstractContextManager[None]:
    """Re-raise driver errors as :class:`StorageError` naming the action, never the URL.

    Covers SQLAlchemy's wrapped errors and raw psycopg errors (the hot paths that run compiled SQL on
    the pooled driver connection). A prepared statement missing or duplicated on the server (PgBouncer
    in transaction mode without ``?prepare_threshold=none``) is a :class:`ConfigurationError` naming
    the setting instead: retrying cannot fix it. (A small class, not a generator: every claim and
    enqueue enters one, and a generator's context manager cost several times as much.)
    """
    return _Translating(action)


class _Translating:
    __slots__ = ("action",)

    def __init__(self, action: str) -> None:
        self.action = action

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            return
        error = translated(exc, self.action)
        if error is not None:
            raise error from exc


def translated(exc: BaseException, action: str) -> Exception | None:
    """The library's error for the driver error ``exc`` met while trying to ``action`` (see
    :func:`translate_errors`); None when ``exc`` is not a driver error."""
    if isinstance(exc, sa.exc.DBAPIError):
        driver_error = exc.orig or exc
        if _is_prepared_statement_error(driver_error):
            return errors.ConfigurationError(
                f"database error while trying to {action}: {first_line(driver_error)}; "
                f"{_PREPARED_STATEMENT_HINT}"
            )
        return errors.StorageError(f"database error while trying to {action}: {first_line(driver_error)}")
    if isinstance(exc, psycopg.Error):
        if _is_prepared_statement_error(exc):
            return errors.ConfigurationError(
                f"database error while trying to {action}: {first_line(exc)}; {_PREPARED_STATEMENT_HINT}"
            )
        return errors.StorageError(f"database error while trying to {action}: {first_line(exc)}")
    if isinstance(exc, sa.exc.SQLAlchemyError):
        return errors.StorageError(f"database error while trying to {action}: {type(exc).__name__}")
    return None
