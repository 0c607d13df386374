"""The delivery Component: routes, the dispatcher job, the outbox sensor and the outbox checks."""

# No `from __future__ import annotations`: Dagster derives the YAML schema from the dataclass fields'
# runtime types (string annotations are not resolved).

import dataclasses
import os
from typing import Any

import dagster as dg
from dagster.components import Component, ComponentLoadContext, Resolvable
from dagster.components import scaffold_with as _scaffold_with

from dagster_joblease import errors
from dagster_joblease.dagster.components.delivery.scaffolder import _DeliveryScaffolder
from dagster_joblease.dagster.components.shared import Status, _env_name, _resource_key, _sensor_status
from dagster_joblease.dagster.jobs import OutboxHealth, build_dispatcher_job, outbox_asset_spec
from dagster_joblease.dagster.sensors import OUTBOX_SENSOR_INTERVAL_S, build_outbox_sensor
from dagster_joblease.dispatch import Route

__all__ = ["CheckSpec", "DispatcherSpec", "JobLeaseDeliveryComponent", "OutboxSensorSpec", "RouteSpec"]


@dataclasses.dataclass
class RouteSpec(Resolvable):
    """One topic's destination. ``url`` or ``url_env`` (a variable read when a run or tick starts, with
    ``url`` as its default); ``secret_headers`` maps a header to the NAME of the variable holding its value;
    ``options`` passes any further :class:`Route` keyword option through unchanged (e.g. delivery limits).

    Attributes:
        url: The topic's URL (the default when ``url_env`` is set but its variable is not).
        url_env: The NAME of a variable holding the URL, read when a run or tick starts.
        headers: Headers sent with every request of this topic (no secrets: they show in the UI).
        secret_headers: Header name to the NAME of the variable holding its value (e.g. a bearer token).
        timeout_s: Seconds a request may take before it counts as failed and is retried.
        options: Any further ``Route`` option, passed through (e.g. ``max_in_flight``, ``rate``).
    """

    url: str | None = None
    url_env: str | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    secret_headers: dict[str, str] = dataclasses.field(default_factory=dict)
    timeout_s: float = 10.0
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def build(self, topic: str) -> Route:
        where = f"JobLeaseDeliveryComponent route {topic!r}"
        url = self.url
        if self.url_env is not None:
            url = os.environ.get(_env_name(f"{where} url_env", self.url_env)) or url
        if url is None:
            raise errors.ConfigurationError(
                f"{where}: no URL: set {self.url_env} or give `url`"
                if self.url_env
                else f"{where}: give `url` (or `url_env`, the variable holding it)"
            )
        for header, env in self.secret_headers.items():
            _env_name(f"{where} secret_headers[{header!r}]", env)
        own = {"url", "headers", "secret_headers", "timeout_s"}
        extra = {f.name for f in dataclasses.fields(Route)} - own
        bad = sorted(set(self.options) - extra)
        if bad:
            raise errors.ConfigurationError(
                f"{where}: options {bad} are not Route options; allowed: {sorted(extra)} (url, headers, "
                "secret_headers and timeout_s are attributes of their own)"
            )
        return Route(
            url,
            headers=dict(self.headers),
            secret_headers=dict(self.secret_headers),
            timeout_s=self.timeout_s,
            **self.options,
        )


@dataclasses.dataclass
class DispatcherSpec(Resolvable):
    """The dispatcher job (:func:`build_dispatcher_job`).

    Attributes:
        name: The job's name.
        max_attempts: Deliveries of a row before it is dead-lettered.
        claim_ms: How long a claimed row is the dispatcher's before another may claim it.
        concurrency: Rows a dispatcher run delivers at once.
        tags: Tags of the dispatcher's runs.
    """

    name: str = "outbox_dispatch_job"
    max_attempts: int = 10
    claim_ms: int = 60_000
    concurrency: int = 8
    tags: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class OutboxSensorSpec(Resolvable):
    """The outbox sensor (:func:`build_outbox_sensor`); it also reports the checks every
    ``checks_interval_seconds``.

    Attributes:
        name: The sensor's name.
        minimum_interval_seconds: Seconds between two evaluations.
        default_status: ``stopped`` (the default) until a person turns it on, or ``running``.
        checks_interval_seconds: Seconds between two reports of the outbox checks.
    """

    name: str = "outbox_dispatch_sensor"
    minimum_interval_seconds: int = OUTBOX_SENSOR_INTERVAL_S
    #: Stopped until a person turns it on: a new project's route points at a receiver nobody started yet.
    default_status: Status = "stopped"
    checks_interval_seconds: int = 300


