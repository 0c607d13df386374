"""Dagster Components for dagster-joblease: the resource, delivery, leased schedules and reconciliation
sensors declared in ``defs.yaml`` (``dg scaffold defs dagster_joblease.dagster.components.<Type> <path>``).

The components wrap the Pythonic builders (:class:`JobLeaseResource`, :func:`build_dispatcher_job`,
:func:`build_outbox_sensor`, :class:`OutboxHealth`, :func:`build_leased_schedule`,
:func:`build_reconciliation_sensor`); they add no behaviour of their own.

- :class:`JobLeaseResourceComponent` declares the ``joblease`` resource **once** per code location
  (``Definitions.merge`` refuses two resources under one key); every other component names it by
  ``resource_key``. It also adds the location's not-run sensors (:func:`build_not_run_sensors`) unless
  ``not_run_sensors: false``.
- :class:`JobLeaseDeliveryComponent`: routes (topic → URL, headers, secret headers by environment-variable
  name, timeout, and any further :class:`~dagster_joblease.dispatch.Route` option under ``options``), the
  dispatcher job, the outbox sensor and the three outbox checks.
- :class:`LeasedScheduleComponent` / :class:`ReconciliationSensorComponent`: a leased schedule or a
  reconciliation sensor for a job or asset **of the same project**.

How a schedule or sensor reaches its target: by a *path reference*. ``target.defs_path`` is the path,
relative to the project's defs folder, of the Python module or component that defines the job (or the
leased asset), and ``target.job`` (or ``target.asset``) its name there. The component builds that path's
definitions through Dagster's component tree (``ComponentLoadContext.build_defs``, which records the
dependency) and hands the object to the Pythonic builder, so the target's partitions are checked when the
code location loads (a typo or an unpartitioned job fails ``dg check defs``, naming the path), not at
the first tick. Leased bodies stay Python (``@leased_op`` / ``@leased_asset``): a lease is code.

Secrets never go into attributes as values: the database URL and secret headers are given as
*environment-variable names*, read when a run or tick starts (``{{ env.X }}`` would resolve to the value
at load time, and the UI shows component attributes).
"""

# No `from __future__ import annotations`: Dagster derives the YAML schema from the dataclass fields'
# runtime types (string annotations are not resolved).

import dataclasses
import datetime as dt
import os
import re
import textwrap
from pathlib import Path
from typing import Any, Literal

import dagster as dg
import sqlalchemy as sa
from dagster.components import Component, ComponentLoadContext, Resolvable, Scaffolder, ScaffoldRequest
from dagster.components import scaffold_with as _scaffold_with

from dagster_joblease import errors
from dagster_joblease.dagster.jobs import OutboxHealth, build_dispatcher_job, outbox_asset_spec
from dagster_joblease.dagster.reconcile import build_reconciliation_sensor
from dagster_joblease.dagster.reconcile.sensor import RECONCILE_INTERVAL_S
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dagster.run_status import build_not_run_sensors
from dagster_joblease.dagster.schedules import build_leased_schedule
from dagster_joblease.dagster.sensors import OUTBOX_SENSOR_INTERVAL_S, build_outbox_sensor
from dagster_joblease.dispatch import Route
from dagster_joblease.storage.engine import DATABASE_URL_ENV

__all__ = [
    "CheckSpec",
    "DispatcherSpec",
    "JobLeaseDeliveryComponent",
    "JobLeaseResourceComponent",
    "LeasedScheduleComponent",
    "OutboxSensorSpec",
    "ReconciliationSensorComponent",
    "RouteSpec",
    "TargetSpec",
]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
Status = Literal["running", "stopped"]


def _shown(value: object) -> str:
    """What a message may say about a value that should have been a variable's name: it may be the secret
    itself, so a URL is shown with its password hidden and anything else is not shown at all."""
    if not isinstance(value, str):
        return f"a {type(value).__name__}"
    if "://" in value:
        try:
            url = sa.engine.make_url(value)
        except sa.exc.ArgumentError:
            return "a URL-like value (not shown: it may hold a secret)"
        return f"the URL {url.render_as_string(hide_password=True)!r} (password hidden)"
    return f"a value of {len(value)} characters (not shown: it may be a secret)"


