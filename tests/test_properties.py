"""Property tests over every public input of identity, outbox and options: any value either works (on both
backends, for real) or raises the documented library error, and an error writes nothing."""

from __future__ import annotations

import re
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dagster_joblease import errors, outbox
from dagster_joblease.identity import JobIdentity, colon_free_id, effect_key, idempotency_key
from dagster_joblease.lease import LeaseService
from dagster_joblease.options import MAX_LEASE_MS, LeaseTiming, resolve_timing
from dagster_joblease.storage.schema import lease_table, outbox_table

KEY_RE = re.compile(r"v2:[0-9a-f]{64}")
# Any code point, control characters included, and text with a lone surrogate in it on purpose
# (st.characters() never yields one by itself).
SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
PLAIN_TEXT = st.text(st.characters(exclude_categories=["Cc"]), min_size=1, max_size=140)
WITH_SURROGATE = st.builds(lambda a, s, b: a + s + b, PLAIN_TEXT, SURROGATES, st.text(max_size=5))
ANY_TEXT = st.one_of(
    st.text(st.one_of(st.characters(), st.characters(categories=["Cc"])), max_size=300), WITH_SURROGATE
)
NOT_TEXT = st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=8), st.booleans())
DB_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _rows(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


@settings(max_examples=400, deadline=None)
@given(
    job_type=st.one_of(st.sampled_from(["INITIAL", "SCHEDULE"]), ANY_TEXT, NOT_TEXT),
    code=st.one_of(ANY_TEXT, NOT_TEXT),
    run_key=st.one_of(st.none(), ANY_TEXT, NOT_TEXT),
    effect_name=st.one_of(ANY_TEXT, NOT_TEXT),
    any_key=st.one_of(ANY_TEXT, NOT_TEXT),
)
def test_identity_inputs_raise_only_invalid_identity(
    job_type: Any, code: Any, run_key: Any, effect_name: Any, any_key: Any
) -> None:
    try:
        job = JobIdentity(job_type, code, run_key)
    except errors.InvalidJobIdentityError:
        pass
    else:
        assert KEY_RE.fullmatch(job.idempotency_key)
        assert idempotency_key(job.type, job.code, job.run_key) == job.idempotency_key
        assert JobIdentity(job.type, job.code, job.run_key) == job  # normalization is idempotent
    for call in (
        lambda: effect_key(any_key, effect_name),
        lambda: colon_free_id(any_key),
        lambda: colon_free_id(any_key, encoding="base64url"),
    ):
        try:
            derived = call()
        except errors.InvalidJobIdentityError:
            continue
        assert ":" not in derived or KEY_RE.fullmatch(derived)


@settings(max_examples=400, deadline=None)
@given(
    lease_ms=st.one_of(st.none(), st.integers(min_value=-(2**70), max_value=2**70), NOT_TEXT, ANY_TEXT),
    heartbeat_ms=st.one_of(st.none(), st.integers(min_value=-(2**70), max_value=2**70), NOT_TEXT),
)
def test_option_inputs_raise_only_invalid_options(lease_ms: Any, heartbeat_ms: Any) -> None:
    try:
        timing = resolve_timing(lease_ms, heartbeat_ms)
    except errors.InvalidLeaseOptionsError:
        return
    assert isinstance(timing, LeaseTiming)
    assert 2 < timing.lease_ms <= MAX_LEASE_MS
    assert timing.heartbeat_ms == 0 or 0 < 2 * timing.heartbeat_ms < timing.lease_ms


@DB_SETTINGS
@given(
    code=ANY_TEXT,
    run_key=st.one_of(ANY_TEXT, st.sampled_from(["2026-11-29", " x ", "\u00e9t\u00e9"])),
    lease_ms=st.one_of(
        st.integers(min_value=-10, max_value=2**60), st.sampled_from([3, MAX_LEASE_MS, MAX_LEASE_MS + 1])
    ),
)
def test_accepted_identities_and_lease_lengths_really_claim(
    engine: sa.Engine, code: str, run_key: str, lease_ms: int
) -> None:
    service = LeaseService(engine)
    before = _rows(engine, lease_table)
    try:
        job = JobIdentity.schedule(code, run_key)
        lease = service.acquire(job, lease_ms=lease_ms)
    except (errors.InvalidJobIdentityError, errors.InvalidLeaseOptionsError):
        assert _rows(engine, lease_table) == before
        return
    if lease is not None:  # None: an earlier example already claimed the same normalized identity
        assert lease.idempotency_key == job.idempotency_key
        service.complete(lease)


JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    ANY_TEXT,
    st.sampled_from([object(), b"bytes", {1, 2}, "\x00"]),
    st.builds(lambda: 10**5000),  # more digits than json.dumps will write
)
PAYLOADS = st.recursive(
    JSON_LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(ANY_TEXT, st.integers()), children, max_size=4),
    ),
    max_leaves=12,
)


VALID_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63), PLAIN_TEXT),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(PLAIN_TEXT, children, max_size=3)
    ),
    max_leaves=6,
)


def _mostly_valid(valid: st.SearchStrategy[Any], anything: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Half usable values, half anything: so every later check is reached often, with every kind of
    bad value in every position."""
    # Not st.one_of(valid, anything): one_of flattens nested one_ofs into equal branches.
    return st.booleans().flatmap(lambda usable: valid if usable else anything)


@settings(DB_SETTINGS, max_examples=150)
@given(
    key=_mostly_valid(
        st.from_regex(r"[!-~]{1,40}", fullmatch=True),
        st.one_of(ANY_TEXT, NOT_TEXT, st.sampled_from(["v2:" + "a" * 64, " k ", "k" * 320, "k" * 321])),
    ),
    topic=_mostly_valid(
        st.one_of(PLAIN_TEXT, WITH_SURROGATE),
        st.one_of(ANY_TEXT, NOT_TEXT, st.sampled_from(["billing", "t" * 128, "t" * 129])),
    ),
    payload=_mostly_valid(VALID_JSON, PAYLOADS),
)
def test_enqueue_inputs_raise_only_documented_errors_and_write_nothing(
    engine: sa.Engine, key: Any, topic: Any, payload: Any
) -> None:
    before = _rows(engine, outbox_table)
    try:
        with engine.begin() as conn:
            inserted = outbox.enqueue_once(conn, idempotency_key=key, topic=topic, payload=payload)
    except (errors.InvalidPayloadError, errors.OutboxConflictError):
        assert _rows(engine, outbox_table) == before
        return
    assert _rows(engine, outbox_table) == before + (1 if inserted else 0)
    with engine.connect() as conn:
        stored = conn.execute(
            sa.select(outbox_table.c.topic, outbox_table.c.payload_sha256).where(
                outbox_table.c.idempotency_key == key
            )
        ).one()
    if inserted:
        assert stored == (topic, outbox.payload_fingerprint(payload))


def test_a_topic_with_a_lone_surrogate_is_refused_before_any_write(engine: sa.Engine) -> None:
    """Found by the property test above: it reached the driver (a raw UnicodeEncodeError on PostgreSQL)."""
    with pytest.raises(errors.InvalidPayloadError, match="surrogate"), engine.begin() as conn:
        outbox.enqueue_once(conn, idempotency_key="k", topic="bill\ud800ing", payload={})
    assert _rows(engine, outbox_table) == 0
