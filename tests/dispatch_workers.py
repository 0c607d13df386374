"""Dispatcher processes for the dispatch tests (module-level so ``multiprocessing`` spawn can import them).

Each worker writes its totals (and the ``action`` of every log record it emitted) as JSON to ``result_path``
when it finishes, so the test can report what each process did.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from typing import Any

import sqlalchemy as sa

from dagster_joblease import errors
from dagster_joblease.dispatch import Dispatcher, DispatchReport, Route
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.schema import outbox_table


class _ActionCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.actions: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.actions[str(getattr(record, "action", "-"))] += 1


def _setup(database_url: str, application_name: str | None) -> tuple[sa.Engine, _ActionCounter]:
    counter = _ActionCounter()
    logging.getLogger("dagster_joblease").addHandler(counter)
    logging.getLogger("dagster_joblease").setLevel(logging.INFO)
    kwargs: dict[str, Any] = {}
    if application_name and database_url.startswith("postgresql"):
        kwargs["connect_args"] = {"application_name": application_name}
    return create_engine(database_url, **kwargs), counter


def _routes(spec: dict[str, dict[str, Any]]) -> dict[str, Route]:
    """Routes from plain dicts: ``url`` plus any other :class:`Route` option (timeout_s, max_in_flight…)."""
    return {topic: Route(r["url"], **{k: v for k, v in r.items() if k != "url"}) for topic, r in spec.items()}


def _write(result_path: str, report: DispatchReport, counter: _ActionCounter, **extra: Any) -> None:
    data = {
        "claimed": report.claimed,
        "sent": report.sent,
        "retried": report.retried,
        "dead": report.dead,
        "lost_claims": report.lost_claims,
        "released": report.released,
        "unrecorded": report.unrecorded,
        "actions": dict(counter.actions),
        **extra,
    }
    with open(result_path, "w") as f:
        json.dump(data, f)


def _pending(engine: sa.Engine) -> int:
    t = outbox_table
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count()).select_from(t).where(t.c.status == "PENDING")
            ).scalar_one()
        )


def drain(
    database_url: str,
    routes: dict[str, dict[str, Any]],
    options: dict[str, Any],
    result_path: str,
    limit: int = 500,
    application_name: str | None = None,
) -> None:
    """Dispatch until no row is PENDING (due or waiting out a backoff), then write the totals and the
    moment (``time.monotonic()``, one clock for every process of the machine) each request was sent."""
    engine, counter = _setup(database_url, application_name)
    totals = DispatchReport()
    sent_at: list[float] = []
    with Dispatcher(engine, _routes(routes), **options) as dispatcher:
        # httpx calls request hooks just before the request goes to the transport.
        dispatcher._client.event_hooks["request"].append(lambda _request: sent_at.append(time.monotonic()))
        started = time.time()
        while True:
            try:
                report = dispatcher.dispatch(limit)
                totals = totals.merge(report)
                if report.claimed == 0 and _pending(engine) == 0:
                    break
            except errors.StorageError:
                time.sleep(0.1)
                continue
            if report.claimed == 0:
                time.sleep(0.02)
        finished = time.time()
    _write(result_path, totals, counter, started=started, finished=finished, sent_at=sent_at)
    engine.dispose()


def run_loop(
    database_url: str,
    routes: dict[str, dict[str, Any]],
    options: dict[str, Any],
    result_path: str,
    limit: int = 100,
    application_name: str | None = None,
    poll_interval_s: float = 0.05,
) -> None:
    """``Dispatcher.run`` until SIGTERM (this is the process's main thread), then write the totals."""
    engine, counter = _setup(database_url, application_name)
    with Dispatcher(engine, _routes(routes), **options) as dispatcher:
        totals = dispatcher.run(poll_interval_s=poll_interval_s, limit=limit)
    _write(result_path, totals, counter, stopped_cleanly=True)
    engine.dispose()


# -- helpers shared by the dispatch tests ------------------------------------------------------------


def enqueue_many(engine: sa.Engine, count: int, *, topic: str = "work", prefix: str = "v2:row") -> list[str]:
    """Enqueue ``count`` rows through the real ``enqueue_once`` in one transaction; returns their keys."""
    from dagster_joblease.outbox import enqueue_once

    keys = [f"{prefix}-{i:05d}" for i in range(count)]
    with engine.begin() as conn:
        for i, key in enumerate(keys):
            enqueue_once(conn, idempotency_key=key, topic=topic, payload={"v": 1, "n": i})
    return keys


def status_counts(engine: sa.Engine) -> dict[str, int]:
    t = outbox_table
    with engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.status, sa.func.count()).group_by(t.c.status))
        return {status: int(n) for status, n in rows}


def keys_requested_more_than_once(engine: sa.Engine) -> dict[str, int]:
    from dagster_joblease.receiver.app import request_table as r

    stmt = (
        sa.select(r.c.idempotency_key, sa.func.count())
        .group_by(r.c.idempotency_key)
        .having(sa.func.count() > 1)
    )
    with engine.connect() as conn:
        return {key: int(n) for key, n in conn.execute(stmt)}


def statuses_answered(engine: sa.Engine) -> dict[int | None, int]:
    from dagster_joblease.receiver.app import request_table as r

    with engine.connect() as conn:
        rows = conn.execute(sa.select(r.c.status_code, sa.func.count()).group_by(r.c.status_code))
        return {status: int(n) for status, n in rows}
