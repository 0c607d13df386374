"""The delivery Component and its scaffolder."""

from dagster_joblease.dagster.components.delivery.component import (
    CheckSpec,
    DispatcherSpec,
    JobLeaseDeliveryComponent,
    OutboxSensorSpec,
    RouteSpec,
)

__all__ = ["CheckSpec", "DispatcherSpec", "JobLeaseDeliveryComponent", "OutboxSensorSpec", "RouteSpec"]
