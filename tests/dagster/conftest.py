"""Dagster fixtures: one PostgreSQL database per test module holding both the joblease tables (psycopg 3)
and Dagster's own storage (dagster-postgres, which needs ``postgresql+psycopg2://``)."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import _admin_execute, clone_template


@dataclasses.dataclass(frozen=True)
class DagsterPg:
    joblease_url: str  #: postgresql+psycopg:// (the library)
    storage_url: str  #: postgresql+psycopg2:// (Dagster's own storage)
    home: Path  #: a DAGSTER_HOME whose dagster.yaml points at storage_url
    instance: dg.DagsterInstance

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "DAGSTER_HOME": str(self.home),
            "JOBLEASE_DATABASE_URL": self.joblease_url,
            "PYTHONWARNINGS": "ignore",
            **extra,
        }


def psycopg2_url(url: str) -> str:
    """Dagster's storage URL for the same database: dagster-postgres breaks on psycopg 3."""
    return make_url(url).set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)


@pytest.fixture(scope="module")
def dagster_pg(pg_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterPg]:
    name = f"joblease_dg_{uuid.uuid4().hex[:10]}"
    url = clone_template(pg_template, name)
    home = tmp_path_factory.mktemp("dagster_home")
    (home / "dagster.yaml").write_text(
        f"storage:\n  postgres:\n    postgres_url: {psycopg2_url(url)}\ntelemetry:\n  enabled: false\n"
    )
    previous = {k: os.environ.get(k) for k in ("DAGSTER_HOME", "JOBLEASE_DATABASE_URL")}
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ["JOBLEASE_DATABASE_URL"] = url
    instance = dg.DagsterInstance.get()  # initialises Dagster's schema once, before any subprocess
    try:
        yield DagsterPg(joblease_url=url, storage_url=psycopg2_url(url), home=home, instance=instance)
    finally:
        instance.dispose()
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
