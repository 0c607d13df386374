"""``joblease leases``: list, show, reset (fail) and purge lease rows."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from typing import Any

import click

from dagster_joblease import admin, errors
from dagster_joblease.admin import MIN_REPLAY_WINDOW_ENV, human_ms
from dagster_joblease.cli.common import (
    DURATION,
    ERROR_CELL_CHARS,
    current_state,
    echo_json,
    exit_code_for,
    floor_option,
    json_option,
    limit_option,
    render_table,
)


@click.group()
def leases() -> None:
    """Inspect, reset and purge lease rows (one per logical run)."""


def _remaining(row: admin.LeaseRow) -> str:
    if row.status != "RUNNING":
        return "-"
    if row.expired:
        return f"expired {human_ms(-(row.remaining_ms or 0))} ago"
    return human_ms(row.remaining_ms)


def _heartbeat(row: admin.LeaseRow) -> str:
    """The holder's own interval (what "stale" is judged by), its last heartbeat's age, STALE past it."""
    if row.heartbeat_ms is None:
        every = "every ? (pre-0002 row)"
    elif row.heartbeat_ms == 0:
        every = "none (expiry only)"
    else:
        every = f"every {human_ms(row.heartbeat_ms)}"
    if row.heartbeat_age_ms is None:
        return every
    return f"{every}, last {human_ms(max(row.heartbeat_age_ms, 0))} ago" + (" STALE" if row.stale else "")


@leases.command("list", short_help="List leases with remaining time on the database clock.")
@click.option("--code", help="Only this job code.")
@click.option(
    "--status",
    type=click.Choice(["running", "success", "fail"], case_sensitive=False),
    help="Only this status.",
)
@click.option(
    "--older-than", type=DURATION, help="Only runs whose current attempt started longer ago (30m, 2h, 7d)."
)
@click.option("--expired", is_flag=True, help="Only RUNNING rows past their expiry (holder stalled or dead).")
@limit_option
@json_option
def leases_list(
    code: str | None, status: str | None, older_than: int | None, expired: bool, limit: int, as_json: bool
) -> None:
    """List leases, newest attempt first. REMAINING is the holder's lease left on the database clock;
    HEARTBEAT is the interval the holder recorded (stale is judged by it, not by yours) and, while it
    runs, its last heartbeat's age (STALE past two intervals: it may still be working until it expires)."""
    rows = admin.list_leases(
        current_state().engine(),
        code=code,
        status=status,
        older_than_ms=older_than,
        expired_only=expired,
        limit=limit,
    )
    if as_json:
        echo_json([r.to_json() for r in rows])
        return
    if not rows:
        click.echo("no leases match")
        return
    click.echo(
        render_table(
            ["ID", "CODE", "RUN KEY", "STATUS", "ATTEMPT", "REMAINING", "HEARTBEAT", "HOLDER", "LAST ERROR"],
            [
                [
                    r.id,
                    r.code,
                    r.run_key,
                    r.status,
                    r.attempt,
                    _remaining(r),
                    _heartbeat(r),
                    r.holder,
                    r.last_error,
                ]
                for r in rows
            ],
            {"LAST ERROR": ERROR_CELL_CHARS, "RUN KEY": 40, "HOLDER": 40},
        )
    )


_KEY_RE = re.compile(r"v2:[0-9a-f]{64}")
# A lone value made only of digits and date/time punctuation: a partition or tick key, or an id.
_RUN_KEY_LIKE = re.compile(r"\d[\d\-:T/._+Z ]*")


def lease_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The one option form that names a lease, the same on every per-lease command."""
    for option in reversed(
        [
            click.option("--key", "key_opt", metavar="KEY", help="The lease's v2: idempotency key."),
            click.option("--code", "code_opt", metavar="CODE", help="The job code (alone: an INITIAL run)."),
            click.option(
                "--run-key", "run_key_opt", metavar="RUN_KEY", help="With --code: that SCHEDULE run."
            ),
            click.option("--id", "lease_id", type=int, help="The lease's numeric row id."),
        ]
    ):
        fn = option(fn)
    return fn


def _optioned_lease(
    key_opt: str | None, code_opt: str | None, run_key_opt: str | None, lease_id: int | None
) -> tuple[str | int, str | None] | None:
    """The lease the options name, as (v2 key | code | id, run key); None when no option was given."""
    if lease_id is not None:
        return lease_id, None
    if key_opt is not None:
        if not _KEY_RE.fullmatch(key_opt.strip()):
            raise click.BadParameter(f"{key_opt!r} is not a v2: idempotency key", param_hint="--key")
        return key_opt.strip(), None
    if code_opt is not None:
        return code_opt, run_key_opt
    return None


def _one_way(given: list[str], forms: str, run_key_opt: str | None, code_opt: str | None) -> None:
    if run_key_opt is not None and code_opt is None:
        raise click.UsageError("--run-key needs --code CODE: a run key alone does not name a run")
    if len(given) != 1:
        raise click.UsageError(
            f"name the lease in exactly one way: {forms} (got {', '.join(given) if given else 'none'})"
        )


def _positional_lease(command: str, key_or_code: str, run_key: str | None) -> str:
    """``KEY`` or ``CODE [RUN_KEY]`` given positionally (the same on `leases show` and `leases fail`).

    A lone value that looks like a run key (a date, a time, a number) is refused rather than read as an
    INITIAL job's code."""
    text = key_or_code.strip()
    if _KEY_RE.fullmatch(text):
        if run_key is not None:
            raise click.UsageError(f"a v2: key names one lease by itself; drop {run_key!r}")
        return text
    if run_key is None and _RUN_KEY_LIKE.fullmatch(text):
        raise click.UsageError(
            f"{text!r} looks like a run key (a date, a time or a number), not a job code. Give its "
            f"code too: `joblease leases {command} --code CODE --run-key {text}`; for an INITIAL job whose "
            f"code really is {text!r}, `--code {text}`; for a lease id, `--id {text}`."
        )
    return key_or_code


