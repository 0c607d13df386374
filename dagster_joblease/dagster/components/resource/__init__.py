"""The resource Component and its scaffolder."""

from dagster_joblease.dagster.components.resource.component import JobLeaseResourceComponent

__all__ = ["JobLeaseResourceComponent"]
