"""Pure delivery policy: how a response or an exception is judged, backoff with full jitter, Retry-After."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import httpx
import pytest

from dagster_joblease.dispatch import policy
from dagster_joblease.dispatch.policy import Outcome


def _response(status: int, body: str = "", headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, text=body, headers=headers)


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
def test_2xx_is_sent(status: int) -> None:
    c = policy.classify_response(_response(status, "ok"))
    assert c.outcome is Outcome.SENT and c.status_code == status


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_3xx_is_dead_because_redirects_are_not_followed(status: int) -> None:
    c = policy.classify_response(_response(status, headers={"Location": "https://elsewhere.example/x"}))
    assert c.outcome is Outcome.DEAD
    assert "redirects are not followed" in c.reason and "elsewhere.example" in c.reason


@pytest.mark.parametrize("status", [408, 409, 425, 429, 500, 502, 503, 504, 599])
def test_transient_statuses_retry(status: int) -> None:
    c = policy.classify_response(_response(status, "busy"))
    assert c.outcome is Outcome.RETRY and c.status_code == status
    assert c.reason == f"HTTP {status}: busy"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 410, 413, 451])
def test_other_4xx_are_dead_with_status_and_body(status: int) -> None:
    c = policy.classify_response(_response(status, '{"detail":\n  "bad field"}'))
    assert c.outcome is Outcome.DEAD
    assert c.reason == f'HTTP {status}: {{"detail": "bad field"}}'


def test_reason_is_bounded() -> None:
    c = policy.classify_response(_response(500, "x" * 10_000))
    assert len(c.reason) == policy.MAX_REASON_CHARS
    c = policy.classify_exception(httpx.ConnectError("y" * 10_000))
    assert len(c.reason) == policy.MAX_REASON_CHARS


def test_classification_through_a_client_does_not_follow_redirects() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.host == "origin.example":
            return httpx.Response(302, headers={"Location": "https://attacker.example/steal"})
        return httpx.Response(200)

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        response = client.post("https://origin.example/hook", headers={"X-Api-Key": "secret"})
    assert seen == ["https://origin.example/hook"]
    assert policy.classify_response(response).outcome is Outcome.DEAD


@pytest.mark.parametrize(
    "exc",
    [
        httpx.ConnectError("refused"),
        httpx.ConnectTimeout("slow connect"),
        httpx.ReadTimeout("slow read"),
        httpx.ReadError("reset"),
        httpx.RemoteProtocolError("Server disconnected without sending a response."),
        httpx.PoolTimeout("pool"),
        OSError("network unreachable"),
    ],
)
def test_network_errors_retry(exc: Exception) -> None:
    c = policy.classify_exception(exc)
    assert c.outcome is Outcome.RETRY and c.status_code is None
    assert type(exc).__name__ in c.reason


def test_timeouts_say_so() -> None:
    assert policy.classify_exception(httpx.ReadTimeout("x")).reason.startswith("timeout")


def test_an_invalid_request_is_dead() -> None:
    c = policy.classify_exception(httpx.LocalProtocolError("Illegal header value"))
    assert c.outcome is Outcome.DEAD and "fix the route" in c.reason


_NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
_YEAR_MS = policy.MAX_RETRY_AFTER_S * 1000


@pytest.mark.parametrize(
    ("header", "expected_ms"),
    [
        ("7", 7_000),
        (" 0 ", 0),
        ("\t120", 120_000),
        ("007", 7_000),
        ("Thu, 01 Jan 2026 12:00:30 GMT", 30_000),
        ("Thu, 01 Jan 2026 11:00:00 GMT", 0),  # in the past: at once
        ("31536000000", _YEAR_MS),  # absurdly long: capped (a route's max_pause_s caps it further)
        ("9" * 5000, _YEAR_MS),  # int() would refuse this many digits
        ("Fri, 31 Dec 9999 23:59:59 GMT", _YEAR_MS),
        (None, None),
        ("", None),
        ("soon", None),
        ("-5", None),
        ("+5", None),
        ("1.5", None),
        ("1e3", None),
        ("5 s", None),
        ("²", None),  # str.isdigit() says True, int() raises: the old parser crashed here
        ("1²", None),
        ("\u0663", None),  # ARABIC-INDIC DIGIT THREE
        ("\uff13", None),  # FULLWIDTH DIGIT THREE: int() would accept it, HTTP does not
        ("\u00a05", None),
        ("Thu, 01 Jan 2026 12:00:30 GMT²", None),
        ("Thu, 99 Foo 2026 99:99:99 GMT", None),
    ],
)
def test_retry_after_is_ascii_delta_seconds_or_an_http_date(
    header: str | None, expected_ms: int | None
) -> None:
    assert policy.parse_retry_after_ms(header, now=_NOW) == expected_ms


def test_retry_after_date_is_relative_to_the_servers_date_header() -> None:
    response = _response(
        503,
        headers={"Retry-After": "Thu, 01 Jan 2026 12:00:05 GMT", "Date": "Thu, 01 Jan 2026 12:00:00 GMT"},
    )
    assert policy.classify_response(response).retry_after_ms == 5_000


class _Top(random.Random):
    """An rng whose uniform() returns the upper bound, to observe the ceiling."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_backoff_is_full_jitter_under_an_exponential_ceiling() -> None:
    top = _Top()
    assert [policy.backoff_ms(n, base_ms=100, max_ms=1_000, rng=top) for n in range(1, 7)] == [
        100,
        200,
        400,
        800,
        1_000,
        1_000,
    ]
    assert policy.backoff_ms(10_000, base_ms=100, max_ms=5_000, rng=top) == 5_000
    rng = random.Random(7)
    samples = [policy.backoff_ms(4, base_ms=100, max_ms=10_000, rng=rng) for _ in range(2_000)]
    assert min(samples) >= 0 and max(samples) <= 800
    # Full jitter spreads over the whole range, not just near the ceiling.
    assert min(samples) < 80 and max(samples) > 720


