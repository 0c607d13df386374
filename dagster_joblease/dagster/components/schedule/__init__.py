"""The schedule Component and its scaffolder."""

from dagster_joblease.dagster.components.schedule.component import LeasedScheduleComponent

__all__ = ["LeasedScheduleComponent"]
