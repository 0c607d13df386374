"""``JobLeaseResource``: the joblease engine, lease service and outbox for Dagster ops, sensors and assets.

Two PostgreSQL drivers live side by side on purpose. This resource's engine uses psycopg 3
(``postgresql+psycopg://``; a bare ``postgresql://`` is read as psycopg 3). Dagster's *own* storage on
PostgreSQL (``dagster.yaml``, dagster-postgres) must be spelled ``postgresql+psycopg2://``: with
SQLAlchemy 2.1 a bare ``postgresql://`` means psycopg 3 there too, and dagster-postgres breaks on it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import dagster as dg
import sqlalchemy as sa
from pydantic import Field, PrivateAttr

from dagster_joblease import checks, errors, identity, lease, options, outbox
from dagster_joblease.dagster import holders
from dagster_joblease.storage import engine as storage_engine
from dagster_joblease.storage.migrate import current_revision, head_revision, migrate, require_schema

__all__ = [
    "DAGSTER_DEFAULT_HEARTBEAT_MS",
    "DAGSTER_DEFAULT_HELD_WAIT_MS",
    "DAGSTER_DEFAULT_LEASE_MS",
    "JobLeaseResource",
    "check_held_wait_ms",
]

T = TypeVar("T")

#: Dagster-side defaults: a dead holder on this instance is taken over after about two heartbeats
#: (20 s) once its run is finished; one on another deployment after at most the lease (3 minutes).
DAGSTER_DEFAULT_LEASE_MS = 3 * 60_000
DAGSTER_DEFAULT_HEARTBEAT_MS = 10_000
#: How long a run that finds its partition held waits for the holder: longer than the default lease, so
#: a dead holder anywhere is taken over within one wait.
DAGSTER_DEFAULT_HELD_WAIT_MS = 5 * 60_000
MAX_HELD_WAIT_MS = 24 * 3_600_000


def check_held_wait_ms(value: object) -> int:
    """``held_wait_ms``: 0 (do not wait) up to a day, as an int number of milliseconds."""
    return checks.milliseconds(
        "held_wait_ms",
        value,
        maximum=MAX_HELD_WAIT_MS,
        why="0 fails at once, a day at most",
        error=checks.lease_option,
    )


class JobLeaseResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Leases and the transactional outbox for Dagster.

    Example::

        defs = dg.Definitions(
            jobs=[daily_billing_job],
            resources={"joblease": JobLeaseResource(database_url=dg.EnvVar("JOBLEASE_DATABASE_URL"))},
        )

    With ``database_url`` unset (or empty) the resource reads ``$JOBLEASE_DATABASE_URL`` when the run
    starts and otherwise uses the embedded SQLite file under ``$DAGSTER_HOME`` (or ``./.joblease/``).
    Note: Dagster's own storage on PostgreSQL must use ``postgresql+psycopg2://``; this resource uses
    psycopg 3 (``postgresql+psycopg://``).
    """

    database_url: str | None = Field(
        default=None,
        description=(
            "SQLAlchemy URL of the joblease tables (postgresql+psycopg://… or sqlite:///…). Unset: "
            "$JOBLEASE_DATABASE_URL, else an SQLite file under $DAGSTER_HOME or ./.joblease/."
        ),
    )
    lease_ms: int | None = Field(
        default=None, description="Lease length in ms (default 3 minutes inside Dagster)."
    )
    heartbeat_ms: int | None = Field(
        default=None,
        description=(
            "Renewal interval in ms (default min(10 s, lease_ms / 3); 0: none). A finished run's lease "
            "is taken over once its heartbeat is older than twice this."
        ),
    )
    held_wait_ms: int | None = Field(
        default=None,
        description=(
            "How long a run that finds its partition held by a live lease waits for the holder before it "
            "fails as 'held' (default 5 minutes; leased_op/leased_asset can override it)."
        ),
    )
    deployment: str | None = Field(
        default=None,
        description=(
            "This deployment's name in lease holders (dagster:<deployment>/<run_id>); default "
            "'storage-' + the start of the instance's run storage id."
        ),
    )
    migrate_on_first_use: bool = Field(
        default=True,
        description="Upgrade the joblease schema when the resource starts; if false, require it at head.",
    )

    _engine: sa.Engine | None = PrivateAttr(default=None)
    _service: lease.LeaseService | None = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        self.check_url_parses()

    def check_url_parses(self) -> None:
        """Refuse, when the definitions load, a URL that cannot even be parsed (a typo in
        ``$JOBLEASE_DATABASE_URL`` or in ``database_url``), rather than at the first run. A variable named
        by ``dg.EnvVar`` that is unset here is left to the run, which may have it."""
        raw = self.database_url
        if isinstance(raw, dg.EnvVar):
            raw = os.environ.get(raw.env_var_name) or None
        url = raw or os.environ.get(storage_engine.DATABASE_URL_ENV)
        if url:
            try:
                storage_engine.normalize_url(url)
            except errors.ConfigurationError as exc:
                raise errors.ConfigurationError(f"JobLeaseResource: {self._url_source()}: {exc}") from None

    # -- lifecycle ---------------------------------------------------------------------------------

    def resolved_url(self) -> str:
        """The URL this resource connects to (may hold a password: never log it, use redact_url)."""
        return (
            self.database_url
            or os.environ.get(storage_engine.DATABASE_URL_ENV)
            or storage_engine.default_sqlite_url()
        )

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        # A run connects (and migrates) before its first step, so a bad URL fails the run at once. A tick
        # (schedule or sensor: no run) connects on first use, so one that can do without the database
        # (a leased schedule whose look-up fails requests its run anyway) is not failed by an outage.
        if context.dagster_run is None:
            self.timing()
            self.resolved_held_wait_ms()
            return
        self._start()
        warning = self.embedded_state_warning(context.instance)
        if warning is not None and context.log is not None:
            context.log.warning(warning)

    def uses_embedded_default(self) -> bool:
        """True when neither ``database_url`` nor ``$JOBLEASE_DATABASE_URL`` is set: the SQLite default."""
        return not (self.database_url or os.environ.get(storage_engine.DATABASE_URL_ENV))

    def embedded_state_warning(self, instance: dg.DagsterInstance | None) -> str | None:
        """What a run says when its leases live in the embedded default file but Dagster's runs do not
        last as long: a temporary instance (``dg dev`` or ``dg launch`` without ``$DAGSTER_HOME``, an
        in-process run) discards its runs, the leases stay, and a later run of a done partition is
        skipped naming a run no instance has. With ``$DAGSTER_HOME`` set, what runs made without it left
        in ``./.joblease/`` (they are not seen). None when the leases live with a lasting instance."""
        if not self.uses_embedded_default():
            return None
        temporary = instance is not None and instance.is_ephemeral
        url = storage_engine.default_sqlite_url(create=False)
        if os.environ.get("DAGSTER_HOME") and not temporary:
            return self._left_behind_warning(url)
        runs = (
            "this Dagster instance keeps its runs in memory"
            if temporary
            else "$DAGSTER_HOME is unset, so this Dagster instance is a temporary one"
        )
        return (
            f"joblease: this run's leases are kept in {storage_engine.describe_database(url)} (the embedded "
            f"default: neither the resource's database_url nor ${storage_engine.DATABASE_URL_ENV} is set), "
            f"but {runs}: its runs are discarded when it goes, the leases stay. A later run of a partition "
            "done here will be skipped, naming a run no instance has. Set DAGSTER_HOME to a lasting folder "
            f"(the leases then live in $DAGSTER_HOME/joblease.sqlite) or ${storage_engine.DATABASE_URL_ENV}."
        )

    @staticmethod
    def _left_behind_warning(url: str) -> str | None:
        """``$DAGSTER_HOME`` is set now, but runs made without it left leases in ``./.joblease/``: these
        runs do not see them (a partition done there is done again here), which must not pass silently."""
        earlier = Path.cwd() / ".joblease" / "joblease.sqlite"
        used = storage_engine.sqlite_file(url)
        if not earlier.is_file() or (used is not None and used.absolute() == earlier.absolute()):
            return None
        return (
            f"joblease: this run's leases are kept in {storage_engine.describe_database(url)}, but "
            f"{earlier} holds leases from runs made here without DAGSTER_HOME, which this run does not see: "
            "a partition done there is not known done here. Move that file to "
            f"{used or 'the database above'} (before any run writes there) if those runs are the history "
            "you mean to keep, or delete the .joblease folder."
        )

    def absent_winner_note(self, run_id: str, code: str, partition_key: str | None) -> str:
        """What a skip adds when the run that did the key is not on this Dagster instance."""
        url = self.resolved_url()
        key = f"{code}@{partition_key}" if partition_key else f"{code} (initial)"
        show = (
            f"joblease --database-url {shlex.quote(storage_engine.redact_url(url))} leases show "
            f"--code {shlex.quote(code)}"
            + (f" --run-key {shlex.quote(partition_key)}" if partition_key else "")
        )
        return (
            f"joblease: run {run_id}, which did {key}, is not on this Dagster instance: the lease in "
            f"{storage_engine.describe_database(url)} outlived the instance that ran it (a temporary "
            "instance, or another deployment sharing the database), so its run link leads nowhere here. "
            f"The key is done and is not done again; `{show}` shows the lease, `joblease leases fail` "
            "with the same options makes the next run redo it."
        )

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        self.close()

    def timing(self) -> options.LeaseTiming:
        """The lease length and heartbeat with the Dagster-side defaults (3 minutes, 10 s)."""
        lease_ms = DAGSTER_DEFAULT_LEASE_MS if self.lease_ms is None else self.lease_ms
        heartbeat_ms = self.heartbeat_ms
        if heartbeat_ms is None and isinstance(lease_ms, int) and not isinstance(lease_ms, bool):
            heartbeat_ms = min(DAGSTER_DEFAULT_HEARTBEAT_MS, options.default_heartbeat_ms(lease_ms))
        return options.resolve_timing(lease_ms, heartbeat_ms)

    def resolved_held_wait_ms(self) -> int:
        return (
            DAGSTER_DEFAULT_HELD_WAIT_MS
            if self.held_wait_ms is None
            else check_held_wait_ms(self.held_wait_ms)
        )

    def resolved_deployment(self, instance: dg.DagsterInstance) -> str:
        """The deployment label for holders: the configured one, else derived from ``instance``."""
        if self.deployment is not None:
            return holders.validate_deployment(self.deployment)
        return holders.default_deployment(instance)

    def _start(self) -> None:
        # Validate the options before any connection is opened: bad options must not touch the database.
        timing = self.timing()
        self.resolved_held_wait_ms()
        if self.deployment is not None:
            holders.validate_deployment(self.deployment)
        url = self.resolved_url()
        try:
            engine = storage_engine.create_engine(url)
        except errors.ConfigurationError as exc:  # the message says it all: our frames add nothing
            raise errors.ConfigurationError(f"JobLeaseResource: {self._url_source()}: {exc}") from None
        try:
            if self.migrate_on_first_use:
                if current_revision(engine) != head_revision():
                    migrate(engine)
            else:
                require_schema(engine)
            service = lease.LeaseService(engine, lease_ms=timing.lease_ms, heartbeat_ms=timing.heartbeat_ms)
        except errors.SchemaNotAtHeadError as exc:
            engine.dispose()
            raise errors.SchemaNotAtHeadError(
                db_revision=exc.db_revision,
                head_revision=exc.head_revision,
                database=f"{storage_engine.describe_database(url)} ({self._url_source()})",
                advice=storage_engine.upgrade_advice(url),
            ) from None
        except errors.StorageError as exc:
            engine.dispose()
            # The message carries the driver's first line; the chain would add only our own frames and
            # SQLAlchemy's (hundreds of lines in a run's failure), so it is dropped.
            raise errors.StorageError(self.unreachable_message(url, exc)) from None
        except BaseException:
            engine.dispose()
            raise
        self._engine = engine
        self._service = service

    def _url_source(self) -> str:
        if isinstance(self.database_url, dg.EnvVar):
            return f"the URL in ${self.database_url.env_var_name} (its database_url)"
        if self.database_url:
            return "the URL in its database_url"
        if os.environ.get(storage_engine.DATABASE_URL_ENV):
            return f"the URL in ${storage_engine.DATABASE_URL_ENV}"
        return f"the default SQLite file (${storage_engine.DATABASE_URL_ENV} is unset)"

    def unreachable_message(self, url: str, exc: BaseException) -> str:
        """What a run or tick says when the joblease database cannot be reached: the resource, where
        its URL came from, the database (never the user or password) and the variable to fix."""
        where = storage_engine.describe_database(url)
        detail = storage_engine.scrub_secrets(str(exc), url)
        return (
            f"JobLeaseResource cannot use the joblease database ({where}, {self._url_source()}): {detail}. "
            f"Check ${storage_engine.DATABASE_URL_ENV} (or the resource's database_url) and that the "
            "database is reachable from here."
        )

    def close(self) -> None:
        """Dispose of the engine (Dagster calls this after each run and each sensor tick)."""
        if self._engine is not None:
            self._engine.dispose()
        self._engine = None
        self._service = None

    # -- what ops use ------------------------------------------------------------------------------

    @property
    def engine(self) -> sa.Engine:
        if self._engine is None:
            self._start()
        assert self._engine is not None
        return self._engine

    @property
    def lease_service(self) -> lease.LeaseService:
        if self._service is None:
            self._start()
        assert self._service is not None
        return self._service

    @contextlib.contextmanager
    def transaction(self, held: lease.Lease | None = None) -> Iterator[sa.Connection]:
        """One transaction for a domain change and its outbox row; fenced by ``held`` when given."""
        if held is None:
            with self.engine.begin() as connection:
                yield connection
        else:
            with self.lease_service.fenced_transaction(held) as connection:
                yield connection

    def enqueue_once(
        self,
        connection: sa.Connection,
        *,
        idempotency_key: str,
        topic: str,
        payload: Any,
        ordering_key: str | None = None,
    ) -> bool:
        """Add an outbox row in ``connection``'s transaction; False when the same row is already there.
        ``ordering_key``: see :func:`dagster_joblease.outbox.enqueue_once`."""
        return outbox.enqueue_once(
            connection,
            idempotency_key=idempotency_key,
            topic=topic,
            payload=payload,
            ordering_key=ordering_key,
        )

    def run_exclusive(
        self, job: identity.JobIdentity, fn: Callable[[lease.Lease], T]
    ) -> lease.ExclusiveOutcome[T]:
        """``LeaseService.run_exclusive`` with this resource's timing."""
        return self.lease_service.run_exclusive(job, fn)

    def due_summary(self) -> outbox.DueSummary:
        """The outbox's due rows, in one indexed query (what the dispatch sensor polls)."""
        return outbox.due_summary(self.engine)
