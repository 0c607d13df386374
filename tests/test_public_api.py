"""The public surface: ``dagster_joblease.__all__`` is sorted, duplicate-free, and every name resolves."""

from __future__ import annotations

import dagster_joblease
import dagster_joblease.testing


def _isort_key(name: str) -> tuple[int, str]:
    # Constants, then classes, then functions: the order ruff's RUF022 ("isort-style") keeps.
    if name.isupper():
        return (0, name)
    if name[:1].isupper():
        return (1, name)
    return (2, name)


def test_all_is_sorted_and_unique() -> None:
    names = list(dagster_joblease.__all__)
    assert len(names) == len(set(names))
    assert names == sorted(names, key=_isort_key)


def test_every_public_name_resolves() -> None:
    missing = [name for name in dagster_joblease.__all__ if not hasattr(dagster_joblease, name)]
    assert missing == []
    for name in dagster_joblease.__all__:
        assert getattr(dagster_joblease, name) is not None


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from dagster_joblease import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(dagster_joblease.__all__)


def test_lease_core_is_public() -> None:
    for name in (
        "JobIdentity",
        "JobType",
        "LeaseService",
        "Lease",
        "AcquireResult",
        "ExclusiveOutcome",
        "NotAcquiredReason",
        "LeaseStatus",
        "idempotency_key",
        "colon_free_id",
        "effect_key",
        "migrate",
        "check_schema",
        "create_engine",
        "JobLeaseError",
        "InvalidJobIdentityError",
        "InvalidLeaseOptionsError",
        "LostLeaseError",
        "StorageError",
        "SchemaNotAtHeadError",
    ):
        assert name in dagster_joblease.__all__, name


def test_testing_kit_all_is_sorted_complete_and_resolves() -> None:
    names = list(dagster_joblease.testing.__all__)
    assert names == sorted(set(names), key=_isort_key)
    assert all(getattr(dagster_joblease.testing, name) is not None for name in names)
    for name in (
        "RecordingDownstream",
        "reclaim_now",
        "expire_now",
        "crash_run_exclusive",
        "crash_point",
        "CrashPoint",
        "CrashResult",
        "drain_outbox",
        "throwaway_database",
    ):
        assert name in names, name
