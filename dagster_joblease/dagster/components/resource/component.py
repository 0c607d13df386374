"""The resource Component: the ``joblease`` resource, once per code location."""

# No `from __future__ import annotations`: Dagster derives the YAML schema from the dataclass fields'
# runtime types (string annotations are not resolved).

import dataclasses
from typing import Any

import dagster as dg
from dagster.components import Component, ComponentLoadContext, Resolvable
from dagster.components import scaffold_with as _scaffold_with

from dagster_joblease.dagster.components.resource.scaffolder import _ResourceScaffolder
from dagster_joblease.dagster.components.shared import _env_name, _resource_key
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dagster.run_status import build_not_run_sensors
from dagster_joblease.storage.engine import DATABASE_URL_ENV

__all__ = ["JobLeaseResourceComponent"]


@_scaffold_with(_ResourceScaffolder)
@dataclasses.dataclass
class JobLeaseResourceComponent(Component, Resolvable):
    """The joblease resource of this code location, declared once.

    The :class:`JobLeaseResource`; every other component names it by ``resource_key``.
    ``database_url_env`` names the environment variable that holds the URL, read when a run or tick
    starts. With the default (``JOBLEASE_DATABASE_URL``) an unset variable means the embedded SQLite file
    under ``$DAGSTER_HOME``, as in Python; any other name must be set (the run fails naming it).

    ``not_run_sensors`` (default on) adds :func:`build_not_run_sensors`' three run-status sensors, so a
    re-execution whose leased step never ran shows ``not-run``, not the ``won`` Dagster copied from its
    parent. Turn it off only where the location's Python code calls ``build_not_run_sensors()`` itself.

    Attributes:
        resource_key: The key the resource is defined under; every other component names it the same way.
        database_url_env: The NAME of the environment variable holding the database URL (never the URL),
            read when a run or tick starts. Default ``JOBLEASE_DATABASE_URL``: unset, the embedded SQLite
            file under ``$DAGSTER_HOME``; any other name must be set.
        lease_ms: Lease length in ms (default 3 minutes), as on ``JobLeaseResource``.
        heartbeat_ms: Renewal interval in ms (default min(10 s, lease_ms / 3); 0: none).
        held_wait_ms: How long a run that finds its partition held waits for the holder (default 5 minutes).
        deployment: This deployment's name in lease holders (default derived from the instance's storage).
        migrate_on_first_use: Upgrade the joblease schema when a run starts; false: require it at head.
        not_run_sensors: Add the location's three not-run sensors (``build_not_run_sensors()``).
    """

    resource_key: str = "joblease"
    database_url_env: str = DATABASE_URL_ENV
    lease_ms: int | None = None
    heartbeat_ms: int | None = None
    held_wait_ms: int | None = None
    deployment: str | None = None
    migrate_on_first_use: bool = True
    not_run_sensors: bool = True

    def build_resource(self) -> JobLeaseResource:
        env = _env_name("JobLeaseResourceComponent database_url_env", self.database_url_env)
        url: Any = None if env == DATABASE_URL_ENV else dg.EnvVar(env)
        return JobLeaseResource(
            database_url=url,
            lease_ms=self.lease_ms,
            heartbeat_ms=self.heartbeat_ms,
            held_wait_ms=self.held_wait_ms,
            deployment=self.deployment,
            migrate_on_first_use=self.migrate_on_first_use,
        )

    def build_defs(self, context: ComponentLoadContext) -> dg.Definitions:
        key = _resource_key("JobLeaseResourceComponent", self.resource_key)
        resource = self.build_resource()
        resource.timing()  # validate lease_ms / heartbeat_ms / held_wait_ms when the location loads
        resource.resolved_held_wait_ms()
        sensors = build_not_run_sensors() if self.not_run_sensors else []
        return dg.Definitions(resources={key: resource}, sensors=sensors)
