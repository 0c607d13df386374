"""`joblease dispatch --once` tells the truth (exit codes, pauses, unrouted rows) and `joblease outbox
status` shows topics and limit groups; against real databases and a real HTTP downstream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from dagster_joblease import cli
from dagster_joblease.outbox import GroupPause
from dagster_joblease.storage import route_groups
from dagster_joblease.storage.clock import db_now, db_now_plus_ms
from dagster_joblease.storage.schema import outbox_table, route_group_table
from tests.dispatch_workers import enqueue_many, status_counts
from tests.limit_server import serve


def run(url: str, *args: str) -> Result:
    return CliRunner().invoke(cli.main, ["--database-url", url, *args], catch_exceptions=False)


PAUSE = GroupPause(
    limit_group="mail",
    paused_until="2026-12-04T22:00:00+00:00",
    remaining_ms=1_500,
    reason="429",
    topics=("a",),
)


@pytest.mark.parametrize(
    ("pauses", "unrouted_topics", "unrouted", "dead", "expired", "starts"),
    [
        ((), {}, 0, 0, 0, []),  # a clean pass says nothing more
        ((PAUSE,), {}, 0, 0, 0, ["paused: limit group mail (topics a) is paused for another 1.5 s"]),
        (
            (),
            {"billing": 3, "x": 1},
            4,
            0,
            0,
            ["4 due row(s) of topics this location does not route: billing (3), x (1)"],
        ),
        ((), {}, 0, 2, 1, ["2 row(s) were dead-lettered in this pass (1 past their route's dedupe_window"]),
        (
            (PAUSE, PAUSE),
            {"billing": 3},
            3,
            1,
            0,
            [
                "paused: limit group mail",
                "paused: limit group mail",
                "3 due row(s)",
                "1 row(s) were dead-lettered",
            ],
        ),
    ],
)
def test_dispatch_notes_name_pauses_then_unrouted_rows_then_dead_rows(
    pauses: tuple[GroupPause, ...],
    unrouted_topics: dict[str, int],
    unrouted: int,
    dead: int,
    expired: int,
    starts: list[str],
) -> None:
    notes = cli.dispatch.dispatch_notes(
        pauses, unrouted_topics, unrouted=unrouted, dead=dead, expired=expired
    )
    assert len(notes) == len(starts)
    for note, start in zip(notes, starts, strict=True):
        assert note.startswith(start), note
    if dead:
        assert notes[-1].endswith("`joblease outbox requeue --all-dead` (or --topic TOPIC, or one ID)")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--route", "a=http://127.0.0.1:9/a"], "give --once or --loop"),
        (["--once"], "no routes: give --routes FILE or --route TOPIC=URL"),
        (["--loop"], "no routes: give --routes FILE or --route TOPIC=URL"),
        ([], "give --once or --loop"),
    ],
)
def test_dispatch_without_a_mode_or_routes_is_a_usage_error(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(
        cli.main, ["--database-url", f"sqlite:///{tmp_path}/none.db", "dispatch", *args]
    )
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "none.db").exists()  # refused before any database work


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
