"""The inbox's one semantics, without IO: keys, fingerprints, the verdict on a key's row, stored answers.

:func:`judge` is the whole decision (pure, table-tested); :mod:`dagster_joblease.inbox.sync` and
:mod:`dagster_joblease.inbox.aio` run the same statements (:mod:`dagster_joblease.storage.inbox`) around it
on their connections, and the ASGI middleware drives either.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import json
import re
from collections.abc import Generator, Iterable, Mapping
from typing import Any, NamedTuple

from dagster_joblease import checks, errors, outbox
from dagster_joblease.errors import InvalidInboxInputError
from dagster_joblease.outbox import MAX_KEY_LENGTH
from dagster_joblease.storage import inbox as store
from dagster_joblease.storage.driver import Query
from dagster_joblease.storage.inbox import InboxStatus, KeyRow

__all__ = [
    "DEFAULT_LOCK_MS",
    "MAX_BODY_BYTES",
    "Answer",
    "InboxResult",
    "KeyVerdict",
    "VerdictKind",
    "Batch",
    "Step",
    "begin_steps",
    "check_answer",
    "check_fence",
    "check_scope",
    "check_lock_ms",
    "check_older_than_ms",
    "judge",
    "raise_refusal",
    "iso_utc",
    "record_key",
    "record_params",
    "request_fingerprint",
    "stored_result",
    "validate_idempotency_key",
]

DEFAULT_LOCK_MS = 30_000
MIN_LOCK_MS = 1
MAX_LOCK_MS = 24 * 3600 * 1000
#: The largest answer body the inbox stores (characters of a str body, bytes of a bytes body).
MAX_BODY_BYTES = 1024 * 1024
#: The most headers one stored answer keeps.
MAX_HEADERS = 64


#: C0 controls, DEL and C1 controls: never part of a key.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
#: An HTTP field name (RFC 9110 token) and a field value without CR, LF or NUL.
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+", re.ASCII)
_FIELD_VALUE = re.compile(r"[^\r\n\x00]*")

Headers = tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class InboxResult:
    """The answer for a key: freshly produced by the effect, or ``replayed`` from the first time.

    ``body`` is what the effect returned (``str`` or ``bytes``), replayed as the same type; ``headers``
    the answer's stored headers as ``(name, value)`` pairs.
    """

    status_code: int
    body: str | bytes
    replayed: bool
    headers: Headers = ()

    @property
    def content(self) -> bytes:
        """The body as bytes (a ``str`` body in UTF-8)."""
        return self.body if isinstance(self.body, bytes) else self.body.encode("utf-8")


class Answer(NamedTuple):
    """An effect's answer, checked: what the inbox stores under the key."""

    status_code: int
    body: str | bytes
    headers: Headers


class VerdictKind(enum.Enum):
    APPLY = "apply"  #: a new key: run the effect
    APPLY_AFTER_EXPIRY = "apply-after-expiry"  #: remove an older version's expired claim, then apply
    REPLAY = "replay"  #: answer with the stored response
    IN_FLIGHT = "in-flight"  #: another transaction holds the key (409)
    CONFLICT = "conflict"  #: the key was used for another request (422)
    STALE_FENCE = "stale-fence"  #: a lower fencing number than one already accepted (409)


@dataclasses.dataclass(frozen=True)
class KeyVerdict:
    kind: VerdictKind
    #: REPLAY: raise the key's stored fencing number to the request's.
    raise_fence: bool = False
    #: IN_FLIGHT: how long the other claim lasts at most, when known.
    retry_after_ms: int | None = None
    #: STALE_FENCE: the fencing number already accepted.
    accepted_fence: int | None = None
    #: CONFLICT: the key's row (its first request's fingerprint and when it was first seen); what the
    #: refusal tells, not part of the decision (verdicts compare without it).
    first: KeyRow | None = dataclasses.field(default=None, compare=False)


def judge(fingerprint: str, fence: int | None, got_lock: bool, row: KeyRow | None) -> KeyVerdict:
    """What to do with a request, from the in-flight lock's outcome and the key's row (None: no row).

    A fenced request (``fence`` not None) older than the key's accepted fencing number is refused before
    anything else: its sender's lease was reclaimed. A replay under a newer fencing number records it.
    """
    if not got_lock:
        return KeyVerdict(VerdictKind.IN_FLIGHT)
    if row is None:
        return KeyVerdict(VerdictKind.APPLY)
    if row.status == InboxStatus.DONE.value:
        if fence is not None and row.fence is not None and fence < row.fence:
            return KeyVerdict(VerdictKind.STALE_FENCE, accepted_fence=row.fence)
        if row.payload_sha256 != fingerprint:
            return KeyVerdict(VerdictKind.CONFLICT, first=row)
        return KeyVerdict(
            VerdictKind.REPLAY,
            raise_fence=fence is not None and (row.fence is None or row.fence < fence),
        )
    # A claim committed by an older version's two-step consumer. While it is live, leave it be; once
    # expired its holder is gone and left no effect, so any request may take it over.
    left = row.lock_left_ms
    if left is not None and left < 0:
        return KeyVerdict(VerdictKind.APPLY_AFTER_EXPIRY)
    if row.payload_sha256 != fingerprint:
        return KeyVerdict(VerdictKind.CONFLICT, first=row)
    return KeyVerdict(VerdictKind.IN_FLIGHT, retry_after_ms=left)


