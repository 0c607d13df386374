"""``JobLeaseResource``: the joblease engine, lease service and outbox for Dagster ops, sensors and assets.

Two PostgreSQL drivers live side by side on purpose. This resource's engine uses psycopg 3
(``postgresql+psycopg://``; a bare ``postgresql://`` is read as psycopg 3). Dagster's *own* storage on
PostgreSQL (``dagster.yaml``, dagster-postgres) must be spelled ``postgresql+psycopg2://``: with
SQLAlchemy 2.1 a bare ``postgresql://`` means psycopg 3 there too, and dagster-postgres breaks on it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import dagster as dg
import sqlalchemy as sa
from pydantic import Field, PrivateAttr

from dagster_joblease import exclusive, identity, lease, options, outbox
from dagster_joblease.storage import engine as storage_engine
from dagster_joblease.storage.migrate import current_revision, head_revision, migrate, require_schema

__all__ = ["JobLeaseResource"]

T = TypeVar("T")


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
    lease_ms: int | None = Field(default=None, description="Lease length in ms (default 15 minutes).")
    heartbeat_ms: int | None = Field(
        default=None, description="Renewal interval in ms (default min(60 s, lease_ms / 3); 0: none)."
    )
    migrate_on_first_use: bool = Field(
        default=True,
        description="Upgrade the joblease schema when the resource starts; if false, require it at head.",
    )

    _engine: sa.Engine | None = PrivateAttr(default=None)
    _service: lease.LeaseService | None = PrivateAttr(default=None)

    # -- lifecycle ---------------------------------------------------------------------------------

    def resolved_url(self) -> str:
        """The URL this resource connects to (may hold a password: never log it, use redact_url)."""
        return (
            self.database_url
            or os.environ.get(storage_engine.DATABASE_URL_ENV)
            or storage_engine.default_sqlite_url()
        )

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._start()

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        self.close()

    def _start(self) -> None:
        # Validate the timing before any connection is opened: bad options must not touch the database.
        options.resolve_timing(self.lease_ms, self.heartbeat_ms)
        engine = storage_engine.create_engine(self.resolved_url())
        try:
            if self.migrate_on_first_use:
                if current_revision(engine) != head_revision():
                    migrate(engine)
            else:
                require_schema(engine)
            service = lease.LeaseService(engine, lease_ms=self.lease_ms, heartbeat_ms=self.heartbeat_ms)
        except BaseException:
            engine.dispose()
            raise
        self._engine = engine
        self._service = service

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
        self, connection: sa.Connection, *, idempotency_key: str, topic: str, payload: Any
    ) -> bool:
        """Add an outbox row in ``connection``'s transaction; False when the same row is already there."""
        return outbox.enqueue_once(connection, idempotency_key=idempotency_key, topic=topic, payload=payload)

    def run_exclusive(
        self, job: identity.JobIdentity, fn: Callable[[lease.Lease], T]
    ) -> exclusive.ExclusiveOutcome[T]:
        """``LeaseService.run_exclusive`` with this resource's timing."""
        return self.lease_service.run_exclusive(job, fn)

    def due_summary(self) -> outbox.DueSummary:
        """The outbox's due rows, in one indexed query (what the dispatch sensor polls)."""
        return outbox.due_summary(self.engine)
