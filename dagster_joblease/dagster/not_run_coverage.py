"""Whether a code location has the sensors that keep a re-execution's copied ``joblease/*`` tags true.

Dagster copies a parent run's tags into a re-execution or a run retry (every tag but a fixed set of its
own ``dagster/*`` ones), and no code of a leased step runs in a re-execution that does not run the step:
only the not-run sensors (:func:`~dagster_joblease.dagster.run_status.build_not_run_sensors`, which a
Components location gets from ``JobLeaseResourceComponent``) can rewrite the copy to ``not-run``. A
leased step in a location without them says so in its log (:func:`uncovered_note`), once per step.
"""

from __future__ import annotations

import dagster as dg

__all__ = ["DESCRIPTION_PREFIX", "is_not_run_sensor", "uncovered_note"]

#: How every not-run sensor's description starts (it marks them: Dagster sensors carry no other label
#: that survives into a loaded repository on every supported Dagster release).
DESCRIPTION_PREFIX = "Rewrites the joblease/* tags of "


def is_not_run_sensor(sensor: dg.SensorDefinition) -> bool:
    """True for a sensor built by ``build_not_run_sensors``."""
    return isinstance(sensor, dg.RunStatusSensorDefinition) and (sensor.description or "").startswith(
        DESCRIPTION_PREFIX
    )


def uncovered_note(repository: dg.RepositoryDefinition | None) -> str | None:
    """The warning a leased step logs when its code location has no not-run sensor; ``None`` when it has
    one (or when the step runs outside a code location: no repository to look at)."""
    if repository is None or any(is_not_run_sensor(s) for s in repository.sensor_defs):
        return None
    return (
        "joblease: this code location has no not-run sensors. If a re-execution or run retry of this run "
        "does not run this step (a re-execution from failure of a later step, or an earlier step "
        "failing), it keeps the joblease/* tags Dagster copies from this run, e.g. joblease/outcome=won. "
        "Add *build_not_run_sensors() to the location's Definitions sensors (a Components location gets "
        "them from JobLeaseResourceComponent unless not_run_sensors: false)."
    )
