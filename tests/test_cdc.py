"""The CDC hand-over (dagster_joblease.cdc): events in Debezium's Outbox Event Router shape, and the contract
with PostgreSQL's own logical decoding (what Debezium reads) on a throwaway cluster with wal_level=logical:
exactly one INSERT per event, in commit order per key, no UPDATE of an event row, nothing from a rolled-back
transaction."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from benchmarks.private_pg import private_server
from dagster_joblease import errors, tracing
from dagster_joblease.admin import purge_events
from dagster_joblease.cdc import enqueue_event, span_context_properties
from dagster_joblease.storage.engine import create_engine
from dagster_joblease.storage.migrate import migrate
from dagster_joblease.storage.schema import outbox_event_table, outbox_table

ROOT = Path(__file__).resolve().parent.parent
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("traceparent", "tracestate", "text"),
    [
        (None, None, None),
        ("00-zz", None, None),  # not a traceparent: nothing
        (PARENT, None, f"traceparent={PARENT}\n"),
        # Properties.store's escapes: '=' and ':' in a value (a tracestate's own separators)
        (PARENT, "vendor=x:y,b=c", f"traceparent={PARENT}\ntracestate=vendor\\=x\\:y,b\\=c\n"),
    ],
)
def test_span_context_properties(traceparent: str | None, tracestate: str | None, text: str | None) -> None:
    assert span_context_properties(tracing.TraceContext(traceparent, tracestate)) == text


def _event(engine: sa.Engine, key: str) -> tuple[str, str, str, str, object, str | None] | None:
    t = outbox_event_table
    columns = (t.c.id, t.c.aggregatetype, t.c.aggregateid, t.c.type, t.c.payload, t.c.tracingspancontext)
    with engine.connect() as conn:
        row = conn.execute(sa.select(*columns).where(t.c.id == key)).first()
    return None if row is None else (row[0], row[1], row[2], row[3], row[4], row[5])


def test_an_event_is_written_once_with_the_routers_columns(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        assert enqueue_event(conn, idempotency_key="k1", topic="orders", payload={"n": 1}, ordering_key="c-1")
        assert enqueue_event(conn, idempotency_key="k2", topic="orders", payload={"n": 2})
    with engine.begin() as conn:  # a repeat: nothing written
        assert not enqueue_event(
            conn, idempotency_key="k1", topic="orders", payload={"n": 1}, ordering_key="c-1"
        )
    assert _event(engine, "k1") == ("k1", "orders", "c-1", "orders", {"n": 1}, None)
    assert _event(engine, "k2") == ("k2", "orders", "k2", "orders", {"n": 2}, None)  # key = the id
    for change in ({"payload": {"n": 9}}, {"topic": "other"}, {"ordering_key": "c-9"}):
        arguments = {"idempotency_key": "k1", "topic": "orders", "payload": {"n": 1}, "ordering_key": "c-1"}
        with pytest.raises(errors.OutboxConflictError), engine.begin() as conn:
            enqueue_event(conn, **{**arguments, **change})  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidOrderingKeyError), engine.begin() as conn:
        enqueue_event(conn, idempotency_key="k3", topic="orders", payload={}, ordering_key=" c ")
    with pytest.raises(errors.InvalidPayloadError), engine.begin() as conn:
        enqueue_event(conn, idempotency_key="k3", topic="orders", payload={"x": float("nan")})
    with engine.connect() as conn:  # the dispatcher's table is untouched: nothing to deliver
        assert conn.execute(sa.select(sa.func.count()).select_from(outbox_table)).scalar_one() == 0


def test_purge_events_keeps_the_minimum_retention(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        enqueue_event(conn, idempotency_key="old", topic="orders", payload={})
    with pytest.raises(errors.RetentionWindowError, match="CDC events written"):
        purge_events(engine, older_than_ms=1_000, min_retention_ms=60_000)
    assert purge_events(engine, older_than_ms=3_600_000, min_retention_ms=60_000) == 0
    assert purge_events(engine, older_than_ms=0, min_retention_ms=0, dry_run=True) == 1
    assert purge_events(engine, older_than_ms=0, min_retention_ms=0) == 1
    assert _event(engine, "old") is None


def test_the_cli_purges_events_past_the_minimum_retention(db_url: str, engine: sa.Engine) -> None:
    from click.testing import CliRunner

    from dagster_joblease.cli import main

    with engine.begin() as conn:
        enqueue_event(conn, idempotency_key="old", topic="orders", payload={})

    def purge(*args: str) -> tuple[int, str]:
        done = CliRunner().invoke(main, ["--database-url", db_url, "outbox", "purge-events", *args])
        return done.exit_code, done.output

    code, output = purge("--written-before", "1h")  # below the default 24h retention
    assert code != 0 and "CDC events written" in output and "Nothing was deleted" in output
    assert purge("--written-before", "0s", "--min-retention", "0s", "--dry-run") == (
        0,
        "would delete 1 CDC event(s)\n",
    )
    assert purge("--written-before", "0s", "--min-retention", "0s") == (0, "deleted 1 CDC event(s)\n")
    assert _event(engine, "old") is None


# -- the contract with logical decoding ----------------------------------------------------------------


@pytest.fixture(scope="module")
def logical_url() -> Iterator[str]:
    """A throwaway cluster of this module's own with ``wal_level = logical`` (the shared server's is
    ``replica``), migrated."""
    with private_server(settings=("wal_level=logical", "max_replication_slots=4")) as url:
        engine = create_engine(url)
        migrate(engine)
        engine.dispose()
        yield url


_CHANGE = re.compile(r"table public\.joblease_outbox_event: (?P<op>INSERT|UPDATE|DELETE): (?P<rest>.*)", re.S)


def _field(rest: str, name: str) -> str | None:
    found = re.search(rf"\b{name}\[[^\]]+\]:(?:'(?P<text>(?:[^']|'')*)'|(?P<null>null))", rest)
    assert found is not None, (name, rest)
    return None if found["null"] else found["text"].replace("''", "'")


def _changes(engine: sa.Engine, slot: str) -> list[tuple[str, str | None, str]]:
    """(operation, id, the change's text) of every change to the event table the slot decoded, in order."""
    with engine.connect() as conn:
        lines = conn.execute(
            sa.text("SELECT data FROM pg_logical_slot_get_changes(:slot, NULL, NULL)"), {"slot": slot}
        ).scalars()
        changes = []
        for line in lines:
            match = _CHANGE.match(line)
            if match is not None:
                id_ = _field(match["rest"], "id") if match["op"] == "INSERT" else None
                changes.append((match["op"], id_, match["rest"]))
        conn.commit()
    return changes


def test_logical_decoding_sees_one_insert_per_event_in_commit_order_and_nothing_else(
    logical_url: str,
) -> None:
    engine = create_engine(logical_url)
    slot = "joblease_cdc_contract"
    try:
        with engine.connect() as conn:
            conn.execute(
                sa.text("SELECT pg_create_logical_replication_slot(:s, 'test_decoding')"), {"s": slot}
            )
            conn.commit()
        producer = NonRecordingSpan(
            SpanContext(TRACE_ID, 0xB7AD6B7169203331, False, TraceFlags(1), TraceState([("vendor", "x:y")]))
        )
        with trace.use_span(producer), engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS shop_order (n int)"))
            conn.execute(sa.text("INSERT INTO shop_order VALUES (1)"))  # the domain change beside it
            assert enqueue_event(
                conn, idempotency_key="k1", topic="orders", payload={"n": 1}, ordering_key="c-1"
            )
        with engine.begin() as conn:  # a repeat writes nothing
            assert not enqueue_event(
                conn, idempotency_key="k1", topic="orders", payload={"n": 1}, ordering_key="c-1"
            )
        with engine.connect() as conn:  # rolled back: nothing reaches the WAL's committed stream
            enqueue_event(conn, idempotency_key="k2", topic="orders", payload={"n": 2}, ordering_key="c-1")
            conn.rollback()
        # Two transactions on one key, inserted in one order and committed in the other.
        with engine.connect() as first, engine.connect() as second:
            enqueue_event(first, idempotency_key="k3", topic="orders", payload={"n": 3}, ordering_key="c-2")
            enqueue_event(second, idempotency_key="k4", topic="orders", payload={"n": 4}, ordering_key="c-2")
            second.commit()
            first.commit()
        with engine.begin() as conn:
            assert enqueue_event(conn, idempotency_key="k5", topic="invoices", payload={"n": 5})
        with pytest.raises(errors.OutboxConflictError), engine.begin() as conn:
            enqueue_event(conn, idempotency_key="k5", topic="invoices", payload={"n": 6})
        assert purge_events(engine, older_than_ms=0, min_retention_ms=0) == 4  # retention: DELETEs only

        changes = _changes(engine, slot)
        inserts = [id_ for op, id_, _ in changes if op == "INSERT"]
        assert inserts == ["k1", "k4", "k3", "k5"]  # one each, in commit order; k2 never
        assert {op for op, _, _ in changes} == {"INSERT", "DELETE"}  # never an UPDATE
        assert [op for op, _, _ in changes].count("DELETE") == 4
        rows = {id_: rest for op, id_, rest in changes if op == "INSERT"}
        assert [_field(rows[k], "aggregateid") for k in ("k1", "k3", "k4", "k5")] == [
            "c-1",
            "c-2",
            "c-2",
            "k5",
        ]
        assert [_field(rows[k], "aggregatetype") for k in ("k1", "k5")] == ["orders", "invoices"]
        assert json.loads(_field(rows["k4"], "payload") or "") == {"n": 4}
        context = _field(rows["k1"], "tracingspancontext")
        assert context is not None
        properties = dict(line.split("=", 1) for line in context.splitlines())
        assert properties["traceparent"].startswith(f"00-{TRACE_ID:032x}-")
        assert properties["tracestate"] == "vendor\\=x\\:y"  # java.util.Properties' escapes
        assert _field(rows["k3"], "tracingspancontext") is None  # enqueued outside any span
    finally:
        with engine.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                    " WHERE slot_name = :s"
                ),
                {"s": slot},
            )
            conn.commit()
        engine.dispose()


def test_the_documented_connector_reads_this_table() -> None:
    """docs/cdc.md's connector configuration names the table and columns the library writes."""
    page = (ROOT / "docs" / "cdc.md").read_text()
    config = json.loads(re.search(r"```json\n(.*?)```", page, re.S)[1])["config"]  # type: ignore[index]
    columns = set(outbox_event_table.c.keys())
    assert config["table.include.list"] == f"public.{outbox_event_table.name}"
    assert config["transforms.outbox.type"] == "io.debezium.transforms.outbox.EventRouter"
    named = [
        config["transforms.outbox.table.field.event.id"],
        config["transforms.outbox.table.field.event.key"],
        config["transforms.outbox.table.field.event.payload"],
        config["transforms.outbox.route.by.field"],
        config["transforms.outbox.tracing.span.context.field"],
        *(
            pair.split(":")[0]
            for pair in config["transforms.outbox.table.fields.additional.placement"].split(",")
        ),
    ]
    assert set(named) <= columns, set(named) - columns
    assert config["transforms.outbox.table.op.invalid.behavior"] == "fatal"  # an UPDATE would stop it