def _env_name(where: str, value: object) -> str:
    if not isinstance(value, str) or not _ENV_NAME.match(value):
        raise errors.ConfigurationError(
            f"{where} must be the *name* of an environment variable (letters, digits, underscore; e.g. "
            f"JOBLEASE_DATABASE_URL), never the secret itself; got {_shown(value)}. Put the value in "
            "that variable and write its name here."
        )
    return value


def _resource_key(where: str, value: object) -> str:
    if not isinstance(value, str) or not _KEY.match(value):
        raise errors.ConfigurationError(
            f"{where} resource_key={value!r} must be a Python identifier (the key the "
            "JobLeaseResourceComponent declares, default 'joblease')"
        )
    return value


def _sensor_status(value: Status) -> dg.DefaultSensorStatus:
    return dg.DefaultSensorStatus.RUNNING if value == "running" else dg.DefaultSensorStatus.STOPPED


def _yaml_block(type_name: str, attributes: str) -> str:
    return f"type: {type_name}\n\nattributes:\n{textwrap.indent(textwrap.dedent(attributes).strip(), '  ')}\n"


class _TemplateScaffolder(Scaffolder[Any]):
    """Writes ``defs.yaml`` with the component's type and a commented, working set of attributes."""

    template = ""

    def scaffold(self, request: ScaffoldRequest[Any]) -> None:
        path = request.target_path
        path.mkdir(parents=True, exist_ok=True)
        text = _yaml_block(request.type_name, self.template)
        target = path / "defs.yaml"
        if request.append and target.exists():
            with target.open("a") as f:
                f.write("---\n" + text)
        else:
            target.write_text(text)


# -- the resource ------------------------------------------------------------------------------------


class _ResourceScaffolder(_TemplateScaffolder):
    template = """
        # The joblease resource, declared once per code location; other components name it by key.
        resource_key: joblease
        # The NAME of the variable holding the URL (postgresql+psycopg://... or sqlite:///...), never the
        # URL: it may carry a password. JOBLEASE_DATABASE_URL unset: an SQLite file under $DAGSTER_HOME.
        database_url_env: JOBLEASE_DATABASE_URL
        # The three run-status sensors that rewrite the joblease/* tags a re-execution copied from its
        # parent to not-run when its leased step never ran. Keep them on unless this location's Python
        # code calls build_not_run_sensors() itself (Dagster refuses two sensors of one name).
        not_run_sensors: true
        """


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


# -- delivery ----------------------------------------------------------------------------------------


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


class _DeliveryScaffolder(_TemplateScaffolder):
    template = """
        resource_key: joblease
        routes:
          billing.daily:
            # Read when a run or tick starts; `url` is the default when the variable is unset.
            url_env: BILLING_API_URL
            url: http://127.0.0.1:8765/billing.daily
            # header -> NAME of the environment variable holding its value (never the value)
            secret_headers: {}
            timeout_s: 10
        dispatcher:
          name: outbox_dispatch_job
        sensor:
          name: outbox_dispatch_sensor
          # Stopped: turn it on (UI > Automation, or `running` here) once the route's URL answers, e.g.
          # after `joblease receiver` (the reference receiver on 127.0.0.1:8765) or your own API is up.
          default_status: stopped
        checks:
          stale_due_ms: 300000
        """


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


# -- leased schedules and reconciliation sensors ------------------------------------------------------