class Step(NamedTuple):
    """One statement a transaction runs: the runner sends back its first row (None if it has none)."""

    query: Query
    params: dict[str, Any]


#: Statements a transaction runs in order, each its own statement, which a runner may send in one round
#: trip (on psycopg, one query string); it sends back their first rows, in order.
Batch = tuple[Step, ...]


def begin_steps(
    dialect_name: str, key: str, fingerprint: str, fence: int | None, lock_ms: int
) -> Generator[Batch, Any, tuple[KeyVerdict, KeyRow | None]]:
    """The start of a key's transaction, as the statements to run (sans IO: the sync and async inboxes
    drive it on their connections): the in-flight lock (PostgreSQL) and the key's row in one batch (the
    read is a statement of its own after the lock's, so its snapshot follows the lock; its row is ignored
    when the lock was not taken), then what the verdict needs written (an expired claim removed, a newer
    fencing number kept)."""
    read = Step(store.READ_KEY, {"key": key})
    got = True
    if dialect_name == "postgresql":
        locked, found = yield (Step(store.LOCK_KEY, {"key": key, "idle_ms": str(lock_ms)}), read)
        got = bool(locked[0])
    else:
        (found,) = yield (read,)
    row = None if found is None or not got else KeyRow(*found)
    verdict = judge(fingerprint, fence, got, row)
    if verdict.kind is VerdictKind.APPLY_AFTER_EXPIRY:
        yield (Step(store.EXPIRE_CLAIM, {"key": key}),)
    elif verdict.raise_fence:
        yield (Step(store.RAISE_FENCE, {"key": key, "fence": fence}),)
    return verdict, row


def raise_refusal(key: str, fence: int | None, verdict: KeyVerdict) -> None:
    """Raise the error a refusing verdict stands for (409, 422); return for APPLY and REPLAY."""
    if verdict.kind is VerdictKind.IN_FLIGHT:
        raise errors.InboxInProgressError(idempotency_key=key, retry_after_ms=verdict.retry_after_ms)
    if verdict.kind is VerdictKind.CONFLICT:
        first = verdict.first
        raise errors.InboxConflictError(
            idempotency_key=key,
            first_fingerprint=None if first is None else first.payload_sha256,
            first_seen=None if first is None else iso_utc(first.created_at),
        )
    if verdict.kind is VerdictKind.STALE_FENCE:
        assert fence is not None and verdict.accepted_fence is not None
        raise errors.InboxStaleFenceError(
            idempotency_key=key, fence=fence, accepted_fence=verdict.accepted_fence
        )


