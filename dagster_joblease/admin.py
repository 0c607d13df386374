"""Administration of leases and the outbox: what an operator needs at 3 a.m., without writing SQL.

Plain functions over an engine (the ``joblease`` CLI is a thin layer on top). Every time and age is read
from the *database* clock (:mod:`dagster_joblease.storage.clock`), so two operators on different machines
see the same "remaining" and "overdue" figures as the workers do.

Safety rules these functions enforce:

- ``admin_fail`` refuses a live ``RUNNING`` lease unless ``force=True`` (two holders could then run the
  same effect), and refuses a ``SUCCESS`` row (it is final; see ``purge_leases``).
- ``purge_leases`` deletes only finished ``SCHEDULE`` rows older than a window that must be at least the
  configured replay window: a purged key can run again. ``INITIAL`` rows are never purged.
- ``purge_sent`` deletes only ``SENT`` outbox rows older than a window that must be at least the
  downstream's deduplication window.
- ``requeue`` keeps the row's idempotency key, so the downstream deduplicates a redelivery.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from dagster_joblease import checks, errors, identity, staleness
from dagster_joblease.errors import AdminArgumentError, AdminRefusedError
from dagster_joblease.lease import LeaseStatus, bound_error
from dagster_joblease.options import MAX_DURATION_MS, default_heartbeat_ms
from dagster_joblease.outbox import OutboxStatus
from dagster_joblease.storage import leases, outbox, outbox_events, purge, route_groups
from dagster_joblease.storage.engine import translate_errors

__all__ = [
    "ADMIN_RESET_PREFIX",
    "DEFAULT_MIN_REPLAY_WINDOW_MS",
    "DEFAULT_MIN_RETENTION_MS",
    "FORCED_MARK",
    "MIN_REPLAY_WINDOW_ENV",
    "MIN_RETENTION_ENV",
    "human_ms",
    "LeaseRow",
    "OutboxRow",
    "OutboxStats",
    "ResetOutcome",
    "TopicCount",
    "admin_fail",
    "env_floor_ms",
    "list_leases",
    "near_matches",
    "list_outbox",
    "outbox_stats",
    "parse_duration_ms",
    "purge_events",
    "purge_leases",
    "purge_sent",
    "requeue",
    "reset_lease",
    "resume_group",
    "show_lease",
]

#: Default floor for ``purge_sent``: 24 hours, the usual downstream Idempotency-Key retention (Stripe's).
DEFAULT_MIN_RETENTION_MS = 24 * 3_600_000
#: Default floor for ``purge_leases``: 7 days. A purged SCHEDULE key can run again after it.
DEFAULT_MIN_REPLAY_WINDOW_MS = 7 * 86_400_000
#: Environment variables that set a floor no caller can go below (the CLI's flags, or Python callers,
#: may only raise it): the outbox's minimum retention and the leases' minimum replay window.
MIN_RETENTION_ENV = "JOBLEASE_OUTBOX_MIN_RETENTION"
MIN_REPLAY_WINDOW_ENV = "JOBLEASE_LEASE_MIN_REPLAY_WINDOW"
#: Every admin reset's ``last_error`` starts with this, so monitoring can tell resets from real failures.
ADMIN_RESET_PREFIX = "admin reset"
#: In ``last_error`` when the reset was forced on a live lease (two holders were possible).
FORCED_MARK = "forced while live"
MAX_LIMIT = 10_000

_OUTBOX_STATUSES = tuple(s.value for s in OutboxStatus)
_LEASE_STATUSES = tuple(s.value for s in LeaseStatus)
_KEY_RE = re.compile(r"v2:[0-9a-f]{64}")

_TWO_HOLDERS_RISK = (
    "forcing it risks two holders at once: the old holder may still be running its effect. Its fenced "
    "writes (heartbeat, complete, fail) will fail with LostLeaseError, but an external effect it already "
    "started may happen twice; only downstream deduplication by the idempotency key makes that harmless"
)


def human_ms(ms: int | None) -> str:
    """A short human duration for messages and tables: 850ms, 12.5s, 4m12s, 2h05m, 7d."""
    if ms is None:
        return "-"
    sign, ms = ("-" if ms < 0 else ""), abs(ms)
    if ms < 1_000:
        return f"{sign}{ms}ms"
    if ms < 60_000:
        return f"{sign}{ms / 1000:.1f}s"
    days, rest = divmod(ms // 1_000, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{sign}{days}d{hours:02d}h" if hours else f"{sign}{days}d"
    if hours:
        return f"{sign}{hours}h{minutes:02d}m" if minutes else f"{sign}{hours}h"
    return f"{sign}{minutes}m{secs:02d}s" if secs else f"{sign}{minutes}m"


_UNITS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 7 * 86_400_000}
_DURATION = re.compile(r"(?:\d+(?:ms|s|m|h|d|w))+")
_DURATION_PART = re.compile(r"(\d+)(ms|s|m|h|d|w)")


def parse_duration_ms(text: str) -> int | None:
    """``90s``, ``30m``, ``2h``, ``7d``, ``1w``, ``1h30m``, ``500ms`` → milliseconds; None if malformed."""
    value = text.strip().lower()
    if not _DURATION.fullmatch(value):
        return None
    return sum(int(n) * _UNITS[u] for n, u in _DURATION_PART.findall(value))


def env_floor_ms(name: str) -> int | None:
    """The floor set by environment variable ``name`` (a duration such as ``24h``), or None if unset.

    Raises :class:`ConfigurationError` naming the variable when it is set but not a duration: a floor
    that silently did not apply would let a purge go below it.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    ms = parse_duration_ms(raw)
    if ms is None or ms > MAX_DURATION_MS:
        raise errors.ConfigurationError(
            f"${name}={raw.strip()!r} is not a duration of at most 100 years; set it like 24h, 7d or 1w, "
            "or unset it"
        )
    return ms