@dataclasses.dataclass
class TargetSpec(Resolvable):
    """A job or leased asset of this project: ``defs_path`` (relative to the defs folder: a Python module
    such as ``billing.py`` or a component's folder) and the ``job`` name or the ``asset`` key
    (``a/b`` for a multi-part key) defined there.

    Attributes:
        defs_path: The module or component folder that defines the target, relative to the defs folder.
        job: The partitioned job's name there (or ``asset``).
        asset: The leased asset's key there, ``a/b`` for a multi-part key (or ``job``).
    """

    defs_path: str
    job: str | None = None
    asset: str | None = None

    def describe(self) -> str:
        name = f"job {self.job!r}" if self.job is not None else f"asset {self.asset!r}"
        return f"{name} of defs path {self.defs_path!r}"

    def resolve(self, context: ComponentLoadContext, where: str) -> dg.JobDefinition | dg.AssetsDefinition:
        if (self.job is None) == (self.asset is None):
            raise errors.ConfigurationError(
                f"{where}: target needs exactly one of `job` (a job name) or `asset` (an asset key, a/b), "
                f"got job={self.job!r}, asset={self.asset!r}"
            )
        defs = context.build_defs(self._checked_path(context, where))
        found = self._find(defs)
        if isinstance(found, dg.JobDefinition | dg.AssetsDefinition):
            return found
        raise errors.ConfigurationError(
            f"{where}: {self.describe()} not found; that path defines {found or 'none'}"
        )

    def _checked_path(self, context: ComponentLoadContext, where: str) -> Path:
        path = Path(self.defs_path)
        if path.is_absolute() or ".." in path.parts:
            raise errors.ConfigurationError(
                f"{where}: target defs_path {self.defs_path!r} must be relative to the defs folder, inside it"
            )
        if not (context.defs_module_path / path).exists():
            what = (
                f"a partitioned job {self.job!r}"
                if self.job is not None
                else f"a leased asset {self.asset!r}"
            )
            raise errors.ConfigurationError(
                f"{where}: target defs_path {self.defs_path!r} does not exist in the defs folder "
                f"{str(context.defs_module_path)!r}; write the Python module that defines {what} there "
                "first (docs/components.md shows one), or point defs_path at the module that does"
            )
        return path

    def _find(self, defs: dg.Definitions) -> dg.JobDefinition | dg.AssetsDefinition | list[str]:
        """The target in ``defs``, or the names that path defines instead."""
        return _find_job(defs, self.job) if self.job is not None else _find_asset(defs, self.asset or "")


def _find_job(defs: dg.Definitions, name: str) -> dg.JobDefinition | list[str]:
    jobs = {j.name: j for j in defs.jobs or [] if isinstance(j, dg.JobDefinition)}
    return jobs.get(name) or sorted(j.name for j in defs.jobs or [])


def _find_asset(defs: dg.Definitions, name: str) -> dg.AssetsDefinition | list[str]:
    assets = {k: a for a in defs.assets or [] if isinstance(a, dg.AssetsDefinition) for k in a.keys}
    return assets.get(dg.AssetKey.from_user_string(name)) or sorted(k.to_user_string() for k in assets)


class _ScheduleScaffolder(_TemplateScaffolder):
    template = """
        # The job (or leased asset) this schedule launches: a path relative to the defs folder, and its name.
        target:
          defs_path: billing.py
          job: daily_billing_job
        code: daily-billing          # the lease code of the job's @leased_op
        cron_schedule: "0 2 * * *"   # default: the partitions' own cadence
        default_status: stopped
        """


@_scaffold_with(_ScheduleScaffolder)
@dataclasses.dataclass
class LeasedScheduleComponent(Component, Resolvable):
    """A leased schedule: each tick runs the last complete partition once.

    :func:`build_leased_schedule`: partition key = Dagster run key = lease run key. For an asset target
    the component also defines the asset job it launches (``<asset>_job`` unless ``job_name`` says
    otherwise).

    Attributes:
        target: The job or leased asset it launches (``TargetSpec``).
        code: The lease code of the target's leased step (``@leased_op(code=...)``).
        cron_schedule: When it ticks (default: the partitions' own cadence).
        execution_timezone: The cron's timezone (default: the partitions').
        name: The schedule's name (default ``<job>_schedule``).
        job_name: For an asset target, the name of the asset job it defines (default ``<asset>_job``).
        description: The schedule's description in the UI.
        default_status: ``stopped`` (the default) or ``running``.
        resource_key: The resource a tick reads the partition's lease through (a done partition skips).
    """

    target: TargetSpec
    code: str
    cron_schedule: str | None = None
    execution_timezone: str | None = None
    name: str | None = None
    job_name: str | None = None
    description: str | None = None
    default_status: Status = "stopped"
    #: The resource a tick reads the partition's lease through (a done partition skips, naming its run).
    resource_key: str = "joblease"

    def build_defs(self, context: ComponentLoadContext) -> dg.Definitions:
        where = f"LeasedScheduleComponent {self.name or self.code!r}"
        target = self.target.resolve(context, where)
        jobs: list[Any] = []
        if isinstance(target, dg.AssetsDefinition):
            if not isinstance(target.partitions_def, dg.TimeWindowPartitionsDefinition):
                raise errors.ConfigurationError(
                    f"{where}: {self.target.describe()} needs time-window partitions for a leased schedule"
                )
            asset_job = dg.define_asset_job(
                self.job_name or f"{target.key.to_python_identifier()}_job",
                selection=[target.key],
                partitions_def=target.partitions_def,
            )
            jobs.append(asset_job)
            job: Any = asset_job  # an unresolved asset job: the builder needs only its name and partitions
        else:
            job = target
        schedule = build_leased_schedule(
            job,
            code=self.code,
            cron_schedule=self.cron_schedule,
            execution_timezone=self.execution_timezone,
            name=self.name,
            description=self.description,
            default_status=(
                dg.DefaultScheduleStatus.RUNNING
                if self.default_status == "running"
                else dg.DefaultScheduleStatus.STOPPED
            ),
            job_by_name=True,
            resource_key=_resource_key(where, self.resource_key),
        )
        return dg.Definitions(jobs=jobs, schedules=[schedule])


