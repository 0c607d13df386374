"""A leased step's metadata (dagster_joblease.dagster.metadata.step_metadata), table-driven: which entries
one key and a range carry, the first error, and the first keys of each outcome past the per-key table."""

from __future__ import annotations

import pytest

from dagster_joblease.dagster import metadata as m


def result(outcome: str, key: str | None = "2024-10-20", **extra: str | None) -> m.LeasedResult:
    return m.LeasedResult(
        code="c",
        partition_key=key,
        idempotency_key=f"v2:{key}",
        outcome=outcome,
        attempt=1,
        outbox="inserted",
        **extra,
    )


def days(outcome: str, count: int, start: int = 0) -> list[m.LeasedResult]:
    return [result(outcome, f"k{i:04d}") for i in range(start, start + count)]


COMMON = [m.META_OUTCOME, m.META_WINNER, m.META_CODE, m.META_RUN_KEY, m.META_ERROR]


@pytest.mark.parametrize(
    ("results", "per_key_table", "keys"),
    [
        ([], True, []),
        (
            [result(m.WON)],
            True,
            [*COMMON, m.META_IDEMPOTENCY_KEY, m.META_ATTEMPT, m.META_HOLDER, m.META_OUTBOX],
        ),
        (days(m.WON, 3), True, [*COMMON, m.META_KEYS, m.META_OUTCOMES, m.META_OUTBOX, m.META_RESULTS]),
        (days(m.WON, 3), False, [*COMMON, m.META_KEYS, m.META_OUTCOMES, m.META_OUTBOX, m.META_FIRST_KEYS]),
        (
            days(m.WON, m.TABLE_MAX_KEYS + 1),
            True,
            [*COMMON, m.META_KEYS, m.META_OUTCOMES, m.META_OUTBOX, m.META_FIRST_KEYS],
        ),
    ],
)
def test_one_key_and_a_range_carry_their_own_entries_in_order(
    results: list[m.LeasedResult], per_key_table: bool, keys: list[str]
) -> None:
    assert list(m.step_metadata(results, per_key_table=per_key_table)) == keys


@pytest.mark.parametrize(
    ("results", "error", "shown"),
    [
        ([result(m.WON)], None, m.NONE),
        ([result(m.FAILED, error="boom")], "boom", "boom"),  # one key: the error as it is
        (
            [result(m.WON, "a"), result(m.FAILED, "b", error="boom"), result(m.LOST, "c", error="gone")],
            "b: boom",  # a range: the first error, named by its key
            "b: boom",
        ),
        ([result(m.FAILED, "a", error=""), result(m.WON, "b")], None, m.NONE),  # an empty error is none
    ],
)
def test_the_first_error_is_shown_named_by_its_key_in_a_range(
    results: list[m.LeasedResult], error: str | None, shown: str
) -> None:
    assert m.first_error(results) == error
    assert m.step_metadata(results)[m.META_ERROR].value == shown


def test_one_keys_attempt_and_holder_say_none_when_absent() -> None:
    only = m.LeasedResult(
        code="c",
        partition_key=None,
        idempotency_key="v2:x",
        outcome=m.HELD,
        attempt=None,
        outbox="not-enqueued",
    )
    meta = m.step_metadata([only])
    assert (meta[m.META_ATTEMPT].value, meta[m.META_HOLDER].value) == (m.NONE, m.NONE)
    assert m.step_metadata([result(m.WON, holder="w:1")])[m.META_ATTEMPT].value == 1


@pytest.mark.parametrize(
    ("results", "first"),
    [
        ([], {}),
        ([result(m.WON, None)], {m.WON: ["(initial)"]}),
        (
            [result(m.WON, "a"), result(m.FAILED, "b"), result(m.WON, "c")],
            {m.FAILED: ["b"], m.WON: ["a", "c"]},  # in OUTCOMES order, keys in the given order
        ),
        (
            days(m.WON, m.FIRST_KEYS_SHOWN + 5) + days(m.LOST, 2, start=100),
            {
                m.LOST: ["k0100", "k0101"],
                m.WON: [f"k{i:04d}" for i in range(m.FIRST_KEYS_SHOWN)],  # at most FIRST_KEYS_SHOWN each
            },
        ),
    ],
)
def test_first_keys_of_each_outcome(results: list[m.LeasedResult], first: dict[str, list[str]]) -> None:
    assert m.first_keys(results) == first
    assert list(m.first_keys(results)) == [o for o in m.OUTCOMES if o in first]
