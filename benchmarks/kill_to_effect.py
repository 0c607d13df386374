"""Seconds from a SIGKILL of a leased run's whole run worker to the partition's effect at the downstream.

    .venv/bin/python benchmarks/kill_to_effect.py [--rounds 3] [--retries both|on|off] [--node]
                                                  [--heartbeat-ms N] [--reconcile-s N] [--dispatch-s N]

The demo's pieces (:mod:`dagster_joblease.demo.runner`: its receiver, its Dagster daemon, its kill point
inside the leased body of ``daily_invoice``), on Dagster's default instance settings (run monitoring off,
the default run coordinator and sensor loop; ``run_retries: {enabled: true, max_retries: 3}`` added for
``on``) and the location ``benchmarks/kill_to_effect_location.py``: the resource's default heartbeat and
the sensor builders' default intervals unless the options say
otherwise. Runs use the in-process executor, so the run worker is the process that holds the lease.

Each round launches one run of a new partition (GraphQL ``launchRun``, as the UI does), waits until it is
inside its leased body, SIGKILLs its run worker (the whole run process), and polls the receiver until it
has the partition's effect. With Dagster's default run launcher the code server that started the run
worker sees it die and marks the run ``FAILURE`` within a second or so (``DagsterApiServer``'s orphaned
run check), so the holder is dead two of its heartbeat intervals after its last beat (``staleness``); a run
left ``STARTED`` (its code server gone too: ``--node`` SIGKILLs both) waits four. Printed per round
(with when the run was marked failed, when the holder became dead, and whether a run retry or the
reconciliation sensor did the partition again) and as medians: the total, and what it is made of, in order:

- ``request``: from the kill until the run that did the partition again was created (Dagster's run retry
  daemon, or the reconciliation sensor at its first tick after the holder became dead);
- ``launch``: from that request until the run started (the queue, a new run worker);
- ``takeover``: from its start until it reclaimed the lease (a run retry that starts before the holder
  is dead waits for it);
- ``body``: from the reclaim until the body committed its outbox row;
- ``dispatch``: from the commit until the receiver applied the effect (the outbox sensor's interval, a
  dispatcher run's launch and its POST).

Figures are printed, never asserted; the machine's load average is printed beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import kill_to_effect_location as location
from dagster_joblease import identity
from dagster_joblease.dagster.reconcile import build_reconciliation_sensor
from dagster_joblease.dagster.sensors import build_outbox_sensor
from dagster_joblease.demo import runner as demo
from dagster_joblease.receiver import effects
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.schema import lease_table, outbox_table

ROOT = Path(__file__).resolve().parent.parent
LOCATION = "benchmarks.kill_to_effect_location"
TOLERANCE = 4  #: heartbeat intervals: the liveness rule's (staleness.holder_death)
DEFAULTS_YAML = "telemetry:\n  enabled: false\n"
RETRIES_YAML = DEFAULTS_YAML + "run_retries:\n  enabled: true\n  max_retries: 3\n"
ROUND_TIMEOUT_S = 600.0
STALE = 2  #: heartbeat intervals: a finished run's holder is dead when its beat is this old
PARTS = ("request", "launch", "takeover", "body", "dispatch")


@dataclasses.dataclass(frozen=True)
class Round:
    """One kill's timeline (seconds since the epoch), the holder's heartbeat interval, and the run that
    did the partition again (a run retry, or the reconciliation sensor's relaunch)."""

    day: str
    killed: float
    last_heartbeat: float
    heartbeat_ms: int
    run_failed: float | None  #: when Dagster marked the killed run FAILURE (None: still STARTED)
    by_retry: bool
    requested: float
    started: float
    reclaimed: float
    committed: float
    effect: float

    @property
    def total(self) -> float:
        return self.effect - self.killed

    @property
    def dead(self) -> float:
        """When the holder became dead by the liveness rule: two of its intervals after its last
        heartbeat once its run is finished, four while it is STARTED."""
        four = self.last_heartbeat + TOLERANCE * self.heartbeat_ms / 1000
        if self.run_failed is None:
            return four
        return min(four, max(self.run_failed, self.last_heartbeat + STALE * self.heartbeat_ms / 1000))

    def parts(self) -> dict[str, float]:
        return {
            "request": self.requested - self.killed,
            "launch": self.started - self.requested,
            "takeover": max(0.0, self.reclaimed - self.started),
            "body": self.committed - max(self.reclaimed, self.started),
            "dispatch": self.effect - self.committed,
        }

    def how(self) -> str:
        failed = "run STARTED" if self.run_failed is None else f"FAILURE +{self.run_failed - self.killed:.1f}"
        return (
            f"{failed}, holder dead +{self.dead - self.killed:.1f} (last beat "
            f"-{self.killed - self.last_heartbeat:.1f}), by {'run retry' if self.by_retry else 'sensor'}"
        )


def _epoch(value: dt.datetime | float) -> float:
    if isinstance(value, float | int):
        return float(value)
    return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).timestamp()


