"""Dagster run termination releases the lease rather than leaving it to expire (real process, real signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.storage import create_engine, lease_table
from tests.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.chaos
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_terminated_run_releases_its_lease(pg_url: str, tmp_path: Path, signum: signal.Signals) -> None:
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.dagster.interrupted_run", pg_url, str(ready)],
        cwd=REPO,
        env={**os.environ, "DAGSTER_HOME": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, timeout=60, interval=0.05)
        assert ready.exists(), proc.stderr.read().decode() if proc.stderr else ""
        proc.send_signal(signum)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    job = JobIdentity.schedule("t-terminated", "2024-01-05")
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        row = conn.execute(sa.select(lease_table).where(lease_table.c.lock_key == job.idempotency_key)).one()
    # Released at once (FAIL, "released: interrupted ..."), not left RUNNING for its 10-minute lease.
    assert row.status == "FAIL"
    assert row.last_error.startswith("released: interrupted by ")
    retry = LeaseService(engine).acquire(job)
    assert retry is not None and retry.attempt == 2 and retry.idempotency_key == job.idempotency_key
    engine.dispose()