def _decide(c: policy.Classification, attempts: int, max_attempts: int = 5) -> policy.Decision:
    return policy.decide(
        c, attempts=attempts, max_attempts=max_attempts, base_ms=100, max_ms=2_000, rng=_Top()
    )


def test_decide_retries_until_max_attempts_then_dead() -> None:
    c = policy.classify_response(_response(500, "down"))
    d = _decide(c, attempts=3)
    assert (d.outcome, d.delay_ms, d.status_code) == (Outcome.RETRY, 400, 500)
    d = _decide(c, attempts=5)
    assert d.outcome is Outcome.DEAD and d.reason == "gave up after 5 attempts; last: HTTP 500: down"


def test_decide_honours_retry_after_bounded_by_max() -> None:
    assert (
        _decide(policy.classify_response(_response(429, headers={"Retry-After": "1"})), 1).delay_ms == 1_000
    )
    assert (
        _decide(policy.classify_response(_response(429, headers={"Retry-After": "99"})), 1).delay_ms == 2_000
    )


def test_decide_keeps_sent_and_dead() -> None:
    assert _decide(policy.classify_response(_response(200)), attempts=99).outcome is Outcome.SENT
    dead = _decide(policy.classify_response(_response(400, "no")), attempts=1)
    assert dead.outcome is Outcome.DEAD and dead.reason == "HTTP 400: no"


def test_422_is_dead_with_the_downstreams_reason_first() -> None:
    c = policy.classify_response(_response(422, '{"detail": "key reused with another payload"}'))
    assert c.outcome is Outcome.DEAD and c.status_code == 422
    assert c.reason.startswith('HTTP 422: {"detail": "key reused with another payload"}')
    assert "not retried" in c.reason


def test_409_is_retried_with_backoff_not_dead() -> None:
    c = policy.classify_response(_response(409, "in flight"))
    d = policy.decide(c, attempts=1, max_attempts=5, base_ms=100, max_ms=1000, max_pause_ms=300_000)
    assert d.outcome is Outcome.RETRY and d.pause_ms is None and not d.deferred and d.delay_ms <= 100


