"""dagster_joblease.checks: what each check accepts, what it refuses, and the one message style."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from dagster_joblease import checks, errors

MAX = checks.MAX_DURATION_MS
HUNDRED_YEARS = "the most is 100 years, so that the time stays a date both backends can store"

# (call, value, expected return)
ACCEPTED: list[tuple[Callable[[object], object], object, object]] = [
    (lambda v: checks.integer("n", v), -5, -5),
    (lambda v: checks.integer("n", v, minimum=1), 1, 1),
    (lambda v: checks.integer("n", v, minimum=1, maximum=3), 3, 3),
    (lambda v: checks.milliseconds("ms", v), 0, 0),
    (lambda v: checks.milliseconds("ms", v), MAX, MAX),
    (lambda v: checks.number("s", v, above=0), 0.001, 0.001),
    (lambda v: checks.number("s", v, minimum=0), 0, 0.0),
    (lambda v: checks.number("s", v, above=0, maximum=600), 600, 600.0),
    (lambda v: checks.text("reason", v), "  why ", "why"),
]

# (call, value, expected exception type, expected message)
REFUSED: list[tuple[Callable[[object], object], object, type[Exception], str]] = [
    (
        lambda v: checks.integer("n", v, minimum=1),
        0,
        errors.ConfigurationError,
        "n must be an int >= 1, got 0",
    ),
    (
        lambda v: checks.integer("n", v, minimum=1),
        True,
        errors.ConfigurationError,
        "n must be an int >= 1, got True",
    ),
    (lambda v: checks.integer("n", v), 1.0, errors.ConfigurationError, "n must be an int, got 1.0"),
    (
        lambda v: checks.integer("limit", v, minimum=1, maximum=10, error=checks.admin_argument),
        11,
        errors.AdminArgumentError,
        "limit must be an int from 1 to 10, got 11",
    ),
    (
        lambda v: checks.integer("rate", v, minimum=1, none="no limit"),
        0,
        errors.ConfigurationError,
        "rate must be None (no limit) or an int >= 1, got 0",
    ),
    (
        lambda v: checks.milliseconds("lease_ms", v, minimum=3, why="so", error=checks.lease_option),
        2,
        errors.InvalidLeaseOptionsError,
        f"lease_ms must be an int number of milliseconds from 3 to {MAX}, got 2; so; {HUNDRED_YEARS}",
    ),
    (
        lambda v: checks.integer("max_pending", v, minimum=1, error=checks.payload),
        "5",
        errors.InvalidPayloadError,
        "max_pending must be an int >= 1, got '5'",
    ),
    (
        lambda v: checks.milliseconds("lock_ms", v, error=checks.inbox_input),
        -1,
        errors.InvalidInboxInputError,
        f"lock_ms must be an int number of milliseconds from 0 to {MAX}, got -1; {HUNDRED_YEARS}",
    ),
    (
        lambda v: checks.number("timeout_s", v, above=0, maximum=600),
        0,
        errors.ConfigurationError,
        "timeout_s must be a finite number of seconds above 0 and at most 600, got 0",
    ),
    (
        lambda v: checks.number("seconds", v, minimum=0, error=checks.fault),
        math.nan,
        errors.InvalidFaultError,
        "seconds must be a finite number of seconds >= 0, got nan",
    ),
    (
        lambda v: checks.number("poll_interval_s", v, minimum=0),
        math.inf,
        errors.ConfigurationError,
        "poll_interval_s must be a finite number of seconds >= 0, got inf",
    ),
    (
        lambda v: checks.number("s", v, minimum=0),
        False,
        errors.ConfigurationError,
        "s must be a finite number of seconds >= 0, got False",
    ),
    (
        lambda v: checks.text("code", v),
        "   ",
        errors.ConfigurationError,
        "code must be a non-blank str, got '   '",
    ),
    # A long text or another object is never echoed: its length or its type only.
    (
        lambda v: checks.text("reason", v, error=checks.admin_argument),
        ["secret-token"],
        errors.AdminArgumentError,
        "reason must be a non-blank str, got a list",
    ),
    (
        lambda v: checks.integer("n", v),
        "postgresql://user:password@host/db",
        errors.ConfigurationError,
        "n must be an int, got a str of 34 characters",
    ),
]


@pytest.mark.parametrize(("call", "value", "expected"), ACCEPTED)
def test_accepted(call: Callable[[object], object], value: object, expected: object) -> None:
    assert call(value) == expected


@pytest.mark.parametrize(("call", "value", "error", "message"), REFUSED)
def test_refused(
    call: Callable[[object], object], value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        call(value)
    assert type(info.value) is error
    assert str(info.value) == message


def test_structured_errors_keep_their_fields() -> None:
    """The lease, payload and inbox errors keep the attributes callers read (option/field, value, rule)."""
    with pytest.raises(errors.InvalidLeaseOptionsError) as lease:
        checks.milliseconds("heartbeat_ms", -1, error=checks.lease_option)
    assert (lease.value.option, lease.value.value) == ("heartbeat_ms", -1)
    assert lease.value.rule.startswith("must be an int number of milliseconds")
    with pytest.raises(errors.InvalidPayloadError) as payload:
        checks.integer("max_payload_bytes", 1, minimum=2, error=checks.payload)
    assert payload.value.field == "max_payload_bytes"
    inbox: Any
    with pytest.raises(errors.InvalidInboxInputError) as inbox:
        checks.integer("fence", -1, minimum=0, error=checks.inbox_input)
    assert inbox.value.field == "fence"
