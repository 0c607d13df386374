"""Two code locations for test_not_run_locations, each as a user would write it.

- ``plain``: the Pythonic way: the jobs and ``build_not_run_sensors()``, no reconciliation sensor,
  nothing else.
- ``bare``: the Pythonic way with no sensors at all (nothing can correct a copy there: its leased steps
  say so in their log).
- ``components``: ``tests/dagster/not_run_components``, loaded as a defs folder: the resource component
  with its defaults and the jobs, no sensor declared by hand.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from dagster.components.core.component_tree import ComponentTree

from dagster_joblease.dagster import build_not_run_sensors
from tests.dagster import jobs, not_run_components

plain = dg.Definitions(
    jobs=[jobs.not_run_after_job(), jobs.not_run_before_job()], sensors=build_not_run_sensors()
)
bare = dg.Definitions(jobs=[jobs.not_run_after_job(), jobs.not_run_before_job()])
components = ComponentTree.from_module(
    defs_module=not_run_components, project_root=Path(__file__).resolve().parents[2]
).build_defs()
