"""The step's context as one key of a range run sees it.

A per-key body of a range run (a single-run backfill) is written for one partition: it reads
``run.context.partition_key`` or ``run.context.partition_time_window`` as it would in a single-partition
run. Dagster's own context answers for the whole range there (``partition_key`` raises, the time window
spans every key), so the body gets a :class:`KeyContext`: the partition answers are this key's, and
everything else (``log``, ``instance``, ``resources``, ``run``, ``add_output_metadata`` …) is the step's
own context, the same object, so events and metadata a body records still reach Dagster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg

__all__ = ["KeyContext", "key_time_window"]

_RESULT = "result"


def _has_time_dimension(partitions_def: dg.PartitionsDefinition | None) -> bool:
    if isinstance(partitions_def, dg.TimeWindowPartitionsDefinition):
        return True
    if isinstance(partitions_def, dg.MultiPartitionsDefinition):
        return any(
            isinstance(d.partitions_def, dg.TimeWindowPartitionsDefinition)
            for d in partitions_def.partitions_defs
        )
    return False


def key_time_window(partitions_def: dg.PartitionsDefinition | None, key: str) -> dg.TimeWindow | None:
    """The time window of one key (None when the partitioning has no time dimension)."""
    if isinstance(partitions_def, dg.TimeWindowPartitionsDefinition | dg.MultiPartitionsDefinition) and (
        _has_time_dimension(partitions_def)
    ):
        return partitions_def.time_window_for_partition_key(key)
    return None


class KeyContext:
    """A view of a step's :class:`dagster.OpExecutionContext` for one partition key of its range.

    ``partition_key``, ``partition_keys``, ``partition_key_range``, ``partition_time_window``,
    ``has_partition_key`` (True), ``has_partition_key_range`` (False) and the ``asset_partition_*_for_output``
    methods answer for this key, as they would in a run of this one partition; every other attribute is
    the step's context's own. The run's tags (``context.run.tags``) still name the range: they are the
    run's.
    """

    def __init__(
        self, context: dg.OpExecutionContext, key: str, partitions_def: dg.PartitionsDefinition | None
    ) -> None:
        if isinstance(partitions_def, dg.MultiPartitionsDefinition) and not isinstance(
            key, dg.MultiPartitionKey
        ):
            key = partitions_def.get_partition_key_from_str(key)
        self._context = context
        self._key = key
        self._partitions_def = partitions_def

    def __getattr__(self, name: str) -> Any:
        if name in ("_context", "_key", "_partitions_def"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._context, name)

    def __repr__(self) -> str:
        return f"KeyContext(partition_key={self._key!r}, run_id={self._context.run_id!r})"

    @property
    def op_execution_context(self) -> KeyContext:
        return self

    @property
    def has_partition_key(self) -> bool:
        return True

    @property
    def has_partition_key_range(self) -> bool:
        return False

    @property
    def partition_key(self) -> str:
        return self._key

    @property
    def multi_partition_key(self) -> dg.MultiPartitionKey:
        if isinstance(self._key, dg.MultiPartitionKey):
            return self._key
        return self._context.multi_partition_key  # Dagster's own error for a one-dimension partitioning

    @property
    def partition_keys(self) -> Sequence[str]:
        return [self._key]

    @property
    def partition_key_range(self) -> dg.PartitionKeyRange:
        return dg.PartitionKeyRange(self._key, self._key)

    @property
    def asset_partition_key_range(self) -> dg.PartitionKeyRange:
        return self.partition_key_range

    @property
    def partition_time_window(self) -> dg.TimeWindow:
        window = key_time_window(self._partitions_def, self._key)
        if window is None:  # no time dimension: Dagster's own error says so
            return self._context.partition_time_window
        return window

    def asset_partition_key_for_output(self, output_name: str = _RESULT) -> str:
        return self._key

    def asset_partition_keys_for_output(self, output_name: str = _RESULT) -> Sequence[str]:
        return [self._key]

    def asset_partition_key_range_for_output(self, output_name: str = _RESULT) -> dg.PartitionKeyRange:
        return self.partition_key_range

    def asset_partitions_time_window_for_output(self, output_name: str = _RESULT) -> dg.TimeWindow:
        return self.partition_time_window
