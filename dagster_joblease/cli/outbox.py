"""``joblease outbox``: stats, list, status, requeue, skip, resume a limit group, purge, purge-events."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from dagster_joblease import admin
from dagster_joblease.admin import MIN_RETENTION_ENV, human_ms
from dagster_joblease.cli.common import (
    DURATION,
    ERROR_CELL_CHARS,
    current_state,
    echo_json,
    floor_option,
    json_option,
    limit_option,
    render_table,
    routes_from_options,
)
from dagster_joblease.storage import engine as storage_engine


@click.group()
def outbox() -> None:
    """Inspect, requeue and purge outbox rows."""


@outbox.command("stats", short_help="Counts by status and topic, due backlog and its age.")
@json_option
def outbox_stats(as_json: bool) -> None:
    """Counts by status and by topic, the due backlog and the age of its oldest row (database clock)."""
    stats = admin.outbox_stats(current_state().engine())
    if as_json:
        echo_json(stats.to_json())
        return
    click.echo(render_table(["STATUS", "COUNT"], [[s, n] for s, n in stats.by_status.items()]))
    click.echo(f"due now: {stats.due}   oldest due waiting: {human_ms(stats.oldest_due_age_ms)}")
    if stats.by_topic:
        click.echo("")
        click.echo(
            render_table(["TOPIC", "STATUS", "COUNT"], [[t.topic, t.status, t.count] for t in stats.by_topic])
        )


def _next_attempt(row: admin.OutboxRow) -> str:
    if row.status != "PENDING" or row.due_in_ms is None:
        return "-"
    if row.claimed:
        return "in flight"
    return f"in {human_ms(row.due_in_ms)}" if row.due_in_ms > 0 else f"due {human_ms(-row.due_in_ms)} ago"


@outbox.command("list", short_help="List outbox rows with their last status and error.")
@click.option(
    "--status",
    type=click.Choice(["pending", "sent", "dead", "skipped"], case_sensitive=False),
    help="Only this status.",
)
@click.option("--topic", help="Only this topic.")
@limit_option
@json_option
def outbox_list(status: str | None, topic: str | None, limit: int, as_json: bool) -> None:
    """List outbox rows (newest first, without payloads) with their last HTTP status and error."""
    rows = admin.list_outbox(current_state().engine(), status=status, topic=topic, limit=limit)
    if as_json:
        echo_json([r.to_json() for r in rows])
        return
    if not rows:
        click.echo("no outbox rows match")
        return
    headers = ["ID", "TOPIC", "STATUS", "ATTEMPTS", "NEXT ATTEMPT", "LAST STATUS", "LAST ERROR"]
    cells = [
        [r.id, r.topic, r.status, r.attempts, _next_attempt(r), r.last_status, r.last_error] for r in rows
    ]
    if any(r.ordering_key is not None for r in rows):  # the column only when some row has a key
        headers.insert(2, "ORDERING KEY")
        for row, cell in zip(rows, cells, strict=True):
            cell.insert(2, row.ordering_key)
    click.echo(
        render_table(headers, cells, {"LAST ERROR": ERROR_CELL_CHARS, "TOPIC": 40, "ORDERING KEY": 40})
    )
    _echo_blocked_keys()


def _echo_blocked_keys() -> None:
    """The ordering keys DEAD rows block (count, and the first few with their blocking row), if any."""
    from dagster_joblease import delivery_status

    with (
        storage_engine.translate_errors("list blocked ordering keys"),
        current_state().engine().connect() as conn,
    ):
        count, blocked = delivery_status.blocked_keys(conn)
    if count:
        click.echo("")
        click.echo(_blocked_keys_text(count, blocked))


def _blocked_keys_text(count: int, blocked: Sequence[Any]) -> str:
    lines = [f"{count} ordering key(s) blocked by a DEAD row (their later rows wait):"]
    lines += [f"  {b.describe()}" for b in blocked]
    if count > len(blocked):
        lines.append(f"  … and {count - len(blocked)} more")
    lines.append(
        "unblock: `joblease outbox requeue ID` (send it again) or `joblease outbox skip ID` (give up)"
    )
    return "\n".join(lines)


@outbox.command("status", short_help="Per topic and limit group: due, in flight, paused, limits.")
@click.option(
    "--routes",
    "routes_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The dispatcher's routes file, to show each topic's limit group (optional).",
)
@click.option("--route", "route_specs", multiple=True, metavar="TOPIC=URL", help="A route; repeat for more.")
@json_option
def outbox_status(routes_file: Path | None, route_specs: tuple[str, ...], as_json: bool) -> None:
    """Delivery status on the database clock: per topic the rows due, in flight, waiting (backoff or
    pause), retrying, dead and skipped (never sent by a person's decision: not dead); per limit group the
    requests in flight (every dispatcher), the limits in force, and a pause (until when, and why). Give
    the routes to see which group each topic is in."""
    from dagster_joblease import delivery_status

    routes = routes_from_options(routes_file, route_specs) if routes_file or route_specs else {}
    status = delivery_status.delivery_status(
        current_state().engine(), topic_groups={t: str(r.limit_group) for t, r in routes.items()}
    )
    if as_json:
        echo_json(status.to_json())
        return
    if not status.topics:
        click.echo("no pending, dead or skipped outbox rows")
    else:
        click.echo(
            render_table(
                ["TOPIC", "GROUP", "DUE", "IN FLIGHT", "WAITING", "RETRYING", "DEAD", "SKIPPED"],
                [
                    [t.topic, t.limit_group, t.due, t.in_flight, t.waiting, t.retrying, t.dead, t.skipped]
                    for t in status.topics
                ],
                {"TOPIC": 40, "GROUP": 40},
            )
        )
    if status.groups:
        click.echo("")
        click.echo(
            render_table(
                ["LIMIT GROUP", "IN FLIGHT", "RATE", "PAUSED UNTIL", "REASON"],
                [
                    [
                        g.limit_group,
                        f"{g.in_flight}/{g.max_in_flight}" if g.max_in_flight else g.in_flight,
                        f"{g.rate}/s (booked {human_ms(g.rate_busy_ms)} ahead)" if g.rate else None,
                        f"{g.paused_until} (in {human_ms(g.pause_remaining_ms)})" if g.paused_until else None,
                        g.pause_reason,
                    ]
                    for g in status.groups
                ],
                {"LIMIT GROUP": 40, "REASON": ERROR_CELL_CHARS},
            )
        )
    if status.blocked_key_count:
        click.echo("")
        click.echo(_blocked_keys_text(status.blocked_key_count, status.blocked_keys))


@outbox.command("requeue", short_help="Make dead rows due again with their original key.")
@click.argument("row_id", type=int, required=False, metavar="[ID]")
@click.option("--all-dead", is_flag=True, help="Requeue every DEAD row.")
@click.option("--topic", help="Requeue every DEAD row of this topic.")
def outbox_requeue(row_id: int | None, all_dead: bool, topic: str | None) -> None:
    """Make rows due again with their original idempotency key: one ID, --all-dead, or --topic T.

    Attempts restart at 0 and the claim is cleared; the last status and error stay visible until the next
    attempt. SENT rows, and rows a dispatcher is delivering right now, are refused. A SKIPPED row (`outbox
    skip`) is requeued by its ID only: --all-dead and --topic take DEAD rows.
    """
    if row_id is None and not all_dead and topic is None:
        raise click.UsageError("give an ID, --all-dead or --topic TOPIC")
    if row_id is not None and (all_dead or topic is not None):
        raise click.UsageError("give either an ID or --all-dead/--topic, not both")
    count = admin.requeue(current_state().engine(), row_id=row_id, all_dead=all_dead, topic=topic)
    click.echo(
        f"requeued {count} row(s); they keep their idempotency keys and are due now. Their retention "
        "clock restarts: a route's dedupe_window counts from the next attempt (requeueing a row that was "
        "dead-lettered past its window sends it again, which you decided is right)"
    )


@outbox.command("skip", short_help="Never send a DEAD row: it becomes SKIPPED, its ordering key flows.")
@click.argument("row_id", type=int, metavar="ID")
def outbox_skip(row_id: int) -> None:
    """Mark DEAD row ID SKIPPED: a person decided it is never sent. It no longer counts as dead (`outbox
    status`, the no_dead_rows check), keeps its ordering key, and no longer holds that key's later rows
    back: they are delivered again, in order. Its last error says it was skipped by an operator, and when
    (the database clock). `joblease outbox requeue ID` makes it PENDING again (it is then sent);
    `outbox purge` deletes it once it was skipped longer ago than --sent-before.

    Refused (exit 1) for a row that is not DEAD (PENDING, SENT, or already SKIPPED), or missing."""
    key = admin.skip(current_state().engine(), row_id)
    flows = (
        "" if key is None else f"; ordering key {key!r} released, its later rows are claimed again in order"
    )
    click.echo(f"skipped outbox row {row_id}: SKIPPED, never sent{flows}")


@outbox.command("resume", short_help="End a limit group's pause now.")
@click.argument("group")
def outbox_resume(group: str) -> None:
    """End limit group GROUP's pause now (a downstream's Retry-After, or consecutive connection failures),
    for every dispatcher: each claims the group's rows again at its next claim. Rows the pause deferred
    keep their next attempt time; rows given back by the pause are due at once.

    Refused (exit 1), naming the groups that are paused, when GROUP has no pause in force.
    """
    ended = admin.resume_group(current_state().engine(), group)
    click.echo(
        f"limit group {group}: pause ended (it was paused until {ended.paused_until}: "
        f"{ended.pause_reason or 'no reason recorded'}); dispatchers claim its rows again at their next claim"
    )


def _retention_options(window: str, whose: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """``--min-retention`` (the floor under ``window``) and ``--dry-run``, as every outbox purge has them."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        command = click.option("--dry-run", is_flag=True, help="Only count the rows that would be deleted.")(
            command
        )
        return click.option(
            "--min-retention",
            type=DURATION,
            help=f"Refuse a {window} below this; set it to at least {whose} deduplication window. "
            f"Default: ${MIN_RETENTION_ENV}, else 24h. ${MIN_RETENTION_ENV} is a floor: this flag can raise "
            "it, never lower it.",
        )(command)

    return decorate