def _floor(given: int, env_name: str) -> tuple[int, str]:
    """The effective floor: the caller's, raised to the environment's; and a note saying which applied."""
    env = env_floor_ms(env_name)
    if env is not None and env > given:
        return env, f" (set by ${env_name}; a caller may raise this floor but not lower it)"
    return given, ""


# -- rows ------------------------------------------------------------------------------------------


def _utc(value: datetime | None) -> datetime | None:
    """Timestamps as aware UTC: SQLite hands back naive UTC text, PostgreSQL the session's zone."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return value


@dataclasses.dataclass(frozen=True)
class LeaseRow:
    """One lease row as an operator sees it. ``remaining_ms`` is on the database clock (RUNNING only;
    negative when the holder is overdue); ``expired`` says a claim could reclaim it right now.

    ``heartbeat_ms`` is the interval the holder recorded when it claimed (0: it never heartbeats and is
    judged by expiry only; ``None``: a row from before migration 0002). ``heartbeat_age_ms`` (RUNNING
    only, database clock) is how long ago it last heartbeated; ``stale`` says that is past the holder's own
    threshold (:func:`dagster_joblease.staleness.stale_after_ms`): a stale holder whose lease has not
    expired may still be working, so nothing takes it over on staleness alone unless its run is known
    to be finished.
    """

    id: int
    idempotency_key: str
    job_type: str
    code: str
    run_key: str | None
    status: str
    attempt: int
    holder: str | None
    lease_ms: int
    heartbeat_ms: int | None
    remaining_ms: int | None
    heartbeat_age_ms: int | None
    stale: bool
    expired: bool
    created_at: datetime
    acquired_at: datetime
    heartbeat_at: datetime
    expires_at: datetime
    finished_at: datetime | None
    last_error: str | None
    result: Any

    @property
    def live(self) -> bool:
        """Held by a holder whose lease has not expired on the database clock."""
        return self.status == LeaseStatus.RUNNING.value and not self.expired

    def to_json(self) -> dict[str, Any]:
        """Stable machine form (ISO 8601 UTC times); the keys are documented in docs/operations.md."""
        return {f.name: _json_value(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class OutboxRow:
    """One outbox row without its payload. ``due_in_ms`` is on the database clock (PENDING only;
    negative: overdue by that much); ``claimed`` means a dispatcher holds an unexpired claim on it."""

    id: int
    idempotency_key: str
    topic: str
    status: str
    attempts: int
    next_attempt_at: datetime
    due_in_ms: int | None
    claimed: bool
    last_status: int | None
    last_error: str | None
    created_at: datetime
    updated_at: datetime
    sent_at: datetime | None
    #: Rows of one ordering key go one at a time, in id order (None: the row has none).
    ordering_key: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {f.name: _json_value(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class TopicCount:
    topic: str
    status: str
    count: int


@dataclasses.dataclass(frozen=True)
class OutboxStats:
    """Counts by status and by (topic, status), plus the due backlog. ``oldest_due_age_ms`` is how long
    the oldest due row has been waiting past its ``next_attempt_at`` (database clock), ``None`` if none."""

    by_status: Mapping[str, int]
    by_topic: tuple[TopicCount, ...]
    due: int
    oldest_due_age_ms: int | None

    @property
    def total(self) -> int:
        return sum(self.by_status.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "by_status": dict(self.by_status),
            "by_topic": [dataclasses.asdict(t) for t in self.by_topic],
            "due": self.due,
            "oldest_due_age_ms": self.oldest_due_age_ms,
            "total": self.total,
        }


# -- purges: one transaction per batch -------------------------------------------------------------


def _in_batches(engine: sa.Engine, action: str, one_batch: Callable[..., int], *, dry_run: bool) -> int:
    """Run a storage purge (``one_batch(conn, dry_run=..., limit=...)``: at most ``limit`` rows on
    ``conn``) one transaction per batch of :data:`~dagster_joblease.storage.purge.PURGE_BATCH` until a
    batch comes back short, so a large purge never holds long locks; the total. ``dry_run``: the one
    count it returns."""
    limit = purge.PURGE_BATCH
    with translate_errors(action):
        if dry_run:
            with engine.connect() as conn:
                return int(one_batch(conn, dry_run=True, limit=limit))
        total = 0
        while True:
            with engine.begin() as conn:
                deleted = int(one_batch(conn, dry_run=False, limit=limit))
            total += deleted
            if deleted < limit:
                return total


# -- validation ------------------------------------------------------------------------------------


def _check_status(value: str | None, allowed: Sequence[str], what: str) -> str | None:
    if value is None:
        return None
    upper = value.strip().upper() if isinstance(value, str) else None
    if upper not in allowed:
        raise AdminArgumentError(
            f"invalid {what} status {value!r}: allowed (any case): {', '.join(s.lower() for s in allowed)}"
        )
    return upper


# -- leases ----------------------------------------------------------------------------------------


def _lease_row(row: sa.Row[Any]) -> LeaseRow:
    m = row._mapping
    heartbeat_ms = m["heartbeat_ms"]
    age = None if m["heartbeat_age_ms"] is None else int(m["heartbeat_age_ms"])
    # A row from before 0002 is judged as the library's default interval for its lease length.
    threshold = staleness.stale_after_ms(heartbeat_ms, legacy_ms=2 * default_heartbeat_ms(m["lease_ms"]))
    return LeaseRow(
        id=m["id"],
        idempotency_key=m["lock_key"],
        job_type=m["job_type"],
        code=m["code"],
        run_key=m["run_key"],
        status=m["status"],
        attempt=m["attempt"],
        holder=m["holder"],
        lease_ms=m["lease_ms"],
        heartbeat_ms=None if heartbeat_ms is None else int(heartbeat_ms),
        remaining_ms=None if m["remaining_ms"] is None else int(m["remaining_ms"]),
        heartbeat_age_ms=age,
        stale=age is not None and staleness.is_stale(age, threshold),
        expired=bool(m["expired"]),
        created_at=_utc(m["created_at"]),  # type: ignore[arg-type]
        acquired_at=_utc(m["acquired_at"]),  # type: ignore[arg-type]
        heartbeat_at=_utc(m["heartbeat_at"]),  # type: ignore[arg-type]
        expires_at=_utc(m["expires_at"]),  # type: ignore[arg-type]
        finished_at=_utc(m["finished_at"]),
        last_error=m["last_error"],
        result=m["result"],
    )


def list_leases(
    engine: sa.Engine,
    *,
    code: str | None = None,
    status: str | None = None,
    older_than_ms: int | None = None,
    expired_only: bool = False,
    limit: int = 100,
) -> list[LeaseRow]:
    """Lease rows, newest attempt first.

    ``older_than_ms`` keeps rows whose current attempt started (``acquired_at``) more than that long ago on
    the database clock, so ``status="running", older_than_ms=2h`` finds runs going for over two hours.
    ``expired_only`` keeps RUNNING rows whose holder is past its expiry (stuck or dead; reclaimable).
    """
    wanted = _check_status(status, _LEASE_STATUSES, "lease")
    limit = checks.integer("limit", limit, minimum=1, maximum=MAX_LIMIT, error=checks.admin_argument)
    before = (
        None
        if older_than_ms is None
        else checks.milliseconds("older_than_ms", older_than_ms, error=checks.admin_argument)
    )
    name = None if code is None else checks.text("code", code, error=checks.admin_argument)
    with translate_errors("list leases"), engine.connect() as conn:
        rows = leases.lease_rows(
            conn, code=name, status=wanted, acquired_before_ms=before, expired_only=expired_only, limit=limit
        )
    return [_lease_row(r) for r in rows]


def _lookup_key(key_or_code: str, run_key: str | None) -> tuple[str, identity.JobIdentity | None]:
    """A ``v2:`` key as is; otherwise the key of (code, run_key) SCHEDULE, or of code alone INITIAL."""
    text = key_or_code.strip()
    if run_key is None and _KEY_RE.fullmatch(text):
        return text, None
    job = (
        identity.JobIdentity.initial(text)
        if run_key is None
        else identity.JobIdentity.schedule(text, run_key)
    )
    return job.idempotency_key, job


def _get_lease(
    conn: sa.Connection, *, lease_id: int | None = None, lock_key: str | None = None
) -> LeaseRow | None:
    row = leases.lease_row(conn, lease_id=lease_id, lock_key=lock_key)
    return None if row is None else _lease_row(row)


def show_lease(engine: sa.Engine, key_or_code: str | int, run_key: str | None = None) -> LeaseRow:
    """One lease by its ``v2:`` key, by ``code`` + ``run_key`` (SCHEDULE), by ``code`` alone (INITIAL), or
    by its numeric row id (an ``int``). Raises :class:`NotFoundError` naming what was looked up."""
    if isinstance(key_or_code, int) and not isinstance(key_or_code, bool):
        return _show_lease_by_id(engine, key_or_code, run_key)
    if not isinstance(key_or_code, str):
        raise AdminArgumentError(f"invalid lease key or code {key_or_code!r}: must be a str or an int id")
    key, job = _lookup_key(key_or_code, run_key)
    with translate_errors("read a lease"), engine.connect() as conn:
        found = _get_lease(conn, lock_key=key)
        if found is not None:
            return found
        schedules = 0 if job is None or run_key is not None else leases.count_schedules(conn, job.code)
        close = [] if job is None or schedules else near_matches(conn, job.code, job.run_key)
    raise errors.NotFoundError(lease_not_found(key, job, schedules=schedules, close=close))


def _show_lease_by_id(engine: sa.Engine, lease_id: int, run_key: str | None) -> LeaseRow:
    if run_key is not None:
        raise AdminArgumentError("a run key cannot be combined with a numeric lease id")
    with translate_errors("read a lease"), engine.connect() as conn:
        found = _get_lease(conn, lease_id=lease_id)
    if found is None:
        raise errors.NotFoundError(f"no lease with id {lease_id}; list them with `joblease leases list`")
    return found


def lease_not_found(
    key: str, job: identity.JobIdentity | None, *, schedules: int, close: Sequence[str]
) -> str:
    """Why :func:`show_lease` found nothing, and what to try: a ``v2:`` key (``job`` None) names the key;
    a code names the run it meant, then the SCHEDULE runs of an INITIAL lookup's code (``schedules``),
    else the near matches (``close``), else how to list them."""
    if job is None:
        return f"no lease with key {key}; list them with `joblease leases list`"
    if job.type is identity.JobType.INITIAL:
        what = f"INITIAL run {job.code!r}"
    else:
        what = f"SCHEDULE run {job.code!r} / {job.run_key!r}"
    if schedules:
        hint = f"; {schedules} SCHEDULE run(s) of that code exist: give the run key too"
    elif close:
        hint = "; close matches: " + ", ".join(close)
    else:
        hint = "; list them with `joblease leases list --code CODE`"
    return f"no lease for {what} (key {key}){hint}"


#: How many recent rows a near-match hint looks at (a bounded query, whatever the table's size).
NEAR_MATCH_SCAN = 1_000


def near_matches(conn: sa.Connection, code: str, run_key: str | None, *, limit: int = 3) -> list[str]:
    """Leases whose name is close to (``code``, ``run_key``), for a "no lease" message: close run keys
    of the same code, else close codes (``difflib.get_close_matches`` over at most
    :data:`NEAR_MATCH_SCAN` of the newest rows). Each is shown as the option form that names it."""
    if run_key is not None:
        keys = leases.recent_run_keys(conn, code, NEAR_MATCH_SCAN)
        close = difflib.get_close_matches(run_key, keys, n=limit, cutoff=0.6)
        if close:
            return [f"--code {code} --run-key {k}" for k in close]
    recent = leases.recent_names(conn, NEAR_MATCH_SCAN)
    codes = list(dict.fromkeys(str(c) for c, _ in recent))
    close_codes = [c for c in difflib.get_close_matches(code, codes, n=limit, cutoff=0.6) if c != code]
    shown = []
    for other in close_codes:
        if run_key is not None and any(c == other and k == run_key for c, k in recent):
            shown.append(f"--code {other} --run-key {run_key}")
        else:
            shown.append(f"--code {other}" if run_key is None else f"code {other!r}")
    return shown


@dataclasses.dataclass(frozen=True)
class ResetOutcome:
    """What :func:`reset_lease` did: the row after it, whether it changed, and whether it was live."""

    lease: LeaseRow
    changed: bool
    was_live: bool


def admin_fail(
    engine: sa.Engine, key: str | int, *, force: bool = False, reason: str = "marked failed by an operator"
) -> LeaseRow:
    """Reset a stuck or failed run to FAIL; see :func:`reset_lease` (this returns only the row)."""
    return reset_lease(engine, key, force=force, reason=reason).lease


def reset_lease(
    engine: sa.Engine, key: str | int, *, force: bool = False, reason: str = "marked failed by an operator"
) -> ResetOutcome:
    """Reset a stuck or failed run so the next claim retries it with the same idempotency key.

    ``key`` is a ``v2:`` key or a numeric lease id. A RUNNING row gets a new ``owner_token`` (the old
    holder is fenced out: its heartbeat/complete/fail raise ``LostLeaseError``) and becomes ``FAIL`` with a
    ``last_error`` starting with ``"admin reset"``. A row that is already ``FAIL`` is returned unchanged.

    Refused (:class:`AdminRefusedError`, nothing changed): a ``SUCCESS`` row (final by design), and a live
    RUNNING row (not expired on the database clock) unless ``force=True`` — which risks two holders.
    """
    if isinstance(key, int) and not isinstance(key, bool):
        where: dict[str, Any] = {"lease_id": key}
        label = f"id {key}"
    elif isinstance(key, str) and _KEY_RE.fullmatch(key.strip()):
        where = {"lock_key": key.strip()}
        label = f"key {key.strip()}"
    else:
        raise AdminArgumentError(
            f"invalid lease key {key!r}: give a v2: idempotency key or a numeric lease id "
            "(`joblease leases show CODE [RUN_KEY]` prints the key)"
        )
    why = checks.text("reason", reason, error=checks.admin_argument)
    with translate_errors("reset a lease"), engine.begin() as conn:
        row = leases.lock_for_reset(conn, **where)
        if row is None:
            raise errors.NotFoundError(f"no lease with {label}; list them with `joblease leases list`")
        before = _lease_row(row)
        if before.status == LeaseStatus.FAIL.value:
            return ResetOutcome(lease=before, changed=False, was_live=False)
        if before.status == LeaseStatus.SUCCESS.value:
            raise AdminRefusedError(
                f"lease {before.id} ({_label(before)}) already succeeded; SUCCESS is final and is never "
                "retried. To let a SCHEDULE run happen again, purge it after its replay window "
                "(`joblease leases purge`)."
            )
        if before.live and not force:
            raise AdminRefusedError(
                f"lease {before.id} ({_label(before)}) is held by a live lease: holder {before.holder}, "
                f"{human_ms(before.remaining_ms)} left on the database clock. Wait for it to finish or "
                f"expire; force it (`--force`) only if that holder is truly gone — {_TWO_HOLDERS_RISK}."
            )
        state = (
            f"{FORCED_MARK} (holder {before.holder}, {human_ms(before.remaining_ms)} left)"
            if before.live
            else f"holder {before.holder} was overdue by {human_ms(-(before.remaining_ms or 0))}"
        )
        text = bound_error(f"{ADMIN_RESET_PREFIX} of attempt {before.attempt}: {why} ({state})")
        # Re-check at the write what the decision rested on (the holder, RUNNING, expired unless forced).
        updated = leases.reset_to_fail(
            conn,
            before.id,
            row._mapping["owner_token"],
            expired_only=not before.live,
            new_token=secrets.token_hex(16),
            error=text,
        )
        if updated != 1:  # only reachable without row locks; the caller may simply retry
            raise AdminRefusedError(
                f"lease {before.id} changed while it was being reset; nothing was changed"
            )
        after = _get_lease(conn, lease_id=before.id)
    assert after is not None
    return ResetOutcome(lease=after, changed=True, was_live=before.live)


def _label(row: LeaseRow) -> str:
    return row.code if row.run_key is None else f"{row.code} / {row.run_key}"


def purge_leases(
    engine: sa.Engine, *, finished_before_ms: int, min_replay_window_ms: int, dry_run: bool = False
) -> int:
    """Delete SUCCESS and FAIL rows of SCHEDULE runs that finished more than ``finished_before_ms`` ago.

    A purged key is forgotten: the same (code, run key) can run again, as attempt 1 with the same
    idempotency key. So the window must be at least ``min_replay_window_ms`` — longer than any schedule,
    backfill or retry could replay that run key — or :class:`RetentionWindowError` is raised and nothing
    is deleted. ``$JOBLEASE_LEASE_MIN_REPLAY_WINDOW``, when set, is a floor under
    ``min_replay_window_ms``. RUNNING rows and INITIAL rows (run once, forever) are never purged. Returns
    the count (what would be deleted, with ``dry_run``).
    """
    window = checks.milliseconds("finished_before_ms", finished_before_ms, error=checks.admin_argument)
    floor, source = _floor(
        checks.milliseconds("min_replay_window_ms", min_replay_window_ms, error=checks.admin_argument),
        MIN_REPLAY_WINDOW_ENV,
    )
    if window < floor:
        raise errors.RetentionWindowError(
            f"refusing to purge leases finished before {human_ms(window)}: below the minimum replay window "
            f"of {human_ms(floor)}{source}. A purged SCHEDULE key can run again (a late schedule tick, "
            "backfill or re-execution of that run key would win a fresh lease), so keep rows at least as "
            "long as such a replay is possible, or lower the configured minimum deliberately. Nothing was "
            "deleted."
        )
    purge_one = functools.partial(leases.purge_finished_schedules, finished_before_ms=window)
    return _in_batches(engine, "purge leases", purge_one, dry_run=dry_run)


# -- outbox ----------------------------------------------------------------------------------------


def outbox_stats(engine: sa.Engine) -> OutboxStats:
    """Counts by status and by (topic, status), the due backlog and the age of its oldest row."""
    with translate_errors("read outbox statistics"), engine.connect() as conn:
        grouped = outbox.counts_by_topic_and_status(conn)
        due, oldest_ms_until = outbox.due_backlog(conn)
    by_status = dict.fromkeys(_OUTBOX_STATUSES, 0)
    for _topic, status, count in grouped:
        by_status[status] = by_status.get(status, 0) + int(count)
    return OutboxStats(
        by_status=by_status,
        by_topic=tuple(TopicCount(topic=t, status=s, count=c) for t, s, c in grouped),
        due=due,
        oldest_due_age_ms=None if oldest_ms_until is None else max(0, -oldest_ms_until),
    )


def _outbox_row(row: sa.Row[Any]) -> OutboxRow:
    m = row._mapping
    return OutboxRow(
        id=m["id"],
        idempotency_key=m["idempotency_key"],
        topic=m["topic"],
        status=m["status"],
        attempts=m["attempts"],
        next_attempt_at=_utc(m["next_attempt_at"]),  # type: ignore[arg-type]
        due_in_ms=None if m["due_in_ms"] is None else int(m["due_in_ms"]),
        claimed=bool(m["claimed"]),
        last_status=m["last_status"],
        last_error=m["last_error"],
        created_at=_utc(m["created_at"]),  # type: ignore[arg-type]
        updated_at=_utc(m["updated_at"]),  # type: ignore[arg-type]
        sent_at=_utc(m["sent_at"]),
        ordering_key=m["ordering_key"],
    )


def list_outbox(
    engine: sa.Engine, *, status: str | None = None, topic: str | None = None, limit: int = 100
) -> list[OutboxRow]:
    """Outbox rows (without payloads), newest first; ``status`` is ``pending``, ``sent``, ``dead`` or
    ``skipped``."""
    wanted = _check_status(status, _OUTBOX_STATUSES, "outbox")
    limit = checks.integer("limit", limit, minimum=1, maximum=MAX_LIMIT, error=checks.admin_argument)
    name = None if topic is None else checks.text("topic", topic, error=checks.admin_argument)
    with translate_errors("list outbox rows"), engine.connect() as conn:
        rows = outbox.outbox_rows(conn, status=wanted, topic=name, limit=limit)
    return [_outbox_row(r) for r in rows]


def requeue(
    engine: sa.Engine, *, row_id: int | None = None, all_dead: bool = False, topic: str | None = None
) -> int:
    """Make rows due again with their original idempotency key; returns how many were requeued.

    Exactly one selection: ``row_id`` (a DEAD or SKIPPED row, or a PENDING row waiting out its backoff —
    not one a dispatcher is delivering right now), ``all_dead`` (every DEAD row) or ``topic`` (every DEAD
    row of that topic; ``all_dead`` may be given with it; SKIPPED rows are requeued only by id).
    Each row gets ``status=PENDING``, ``attempts=0``,
    ``next_attempt_at`` = database now and no claim. ``last_status``/``last_error`` are kept as history until
    the next delivery attempt overwrites them. SENT rows are never requeued. The row's first-attempt time is
    cleared, so a route's ``dedupe_window`` restarts from the next attempt: requeueing a row dead-lettered
    past its window is a person's decision that sending it again is right.
    """
    if row_id is not None and (all_dead or topic is not None):
        raise AdminArgumentError("requeue takes one selection: a row id, or all_dead / topic, not both")
    if row_id is not None:
        return _requeue_one(engine, row_id)
    if not all_dead and topic is None:
        raise AdminArgumentError("requeue needs a selection: a row id, all_dead=True or a topic")
    name = None if topic is None else checks.text("topic", topic, error=checks.admin_argument)
    with translate_errors("requeue outbox rows"), engine.begin() as conn:
        return outbox.requeue_dead(conn, name)


def _requeue_one(engine: sa.Engine, row_id: int) -> int:
    checks.integer("row_id", row_id, error=checks.admin_argument)
    with translate_errors("requeue an outbox row"), engine.begin() as conn:
        current = outbox.lock_for_requeue(conn, row_id)
        if current is None:
            raise errors.NotFoundError(f"no outbox row with id {row_id}; see `joblease outbox list`")
        status, claimed = current
        refusal = requeue_refusal(row_id, status, claimed=claimed)
        if refusal is not None:
            raise AdminRefusedError(refusal)
        # Re-check at the write the state the refusal above rested on.
        updated = outbox.requeue_one(conn, row_id, status)
        if updated != 1:
            raise AdminRefusedError(
                f"outbox row {row_id} changed while it was being requeued; nothing was changed"
            )
        return updated


def requeue_refusal(row_id: int, status: str, *, claimed: bool) -> str | None:
    """Why one outbox row may not be requeued (None: it may): a SENT row never is, nor a PENDING row a
    dispatcher is delivering right now (an unexpired claim)."""
    if status == "SENT":
        return f"outbox row {row_id} was already SENT; requeueing delivered rows is not supported"
    if status == "PENDING" and claimed:
        return (
            f"outbox row {row_id} is being delivered by a dispatcher right now (unexpired claim); "
            "try again after the attempt finishes"
        )
    return None


def skip(engine: sa.Engine, row_id: int) -> str | None:
    """Mark DEAD row ``row_id`` SKIPPED: a person decided it is never sent. Returns its ordering key (None
    when it has none).

    SKIPPED is terminal for the dispatcher: the row is never claimed, it no longer counts as dead (the
    ``no_dead_rows`` check, ``outbox status``), and it keeps its ordering key, which no longer holds that
    key's later rows back (:func:`dagster_joblease.storage.outbox.head_of_its_key` counts PENDING and DEAD
    rows only): they flow again, in order. Its ``last_error`` says who skipped it and when (the database
    clock), and keeps the error it had. ``requeue`` of it makes it PENDING again, the head of its key
    again (the lowest id), sent once no row of its key is in flight (``head_of_its_key``: the one rule,
    met at the claim). Refused for a row that is not DEAD: a PENDING row is still being delivered or
    retried (let it finish, or wait until it is DEAD), a SENT row was delivered, a SKIPPED row already
    is."""
    checks.integer("row_id", row_id, error=checks.admin_argument)
    with translate_errors("skip an outbox row"), engine.begin() as conn:
        current = outbox.lock_for_skip(conn, row_id)
        if current is None:
            raise errors.NotFoundError(f"no outbox row with id {row_id}; see `joblease outbox list`")
        status, ordering_key, last_error = current
        refusal = skip_refusal(row_id, status)
        if refusal is not None:
            raise AdminRefusedError(refusal)
        note = skipped_row_note(route_groups.database_now(conn), ordering_key, last_error)
        if outbox.skip_dead(conn, row_id, note) != 1:
            raise AdminRefusedError(
                f"outbox row {row_id} changed while it was being skipped; nothing was changed"
            )
        return None if ordering_key is None else str(ordering_key)


def skip_refusal(row_id: int, status: str) -> str | None:
    """Why one outbox row may not be skipped (None: it may): only a DEAD row is."""
    if status == OutboxStatus.DEAD:
        return None
    why = {
        OutboxStatus.PENDING.value: "it is still being delivered or retried: let it finish, or skip it once "
        "it is DEAD",
        OutboxStatus.SENT.value: "it was delivered; there is nothing to skip",
        OutboxStatus.SKIPPED.value: f"it already is; `joblease outbox requeue {row_id}` sends it after all",
    }.get(status, "unknown status")
    return f"outbox row {row_id} is {status}; only a DEAD row is skipped ({why})"


def skipped_row_note(now: datetime, ordering_key: str | None, last_error: str | None) -> str:
    """The ``last_error`` a skipped row keeps: who skipped it, when (``now``, the database clock), its
    ordering key, and the error it had."""
    key = "" if ordering_key is None else f"; its ordering key {ordering_key!r} flows on"
    note = f"skipped by an operator at {now.isoformat(timespec='seconds')}: never sent{key}"
    return f"{note} (last error: {last_error})" if last_error else note


def resume_group(engine: sa.Engine, group: str) -> route_groups.GroupState:
    """End limit group ``group``'s pause now, for every dispatcher: each claims its rows again at its next
    claim. Returns the group's state as it was (its pause and reason). Refused, naming the groups that are
    paused, when ``group`` has no pause in force (nothing is written then)."""
    with translate_errors("end a limit group's pause"), engine.begin() as conn:
        ended = route_groups.resume(conn, group)
        if ended is not None:
            return ended
        paused = sorted(name for name, state in route_groups.read_states(conn).items() if state.paused)
    others = f"paused now: {', '.join(paused)}" if paused else "no limit group is paused now"
    raise AdminRefusedError(f"limit group {group!r} is not paused; {others}")


def purge_sent(engine: sa.Engine, *, older_than_ms: int, min_retention_ms: int, dry_run: bool = False) -> int:
    """Delete SENT rows delivered more than ``older_than_ms`` ago (database clock).

    Once a row is gone, enqueueing the same key again inserts a new row and delivers it again; only the
    downstream's own deduplication then stops a second effect. So the window must be at least
    ``min_retention_ms``, which documents the downstream's deduplication window, or
    :class:`RetentionWindowError` is raised and nothing is deleted. ``$JOBLEASE_OUTBOX_MIN_RETENTION``, when
    set, is a floor under ``min_retention_ms``. SKIPPED rows skipped more than ``older_than_ms`` ago go too
    (aged by ``updated_at``, which the skip set to the database clock). PENDING and DEAD rows are never
    purged.
    """
    window = _retention_window(older_than_ms, min_retention_ms, "outbox rows sent")
    purge_one = functools.partial(outbox.purge_sent, sent_before_ms=window)
    return _in_batches(engine, "purge sent and skipped outbox rows", purge_one, dry_run=dry_run)


def purge_events(
    engine: sa.Engine, *, older_than_ms: int, min_retention_ms: int, dry_run: bool = False
) -> int:
    """Delete CDC events (:mod:`dagster_joblease.cdc`) inserted more than ``older_than_ms`` ago (database
    clock): retention of the hand-over table.

    An event is shipped once its transaction commits: the connector reads the INSERT from the WAL, which
    its replication slot keeps until the connector confirms it, and the router ignores the DELETE. The
    window only keeps a key's row long enough that a repeat of the key writes nothing; after it, a repeat
    is a new event, and only the consumer's deduplication (on the ``id`` header) stops a second effect.
    So the window must be at least ``min_retention_ms`` (and ``$JOBLEASE_OUTBOX_MIN_RETENTION``), as for
    :func:`purge_sent`, or :class:`RetentionWindowError` is raised and nothing is deleted.
    """
    window = _retention_window(older_than_ms, min_retention_ms, "CDC events written")
    purge_one = functools.partial(outbox_events.purge_older_than, older_than_ms=window)
    return _in_batches(engine, "purge CDC outbox events", purge_one, dry_run=dry_run)


def _retention_window(older_than_ms: int, min_retention_ms: int, rows: str) -> int:
    """``older_than_ms``, checked against the minimum retention (the argument, floored by
    ``$JOBLEASE_OUTBOX_MIN_RETENTION``); :class:`RetentionWindowError` below it."""
    window = checks.milliseconds("older_than_ms", older_than_ms, error=checks.admin_argument)
    floor, source = _floor(
        checks.milliseconds("min_retention_ms", min_retention_ms, error=checks.admin_argument),
        MIN_RETENTION_ENV,
    )
    if window < floor:
        raise errors.RetentionWindowError(
            f"refusing to purge {rows} before {human_ms(window)}: below the minimum retention of "
            f"{human_ms(floor)}{source}, which must cover the downstream's deduplication window. After a "
            "purge, a re-enqueue of the same key is delivered again, and only the downstream can still "
            "deduplicate it. Nothing was deleted."
        )
    return window