def _launch_run(execute: Callable[[str, Mapping[str, Any]], dict[str, Any]], day: str) -> None:
    repo = {"repositoryLocationName": LOCATION, "repositoryName": demo.REPOSITORY}
    params = {
        "selector": {**repo, "jobName": demo.JOB_NAME},
        "runConfigData": "{}",
        "executionMetadata": {"tags": [{"key": "dagster/partition", "value": day}]},
    }
    answer = execute(demo.LAUNCH_MUTATION, {"params": params})["launchRun"]
    if answer["__typename"] != "LaunchRunSuccess":
        raise SystemExit(f"kill_to_effect: the run of {day} was refused: {answer}")


def _lease(engine: sa.Engine, key: str) -> Any:
    t = lease_table
    columns = (t.c.heartbeat_at, t.c.heartbeat_ms, t.c.acquired_at, t.c.holder)
    with engine.connect() as conn:
        return conn.execute(sa.select(*columns).where(t.c.lock_key == key)).one()


def _committed(engine: sa.Engine, key: str) -> float:
    t = outbox_table
    with engine.connect() as conn:
        created = conn.execute(sa.select(t.c.created_at).where(t.c.idempotency_key == key)).scalar_one()
    return _epoch(created)


def _run(instance: Any, holder: str) -> Any:
    """The run record of a lease's holder (``dagster:<storage>/<run id>``)."""
    record = instance.get_run_record_by_id(holder.rsplit("/", 1)[-1])
    if record is None:
        raise SystemExit(f"kill_to_effect: no Dagster run for the holder {holder}")
    return record


def _code_server(worker: int) -> int:
    """The code server that started a run worker (its parent, ``dagster api grpc``; Linux ``/proc``)."""
    parent = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
    command = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    if "api grpc" not in command:
        raise SystemExit(f"kill_to_effect: the run worker's parent is not a code server: {command}")
    return parent


def _one_round(
    plan: demo.DemoPlan,
    day: str,
    deadline: demo._Deadline,
    execute: Callable[[str, Mapping[str, Any]], dict[str, Any]],
    engines: tuple[sa.Engine, sa.Engine],
    instance: Any,
    node: bool = False,
) -> Round:
    engine, receiver_engine = engines
    key = identity.idempotency_key("SCHEDULE", demo.BILLING_CODE, day)
    (plan.kill_dir / f"{day}.kill").write_text("")
    pid_file = plan.kill_dir / f"{day}.pid"
    _launch_run(execute, day)
    deadline.wait_for(pid_file.exists, f"the run of {day} to be inside its leased body")
    time.sleep(0.2)  # the file is written before the body waits; the lease is held by then
    worker = int(pid_file.read_text())
    victims = [worker, _code_server(worker)] if node else [worker]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    killed = time.time()
    dead_holder = _lease(engine, key)  # the lock key is the idempotency key
    applied: list[float] = []

    def has_effect() -> bool:
        if any(k == key for k, _topic, _payload in effects(receiver_engine)):
            applied.append(time.time())
        return bool(applied)

    deadline.wait_for(has_effect, f"the effect of {day} at the receiver")
    killed_run = _run(instance, dead_holder.holder)
    winner = _lease(engine, key)
    again = _run(instance, winner.holder)
    end = killed_run.end_time if killed_run.dagster_run.is_finished else None
    return Round(
        day=day,
        killed=killed,
        last_heartbeat=_epoch(dead_holder.heartbeat_at),
        heartbeat_ms=int(dead_holder.heartbeat_ms),
        run_failed=None if end is None else float(end),
        by_retry="dagster/retry_number" in again.dagster_run.tags,
        requested=_epoch(again.create_timestamp),
        started=float(again.start_time),
        reclaimed=_epoch(winner.acquired_at),
        committed=_committed(engine, key),
        effect=applied[0],
    )


@dataclasses.dataclass(frozen=True)
class Settings:
    """The location's timings (``None``: the library's default) and the rounds of one mode."""

    retries: bool
    rounds: int
    heartbeat_ms: int | None = None
    reconcile_s: int | None = None
    dispatch_s: int | None = None
    node: bool = False  #: SIGKILL the run worker's code server too (the run stays STARTED)

    def env(self) -> dict[str, str]:
        def text(value: int | None) -> str:
            return "" if value is None else str(value)

        return {
            location.HEARTBEAT_ENV: text(self.heartbeat_ms),
            location.RECONCILE_ENV: text(self.reconcile_s),
            location.DISPATCH_ENV: text(self.dispatch_s),
        }


