"""The reference receiver run by a role that owns nothing and may create nothing.

PostgreSQL 15 grants nobody CREATE on ``public`` by default, so a receiver role with only the rights on
its tables must still start and serve with ``--no-migrate``: the receiver needs no function or other
schema object of its own (the inbox is plain statements). Roles are cluster-wide: each test makes its
own, uniquely named, and drops it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from dagster_joblease.receiver import effect_count, ensure_tables
from dagster_joblease.storage import create_engine
from tests.conftest import _admin_execute
from tests.receiver_proc import start_receiver

pytestmark = pytest.mark.postgres_only

#: What a receiver role needs (see docs, the reference receiver): rows, not schema rights.
GRANTS = [
    "GRANT SELECT, INSERT, UPDATE, DELETE ON joblease_inbox TO {role}",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON joblease_receiver_effect, joblease_receiver_request TO {role}",
    "GRANT USAGE ON SEQUENCE joblease_receiver_request_id_seq, joblease_receiver_effect_id_seq TO {role}",
    "GRANT SELECT ON joblease_alembic_version TO {role}",
]


@pytest.fixture
def owner(pg_url: str) -> Iterator[sa.Engine]:
    """The database owner's engine (postgres): the receiver's tables exist."""
    engine = create_engine(pg_url)
    ensure_tables(engine)
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


def test_a_role_with_row_rights_only_serves_with_no_migrate(role_url: str, owner: sa.Engine) -> None:
    with start_receiver(role_url, "--no-migrate", "--log-level", "WARNING") as receiver:
        with httpx.Client(timeout=30) as client:
            first = _post(client, receiver.url + "/work", "k-1", {"v": 1})
            assert first.status_code == 200, first.text
            again = _post(client, receiver.url + "/work", "k-1", {"v": 1})
            assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
            assert _post(client, receiver.url + "/work", "k-1", {"v": 2}).status_code == 422
            assert _post(client, receiver.url + "/work", "k-2", {"v": 1}).status_code == 200
        stderr = receiver.stderr()
    assert "WARNING" not in stderr and "ERROR" not in stderr, stderr
    assert effect_count(owner) == 2


def test_migrate_at_head_needs_no_right_to_create(role_url: str) -> None:
    """--migrate on a database already at head needs nothing created: it starts."""
    with start_receiver(role_url, "--migrate") as receiver, httpx.Client(timeout=30) as client:
        assert _post(client, receiver.url + "/work", "k", {"v": 1}).status_code == 200