@leases.command("show", short_help="Show one lease by key, code [run key] or id.")
@click.argument("key_or_code", required=False, metavar="[KEY | CODE [RUN_KEY]]")
@click.argument("run_key", required=False, metavar="")
@lease_options
@json_option
def leases_show(
    key_or_code: str | None,
    run_key: str | None,
    key_opt: str | None,
    code_opt: str | None,
    run_key_opt: str | None,
    lease_id: int | None,
    as_json: bool,
) -> None:
    """Show one lease, named in exactly one way (the options are the same on `leases fail`):

    \b
      joblease leases show --code CODE --run-key RUN_KEY   a SCHEDULE run (or: show CODE RUN_KEY)
      joblease leases show --code CODE                     an INITIAL run (CODE alone works unless it
                                                           looks like a run key: a date, a time, a number)
      joblease leases show --key v2:…                      (or: show v2:…)
      joblease leases show --id N

    A lone positional value that looks like a run key (2024-02-03) is refused rather than read as an
    INITIAL job's code; give its code too. No such lease: close run keys (or codes) are suggested.
    """
    given = [
        name
        for name, value in (
            ("KEY | CODE [RUN_KEY]", key_or_code),
            ("--key", key_opt),
            ("--code", code_opt),
            ("--id", lease_id),
        )
        if value is not None
    ]
    _one_way(
        given,
        "KEY, CODE [RUN_KEY], --key KEY, --code CODE [--run-key RUN_KEY] or --id N",
        run_key_opt,
        code_opt,
    )
    target: str | int
    optioned = _optioned_lease(key_opt, code_opt, run_key_opt, lease_id)
    if optioned is not None:
        target, run_key = optioned
    else:
        assert key_or_code is not None
        target = _positional_lease("show", key_or_code, run_key)
    row = admin.show_lease(current_state().engine(), target, run_key)
    if as_json:
        echo_json(row.to_json())
        return
    fields = [
        ("id", row.id),
        ("key", row.idempotency_key),
        ("type", row.job_type),
        ("code", row.code),
        ("run key", row.run_key),
        ("status", row.status),
        ("attempt", row.attempt),
        ("holder", row.holder),
        ("lease length", human_ms(row.lease_ms)),
        ("remaining", _remaining(row)),
        ("heartbeats", _heartbeat(row)),
        ("created", row.created_at.isoformat()),
        ("acquired", row.acquired_at.isoformat()),
        ("heartbeat", row.heartbeat_at.isoformat()),
        ("expires", row.expires_at.isoformat()),
        ("finished", row.finished_at.isoformat() if row.finished_at else None),
        ("last error", row.last_error),
        ("result", None if row.result is None else json.dumps(row.result, ensure_ascii=False)),
    ]
    width = max(len(k) for k, _ in fields)
    for name, value in fields:
        click.echo(f"{name.ljust(width)}  {'-' if value is None else value}")


def _lease_ref(text: str) -> str | int:
    return int(text) if text.isdigit() else text


def _is_key_or_id(text: str) -> bool:
    return text.isdigit() or bool(_KEY_RE.fullmatch(text.strip()))


def _refs_to_fail(keys: tuple[str, ...], optioned: tuple[str | int, str | None] | None) -> list[str | int]:
    """The leases `leases fail` names: by an option, by keys or ids, or by CODE [RUN_KEY] as on `show`.
    A code (and run key) is looked up first, so a near miss gets the same hints as `leases show`."""
    if optioned is None and all(_is_key_or_id(ref) for ref in keys):
        return [_lease_ref(ref) for ref in keys]
    if optioned is None:
        if len(keys) > 2 or _is_key_or_id(keys[0]):
            bad = next(ref for ref in keys if not _is_key_or_id(ref))
            raise click.UsageError(
                f"{bad!r} is neither a v2: key nor a numeric lease id: several positional arguments of "
                "`leases fail` are keys or ids; a run by its code is CODE [RUN_KEY] alone, or "
                "`--code CODE --run-key RUN_KEY`."
            )
        code, run_key = keys[0], (keys[1] if len(keys) == 2 else None)
        optioned = _positional_lease("fail", code, run_key), run_key
    target, run_key = optioned
    if isinstance(target, str) and not _KEY_RE.fullmatch(target):
        return [admin.show_lease(current_state().engine(), target, run_key).id]
    return [target]


