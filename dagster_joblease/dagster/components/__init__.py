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


Each Component lives in a folder of its own with its scaffolder (``resource/``, ``delivery/``,
``schedule/``, ``reconciliation/``); what they share is :mod:`~dagster_joblease.dagster.components.shared`.
"""

from dagster_joblease.dagster.components.delivery import (
    CheckSpec,
    DispatcherSpec,
    JobLeaseDeliveryComponent,
    OutboxSensorSpec,
    RouteSpec,
)
from dagster_joblease.dagster.components.reconciliation import ReconciliationSensorComponent
from dagster_joblease.dagster.components.resource import JobLeaseResourceComponent
from dagster_joblease.dagster.components.schedule import LeasedScheduleComponent
from dagster_joblease.dagster.components.shared import TargetSpec

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