class _ReconcileScaffolder(_TemplateScaffolder):
    template = """
        target:
          defs_path: billing.py
          job: daily_billing_job       # or `asset: billing_day` for a @leased_asset
        code: daily-billing
        resource_key: joblease
        lookback_seconds: 604800       # 7 days
        max_relaunches: 5
        default_status: running
        """


@_scaffold_with(_ReconcileScaffolder)
@dataclasses.dataclass
class ReconciliationSensorComponent(Component, Resolvable):
    """Relaunches partitions whose lease failed, expired, lost its holder or ended held.

    :func:`build_reconciliation_sensor` for a partitioned job or leased asset; durations in seconds.

    Attributes:
        target: The job or leased asset whose partitions it relaunches (``TargetSpec``).
        code: The lease code of the target's leased step.
        name: The sensor's name (default from the code).
        resource_key: The joblease resource it reads the leases through.
        lookback_seconds: Only leases active, and runs created, within this window are considered.
        catch_up_from: A partition key: never-attempted partitions from it on are requested too.
        max_requests_per_tick: At most this many run requests per evaluation (relaunches first).
        max_relaunches: Relaunches per partition before it gives up and says so.
        backoff_seconds: The second relaunch waits this long after the lease's last activity, doubling.
        max_backoff_seconds: The cap of that wait.
        relaunch_canceled: Relaunch a partition whose latest run was canceled (default: leave it).
        holder_stale_ms: May only lengthen how old a RUNNING holder's heartbeat must be to count as dead.
        minimum_interval_seconds: Seconds between two evaluations.
        description: The sensor's description in the UI.
        default_status: ``running`` (the default: it is the safety net) or ``stopped``.
    """

    target: TargetSpec
    code: str
    name: str | None = None
    resource_key: str = "joblease"
    lookback_seconds: int = 7 * 86_400
    catch_up_from: str | None = None
    max_requests_per_tick: int = 10
    max_relaunches: int = 5
    backoff_seconds: int = 120
    max_backoff_seconds: int = 3_600
    relaunch_canceled: bool = False
    holder_stale_ms: int | None = None
    minimum_interval_seconds: int = RECONCILE_INTERVAL_S
    description: str | None = None
    default_status: Status = "running"

    def build_defs(self, context: ComponentLoadContext) -> dg.Definitions:
        where = f"ReconciliationSensorComponent {self.name or self.code!r}"
        target = self.target.resolve(context, where)
        for label, value in (
            ("lookback_seconds", self.lookback_seconds),
            ("backoff_seconds", self.backoff_seconds),
            ("max_backoff_seconds", self.max_backoff_seconds),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise errors.ConfigurationError(f"{where}: {label}={value!r} must be an int >= 0 (seconds)")
        sensor = build_reconciliation_sensor(
            target,
            code=self.code,
            name=self.name,
            lookback=dt.timedelta(seconds=self.lookback_seconds),
            catch_up_from=self.catch_up_from,
            max_requests_per_tick=self.max_requests_per_tick,
            max_relaunches=self.max_relaunches,
            backoff=dt.timedelta(seconds=self.backoff_seconds),
            max_backoff=dt.timedelta(seconds=self.max_backoff_seconds),
            relaunch_canceled=self.relaunch_canceled,
            holder_stale_ms=self.holder_stale_ms,
            minimum_interval_seconds=self.minimum_interval_seconds,
            resource_key=_resource_key(where, self.resource_key),
            default_status=_sensor_status(self.default_status),
            description=self.description,
        )
        return dg.Definitions(sensors=[sensor])