@leases.command("fail", short_help="Reset stuck or failed runs so the next claim retries them.")
@click.argument("keys", nargs=-1, required=False, metavar="[KEY_OR_ID... | CODE [RUN_KEY]]")
@lease_options
@click.option(
    "--force",
    is_flag=True,
    help="Also reset a live RUNNING lease. Risk: two holders — the old one may still be running its effect; "
    "its fenced writes will fail, but an effect it already started may happen twice (harmless only if the "
    "downstream deduplicates by the idempotency key).",
)
@click.option(
    "--reason", default="marked failed by an operator", show_default=True, help="Recorded in last_error."
)
def leases_fail(
    keys: tuple[str, ...],
    key_opt: str | None,
    code_opt: str | None,
    run_key_opt: str | None,
    lease_id: int | None,
    force: bool,
    reason: str,
) -> None:
    """Reset stuck or failed runs to FAIL so the next claim retries them with the same idempotency key.

    The lease is named as on `leases show`, by options or positionally:

    \b
      joblease leases fail --code CODE --run-key RUN_KEY   a SCHEDULE run (or: fail CODE RUN_KEY)
      joblease leases fail --code CODE                     an INITIAL run (or: fail CODE, unless CODE
                                                           looks like a run key: a date, a time, a number)
      joblease leases fail --key v2:… | --id N             (or: fail v2:… | fail N)
      joblease leases fail KEY_OR_ID...                    several v2: keys or numeric ids at once

    The old holder is fenced out (new owner token). A live lease is refused unless --force; a SUCCESS
    row is always refused (purge it instead).
    """
    given = [
        name
        for name, value in (
            ("KEY_OR_ID... | CODE [RUN_KEY]", keys or None),
            ("--key", key_opt),
            ("--code", code_opt),
            ("--id", lease_id),
        )
        if value is not None
    ]
    _one_way(
        given,
        "--code CODE [--run-key RUN_KEY], --key KEY, --id N, KEY_OR_ID... or CODE [RUN_KEY]",
        run_key_opt,
        code_opt,
    )
    refs = _refs_to_fail(keys, _optioned_lease(key_opt, code_opt, run_key_opt, lease_id))
    engine = current_state().engine()
    worst = 0
    for ref in refs:
        try:
            outcome = admin.reset_lease(engine, ref, force=force, reason=reason)
        except (errors.NotFoundError, errors.AdminRefusedError, errors.AdminArgumentError) as exc:
            click.echo(f"Error: {ref}: {exc}", err=True)
            worst = max(worst, exit_code_for(exc))
            continue
        row = outcome.lease
        if outcome.was_live:
            click.echo(
                f"warning: lease {row.id} was live; its old holder may still run its effect and a retry may "
                "repeat it — harmless only if the downstream deduplicates by the idempotency key",
                err=True,
            )
        run = row.code if row.run_key is None else f"{row.code} / {row.run_key}"
        click.echo(
            f"lease {row.id} ({run}) {'is now' if outcome.changed else 'was already'} FAIL: the next claim "
            f"retries it as attempt {row.attempt + 1} with key {row.idempotency_key}"
        )
    if worst:
        sys.exit(worst)


@leases.command("purge", short_help="Delete finished SCHEDULE rows older than a window.")
@click.option(
    "--finished-before", type=DURATION, required=True, help="Delete rows finished longer ago (e.g. 30d)."
)
@click.option(
    "--min-replay-window",
    type=DURATION,
    help="Refuse a --finished-before below this: a purged run key can run again. Default: "
    f"${MIN_REPLAY_WINDOW_ENV}, else 7d. ${MIN_REPLAY_WINDOW_ENV} is a floor: this flag can raise it, "
    "never lower it.",
)
@click.option("--dry-run", is_flag=True, help="Only count the rows that would be deleted.")
def leases_purge(finished_before: int, min_replay_window: int | None, dry_run: bool) -> None:
    """Delete SUCCESS/FAIL rows of SCHEDULE runs finished before the window (INITIAL, RUNNING rows kept).

    After a purge the same (code, run key) can win a fresh lease again (attempt 1, same key), so the window
    must cover every way that run key could be replayed (late ticks, backfills, re-executions).
    """
    count = admin.purge_leases(
        current_state().engine(),
        finished_before_ms=finished_before,
        min_replay_window_ms=floor_option(
            min_replay_window, MIN_REPLAY_WINDOW_ENV, admin.DEFAULT_MIN_REPLAY_WINDOW_MS
        ),
        dry_run=dry_run,
    )
    click.echo(f"{'would delete' if dry_run else 'deleted'} {count} finished SCHEDULE lease row(s)")
