"""The reference receiver run by a role that does not own its function and may not create one.

PostgreSQL 15 grants nobody CREATE on ``public`` by default, so a receiver role with only the rights on
its tables must still start: with ``--no-migrate`` it creates nothing, uses ``joblease_receiver_apply``
when this version's is there and otherwise serves on the generic inbox path after a one-line warning;
with ``--migrate`` it leaves a function it cannot replace as it is. Roles are cluster-wide: each test
makes its own, uniquely named, and drops it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from dagster_joblease.receiver import APPLY_FUNCTION, ReceiverServer, effect_count, ensure_tables
from dagster_joblease.receiver.app import apply_function_state
from dagster_joblease.storage import create_engine
from tests.conftest import _admin_execute
from tests.receiver_proc import start_receiver

pytestmark = pytest.mark.postgres_only

#: What a receiver role needs (see docs/operations.md, the reference receiver): rows, not schema rights.
GRANTS = [
    "GRANT SELECT, INSERT, UPDATE, DELETE ON joblease_inbox TO {role}",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON joblease_receiver_effect, joblease_receiver_request TO {role}",
    "GRANT USAGE ON SEQUENCE joblease_receiver_request_id_seq TO {role}",
    "GRANT SELECT ON joblease_alembic_version TO {role}",
]

OLD_FUNCTION = f"""
CREATE FUNCTION {APPLY_FUNCTION}(
    p_key text, p_sha256 text, p_topic text, p_payload text, p_status integer, p_body text
) RETURNS TABLE(outcome text, response_status integer, response_body text, lock_left_ms bigint)
LANGUAGE plpgsql AS $fn$ BEGIN RAISE EXCEPTION 'an older receiver''s function'; END $fn$
"""


@pytest.fixture
def owner(pg_url: str) -> Iterator[sa.Engine]:
    """The database owner's engine (postgres): the receiver's tables exist, its function does not."""
    engine = create_engine(pg_url)
    ensure_tables(engine, function=False)
    yield engine
    engine.dispose()


@pytest.fixture
def role_url(pg_url: str, owner: sa.Engine) -> Iterator[str]:
    """The URL of a new login role with only the GRANTS above (no CREATE anywhere, owns nothing)."""
    role = f"joblease_recv_{uuid.uuid4().hex[:10]}"
    _admin_execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        with owner.begin() as conn:
            for grant in GRANTS:
                conn.exec_driver_sql(grant.format(role=f'"{role}"'))
            may_create = conn.exec_driver_sql(
                f"SELECT has_schema_privilege('{role}', 'public', 'CREATE')"
            ).scalar_one()
        assert may_create is False, "PostgreSQL 15's default: no CREATE on public for other roles"
        yield make_url(pg_url).set(username=role).render_as_string(hide_password=False)
    finally:
        with owner.begin() as conn:
            conn.exec_driver_sql(
                f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
            )
            conn.exec_driver_sql(f'DROP OWNED BY "{role}"')  # its privileges in this database
        _admin_execute(f'DROP ROLE IF EXISTS "{role}"')


def _post(client: httpx.Client, url: str, key: str, payload: object) -> httpx.Response:
    return client.post(url, content=json.dumps(payload), headers={"Idempotency-Key": key})


def _serves_like_the_inbox(base_url: str) -> None:
    with httpx.Client(timeout=30) as client:
        first = _post(client, base_url + "/work", "k-1", {"v": 1})
        assert first.status_code == 200, first.text
        again = _post(client, base_url + "/work", "k-1", {"v": 1})
        assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
        assert _post(client, base_url + "/work", "k-1", {"v": 2}).status_code == 422
        assert _post(client, base_url + "/work", "k-2", {"v": 1}).status_code == 200


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if APPLY_FUNCTION in line]


def test_no_migrate_starts_without_the_function_and_serves_on_the_generic_path(
    role_url: str, owner: sa.Engine
) -> None:
    with start_receiver(role_url, "--no-migrate", "--log-level", "WARNING") as receiver:
        _serves_like_the_inbox(receiver.url)
        stderr = receiver.stderr()
    lines = _warnings(stderr)
    assert len(lines) == 1 and "is missing" in lines[0] and "--migrate" in lines[0], stderr
    assert "WARNING" in lines[0]
    assert apply_function_state(owner) == "missing"  # nothing was created
    assert effect_count(owner) == 2


def test_a_current_function_the_role_does_not_own_is_used_with_or_without_migrate(
    role_url: str, owner: sa.Engine
) -> None:
    ensure_tables(owner)  # the owner's set-up creates it
    assert apply_function_state(owner) == "current"
    for flag in ("--migrate", "--no-migrate"):
        with start_receiver(role_url, flag) as receiver:
            with httpx.Client(timeout=30) as client:
                answer = _post(client, receiver.url + "/work", f"k{flag}", {"v": 1})
                assert answer.status_code == 200, answer.text
            stderr = receiver.stderr()
        assert _warnings(stderr) == [], stderr
    engine = create_engine(role_url)
    try:
        server = ReceiverServer(engine)
        try:
            assert server.fast_path
        finally:
            server.server_close()
    finally:
        engine.dispose()
    assert effect_count(owner) == 2


def test_an_older_function_the_role_cannot_replace_is_never_called(role_url: str, owner: sa.Engine) -> None:
    with owner.begin() as conn:
        conn.exec_driver_sql(OLD_FUNCTION)
    assert apply_function_state(owner) == "other"
    with start_receiver(role_url, "--migrate") as receiver:
        _serves_like_the_inbox(receiver.url)  # the old function raises if called
        stderr = receiver.stderr()
    lines = _warnings(stderr)
    assert len(lines) == 1 and "not this version's" in lines[0], stderr
    assert apply_function_state(owner) == "other"
    assert effect_count(owner) == 2


def test_the_owners_set_up_replaces_an_older_function(owner: sa.Engine) -> None:
    with owner.begin() as conn:
        conn.exec_driver_sql(OLD_FUNCTION)
    ensure_tables(owner)
    assert apply_function_state(owner) == "current"
    server = ReceiverServer(owner)
    try:
        assert server.fast_path
        assert not server.apply("k", "work", b'{"v": 1}').replayed
        assert server.apply("k", "work", b'{"v": 1}').replayed
    finally:
        server.server_close()


def test_a_function_dropped_while_serving_falls_back_to_the_inbox(owner: sa.Engine) -> None:
    ensure_tables(owner)
    server = ReceiverServer(owner)
    try:
        assert server.fast_path
        assert not server.apply("before", "work", b"{}").replayed
        with owner.begin() as conn:
            conn.exec_driver_sql(f"DROP FUNCTION {APPLY_FUNCTION}")
        assert not server.apply("after", "work", b"{}").replayed
        assert not server.fast_path
        assert server.apply("before", "work", b"{}").replayed
    finally:
        server.server_close()
    assert effect_count(owner) == 2
