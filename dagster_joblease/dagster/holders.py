"""Lease holders inside Dagster: ``dagster:<deployment>/<run_id>``, and whether that run is finished.

A lease taken by a Dagster run records the run (and which deployment launched it) as its holder, so a
later run, the reconciliation sensor or an operator can tell a dead holder from a live one. Run ids are
UUIDs: a run id found on this instance is this instance's run, whatever the deployment label says, so the
label is for people (``joblease leases list``) and the run id for :func:`holder_run_finished`.
"""

from __future__ import annotations

import dataclasses
import re

import dagster as dg

from dagster_joblease import errors, lease

__all__ = [
    "FINISHED_RUN_STATUSES",
    "HOLDER_PREFIX",
    "DagsterHolder",
    "decode_holder",
    "default_deployment",
    "encode_holder",
    "holder_run_finished",
    "holder_run_status",
    "validate_deployment",
]

HOLDER_PREFIX = "dagster:"
MAX_DEPLOYMENT_CHARS = 128
_DEPLOYMENT = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

#: Dagster run statuses after which the run's own processes are done (a surviving step process may
#: still heartbeat, which is why takeover also needs a stale heartbeat).
FINISHED_RUN_STATUSES = frozenset(
    {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}
)


@dataclasses.dataclass(frozen=True)
class DagsterHolder:
    """A decoded ``dagster:<deployment>/<run_id>`` holder."""

    deployment: str
    run_id: str

    def __str__(self) -> str:
        return f"{HOLDER_PREFIX}{self.deployment}/{self.run_id}"


def validate_deployment(value: object) -> str:
    """A deployment label: 1-128 of ``A-Z a-z 0-9 _ . : @ -`` (no ``/``, so a holder decodes uniquely)."""
    if not isinstance(value, str) or not _DEPLOYMENT.match(value):
        raise errors.ConfigurationError(
            f"invalid deployment {value!r}: must be 1-{MAX_DEPLOYMENT_CHARS} characters of letters, digits "
            "and '_.:@-' (no '/' or spaces); e.g. deployment='prod-eu'"
        )
    return value


def encode_holder(deployment: str, run_id: str) -> str:
    """``dagster:<deployment>/<run_id>``, validated (at most 255 characters, the holder column)."""
    validate_deployment(deployment)
    if not _RUN_ID.match(run_id):
        raise errors.ConfigurationError(f"invalid Dagster run id {run_id!r}: expected a run's UUID")
    return lease.validate_holder(str(DagsterHolder(deployment, run_id)))


def decode_holder(holder: str | None) -> DagsterHolder | None:
    """The Dagster run behind a holder label, or ``None`` for any other holder (``host:pid``, absent)."""
    if not holder or not holder.startswith(HOLDER_PREFIX):
        return None
    deployment, sep, run_id = holder[len(HOLDER_PREFIX) :].rpartition("/")
    if not sep or not _DEPLOYMENT.match(deployment) or not _RUN_ID.match(run_id):
        return None
    return DagsterHolder(deployment, run_id)


def default_deployment(instance: dg.DagsterInstance) -> str:
    """A label for this instance: ``storage-`` + the first 8 hex digits of its run storage id.

    Every process of one deployment shares its run storage, so they agree on it without configuration;
    set ``JobLeaseResource(deployment=...)`` for a readable name.
    """
    get_id = getattr(instance.run_storage, "get_run_storage_id", None)  # SQL run storages have one
    try:
        storage_id = str(get_id()) if callable(get_id) else ""
    except Exception:  # the label is informational: never fail a run over it
        storage_id = ""
    if not storage_id:
        return "unknown"
    return "storage-" + "".join(ch for ch in storage_id if ch.isalnum())[:8]


def holder_run_status(instance: dg.DagsterInstance, holder: str | None) -> dg.DagsterRunStatus | None:
    """The status of the holder's Dagster run on ``instance``; ``None`` if not a Dagster holder or unknown."""
    decoded = decode_holder(holder)
    if decoded is None:
        return None
    run = instance.get_run_by_id(decoded.run_id)
    return None if run is None else run.status


def holder_run_finished(instance: dg.DagsterInstance, holder: str | None) -> bool | None:
    """Is the holder's Dagster run finished (SUCCESS, FAILURE, CANCELED) on ``instance``?

    ``None`` when the holder is not a Dagster run or its run is not on this instance (another deployment,
    a deleted run): then only lease expiry can free the lease. A finished run does not prove its
    processes are dead; pair this with a stale heartbeat (``LeaseService.fail_dead_holder``).
    """
    status = holder_run_status(instance, holder)
    if status is None:
        return None
    return status in FINISHED_RUN_STATUSES
