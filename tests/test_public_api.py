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


#: What a first program needs, and nothing else (issue 39): an identity, the lease service and its lease,
#: the outbox's two enqueue functions, the dispatcher and its route, the inbox, the schema helpers, the
#: base error.
ROOT = {
    "Dispatcher",
    "Inbox",
    "JobIdentity",
    "JobLeaseError",
    "Lease",
    "LeaseService",
    "Route",
    "create_engine",
    "enqueue_many",
    "enqueue_once",
    "migrate",
}

#: Where the names a user meets next live: each stays public in its own module.
HOMES = {
    "dagster_joblease.errors": ["ConfigurationError", "LostLeaseError", "SchemaNotAtHeadError"],
    "dagster_joblease.identity": ["JobType", "idempotency_key", "colon_free_id", "effect_key"],
    "dagster_joblease.lease": ["AcquireResult", "ExclusiveOutcome", "NotAcquiredReason", "LeaseStatus"],
    "dagster_joblease.batch": ["MAX_BATCH_KEYS", "claim_many", "complete_many", "fenced_transaction_many"],
    "dagster_joblease.outbox": ["OutboxItem", "OutboxStatus", "canonical_json", "payload_fingerprint"],
    "dagster_joblease.dispatch": ["DispatchReport", "RowOutcome", "load_routes"],
    "dagster_joblease.inbox": ["InboxResult", "InboxStatus"],
    "dagster_joblease.admin": ["LeaseRow", "list_leases", "list_outbox", "requeue", "purge_sent"],
    "dagster_joblease.storage": ["DATABASE_URL_ENV", "check_schema", "current_revision", "redact_url"],
}


def test_the_root_exports_what_a_first_program_needs() -> None:
    assert set(dagster_joblease.__all__) == ROOT
    assert len(dagster_joblease.__all__) <= 20


def test_every_other_name_is_public_in_its_own_module() -> None:
    import importlib

    for module_name, names in HOMES.items():
        module = importlib.import_module(module_name)
        public = getattr(module, "__all__", None)
        for name in names:
            assert getattr(module, name) is not None, (module_name, name)
            assert public is None or name in public, (module_name, name)


def test_the_dagster_layer_exports_at_most_fifteen_names() -> None:
    import dagster_joblease.dagster
    import dagster_joblease.dagster.metadata

    names = list(dagster_joblease.dagster.__all__)
    assert len(names) <= 15
    assert names == sorted(set(names), key=_isort_key)
    assert all(getattr(dagster_joblease.dagster, name) is not None for name in names)
    assert {"leased_op", "leased_asset", "JobLeaseResource", "build_leased_schedule"} <= set(names)
    assert {n for n in names if n.endswith("Component")} == {
        "JobLeaseDeliveryComponent",
        "JobLeaseResourceComponent",
        "LeasedScheduleComponent",
        "ReconciliationSensorComponent",
    }
    # Tags and outcome names: one module, imported when needed.
    assert not [n for n in names if n.startswith("TAG_")]
    tags = set(dagster_joblease.dagster.metadata.__all__)
    assert {"TAG_OUTCOME", "TAG_CODE", "WON", "SKIPPED_SUCCEEDED"} <= tags


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
