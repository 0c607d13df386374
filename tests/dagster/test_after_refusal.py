"""after_refusal: what a per-key waiter does with a key another holder has (a pure decision, table-driven)."""

from __future__ import annotations

import pytest

from dagster_joblease.dagster.ops import Next, after_refusal


@pytest.mark.parametrize(
    ("status", "took_over", "past_deadline", "expected"),
    [
        ("SUCCESS", False, False, Next.SKIP),  # another holder did it: a recorded skip, even mid-wait
        ("SUCCESS", False, True, Next.SKIP),  # ... and after the wait (a freed key is looked at once more)
        ("RUNNING", True, False, Next.RETRY),  # its holder is dead and was failed: claim again at once
        ("RUNNING", True, True, Next.RETRY),  # ... even when the wait is over
        ("RUNNING", False, False, Next.WAIT),  # a live holder, time left
        ("RUNNING", False, True, Next.HELD),  # a live holder, the wait is over
        ("FAIL", False, False, Next.WAIT),  # freed, but another claimer won the race: claim again
        ("FAIL", False, True, Next.HELD),
        (None, False, False, Next.WAIT),  # no row (deleted under us): claim again
        (None, False, True, Next.HELD),
    ],
)
def test_after_refusal(status: str | None, took_over: bool, past_deadline: bool, expected: Next) -> None:
    assert after_refusal(status, took_over=took_over, past_deadline=past_deadline) is expected