def measure(settings: Settings, work: Path) -> list[Round]:
    """``settings.rounds`` kills in one Dagster home under ``work`` (one daemon, one receiver)."""
    first = dt.date(2024, 3, 1)
    days = tuple((first + dt.timedelta(days=i)).isoformat() for i in range(settings.rounds))
    plan = demo.DemoPlan(work=work, days=days, tick=dt.datetime.now(dt.UTC))
    plan.home.mkdir(parents=True, exist_ok=True)
    plan.kill_dir.mkdir(exist_ok=True)
    (plan.home / "dagster.yaml").write_text(RETRIES_YAML if settings.retries else DEFAULTS_YAML)
    names = (*demo.DEMO_ENV, "PYTHONPATH", *settings.env())
    with contextlib.ExitStack() as stack:
        stack.enter_context(demo._restored_env(names))
        os.environ.update(settings.env())
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        engine = create_engine(plan.joblease_url)
        receiver_engine = create_engine(plan.receiver_url)
        stack.callback(receiver_engine.dispose)
        stack.callback(engine.dispose)
        instance = demo._prepare_instance(plan, engine)
        deadline = demo._Deadline(ROUND_TIMEOUT_S * settings.rounds, work)
        deadline.daemon = demo._start_processes(plan, stack, LOCATION)
        stack.enter_context(demo._stderr_to(work / "graphql.log"))
        execute = stack.enter_context(demo._graphql(instance, LOCATION))
        rounds = []
        for day in days:
            engines = (engine, receiver_engine)
            done = _one_round(plan, day, deadline, execute, engines, instance, settings.node)
            rounds.append(done)
            print(f"  {_line(day, done.total, done.parts())}  ({done.how()})", flush=True)
        return rounds


def _line(name: str, total: float, parts: Mapping[str, float]) -> str:
    return f"{name:<12} {total:6.1f} s = " + " + ".join(f"{k} {parts[k]:5.1f}" for k in PARTS)


def summary(settings: Settings, rounds: list[Round]) -> str:
    """The medians of one mode, with its timings and the machine's load."""
    heartbeat_s = rounds[0].heartbeat_ms / 1000
    medians = {k: statistics.median(r.parts()[k] for r in rounds) for k in PARTS}
    totals = [r.total for r in rounds]
    load = os.getloadavg()
    return "\n".join(
        [
            f"run retries {'on' if settings.retries else 'off'}: heartbeat {heartbeat_s:g} s "
            f"(a holder is dead {STALE * heartbeat_s:g} s after its last beat once its run is finished, "
            f"{TOLERANCE * heartbeat_s:g} s while it is STARTED), reconciliation sensor "
            f"{settings.reconcile_s or location.default_interval(build_reconciliation_sensor)} s, "
            f"outbox sensor {settings.dispatch_s or location.default_interval(build_outbox_sensor)} s",
            f"  kill -> effect: median {statistics.median(totals):.1f} s, min {min(totals):.1f}, "
            f"max {max(totals):.1f} ({len(rounds)} rounds; load average "
            f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs)",
            f"  {_line('median', statistics.median(totals), medians)}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="kills per mode (default 3)")
    parser.add_argument("--retries", choices=("both", "on", "off"), default="both")
    parser.add_argument("--heartbeat-ms", type=int, help="the resource's heartbeat (default: its own)")
    parser.add_argument("--reconcile-s", type=int, help="the reconciliation sensor's interval (default 60)")
    parser.add_argument("--dispatch-s", type=int, help="the outbox sensor's interval (default 30)")
    parser.add_argument("--workdir", type=Path, help="keep the Dagster homes and logs here")
    parser.add_argument(
        "--node",
        action="store_true",
        help="SIGKILL the run worker's code server too (the whole node: the run stays STARTED)",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the daemon and receiver on the way out
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.retries]
    base = args.workdir or Path(tempfile.mkdtemp(prefix="joblease-k2e-"))
    results = []
    for retries in modes:
        settings = Settings(
            retries, args.rounds, args.heartbeat_ms, args.reconcile_s, args.dispatch_s, node=args.node
        )
        print(f"run retries {'on' if retries else 'off'} ({base}):", flush=True)
        results.append((settings, measure(settings, base / ("retries" if retries else "no-retries"))))
    for settings, rounds in results:
        print(summary(settings, rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