@outbox.command("purge", short_help="Delete SENT (and SKIPPED) rows older than a window.")
@click.option(
    "--sent-before",
    type=DURATION,
    required=True,
    help="Delete SENT rows delivered longer ago (e.g. 7d), and SKIPPED rows skipped longer ago (their "
    "updated_at, set to the database clock by the skip).",
)
@_retention_options("--sent-before", "the downstream's")
def outbox_purge(sent_before: int, min_retention: int | None, dry_run: bool) -> None:
    """Delete SENT rows older than the window, and SKIPPED rows skipped before it (by updated_at, which
    `outbox skip` sets to the database clock); PENDING and DEAD rows are kept.

    After a purge, enqueueing the same key again delivers it again, so the window must be at least the
    downstream's deduplication window.
    """
    count = admin.purge_sent(
        current_state().engine(),
        older_than_ms=sent_before,
        min_retention_ms=floor_option(min_retention, MIN_RETENTION_ENV, admin.DEFAULT_MIN_RETENTION_MS),
        dry_run=dry_run,
    )
    click.echo(f"{'would delete' if dry_run else 'deleted'} {count} SENT or SKIPPED outbox row(s)")


@outbox.command("purge-events", short_help="Delete CDC events (joblease_outbox_event) older than a window.")
@click.option(
    "--written-before",
    type=DURATION,
    required=True,
    help="Delete events inserted longer ago (e.g. 7d); the connector read them from the WAL at commit.",
)
@_retention_options("--written-before", "the consumers'")
def outbox_purge_events(written_before: int, min_retention: int | None, dry_run: bool) -> None:
    """Delete the CDC hand-over's events (dagster_joblease.cdc) inserted before the window; the router
    ignores the DELETEs.

    A row only keeps a repeat of its key from writing a second event, so the window must be at least the
    consumers' deduplication window (on the ``id`` header).
    """
    count = admin.purge_events(
        current_state().engine(),
        older_than_ms=written_before,
        min_retention_ms=floor_option(min_retention, MIN_RETENTION_ENV, admin.DEFAULT_MIN_RETENTION_MS),
        dry_run=dry_run,
    )
    click.echo(f"{'would delete' if dry_run else 'deleted'} {count} CDC event(s)")