def iso_utc(moment: object) -> str | None:
    """A database timestamp as ISO 8601 in UTC (``2026-12-06T01:02:03.456Z``); a naive one (SQLite) is UTC."""
    if not isinstance(moment, datetime.datetime):
        return None
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=datetime.UTC)
    return aware.astimezone(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


#: Marks a stored key as scoped (:func:`record_key`): a control character, never part of a valid key.
_SCOPED = "\x1f"


def record_key(key: str, scope: str | None) -> str:
    """The key a request's record is stored under: ``key`` itself, or for a scoped caller a digest of its
    scope and key (so two callers' equal keys are two records, and a scoped record can never be a valid
    unscoped key: it starts with a control character)."""
    if scope is None:
        return key
    digest = hashlib.sha256(f"{len(scope)}:{scope}\x00{key}".encode("utf-8", "surrogatepass")).hexdigest()
    return _SCOPED + digest


def check_scope(scope: object) -> str | None:
    """``scope`` if it is None or a non-empty str of at most 1,024 characters."""
    if scope is None or (isinstance(scope, str) and 0 < len(scope) <= 1024):
        return scope
    raise InvalidInboxInputError(
        "key_scope",
        f"{type(scope).__name__} of length {len(scope) if isinstance(scope, str) else '-'} is not a scope; "
        "give None (unscoped) or a non-empty str of at most 1024 characters (e.g. the caller's account id)",
    )


def stored_result(row: KeyRow) -> InboxResult:
    """The replay of a DONE row's answer."""
    body: str | bytes = row.response_content if row.response_content is not None else row.response_body or ""
    headers: Headers = ()
    if row.response_headers:
        headers = tuple((str(name), str(value)) for name, value in json.loads(row.response_headers))
    return InboxResult(int(row.response_status or 0), body, True, headers)


def record_params(key: str, fingerprint: str, fence: int | None, answer: Answer) -> dict[str, Any]:
    """The binds of :data:`dagster_joblease.storage.inbox.RECORD_DONE` for an answer."""
    text = answer.body if isinstance(answer.body, str) else None
    return {
        "key": key,
        "sha256": fingerprint,
        "response_status": answer.status_code,
        "response_body": text,
        "response_content": None if text is not None else answer.body,
        "response_headers": json.dumps(answer.headers) if answer.headers else None,
        "fence": fence,
    }


def validate_idempotency_key(key: object) -> str:
    """Return ``key`` if it is a usable idempotency key, else raise :class:`InvalidInboxInputError`."""
    if not isinstance(key, str):
        raise InvalidInboxInputError("idempotency_key", f"must be a str, got {type(key).__name__}")
    if not key.strip():
        raise InvalidInboxInputError("idempotency_key", f"{key!r} is blank; send a non-empty key")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidInboxInputError(
            "idempotency_key",
            f"is {len(key)} characters; at most {MAX_KEY_LENGTH} are allowed, shorten it",
        )
    control = _CONTROL.search(key)
    if control is not None:
        raise InvalidInboxInputError(
            "idempotency_key",
            f"{key[:40]!r} contains the control character U+{ord(control.group()):04X}; remove it",
        )
    return key


def check_fence(fence: object) -> int | None:
    """``fence`` if it is None or a fencing number (an int from 0 to 10**15 - 1)."""
    if fence is None:
        return None
    return checks.integer(
        "fence",
        fence,
        minimum=0,
        maximum=10**15 - 1,
        none="no fence",
        why="a lease's attempt",
        error=checks.inbox_input,
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: What ``json.loads(raw, parse_constant=…)`` does, without building a decoder per request body.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def request_fingerprint(payload: Any) -> str:
    """SHA-256 hex of the payload, insensitive to JSON formatting.

    Python values are hashed as :func:`outbox.canonical_json`. ``bytes``/``str`` are taken as a request
    body: if they parse as JSON, the canonical form of the parsed value is hashed (so key order and
    whitespace do not matter); otherwise the raw bytes (UTF-8 for ``str``) are hashed.
    """
    if isinstance(payload, bytes | bytearray | str):
        raw = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else bytes(payload)
        try:
            parsed = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
            return outbox.payload_fingerprint(parsed)
        except (ValueError, RecursionError, errors.InvalidPayloadError):
            return hashlib.sha256(raw).hexdigest()
    return outbox.payload_fingerprint(payload)


def check_lock_ms(value: object) -> int:
    return checks.milliseconds(
        "lock_ms",
        value,
        minimum=MIN_LOCK_MS,
        maximum=MAX_LOCK_MS,
        why="make it longer than the slowest effect, since a claim older than that is taken over",
        error=checks.inbox_input,
    )


def check_older_than_ms(value: object) -> int:
    return checks.milliseconds("older_than_ms", value, why="time since completion", error=checks.inbox_input)


def _check_answer_headers(key: str, headers: object) -> Headers:
    pairs: Iterable[Any] = headers.items() if isinstance(headers, Mapping) else headers  # type: ignore[assignment]
    try:
        checked = tuple(pairs)
    except TypeError:
        checked = None
    if (
        checked is None
        or len(checked) > MAX_HEADERS
        or not all(
            isinstance(pair, tuple)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and isinstance(pair[1], str)
            and _FIELD_NAME.fullmatch(pair[0])
            and _FIELD_VALUE.fullmatch(pair[1])
            for pair in checked
        )
    ):
        raise InvalidInboxInputError(
            "effect result",
            f"the effect for key {key!r} returned headers {headers!r:.80}; give at most {MAX_HEADERS} "
            "(name, value) str pairs (or a mapping) with token names and values without CR, LF or NUL",
        )
    return checked


def check_answer(key: str, value: object) -> Answer:
    """An effect's result as an :class:`Answer`: ``(status, body)`` or ``(status, body, headers)``."""
    if (
        isinstance(value, tuple)
        and len(value) in (2, 3)
        and isinstance(value[0], int)
        and not isinstance(value[0], bool)
        and 100 <= value[0] <= 599
        and isinstance(value[1], str | bytes)
        and len(value[1]) <= MAX_BODY_BYTES
    ):
        headers = _check_answer_headers(key, value[2]) if len(value) == 3 else ()
        return Answer(value[0], value[1], headers)
    raise InvalidInboxInputError(
        "effect result",
        f"the effect for key {key!r} returned {value!r:.80}; it must return (status_code, body) or "
        f"(status_code, body, headers) with an int HTTP status 100-599 and a str or bytes body of at most "
        f"{MAX_BODY_BYTES} characters or bytes",
    )
