"""What the joblease Components share: attribute checks, the template scaffolder, the target of a
schedule or sensor."""

# No `from __future__ import annotations`: Dagster derives the YAML schema from the dataclass fields'
# runtime types (string annotations are not resolved).

import dataclasses
import re
import textwrap
from pathlib import Path
from typing import Any, Literal

import dagster as dg
import sqlalchemy as sa
from dagster.components import ComponentLoadContext, Resolvable, Scaffolder, ScaffoldRequest

from dagster_joblease import errors

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
