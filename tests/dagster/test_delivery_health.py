"""``outbox.delivery_health``: what the delivery checks read, per location's topics, on both backends."""

from __future__ import annotations

import sqlalchemy as sa

from dagster_joblease import create_engine, outbox
from dagster_joblease.storage.clock import db_now_plus_ms
from dagster_joblease.storage.schema import outbox_table
from tests.conftest import wait_until


def test_delivery_health_counts_only_the_routed_topics_and_warns_about_the_rest(db_url: str) -> None:
    engine = create_engine(db_url)
    try:
        t = outbox_table
        with engine.begin() as conn:
            for key, topic in [("a1", "a"), ("a2", "a"), ("a3", "a"), ("a4", "a"), ("b1", "b"), ("c1", "c")]:
                outbox.enqueue_once(conn, idempotency_key=f"v2:{key}", topic=topic, payload={"k": key})
            conn.execute(sa.update(t).where(t.c.idempotency_key == "v2:a2").values(status="DEAD", attempts=1))
            conn.execute(  # failed once, waiting out its backoff: retrying, not due
                sa.update(t)
                .where(t.c.idempotency_key == "v2:a3")
                .values(attempts=1, last_error="HTTP 503", next_attempt_at=db_now_plus_ms(60_000))
            )
        wait_until(lambda: outbox.delivery_health(engine, topics=["a"], unrouted_after_ms=0).unrouted == 2)

        health = outbox.delivery_health(engine, topics=["a"], unrouted_after_ms=0)
        assert (health.due, health.retrying, health.dead) == (2, 1, 1)
        assert health.oldest_due_age_ms is not None and health.oldest_due_age_ms >= 0
        assert (health.unrouted, health.unrouted_topics) == (2, ("b", "c"))

        patient = outbox.delivery_health(engine, topics=["a"], unrouted_after_ms=3_600_000)
        assert (patient.unrouted, patient.unrouted_topics, patient.oldest_unrouted_age_ms) == (0, (), None)

        everything = outbox.delivery_health(engine)  # one location routing every topic
        assert (everything.due, everything.retrying, everything.dead, everything.unrouted) == (4, 1, 1, 0)

        nothing = outbox.delivery_health(engine, topics=[], unrouted_after_ms=0)
        assert (nothing.due, nothing.dead, nothing.unrouted) == (0, 0, 5)
    finally:
        engine.dispose()
