"""The step's context as one key of a range run sees it.

A per-key body of a range run (a single-run backfill) is written for one partition: it reads
``run.context.partition_key`` or ``run.context.partition_time_window`` as it would in a single-partition
run. Dagster's own context answers for the whole range there (``partition_key`` raises, the time window
spans every key, an upstream input's partitions are the range's), so the body gets a :class:`KeyContext`:
the partition answers are this key's, its upstream answers are what this key reads through the
dependency's partition mapping (or a :class:`dagster.DagsterInvariantViolationError` saying the
question has no per-key answer), and everything else (``log``, ``instance``, ``resources``, ``run``,
``add_output_metadata`` …) is the step's own context, the same object, so events and metadata a body
records still reach Dagster.
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
    methods answer for this key, as they would in a run of this one partition; so do the upstream
    questions ``asset_partition_key_for_input``, ``asset_partition_keys_for_input``,
    ``asset_partition_key_range_for_input`` and ``asset_partitions_time_window_for_input``: the
    upstream partitions *this key* depends on (its partition mapped through the dependency's partition
    mapping), or :class:`dagster.DagsterInvariantViolationError` saying why the question has no per-key
    answer. Every other attribute is the step's context's own. The run's tags (``context.run.tags``)
    still name the range: they are the run's.
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

    # ---- Upstream questions: what this key reads ---------------------------------------------------------

    def _no_answer(self, input_name: str, why: str) -> dg.DagsterInvariantViolationError:
        return dg.DagsterInvariantViolationError(
            f"input {input_name!r} has no per-key answer for partition {self._key!r} of this range run: {why}"
        )

    def _upstream(self, input_name: str) -> tuple[list[str], dg.PartitionsDefinition]:
        """The upstream partition keys this key depends on through ``input_name``, and their definition."""
        context = self._context
        try:
            upstream_key = context.asset_key_for_input(input_name)
            upstream_def = context.asset_partitions_def_for_input(input_name)
            assets_def = context.assets_def
            own_key = context.asset_key
        except Exception as exc:  # an op, or an input with no asset behind it
            raise self._no_answer(input_name, f"{type(exc).__name__}: {exc}") from exc
        if upstream_def is None or self._partitions_def is None:
            raise self._no_answer(input_name, "the upstream asset or this one is not partitioned")
        with dg.partition_loading_context(dynamic_partitions_store=context.instance):
            mapping = assets_def.infer_partition_mapping(own_key, upstream_key, upstream_def)
            mine = self._partitions_def.empty_subset().with_partition_keys([str(self._key)])
            mapped = mapping.get_upstream_mapped_partitions_result_for_partitions(
                mine, self._partitions_def, upstream_def
            )
            missing = list(mapped.required_but_nonexistent_subset.get_partition_keys())
            keys = list(mapped.partitions_subset.get_partition_keys())
        if missing:
            raise self._no_answer(
                input_name,
                f"it depends on partitions {missing[:5]!r} that {upstream_key.to_user_string()} lacks",
            )
        return keys, upstream_def

    def asset_partition_keys_for_input(self, input_name: str) -> Sequence[str]:
        return self._upstream(input_name)[0]

    def asset_partition_key_range_for_input(self, input_name: str) -> dg.PartitionKeyRange:
        keys, upstream_def = self._upstream(input_name)
        if not keys:
            raise self._no_answer(input_name, "it depends on no upstream partition")
        with dg.partition_loading_context(dynamic_partitions_store=self._context.instance):
            ranges = (
                upstream_def.empty_subset().with_partition_keys(keys).get_partition_key_ranges(upstream_def)
            )
        if len(ranges) != 1:
            raise self._no_answer(
                input_name, f"it depends on {len(ranges)} separate ranges of upstream partitions"
            )
        return ranges[0]

    def asset_partition_key_for_input(self, input_name: str) -> str:
        keys, _ = self._upstream(input_name)
        if len(keys) != 1:
            shown = f"{keys[0]}..{keys[-1]}" if keys else "none"
            raise self._no_answer(
                input_name,
                f"it depends on {len(keys)} upstream partitions ({shown}), not one; ask "
                "asset_partition_keys_for_input",
            )
        return keys[0]

    def asset_partitions_time_window_for_input(self, input_name: str) -> dg.TimeWindow:
        keys, upstream_def = self._upstream(input_name)
        windows = [w for w in (key_time_window(upstream_def, k) for k in keys) if w is not None]
        if not windows or len(windows) != len(keys):
            raise self._no_answer(input_name, "the upstream partitions have no time window")
        return dg.TimeWindow(min(w.start for w in windows), max(w.end for w in windows))
