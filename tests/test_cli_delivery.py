"""`joblease dispatch --once` tells the truth (exit codes, pauses, unrouted rows) and `joblease outbox
status` shows topics and limit groups; against real databases and a real HTTP downstream."""

from __future__ import annotations

import json
from pathlib import Path

import sqlalchemy as sa
from click.testing import CliRunner, Result

from dagster_joblease import cli
from dagster_joblease.storage import route_groups
from dagster_joblease.storage.clock import db_now, db_now_plus_ms
from dagster_joblease.storage.schema import outbox_table, route_group_table
from tests.dispatch_workers import enqueue_many, status_counts
from tests.limit_server import serve


def run(url: str, *args: str) -> Result:
    return CliRunner().invoke(cli.main, ["--database-url", url, *args], catch_exceptions=False)


def test_dispatch_once_exits_1_naming_dead_rows_and_reports_unrouted_rows_without_failing(
    db_url: str, engine: sa.Engine
) -> None:
    enqueue_many(engine, 2, topic="good")
    enqueue_many(engine, 1, topic="bad", prefix="v2:bad")
    enqueue_many(engine, 3, topic="billing", prefix="v2:billing")  # another location's topic
    with serve(latency_s=0.0, respond=lambda path, n: (400, {}) if path == "/bad" else (200, {})) as server:
        failed = run(
            db_url,
            "dispatch",
            "--once",
            "--route",
            f"good={server.url}/good",
            "--route",
            f"bad={server.url}/bad",
        )
        assert failed.exit_code == 1, failed.output
        assert "1 row(s) were dead-lettered in this pass" in failed.output
        assert "joblease outbox requeue --all-dead" in failed.output
        assert "3 due row(s) of topics this location does not route: billing (3)" in failed.output
        enqueue_many(engine, 1, topic="good", prefix="v2:more")
        ok = run(db_url, "dispatch", "--once", "--json", "--route", f"good={server.url}/good")
        assert ok.exit_code == 0, ok.output  # unrouted rows are reported, not failed
        doc = json.loads(ok.stdout)
        # the dead "bad" row is not due; billing's rows are
        assert doc["sent"] == 1 and doc["dead"] == 0 and doc["unrouted_due"] == 3
        assert doc["unrouted_due_topics"] == {"billing": 3}
    assert status_counts(engine) == {"SENT": 3, "DEAD": 1, "PENDING": 3}
    requeued = run(db_url, "outbox", "requeue", "--topic", "bad")
    assert requeued.exit_code == 0 and "retention clock restarts" in requeued.output


def test_dispatch_once_during_a_pause_says_so_and_status_shows_it(
    db_url: str, engine: sa.Engine, tmp_path: Path
) -> None:
    enqueue_many(engine, 2, topic="mail")
    routes = tmp_path / "routes.toml"
    routes.write_text(
        '[mail]\nurl = "http://127.0.0.1:9/mail"\n[mail.limits]\nlimit_group = "mailer"\nmax_in_flight = 2\n'
    )
    with engine.begin() as conn:
        route_groups.record_pause(conn, "mailer", 600_000, "HTTP 429 with Retry-After from topic mail")
    result = run(db_url, "dispatch", "--once", "--routes", str(routes))
    assert result.exit_code == 0, result.output
    assert "done: claimed 0" in result.output
    assert "paused: limit group mailer (topics mail) is paused for another" in result.output
    assert "HTTP 429 with Retry-After" in result.output
    status = run(db_url, "outbox", "status", "--routes", str(routes), "--json")
    assert status.exit_code == 0, status.output
    doc = json.loads(status.stdout)
    (topic,) = doc["topics"]
    assert (topic["topic"], topic["limit_group"], topic["due"], topic["dead"]) == ("mail", "mailer", 2, 0)
    (group,) = doc["groups"]
    assert group["limit_group"] == "mailer" and group["paused_until"] and group["pause_remaining_ms"] > 0
    table = run(db_url, "outbox", "status", "--routes", str(routes))
    assert "mailer" in table.output and "PAUSED UNTIL" in table.output
    # The pause ends (written in the past on the database clock): the status says so.
    with engine.begin() as conn:
        conn.execute(
            sa.update(route_group_table).values(paused_until=db_now_plus_ms(sa.literal(-1, sa.BigInteger())))
        )
        conn.execute(sa.update(outbox_table).values(next_attempt_at=db_now()))
    (group,) = json.loads(run(db_url, "outbox", "status", "--json").stdout)["groups"]
    assert group["paused_until"] is None


def test_the_docs_routes_example_loads_with_its_limits(tmp_path: Path) -> None:
    import re

    from dagster_joblease.dispatch import load_routes

    page = (Path(__file__).resolve().parent.parent / "docs" / "delivery.md").read_text()
    section = page.split("## Bounded by the downstream's capacity", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```toml\n(.*?)```", section, flags=re.DOTALL)
    path = tmp_path / "routes.toml"
    path.write_text(example)
    route = load_routes(path)["billing"]
    assert (route.limit_group, route.max_in_flight, route.rate, route.max_pause_s) == (
        "billing-api",
        4,
        50,
        300,
    )
    assert route.dedupe_window_s == 86_400 and route.key_format == "bare"
