"""The ``joblease receiver`` / ``python -m dagster_joblease.receiver`` command line."""

from __future__ import annotations

import logging

import click

from dagster_joblease import errors, inbox
from dagster_joblease.receiver import app
from dagster_joblease.storage.engine import DATABASE_URL_ENV, scrub_secrets

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
    default=app.DEFAULT_MAX_CONNECTIONS,
    show_default=True,
    help="Connections served at once (a thread each); one more is answered 503 and closed.",
)
@click.option(
    "--idle-timeout-s",
    type=click.FloatRange(0, 3600, min_open=True),
    default=app.DEFAULT_IDLE_TIMEOUT_S,
    show_default=True,
    help="Close a keep-alive connection idle this long.",
)
@click.option(
    "--read-timeout-s",
    type=click.FloatRange(0, 3600, min_open=True),
    default=app.DEFAULT_READ_TIMEOUT_S,
    show_default=True,
    help="Answer 408 and close when a request's head stalls this long, or its body takes longer in total.",
)
@click.option(
    "--migrate/--no-migrate",
    default=True,
    show_default=True,
    help="Set up at startup: install or upgrade the joblease schema (the inbox table) and create the "
    "receiver's PostgreSQL function if missing or outdated. --no-migrate creates nothing but the "
    "receiver's tables when missing, and uses the function only if it is there.",
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

    POST /TOPIC with an Idempotency-Key header: 200 the first time, the same response again (with
    Idempotent-Replayed: true) on a replay, 409 while the key is in flight, 422 for the key with another
    payload, 400 without a key. GET /health answers 200. Options marked [testing] inject faults; the
    "first N" counters are per process and apply in sequence: drops, then hangs, then failures.
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faults = app.Faults(
        fail_first=fail_first,
        fail_status=fail_status,
        hang_first=hang_first,
        hang_ms=hang_ms,
        drop_first=drop_first,
        always_status=_parse_topic_status(always_status_for_topic),
        delay_after_apply_ms=delay_after_apply_ms,
        effect_delay_ms=effect_delay_ms,
    )

    def ready(url: str) -> None:
        click.echo(f"listening on {url}")

    try:
        app.serve(
            database_url,
            host=host,
            port=port,
            faults=faults,
            lock_ms=lock_ms,
            migrate=migrate,
            on_ready=ready,
            max_connections=max_connections,
            idle_timeout_s=idle_timeout_s,
            read_timeout_s=read_timeout_s,
        )
    except errors.JobLeaseError as exc:
        # The message may quote a driver error that names the URL or pieces of its password.
        raise click.ClickException(scrub_secrets(str(exc), database_url)) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
