"""The dispatcher's pure decisions (dagster_joblease.dispatch.decisions), table-driven."""

from __future__ import annotations

import pytest

from dagster_joblease.dispatch import decisions


@pytest.mark.parametrize(
    ("age_at_claim_ms", "since_claim_s", "window_s", "timeout_s", "allowed"),
    [
        (None, 1e9, 10.0, 1.0, True),  # the first attempt: nothing earlier can be repeated
        (5_000.0, 100.0, None, 1.0, True),  # no window on the route
        (0.0, 0.0, 10.0, 1.0, True),
        (8_000.0, 0.0, 10.0, 1.0, True),  # 8 + 1 < 10
        (8_000.0, 0.999, 10.0, 1.0, True),
        (8_000.0, 1.0, 10.0, 1.0, False),  # the timeout would end exactly at the window
        (9_500.0, 0.0, 10.0, 1.0, False),  # claimed in time, but too old to start at all
        (5_000.0, 4.5, 10.0, 1.0, False),  # waited for a worker past the window
        (86_340_000.0, 0.0, 86_400.0, 60.0, False),  # the defaults: 24 h window, 60 s timeout
        (86_339_000.0, 0.0, 86_400.0, 60.0, True),
    ],
)
def test_within_dedupe_window(
    age_at_claim_ms: float | None,
    since_claim_s: float,
    window_s: float | None,
    timeout_s: float,
    allowed: bool,
) -> None:
    verdict = decisions.within_dedupe_window(
        age_at_claim_ms=age_at_claim_ms, since_claim_s=since_claim_s, window_s=window_s, timeout_s=timeout_s
    )
    assert verdict is allowed


def test_the_dedupe_window_reason_names_the_window_and_the_way_out() -> None:
    reason = decisions.dedupe_window_reason(86_400.0)
    assert "dedupe_window (86400 s" in reason and "joblease outbox requeue" in reason


_GO, _BACK, _DEAD = decisions.Start.GO, decisions.Start.GIVE_BACK, decisions.Start.EXPIRED


@pytest.mark.parametrize(
    ("case", "changes", "expected"),
    [
        ("a fresh claim, nothing in the way", {}, _GO),
        ("stopping (SIGTERM)", {"stopping": True}, _BACK),
        ("the timeout ends exactly at the claim's end", {"now": 150.0}, _GO),
        ("the timeout would outlive the claim", {"now": 150.1}, _BACK),
        ("its group is paused", {"paused_until": 100.5}, _BACK),
        ("a pause that ended", {"paused_until": 99.9}, _GO),
        ("a first attempt waits long: no window to pass", {"now": 140.0, "window_s": 20.0}, _GO),
        ("a retry inside its window", {"age_at_claim_ms": 5_000.0, "window_s": 20.0}, _GO),
        (
            "a retry that waited past its window",
            {"age_at_claim_ms": 5_000.0, "window_s": 20.0, "now": 106.0},
            _DEAD,
        ),
        (
            "stopping wins over an expired window",
            {"age_at_claim_ms": 1e9, "window_s": 20.0, "stopping": True},
            _BACK,
        ),
        (
            "a pause wins over an expired window",
            {"age_at_claim_ms": 1e9, "window_s": 20.0, "paused_until": 1e9},
            _BACK,
        ),
    ],
)
def test_may_start(case: str, changes: dict[str, object], expected: decisions.Start) -> None:
    # Claimed at local time 99.0 with a claim (less its margin) ending at 160.0 and a 10 s timeout.
    args: dict[str, object] = {
        "now": 100.0,
        "stopping": False,
        "claim_ends_at": 160.0,
        "timeout_s": 10.0,
        "paused_until": 0.0,
        "age_at_claim_ms": None,
        "claimed_at": 99.0,
        "window_s": None,
        **changes,
    }
    assert decisions.may_start(**args) is expected, case  # type: ignore[arg-type]