def test_retry_after_on_429_or_503_pauses_and_defers_without_counting() -> None:
    for status in (429, 503):
        c = policy.classify_response(_response(status, "slow down", headers={"Retry-After": "2"}))
        d = policy.decide(c, attempts=9, max_attempts=10, base_ms=100, max_ms=1000, max_pause_ms=300_000)
        assert d.outcome is Outcome.RETRY and d.pause_ms == 2000 and d.deferred and d.delay_ms == 2000
        # attempts=10 of 10 would be dead for an ordinary retry; a deferral does not use attempts up
        d = policy.decide(c, attempts=10, max_attempts=10, base_ms=100, max_ms=1000, max_pause_ms=300_000)
        assert d.outcome is Outcome.RETRY and d.deferred
    capped = policy.decide(
        policy.classify_response(_response(429, "", headers={"Retry-After": "86400"})),
        attempts=1,
        max_attempts=10,
        base_ms=100,
        max_ms=1000,
        max_pause_ms=5_000,
    )
    assert capped.pause_ms == 5_000


@pytest.mark.parametrize(
    ("deferrals", "max_deferrals", "outcome"),
    [
        (0, 1, Outcome.RETRY),
        (1, 1, Outcome.DEAD),
        (0, 2, Outcome.RETRY),
        (1, 2, Outcome.RETRY),  # the old rule dead-lettered here, after one deferral
        (2, 2, Outcome.DEAD),
        (4, 5, Outcome.RETRY),
        (5, 5, Outcome.DEAD),
        (99, 100, Outcome.RETRY),
        (100, 100, Outcome.DEAD),
    ],
)
def test_max_deferrals_is_how_many_deferrals_a_row_gets(
    deferrals: int, max_deferrals: int, outcome: Outcome
) -> None:
    c = policy.classify_response(_response(503, "", headers={"Retry-After": "1"}))
    d = policy.decide(
        c,
        attempts=1,
        max_attempts=10,
        base_ms=100,
        max_ms=1000,
        max_pause_ms=5_000,
        deferrals=deferrals,
        max_deferrals=max_deferrals,
    )
    assert d.outcome is outcome
    if outcome is Outcome.DEAD:
        assert f"gave up after {max_deferrals} Retry-After deferrals" in d.reason
    else:
        assert d.deferred and d.pause_ms == 1000


def test_no_group_pause_when_turned_off_or_without_retry_after() -> None:
    c = policy.classify_response(_response(429, "", headers={"Retry-After": "2"}))
    d = policy.decide(c, attempts=1, max_attempts=10, base_ms=100, max_ms=1000, max_pause_ms=0)
    assert d.pause_ms is None and not d.deferred and d.delay_ms == 1000
    bare = policy.classify_response(_response(429, ""))
    d = policy.decide(bare, attempts=1, max_attempts=10, base_ms=100, max_ms=1000, max_pause_ms=5_000)
    assert d.pause_ms is None and not d.deferred


@pytest.mark.parametrize(
    "date",
    [
        "Sun, 06 Dec 99999999999999999999 01:00:00 GMT",  # past a C long: OverflowError
        "Sun, 06 Dec 9999999999 01:00:00 GMT",  # past a C int: OverflowError
        "Sun, 06 Dec 99999 01:00:00 GMT",  # past 9999: ValueError
        "not a date",
    ],
)
def test_retry_after_with_an_absurd_date_header_still_pauses(date: str) -> None:
    """Scenario 6 of issue 36: a 429 with ``Retry-After: 30`` and a ``Date`` no datetime can hold was
    judged a connection failure (the OverflowError escaped classify_response): attempt counted, no pause.
    The Date is no clock then; the delta-seconds need none."""
    c = policy.classify_response(_response(429, "slow down", headers={"Retry-After": "30", "Date": date}))
    assert c.outcome is Outcome.RETRY and c.status_code == 429 and c.retry_after_ms == 30_000
    d = policy.decide(c, attempts=1, max_attempts=10, base_ms=100, max_ms=1000, max_pause_ms=300_000)
    assert d.pause_ms == 30_000 and d.deferred
