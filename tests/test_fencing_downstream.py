"""Fencing numbers downstream, end to end: a leased body posts straight to a downstream with
``lease.headers()``; after a reclaim, the stale holder is refused (409) instead of handed the new answer."""

from __future__ import annotations

import httpx
import sqlalchemy as sa

from dagster_joblease import wire
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.testing import RecordingDownstream, reclaim_now


def test_lease_headers_carry_the_key_and_the_attempt(service: LeaseService) -> None:
    lease = service.acquire(JobIdentity.schedule("fenced-bill", "2026-12-01"))
    assert lease is not None
    assert lease.headers() == {"Idempotency-Key": lease.idempotency_key, "Fencing-Token": "1"}
    quoted = lease.headers(key_format="sf-string")
    assert wire.parse_key(quoted["Idempotency-Key"]) == lease.idempotency_key


def test_a_stale_holder_is_refused_by_the_downstream(
    engine: sa.Engine, service: LeaseService, joblease_downstream: RecordingDownstream
) -> None:
    job = JobIdentity.schedule("fenced-bill", "2026-12-02")
    stale = service.acquire(job)
    assert stale is not None
    fresh = reclaim_now(service, stale)  # the stale holder paused; another took the run over
    assert fresh.attempt == stale.attempt + 1
    url = joblease_downstream.url("/billing")
    with httpx.Client(timeout=10) as client:
        applied = client.post(url, json={"day": "2026-12-02"}, headers=fresh.headers())
        assert applied.status_code == 200
        late = client.post(url, json={"day": "2026-12-02"}, headers=stale.headers())
    assert late.status_code == 409 and late.json()["title"] == "Stale fencing token"
    assert joblease_downstream.effects(fresh.idempotency_key) == 1
