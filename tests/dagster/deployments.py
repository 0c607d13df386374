"""A temporary Dagster deployment for tests that run Dagster's daemons' own code in process: an instance
(``instance_for_test`` with the given overrides) with one module's ``defs`` loaded as a code location
named after the module, as ``dagster-daemon`` loads one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
from dagster._core.remote_origin import InProcessCodeLocationOrigin
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget

REPO_ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def deployment(
    module: str, overrides: Mapping[str, Any]
) -> Iterator[tuple[dg.DagsterInstance, WorkspaceProcessContext]]:
    """The instance and the workspace with ``module:defs`` loaded as location ``module``'s last name."""
    with dg.instance_for_test(overrides=dict(overrides)) as instance:
        origin = InProcessCodeLocationOrigin(
            loadable_target_origin=LoadableTargetOrigin(
                module_name=module, attribute="defs", working_directory=str(REPO_ROOT)
            ),
            location_name=module.rsplit(".", 1)[-1],
        )
        with WorkspaceProcessContext(instance, InProcessWorkspaceLoadTarget(origin)) as workspace:
            yield instance, workspace
