"""The reconciliation sensor: nothing stays undone silently, at any number of partitions, keys and runs.

A partition can be left undone with nothing scheduled to redo it: its holder was SIGKILLed (Dagster's run
monitoring is off by default, so the run stays STARTED), a run failed after Dagster's own retries (off by
default) were spent, a backfill already counted as finished, a run gave up waiting for a live holder
(``held``), a range run stopped before some of its keys, or a downstream step never ran because its
upstream failed. Dagster does not know the partition still needs work; the lease table and the runs do.

It is three parts (:mod:`.facts` → :mod:`.judge` → :mod:`.sensor`):

- **Facts** (IO): lease rows, runs of every shape (single-partition runs, single-run range backfills, runs
  of ``define_asset_job`` jobs and of the implicit asset job) and materializations. Every source is read
  in pages from a cursor: the lease rows of the code (the most recently active first, so a new failure is
  seen in one tick, then a sweep by row id), the runs of this deployment that may have left keys undone
  (failed, zombie, and with ``relaunch_canceled`` canceled runs: walked oldest first, key by key; keys
  they finished are filtered *before* anything counts against the budget), never-attempted keys
  (``catch_up_from``) and finished re-executions. No per-tick cap hides work: each source resumes where
  the last tick stopped, and the skip message says what is left.
- **Judge** (pure, table-tested): per key, from its lease row and who named it, then (only for keys that
  need a run) from its runs: done, held by a live holder, to record, in flight, left alone after a
  person's cancel, capped, backing off, or relaunched.
- **Sensor**: turns verdicts into run requests and acts on the rest.

**Life comes from the lease, by one rule** (:func:`dagster_joblease.staleness.holder_death`, the one
waiting runs apply): a holder is dead when its lease expired, its heartbeat is missing for four of its own
intervals, or its run is finished and its heartbeat stale; anything short of that is alive.

**Zombies.** A run Dagster still calls STARTING/STARTED is a zombie, not in flight, when it holds no live
lease of any code and a RUNNING lease it holds is dead by that rule, or when, holding no lease, it stayed
quiet longer than the held wait plus ``zombie_margin`` since it started or last held one. Its undone
keys (the one it held, and every key of its range it never tried) are relaunched, its done keys recorded,
and it is tagged ``lost``. The sensor fails a dead holder's lease (fenced on its attempt and the heartbeat
age the rule used) before relaunching, so the relaunched run reclaims it at once. Enable run monitoring
to have Dagster fail such runs too.

**Done but not recorded.** For a leased asset, a key whose lease is SUCCESS but which has no
materialization on this instance is recorded (an ``AssetMaterialization`` pointing at the run that did it)
when this deployment asked for it: its holder's run here ended or died, or a run here left it undone
(e.g. it failed ``held`` while another deployment held the key and then finished it).

**Upstream first.** A run that selected the target *and* its upstream assets, in which an upstream asset
did not finish a key (so Dagster skipped the target's step), is relaunched for that key with those
upstream assets selected too: a downstream step is never relaunched without its upstream.

Relaunches are capped per partition (``max_relaunches``) with exponential backoff, so a deterministic bug
does not loop forever; a capped partition is named in the skip message and the sensor cursor. The cap
counts the partition's runs Dagster tagged with this sensor's name (``dagster/sensor_name``) that are not
re-executions or retries. A partition whose latest run (of any shape) was canceled by a person is left
alone unless ``relaunch_canceled=True``. Run keys include the lease attempt and the relaunch number, so
they never collide with an earlier request (a sensor's run keys dedupe forever). A relaunched run is an
ordinary leased run: the lease still lets exactly one run do the work.

**Tags that never lie.** A re-execution or run retry of the target whose leased step never ran keeps the
``joblease/*`` tags Dagster copied from its parent; the sensor rewrites them to ``not-run`` once the run
finishes (as :func:`~dagster_joblease.dagster.run_status.build_not_run_sensors` does for every job of a
code location).
"""

from __future__ import annotations

from dagster_joblease.dagster.reconcile.judge import zombie_reason
from dagster_joblease.dagster.reconcile.sensor import build_reconciliation_sensor

__all__ = [
    "build_reconciliation_sensor",
    "zombie_reason",
]
