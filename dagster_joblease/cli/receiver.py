"""The ``joblease receiver`` / ``python -m dagster_joblease.receiver`` command line."""

from __future__ import annotations

import logging

import click

from dagster_joblease import errors, inbox
from dagster_joblease.receiver import server
from dagster_joblease.storage.engine import DATABASE_URL_ENV, scrub_secrets
from dagster_joblease.testing.faults import Faults

__all__ = ["receiver_command"]


def _parse_topic_status(values: tuple[str, ...]) -> dict[str, int]:
    rules: dict[str, int] = {}
    for value in values:
        topic, sep, status = value.rpartition("=")
        if not sep or not status.strip().isdigit() or not 100 <= int(status) <= 599:
            raise click.BadParameter(
                f"{value!r} must be TOPIC=STATUS with an HTTP status 100-599, e.g. mail=400",
                param_hint="--always-status-for-topic",
            )
        rules[topic.lstrip("/")] = int(status)
    return rules


_count = click.IntRange(min=0)


@click.command("receiver")
@click.option(
    "--database-url",
    envvar=DATABASE_URL_ENV,
    required=True,
    help=f"Database for the inbox and the receiver's tables (default: ${DATABASE_URL_ENV}).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8765,
    show_default=True,
    help="Port; 0 picks a free one. The real address is printed as `listening on http://HOST:PORT`.",
)
@click.option(
    "--lock-ms",
    type=click.IntRange(inbox.MIN_LOCK_MS, inbox.MAX_LOCK_MS),
    default=inbox.DEFAULT_LOCK_MS,
    show_default=True,
    help="How long an effect may stall inside its transaction before it is rolled back (the key frees).",
)
@click.option(
    "--max-connections",
    type=click.IntRange(1, 10_000),
    default=server.DEFAULT_MAX_CONNECTIONS,
    show_default=True,
    help="Connections or requests served at once (uvicorn's limit_concurrency); beyond it, 503. Also "
    "the most PostgreSQL connections the receiver opens.",
)
@click.option(
    "--idle-timeout-s",
    type=click.FloatRange(0, 3600, min_open=True),
    default=server.DEFAULT_IDLE_TIMEOUT_S,
    show_default=True,
    help="Close a keep-alive connection idle this long (uvicorn's timeout_keep_alive).",
)
@click.option(
    "--read-timeout-s",
    type=click.FloatRange(0, 3600, min_open=True),
    default=server.DEFAULT_READ_TIMEOUT_S,
    show_default=True,
    help="Answer 408 and close when a request's body takes longer than this in total.",
)
@click.option(
    "--retention",
    "retention",
    default=None,
    metavar="DURATION",
    help="Forget answered keys this long after they were answered (e.g. 24h, 7d; checked every minute). "
    "Keep it longer than every sender's dedupe_window. Default: keep them forever.",
)
@click.option(
    "--http",
    type=click.Choice(server.HTTP_IMPLEMENTATIONS),
    default="h11",
    show_default=True,
    help="uvicorn's HTTP/1.1 implementation.",
)
@click.option(
    "--migrate/--no-migrate",
    default=True,
    show_default=True,
    help="Set up at startup: install or upgrade the joblease schema (the inbox table). --no-migrate "
    "creates nothing but the receiver's own tables when missing.",
)
@click.option(
    "--fail-first", type=_count, default=0, help="[testing] The first N POSTs answer --fail-status."
)
@click.option(
    "--fail-status",
    type=click.IntRange(100, 599),
    default=500,
    show_default=True,
    help="[testing] See --fail-first.",
)
@click.option(
    "--hang-first", type=_count, default=0, help="[testing] The first N POSTs hang --hang-ms, then 503."
)
@click.option("--hang-ms", type=_count, default=30_000, show_default=True, help="[testing] See --hang-first.")
@click.option(
    "--drop-first", type=_count, default=0, help="[testing] The first N POSTs get no response at all."
)
@click.option(
    "--always-status-for-topic",
    multiple=True,
    metavar="TOPIC=STATUS",
    help="[testing] POSTs to /TOPIC always answer STATUS without applying. Repeatable.",
)
@click.option(
    "--delay-after-apply-ms",
    type=_count,
    default=0,
    help="[testing] Apply and commit the effect, then wait this long before answering.",
)
@click.option(
    "--effect-delay-ms",
    type=_count,
    default=0,
    help="[testing] Sleep inside the effect's transaction (keeps the key in flight: 409 meanwhile).",
)
@click.option("--log-level", default="WARNING", show_default=True, help="Logging level (to stderr).")
def receiver_command(
    database_url: str,
    host: str,
    port: int,
    lock_ms: int,
    max_connections: int,
    idle_timeout_s: float,
    read_timeout_s: float,
    retention: str | None,
    http: str,
    migrate: bool,
    fail_first: int,
    fail_status: int,
    hang_first: int,
    hang_ms: int,
    drop_first: int,
    always_status_for_topic: tuple[str, ...],
    delay_after_apply_ms: int,
    effect_delay_ms: int,
    log_level: str,
) -> None:
    """Run the reference downstream receiver: it applies each Idempotency-Key once, via the inbox.

    A Starlette app served by uvicorn. POST /TOPIC with an Idempotency-Key header: 200 the first time,
    the same response again (with Idempotent-Replayed: true) on a replay, 409 while the key is in flight,
    422 for the key with another request, 400 without a key. GET /health answers 200. Options marked
    [testing] inject faults; the "first N" counters are per process and apply in sequence: drops, then
    hangs, then failures (--drop-first puts a small TCP proxy in front of uvicorn to drop connections).
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = server.ReceiverOptions(
            lock_ms=lock_ms,
            max_connections=max_connections,
            idle_timeout_s=idle_timeout_s,
            read_timeout_s=read_timeout_s,
            retention_s=None if retention is None else _duration_s(retention),
            http=http,
            effect_delay_ms=effect_delay_ms,
            faults=Faults(
                fail_first=fail_first,
                fail_status=fail_status,
                hang_first=hang_first,
                hang_ms=hang_ms,
                drop_first=drop_first,
                always_status=_parse_topic_status(always_status_for_topic),
                delay_after_apply_ms=delay_after_apply_ms,
            ),
        )
    except errors.ConfigurationError as exc:
        raise click.BadParameter(str(exc)) from exc

    def ready(url: str) -> None:
        click.echo(f"listening on {url}")

    try:
        server.serve(database_url, host=host, port=port, options=options, migrate=migrate, on_ready=ready)
    except errors.JobLeaseError as exc:
        # The message may quote a driver error that names the URL or pieces of its password.
        raise click.ClickException(scrub_secrets(str(exc), database_url)) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def _duration_s(value: str) -> float:
    from dagster_joblease.dispatch.routes import duration_s

    seconds = duration_s(value, "--retention", "retention")
    if seconds <= 0:
        raise click.BadParameter(f"{value!r} must be a positive duration", param_hint="--retention")
    return seconds
