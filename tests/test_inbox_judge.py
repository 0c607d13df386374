"""The inbox's decision as a pure function, table by table, and the wire format of its headers."""

from __future__ import annotations

import pytest

from dagster_joblease import errors, wire
from dagster_joblease.inbox.core import KeyVerdict, VerdictKind, judge
from dagster_joblease.storage.inbox import KeyRow

FP, OTHER = "a" * 64, "b" * 64


def _done(fingerprint: str = FP, fence: int | None = None) -> KeyRow:
    return KeyRow("DONE", fingerprint, 201, "{}", None, None, fence, None)


def _claim(fingerprint: str = FP, left_ms: int | None = 5_000) -> KeyRow:
    return KeyRow("IN_PROGRESS", fingerprint, None, None, None, None, None, left_ms)


@pytest.mark.parametrize(
    ("fence", "got_lock", "row", "verdict"),
    [
        # the in-flight lock is held elsewhere: nothing else is read
        (None, False, None, KeyVerdict(VerdictKind.IN_FLIGHT)),
        (None, True, None, KeyVerdict(VerdictKind.APPLY)),
        (7, True, None, KeyVerdict(VerdictKind.APPLY)),
        (None, True, _done(), KeyVerdict(VerdictKind.REPLAY)),
        (None, True, _done(OTHER), KeyVerdict(VerdictKind.CONFLICT)),
        # fencing: unfenced requests are not judged by it; a newer number is recorded on a replay
        (None, True, _done(fence=3), KeyVerdict(VerdictKind.REPLAY)),
        (3, True, _done(fence=3), KeyVerdict(VerdictKind.REPLAY)),
        (4, True, _done(fence=3), KeyVerdict(VerdictKind.REPLAY, raise_fence=True)),
        (0, True, _done(fence=None), KeyVerdict(VerdictKind.REPLAY, raise_fence=True)),
        (2, True, _done(fence=3), KeyVerdict(VerdictKind.STALE_FENCE, accepted_fence=3)),
        (2, True, _done(OTHER, fence=3), KeyVerdict(VerdictKind.STALE_FENCE, accepted_fence=3)),
        (4, True, _done(OTHER, fence=3), KeyVerdict(VerdictKind.CONFLICT)),
        # an older version's two-step claim: live (409 with its lock, or 422), expired (taken over)
        (None, True, _claim(), KeyVerdict(VerdictKind.IN_FLIGHT, retry_after_ms=5_000)),
        (None, True, _claim(left_ms=None), KeyVerdict(VerdictKind.IN_FLIGHT)),
        (None, True, _claim(OTHER), KeyVerdict(VerdictKind.CONFLICT)),
        (None, True, _claim(left_ms=-1), KeyVerdict(VerdictKind.APPLY_AFTER_EXPIRY)),
        (None, True, _claim(OTHER, left_ms=-1), KeyVerdict(VerdictKind.APPLY_AFTER_EXPIRY)),
    ],
)
def test_judge(fence: int | None, got_lock: bool, row: KeyRow | None, verdict: KeyVerdict) -> None:
    assert judge(FP, fence, got_lock, row) == verdict


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ("v2:abc", "v2:abc"),
        ('"v2:abc"', "v2:abc"),
        ('  "a\\"b\\\\c" ', 'a"b\\c'),
        ("\tbare value ", "bare value"),
        ('""', ""),
    ],
)
def test_parse_key_takes_bare_values_and_sf_strings(raw: str, key: str) -> None:
    assert wire.parse_key(raw) == key


@pytest.mark.parametrize("raw", ['"open', '"a"b"', '"bad\\escape"', '"é"', '"tab\there"'])
def test_parse_key_refuses_broken_sf_strings(raw: str) -> None:
    with pytest.raises(errors.InvalidInboxInputError, match="RFC 8941"):
        wire.parse_key(raw)


@pytest.mark.parametrize("key", ["v2:abc", 'a"b\\c', "plain"])
def test_format_key_round_trips(key: str) -> None:
    for key_format in wire.KEY_FORMATS:
        assert wire.parse_key(wire.format_key(key, key_format)) == key
    assert wire.format_key(key) == key
    with pytest.raises(errors.ConfigurationError, match="key_format='quoted'"):
        wire.format_key(key, "quoted")


@pytest.mark.parametrize(("raw", "fence"), [("0", 0), (" 42 ", 42), ("9" * 15, 10**15 - 1)])
def test_parse_fence(raw: str, fence: int) -> None:
    assert wire.parse_fence(raw) == fence


@pytest.mark.parametrize("raw", ["", "-1", "1.0", "0x10", "9" * 16, "²", "1 2"])
def test_parse_fence_refuses_anything_but_a_small_non_negative_integer(raw: str) -> None:
    with pytest.raises(errors.InvalidInboxInputError, match="fencing token"):
        wire.parse_fence(raw)


@pytest.mark.parametrize(
    ("status", "retried"),
    [
        (200, False),
        (201, False),
        (400, False),
        (422, False),
        (408, True),
        (409, True),
        (425, True),
        (429, True),
        (500, True),
        (503, True),
    ],
)
def test_retryable_statuses(status: int, retried: bool) -> None:
    assert wire.is_retryable_status(status) is retried