@dataclasses.dataclass
class CheckSpec(Resolvable):
    """The three outbox checks on ``joblease_outbox`` (:class:`OutboxHealth`).

    Attributes:
        stale_due_ms: ``delivery_backlog`` warns when the oldest due row has waited longer.
        unrouted_after_ms: ``no_unrouted_rows`` warns when a pending row of a topic this location does not
            route is older.
    """

    stale_due_ms: int = 5 * 60_000
    unrouted_after_ms: int = 15 * 60_000


@_scaffold_with(_DeliveryScaffolder)
@dataclasses.dataclass
class JobLeaseDeliveryComponent(Component, Resolvable):
    """Outbox delivery: routes, the dispatcher job, its sensor and the outbox checks.

    The outbox sensor (``sensor: null`` for none) and the outbox checks (``checks: null`` for none) run on
    the resource named by ``resource_key``. The sensor is stopped by default: turn it on (in the UI, or
    ``default_status: running``) once every route's downstream answers, e.g. ``joblease receiver``.

    Attributes:
        routes: Topic to its route (``RouteSpec``): where and how each topic's rows are delivered.
        resource_key: The joblease resource the job, sensor and checks use.
        dispatcher: The dispatcher job (``DispatcherSpec``).
        sensor: The outbox sensor (``OutboxSensorSpec``); ``null``: none.
        checks: The outbox checks (``CheckSpec``); ``null``: none.
    """

    routes: dict[str, RouteSpec]
    resource_key: str = "joblease"
    dispatcher: DispatcherSpec = dataclasses.field(default_factory=DispatcherSpec)
    sensor: OutboxSensorSpec | None = dataclasses.field(default_factory=OutboxSensorSpec)
    checks: CheckSpec | None = dataclasses.field(default_factory=CheckSpec)

    def route_map(self) -> dict[str, Route]:
        """The routes, read now (each run and tick calls this, so a changed ``url_env`` needs no reload)."""
        return {topic: spec.build(topic) for topic, spec in self.routes.items()}

    def build_defs(self, context: ComponentLoadContext) -> dg.Definitions:
        key = _resource_key("JobLeaseDeliveryComponent", self.resource_key)
        if not self.routes:
            raise errors.ConfigurationError(
                "JobLeaseDeliveryComponent needs at least one route (topic: {url: ...})"
            )
        self.route_map()  # validate every route when the location loads (env-named URLs may be unset)
        routes = self.route_map
        checks = self.checks or CheckSpec()
        health = OutboxHealth(
            routes=routes,
            stale_due_ms=checks.stale_due_ms,
            unrouted_after_ms=checks.unrouted_after_ms,
            resource_key=key,
        )
        spec = self.dispatcher
        job = build_dispatcher_job(
            routes,
            name=spec.name,
            resource_key=key,
            max_attempts=spec.max_attempts,
            claim_ms=spec.claim_ms,
            concurrency=spec.concurrency,
            tags=spec.tags,
            health=health,
        )
        sensors = []
        if self.sensor is not None:
            sensors.append(
                build_outbox_sensor(
                    job,
                    name=self.sensor.name,
                    resource_key=key,
                    minimum_interval_seconds=self.sensor.minimum_interval_seconds,
                    default_status=_sensor_status(self.sensor.default_status),
                    routes=routes,
                    health=health if self.checks is not None else None,
                    checks_interval_seconds=self.sensor.checks_interval_seconds,
                )
            )
        return dg.Definitions(
            assets=[outbox_asset_spec],
            asset_checks=health.asset_checks() if self.checks is not None else [],
            jobs=[job],
            sensors=sensors,
        )
