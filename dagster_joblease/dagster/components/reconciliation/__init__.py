"""The reconciliation Component and its scaffolder."""

from dagster_joblease.dagster.components.reconciliation.component import ReconciliationSensorComponent

__all__ = ["ReconciliationSensorComponent"]
