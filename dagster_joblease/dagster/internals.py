"""The names this package takes from Dagster's private modules, each because Dagster has no public spelling
of it; every other Dagster name is imported from ``dagster`` itself. They exist in every release that
pyproject.toml admits (the lowest-release CI venv, ``.ci/dagster-lowest.txt``, imports this module too).

- :data:`REPOSITORY_LABEL_TAG`: the hidden run tag (``.dagster/repository``, ``repo@location``) Dagster
  puts on every run; filtering runs by it is the only way to pick one code location's runs when another
  location has a job of the same name (``RunsFilter`` has no location field).
- :class:`EngineEventData`: the payload of the step engine event, with metadata, that records a leased
  step's outcomes (``DagsterInstance.report_engine_event`` is public and takes it; ``context.log`` carries
  no metadata, and ``log_event`` takes only asset events and expectation results).
- :func:`module_workspace`: a code location loaded in this process for Dagster's GraphQL schema, as the
  UI's server does (the demo drives backfills and schedule ticks through it); Dagster has no public API
  that loads a workspace. Imported only when called: ``import dagster`` does not load these modules.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dagster._core.events import EngineEventData
from dagster._core.storage.tags import REPOSITORY_LABEL_TAG

__all__ = ["REPOSITORY_LABEL_TAG", "EngineEventData", "module_workspace"]


@contextmanager
def module_workspace(instance: Any, module: str) -> Iterator[Any]:
    """A ``WorkspaceProcessContext`` on ``instance`` with the code location of ``module`` loaded."""
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import ModuleTarget

    target = ModuleTarget(module_name=module, attribute=None, working_directory=None, location_name=None)
    with WorkspaceProcessContext(instance, target) as process_context:
        yield process_context
